"""The BPF start-up: the programs loaded and the Tracer built, the kernel build-id path checked.

:func:`load_programs` compiles (or takes from the cache) and attaches the
recording programs (kernel.tracer.Tracer) while, beside it, the page-cache
reader is checked and then turned on.  The BPF program (bpf/buildidd.bpf.c) reads each mapped file's build-id from
its page cache (bpf/pagecache.h) once it knows where this boot keeps page
structs and the direct map (struct pagecache_bases, zeros: off, every event
then carries kernel_status "fault").  Here, before recording: a separate probe
program (kernel.pagecache.PageCacheProbe) finds the bases
(kernel.pagecache.discover_bases) and reads known files, which user space
reads too (resolve.buildid.read_build_id_fd, kernel.pagecache_selftest); only
when every one agrees are the bases written into the main program's map.
The outcome is the session record's ``kernel_build_id_path`` and ``status``'s.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

from buildidd import heap
from buildidd.config import Config
from buildidd.errors import BuildiddError, ElfError
from buildidd.kernel.btf import Btf
from buildidd.kernel.pagecache import Bases, PageCacheProbe, discover_bases
from buildidd.kernel.pagecache_selftest import check_kernel_path
from buildidd.kernel.tracer import Tracer
from buildidd.resolve.buildid import read_build_id_fd

log = logging.getLogger(__name__)

__all__ = ["KernelPath", "check_kernel_path_now", "configured_kernel_path", "configured_tracer", "load_programs"]


@dataclass(frozen=True)
class KernelPath:
    """Whether the BPF side reads build-ids (the session record's ``kernel_build_id_path``).

    Attributes:
        enabled: True when the check passed (apply() then writes the bases into the main program).
        reason: why it is off (None when enabled), e.g. the self-test case that disagreed.
        bases: what discover_bases found (None when off).
    """

    enabled: bool
    reason: str | None
    bases: Bases | None = None

    def apply(self, tracer: Tracer) -> None:
        """Write the bases into tracer's program (nothing when off: its events carry ``fault``)."""
        if self.enabled and self.bases is not None:
            tracer.set_pagecache_bases(self.bases.vmemmap_base, self.bases.page_offset_base)

    def as_dict(self) -> dict:
        """JSON form: {"enabled": bool, "reason": text or null}."""
        return {"enabled": self.enabled, "reason": self.reason}


def _user_build_id(fd: int) -> bytes | None:
    try:
        bid = read_build_id_fd(fd)
    except ElfError:
        return None
    return bid.raw if bid is not None else None


def _known_files() -> list[tuple[str, str]]:
    """Real ELF files of this host checked besides the synthetic ones: our interpreter and its libc."""
    out = [("python", os.path.realpath(sys.executable))]
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split(maxsplit=5)[5].strip() if len(line.split(maxsplit=5)) == 6 else ""
            if "/libc.so" in path or "/libc-" in path:
                out.append(("libc", path))
                break
    return out


def check_kernel_path_now(work_dir: str | None = None, pin_root: str | None = None,
                          cache_dir: str | None = None, btf: Btf | None = None) -> KernelPath:
    """Check the page-cache reader against user space (before the main program is attached:
    compiling the probe takes seconds, during which no event would be consumed).

    Never raises for a failed check: the kernel path then stays off and the
    KernelPath says why (the probe cannot load, the bases are not found, a
    file disagreed).  The probe program is closed before returning (kept
    pinned under pin_root for the next start when given, see kernel.pinned; what BCC compiled
    kept in cache_dir, see kernel.progcache).
    """
    try:
        probe = PageCacheProbe(btf, pin_root=pin_root, cache_dir=cache_dir)
    except BuildiddError as e:
        return KernelPath(False, f"probe program: {e}")
    try:
        bases = discover_bases(probe)
        with tempfile.TemporaryDirectory(prefix="buildidd-pc-", dir=work_dir) as d:
            verdict = check_kernel_path(probe, d, _user_build_id, _known_files())
    except (BuildiddError, OSError) as e:
        return KernelPath(False, f"self-test: {e}")
    finally:
        probe.close()
    if not verdict.ok:
        log.warning("kernel build-id path off: %s", verdict.reason)
        return KernelPath(False, f"self-test: {verdict.reason}")
    return KernelPath(True, None, bases)


def configured_kernel_path(config: Config, btf: Btf | None = None) -> KernelPath:
    """:func:`check_kernel_path_now` (its probe kept under Config.bpf_pin_root, what BCC compiled
    in Config.bpf_cache_dir), or off without a check when Config.kernel_build_id is false.  btf:
    the kernel's, already parsed (None: parsed here)."""
    if not config.kernel_build_id:
        return KernelPath(False, "kernel_build_id = false in the config")
    return check_kernel_path_now(pin_root=config.bpf_pin_root or None, cache_dir=config.bpf_cache_dir or None,
                                 btf=btf)


def configured_tracer(config: Config, btf: Btf | None = None) -> Tracer:
    """The Tracer config asks for: its ring size, bpffs pins (bpf_pin_root), compile cache (bpf_cache_dir).
    btf: the kernel's, already parsed (None: parsed here).

    Raises:
        ProbeError: as Tracer.
    """
    return Tracer(ring_bytes=config.ring_bytes, btf=btf, pin_root=config.bpf_pin_root or None,
                  cache_dir=config.bpf_cache_dir or None)


def load_programs(config: Config) -> tuple[KernelPath, Tracer]:
    """The main program loaded and attached, with the page-cache path checked and applied.

    The check (:func:`configured_kernel_path`: the probe program, its bases, the self-test)
    runs on a thread while the main program loads on this one: each is mostly BCC's compile
    in a child process or the kernel's verifier, which run side by side on two CPUs (the start
    time is the README's).  The BTF is parsed once, here, for both: parsed on the thread too, it
    would leave its parse in that thread's malloc arena, which the threads started later reuse
    (a larger RSS after READY).  The probe is the smaller, so it is
    normally done when the main program attaches and the bases are written right after; a
    mapping in between carries kernel_status ``fault`` and is read by user space.

    Raises:
        ProbeError: the main program cannot be loaded (the check has ended; nothing is left).
    """
    btf = Btf.load()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="buildidd-bpfstart") as pool:
        check = pool.submit(configured_kernel_path, config, btf)
        try:
            tracer = configured_tracer(config, btf)
        except BaseException:
            wait([check])               # its probe closes itself; the Tracer's error is the one raised
            raise
        try:
            kernel_path = check.result()
        except BaseException:
            tracer.close()
            raise
    kernel_path.apply(tracer)
    del btf                 # the whole parsed BTF; its pages go back now, not at the first trim
    heap.trim()
    return kernel_path, tracer

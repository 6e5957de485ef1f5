"""The kernel side: bpf/buildidd.bpf.c compiled by BCC in a child (kernel.loader), its fds held here.

Kernel struct offsets come from BTF (:mod:`buildidd.kernel.layout`) and reach the C code as
``-DOFF_<STRUCT>_<FIELD>=<bytes>``, the type ids of the structs it reads with
KLD (bpf/kfuncs.h) as ``-DBTF_ID_<STRUCT>=<id>``; the installed kernel headers
are used only by BCC's compiler for its own boilerplate, never for a struct
layout.
"""

from __future__ import annotations

import array
import ctypes
import errno
import logging
import mmap
import os
import time
from dataclasses import dataclass, field

from buildidd.kernel import synth
from buildidd.kernel.btf import Btf
from buildidd.errors import ProbeError
from buildidd.kernel.events import BPF_DIR, N_DROP_CAUSES, DropCause, DropTime
from buildidd.kernel.loader import LoadSpec, TailCall
from buildidd.kernel.attach import ensure_tracefs
from buildidd.kernel.layout import kernel_layout, kld_support
from buildidd.kernel.progcache import load_program
from buildidd.kernel.budget import UidBudgets
from buildidd.kernel.pagecache import PagecacheBases

log = logging.getLogger(__name__)

#: Ring buffers at most (bpf/buildidd.bpf.c declares events0..events7).
MAX_RINGS = 8
#: bpf/buildidd.bpf.c's bpf_loop callbacks (bpf/callbacks.h): read_path's step and the page-cache
#: walk's step, per scratch slot.
CALLBACKS = ("path_step_live", "path_step_iter", "pc_step_live", "pc_step_iter")


def load_spec(layout: dict[str, int], ring_bytes: int, nrings: int,
              kld: tuple[dict[str, int], tuple[tuple[str, int], ...]] = ({}, ())) -> LoadSpec:
    """What the loader compiles and attaches for a kernel layout (kernel_layout), rings of
    ring_bytes each (a power-of-two number of pages), nrings of them, with KLD as kld_support
    gives it (its BTF_ID_ macros and kfunc ids; none: compiled with -DNO_KFUNCS).

    Raises:
        ProbeError: ring_bytes is not a power-of-two number of pages.
    """
    page = os.sysconf("SC_PAGE_SIZE")
    pages = ring_bytes // page
    if pages < 1 or pages & (pages - 1) or pages * page != ring_bytes:
        raise ProbeError(f"ring buffer of {ring_bytes} bytes is not a power-of-two number of pages")
    # A wake-up when a CPU has written an eighth of a ring since the last drain;
    # CPUs beyond MAX_RINGS share rings, and then each wakes at its share of that.
    sharing = -(-(os.cpu_count() or 1) // nrings)
    kld_ids, kfuncs = kld
    cflags = [f"-D{k}={v}" for k, v in sorted({**layout, **kld_ids}.items())]
    cflags += [f"-DPAGE_SHIFT={page.bit_length() - 1}", f"-DRINGBUF_PAGES={pages}", f"-DNRINGS={nrings}",
               f"-DWAKE_BYTES={max(page, ring_bytes // 8 // sharing)}",
               f"-DUID_RING_BYTES={max(page, ring_bytes // 4 // sharing)}", f"-I{BPF_DIR}", "-Wno-unused-function"]
    if not kfuncs:
        cflags.append("-DNO_KFUNCS")
    raw = tuple((name, f"on_{name}") for kind, name in Tracer.PROGRAMS if kind == "raw_tracepoint")
    tracepoints: tuple[str, ...] = ()
    if "SYSCALL_REGS" in layout:
        raw += (("sys_exit", "on_sys_exit"),)
    else:
        tracepoints = Tracer.FALLBACK_TRACEPOINTS
    # TRACEPOINT_PROBE(category, event) functions are attached by BCC on load;
    # exec_vmas is reached by tail call from exec_tail[0], which the Tracer
    # keeps alive by holding the program array's fd.
    return LoadSpec(os.path.join(BPF_DIR, "buildidd.bpf.c"), tuple(cflags), raw_tracepoints=raw,
                    tail_calls=(TailCall("exec_tail", 0, "exec_vmas"),),
                    required_tracepoints=tracepoints, iterators=(synth.ITERATOR,), callbacks=CALLBACKS,
                    kfuncs=kfuncs)


@dataclass
class DropReport:
    """Kernel-side drops since the previous report.

    Attributes:
        counts: cause name → events lost since the previous report.
        first_ns, last_ns: ns since boot of the first and last drop in the
            interval (0 when there was none).
    """

    counts: dict[str, int] = field(default_factory=dict)
    first_ns: int = 0
    last_ns: int = 0

    @property
    def total(self) -> int:
        """Events dropped in the interval, all causes."""
        return sum(self.counts.values())


#: drain_gen's word that says the consumer sleeps without polling (bpf/buildidd.bpf.c DRAIN_GEN_SLEEPING).
DRAIN_GEN_SLEEPING = 1


@dataclass
class QuietWatch:
    """Views into the mapped BPF maps that a quiet wait reads and sets (Tracer.quiet_watch).

    Attributes:
        drops: the drops map's counters, one u64 per DropCause.
        drops_seen: those counters as Tracer.drops() last reported them (bytes, native u64s).
        sleeping: drain_gen[DRAIN_GEN_SLEEPING] (one u64): non-zero while the consumer sleeps.
    """

    drops: memoryview
    drops_seen: bytes
    sleeping: memoryview

    def release(self) -> None:
        """Release the views (the maps cannot be unmapped while one is held)."""
        self.drops.release()
        self.sleeping.release()


class Tracer:
    """The loaded and attached BPF programs and their ring buffers.

    BCC compiles, loads and attaches in a short-lived child (:mod:`buildidd.kernel.loader`):
    this process holds only file descriptors and never maps the compiler.

    Args:
        ring_bytes: the size of each ring buffer (one per CPU, at most
            MAX_RINGS), a power-of-two number of pages; no default here:
            Config.ring_bytes is the one default.
        pin_root: a bpffs directory where the loaded program is kept for the
            next start on this boot (kernel.pinned, Config.bpf_pin_root);
            None: compiled and loaded afresh, nothing kept.
        btf: the kernel's BTF, already parsed (None: /sys/kernel/btf/vmlinux is).
        cache_dir: where what BCC compiled is kept across boots (kernel.progcache,
            Config.bpf_cache_dir); None: compiled at every start without pins.

    Raises:
        ProbeError: BTF lacks a needed field, compilation, load or attach failed.
    """

    #: Without SYSCALL_REGS (another architecture) the BPF side has these instead of on_sys_exit.
    FALLBACK_TRACEPOINTS = ("syscalls:sys_exit_mmap", "syscalls:sys_enter_mprotect",
                            "syscalls:sys_exit_mprotect")
    PROGRAMS = (
        ("raw_tracepoint", "sched_process_exec"),
        ("raw_tracepoint", "sched_process_fork"),
        ("raw_tracepoint", "sched_process_exit"),
        ("raw_tracepoint", "task_rename"),
    )

    def __init__(self, *, ring_bytes: int, btf: Btf | None = None,
                 pin_root: str | None = None, cache_dir: str | None = None):
        t0 = time.monotonic()
        ensure_tracefs()
        btf = btf or Btf.load()
        self.layout = kernel_layout(btf)
        page = os.sysconf("SC_PAGE_SIZE")
        self.nrings = max(1, min(MAX_RINGS, os.cpu_count() or 1))
        #: True when i386 (compat) syscalls are traced (raw_syscalls:sys_exit, see on_sys_exit).
        self.compat = "TS_COMPAT" in self.layout and "SYSCALL_REGS" in self.layout
        #: what was compiled and loaded (kernel.loader.LoadSpec): with kfuncs, or -DNO_KFUNCS.
        self.spec = load_spec(self.layout, ring_bytes, self.nrings, kld_support(btf))
        self.prog = load_program(self.spec, pin_root, cache_dir)
        #: seconds the child spent compiling and loading (BPF()).
        self.compile_s = self.prog.compile_s
        #: seconds the child spent attaching and filling the program array.
        self.attach_s = self.prog.attach_s
        #: seconds from start to holding every fd (BTF, layout, child start, compile, attach).
        self.load_s = time.monotonic() - t0
        self._drop_totals = [0] * N_DROP_CAUSES
        #: (map fd, size in bytes) of each BPF_MAP_TYPE_RINGBUF, consumed by capture.rings.
        self.ring_maps = [(self.prog.maps[f"events{i}"].fd, ring_bytes) for i in range(self.nrings)]
        # BPF_F_MMAPABLE arrays, read and written with loads and stores: no bpf(2) call on the
        # recording thread's path at each drain and drop check.
        self._mapped = [mmap.mmap(self.prog.maps[name].fd, page, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE, offset=0) for name in ("drain_gen", "drops")]
        self._drain_words, self._drop_words = (memoryview(m).cast("Q") for m in self._mapped)
        #: the per-user record budgets (kernel.budget): configure() them, report() what they held back.
        self.budgets = UidBudgets(self.prog.maps["uid_budget"], self.prog.maps["uid_budget_cfg"])

    def set_pagecache_bases(self, vmemmap_base: int, page_offset_base: int) -> None:
        """Turn the page-cache build-id reads on: write struct pagecache_bases (bpf/pagecache.h),
        found and checked by capture.bpfstart; zeros turn them off."""
        self.prog.maps["pagecache_bases"].update(ctypes.c_int(0), PagecacheBases(vmemmap_base, page_offset_base))

    def reset_wakeups(self) -> None:
        """Start every CPU's count of bytes written since its last wake-up afresh: called after a
        drain, so that a CPU wakes the consumer once WAKE_BYTES are written since the consumer
        last read, as perf's wakeup_watermark counts.

        One store into the mmap'ed BPF_F_MMAPABLE array drain_gen (u64 at offset 0): each CPU's
        wake_state starts from zero at its next record when the generation it holds differs
        (bpf/buildidd.bpf.c wake_flag), instead of a bpf(2) map update per drain.
        """
        words = self._drain_words
        words[0] = (words[0] + 1) & 0xFFFF_FFFF_FFFF_FFFF

    def drain_generation(self) -> int:
        """The consumer's drain count as the BPF side reads it (map drain_gen, key 0, via bpf(2))."""
        return int.from_bytes(self.prog.maps["drain_gen"].lookup(ctypes.c_int(0)), "little")

    def drops(self) -> DropReport:
        """Kernel-side drops since the previous call (the map drops, read through its mapping;
        drop_times with bpf(2) only when a count moved)."""
        report = DropReport()
        words = self._drop_words[:N_DROP_CAUSES].tolist()
        if words == self._drop_totals:      # the common case, without a loop over DropCause
            return report
        for cause in DropCause:
            total = words[cause]
            delta = total - self._drop_totals[cause]
            if delta:
                report.counts[cause.name.lower()] = delta
                self._drop_totals[cause] = total
        if report.counts:
            times = self.prog.maps["drop_times"]
            per_cpu = [DropTime.from_buffer_copy(v) for v in times.lookup(ctypes.c_int(0))]
            firsts = [t.first_ns for t in per_cpu if t.first_ns]
            report.first_ns = min(firsts) if firsts else 0
            report.last_ns = max((t.last_ns for t in per_cpu), default=0)
            times.update(ctypes.c_int(0), DropTime())  # one value for every CPU
        return report

    def quiet_watch(self) -> QuietWatch:
        """What a quiet wait (capture.rings.Rings.quiet_wait) reads and sets, as views of the
        mapped maps: the drops counters with their totals as drops() last reported, and the
        consumer's sleeping flag (drain_gen[1], bpf/buildidd.bpf.c DRAIN_GEN_SLEEPING).
        Release the views (QuietWatch.release) before close()."""
        return QuietWatch(self._drop_words[:N_DROP_CAUSES], array.array("Q", self._drop_totals).tobytes(),
                          self._drain_words[DRAIN_GEN_SLEEPING:DRAIN_GEN_SLEEPING + 1])

    def memo_stats(self) -> dict[str, int]:
        """Counters of the kernel's build-id memo (bpf/buildid_memo.h, enum bid_memo_stat), summed
        over CPUs, since the program was loaded or its maps reset: {"hits": mappings answered from
        the memo, "fills": entries made, "confirms": entries confirmed by a second read,
        "writer_skips": mappings of a file open for writing, read from its page cache}."""
        table = self.prog.maps["bid_memo_stats"]
        return {name: sum(int.from_bytes(v, "little") for v in table.lookup(ctypes.c_int(i)))
                for i, name in enumerate(("hits", "fills", "confirms", "writer_skips"))}

    def synthesize(self, sink) -> "synth.SynthResult":
        """The executable file mappings of every running process, read now by the task_vma
        iterator (kernel.synth): sink(records) takes raw struct map_event records (origin
        BUILDIDD_ORIGIN_SYNTHESIZED) a chunk at a time.

        Raises:
            OSError: the iterator could not be created or read.
        """
        prog = self.prog.progs.get(synth.ITERATOR)
        if prog is None:            # the kernel refused it at load (loader: iterators are optional)
            raise OSError(errno.EOPNOTSUPP, f"{synth.ITERATOR} was not loaded")
        return synth.synthesize(prog, sink)

    def close(self) -> None:
        """Detach and unload every program (closes every fd the loader handed over)."""
        self._drain_words.release()
        self._drop_words.release()
        for m in self._mapped:
            m.close()
        self.prog.close()

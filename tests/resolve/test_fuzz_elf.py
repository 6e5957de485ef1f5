"""Fuzzing the ELF readers with mutations of real binaries (hypothesis).

Targets: the note reader (:func:`parse_build_id`, :func:`read_build_id_fd`,
:func:`build_id_from_notes`) and the store's ELF handling
(:func:`buildidd.store.sdt_probe_cache`, the debug-section check that picks
the copy served for symbols, :func:`buildidd.store.debuginfo.has_debug_sections`).
Seeds are gcc-built binaries (64- and 32-bit, shared, stripped, with SDT notes
and an 8-aligned note); each case overwrites a few spans (biased to the ELF
header and the header tables, with boundary integers), may truncate, and runs
every target on the bytes in memory and through a memfd.

Each case is bounded: SIGALRM after :data:`CASE_TIMEOUT_S` fails it, and its
tracemalloc peak must stay under :data:`CASE_MEMORY_BYTES`.  Only the
project's own :class:`~buildidd.errors.ElfError` may escape (sdt_probe_cache
and has_debug_sections raise nothing on malformed input).  Deterministic
(derandomized) so that CI runs the same cases.
"""

from __future__ import annotations

import io
import os
import signal
import struct
import time
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from buildidd.errors import ElfError
from buildidd.resolve.buildid import build_id_from_notes, parse_build_id, read_build_id_fd
from buildidd.store import sdt_probe_cache
from buildidd.store.debuginfo import copy_sections, has_debug_sections, lacks_section, read_debuglink

from conftest import gcc

CASES = 1200
CASE_TIMEOUT_S = 5
CASE_MEMORY_BYTES = 64 << 20

SDT_SRC = """
#define NOTE(ver, loc, prov, name, args) __asm__ __volatile__ ( \\
    "990: nop\\n.pushsection .note.stapsdt,\\"?\\",\\"note\\"\\n.balign 4\\n.4byte 992f-991f,994f-993f,3\\n" \\
    "991: .asciz \\"stapsdt\\"\\n992: .balign 4\\n993: .8byte 990b\\n.8byte _.stapsdt.base\\n.8byte 0\\n" \\
    ".asciz \\"" prov "\\"\\n.asciz \\"" name "\\"\\n.asciz \\"" args "\\"\\n994: .balign 4\\n.popsection\\n" \\
    ".ifndef _.stapsdt.base\\n.pushsection .stapsdt.base,\\"aG\\",\\"progbits\\",.stapsdt.base,comdat\\n" \\
    ".weak _.stapsdt.base\\n.hidden _.stapsdt.base\\n_.stapsdt.base: .space 1\\n.size _.stapsdt.base, 1\\n" \\
    ".popsection\\n.endif\\n")
int main(int c, char **v) { NOTE(0, 0, "fz", "probe", "8@%rdi -4@$5"); return c; }
"""
MAIN = "int g(int x) { return x * 3; } int main(int c, char **v) { return g(c); }"


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> list[bytes]:
    tmp = tmp_path_factory.mktemp("fuzzseeds")
    out = [
        gcc(MAIN, tmp / "exe64", "-g", "-Wl,--build-id=sha1"),
        gcc(MAIN, tmp / "exe32", "-m32", "-Wl,--build-id=md5"),
        gcc(MAIN, tmp / "lib.so", "-shared", "-fPIC", "-Wl,--build-id=0x0123456789abcdef"),
        gcc(SDT_SRC, tmp / "sdt", "-Wl,--build-id=sha1"),
        gcc(MAIN, tmp / "prop", "-fcf-protection=full", "-Wl,-z,ibt,-z,shstk", "-Wl,--build-id=sha1"),
    ]
    stripped = tmp / "stripped"
    os.system(f"strip --strip-all -o {stripped} {out[0]}")
    out.append(stripped)
    return [p.read_bytes() for p in out]


BOUNDARY = [0, 1, 3, 4, 7, 8, 0x7f, 0x80, 0xff, 0xffff, 0x7fffffff, 0xffffffff, 0xfffffffffffffff0,
            0xffffffffffffffff, 1 << 63, 4096, 65536]

#: Offsets of the ELF64/ELF32 header fields that steer the walk (e_phoff, e_shoff, counts, sizes, class, data).
HOT = [4, 5, 0x20, 0x28, 0x2A, 0x2C, 0x2E, 0x30, 0x34, 0x36, 0x38, 0x3A, 0x3C, 0x3E, 0x1C]


@st.composite
def mutations(draw):
    seed = draw(st.integers(0, 5))
    n = draw(st.integers(1, 8))
    edits = []
    for _ in range(n):
        where = draw(st.one_of(st.sampled_from(HOT), st.integers(0, 4095), st.integers(0, 1 << 16)))
        what = draw(st.one_of(
            st.binary(min_size=1, max_size=8),
            st.builds(lambda v, w: struct.pack("<Q", v)[:w], st.sampled_from(BOUNDARY), st.sampled_from([1, 2, 4, 8])),
        ))
        edits.append((where, what))
    cut = draw(st.one_of(st.none(), st.integers(0, 1 << 16)))
    return seed, edits, cut


def mutate(data: bytes, edits, cut) -> bytes:
    buf = bytearray(data)
    for where, what in edits:
        where %= max(1, len(buf))
        buf[where:where + len(what)] = what
    if cut is not None:
        del buf[cut:]
    return bytes(buf)


class _CaseTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise _CaseTimeout(f"a fuzz case ran over {CASE_TIMEOUT_S} s")


def _debuglink_of(fd: int):
    """read_debuglink of fd's file (it takes a path: the memfd's /proc/self/fd name)."""
    return read_debuglink(Path(f"/proc/self/fd/{fd}"))


def run_targets(data: bytes) -> None:
    """Every target on data; only ElfError may escape from the note readers."""
    for call in (lambda: parse_build_id(data), lambda: build_id_from_notes(data[64:4096]),
                 lambda: parse_build_id(data[:4096], max(len(data), 4096))):
        try:
            call()
        except ElfError:
            pass
    fd = os.memfd_create("fuzz")
    try:
        os.write(fd, data)
        try:
            read_build_id_fd(fd)
        except ElfError:
            pass
        has_debug = has_debug_sections(fd)
        lacks_sdt = lacks_section(fd, b".note.stapsdt")
        # The store reads a copy's sections once (copy_sections): the same answers as the three readers.
        known = copy_sections(fd)
        link = _debuglink_of(fd)
        assert (known.has_debug, known.lacks(b".note.stapsdt"), known.debuglink) == (has_debug, lacks_sdt, link)
    finally:
        os.close(fd)
    probes = sdt_probe_cache(io.BytesIO(data), "/fuzz")
    assert isinstance(probes, bytes)
    # store.sdt.probes_text skips pyelftools on lacks_section: never where pyelftools finds probes.
    assert not (lacks_sdt and probes), "lacks_section said no .note.stapsdt, pyelftools found probes"


def test_fuzz_elf_readers_with_mutated_binaries(seeds):
    stats = {"cases": 0, "slowest_s": 0.0, "peak_bytes": 0}
    old = signal.signal(signal.SIGALRM, _alarm)

    @settings(max_examples=CASES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(mutations())
    def case(m):
        seed, edits, cut = m
        data = mutate(seeds[seed], edits, cut)
        tracemalloc.start()
        signal.alarm(CASE_TIMEOUT_S)
        t0 = time.perf_counter()
        try:
            run_targets(data)
        finally:
            signal.alarm(0)
            elapsed = time.perf_counter() - t0
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
        stats["cases"] += 1
        stats["slowest_s"] = max(stats["slowest_s"], elapsed)
        stats["peak_bytes"] = max(stats["peak_bytes"], peak)
        assert peak < CASE_MEMORY_BYTES, (peak, m)

    try:
        case()
    finally:
        signal.signal(signal.SIGALRM, old)
    print(f"fuzz: {stats['cases']} cases, slowest {stats['slowest_s'] * 1000:.1f} ms, "
          f"peak {stats['peak_bytes']} bytes traced")
    assert stats["cases"] >= 1000


def test_seeds_parse(seeds):
    """The unmutated seeds are read correctly (the fuzz starts from valid files)."""
    for data in seeds:
        assert parse_build_id(data) is not None

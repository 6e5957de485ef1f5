#!/usr/bin/env python3
"""Time buildidd's build-id reader against pyelftools.

Reads the GNU build-id of the first 200 shared objects (``*.so*``, sorted by
name, regular files only) in a library directory with both readers and prints
the mean wall time per file in microseconds.  Each reader runs ``--rounds``
times over the set after one warm-up pass, so the page cache is warm for
both.  A measurement, not a test: it asserts only that the readers agree.

Usage: scripts/bench_buildid.py [--dir /lib/x86_64-linux-gnu] [--count 200] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import time


from elftools.common.exceptions import ELFError as PyElfError  # noqa: E402
from elftools.elf.elffile import ELFFile  # noqa: E402

from buildidd.resolve.buildid import read_build_id  # noqa: E402
from buildidd.errors import ElfError  # noqa: E402


def ours(path: str) -> str | None:
    """Build-id hex by buildidd, ``None`` without one or on a bad file."""
    try:
        bid = read_build_id(path)
    except ElfError:
        return None
    return None if bid is None else bid.hex


def pyelftools(path: str) -> str | None:
    """Build-id hex by pyelftools: PT_NOTE segments, then SHT_NOTE sections."""
    try:
        with open(path, "rb") as f:
            elf = ELFFile(f)
            regions = [s for s in elf.iter_segments() if s["p_type"] == "PT_NOTE"]
            regions += [s for s in elf.iter_sections() if s["sh_type"] == "SHT_NOTE"]
            for region in regions:
                for note in region.iter_notes():
                    if note["n_type"] == "NT_GNU_BUILD_ID" and note["n_name"] == "GNU":
                        return note["n_desc"]
    except (PyElfError, ValueError, OSError):
        return None
    return None


def time_per_file_us(fn, paths: list[str], rounds: int) -> float:
    """Mean microseconds per call of ``fn`` over ``paths``, ``rounds`` passes."""
    for p in paths:
        fn(p)
    start = time.perf_counter_ns()
    for _ in range(rounds):
        for p in paths:
            fn(p)
    return (time.perf_counter_ns() - start) / 1000 / (rounds * len(paths))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/lib/x86_64-linux-gnu")
    ap.add_argument("--count", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    paths = []
    for name in sorted(os.listdir(args.dir)):
        p = os.path.join(args.dir, name)
        if ".so" in name and os.path.isfile(p) and not os.path.islink(p):
            paths.append(p)
        if len(paths) == args.count:
            break
    if not paths:
        print(f"no shared objects in {args.dir}", file=sys.stderr)
        return 1

    disagree = [p for p in paths if ours(p) != pyelftools(p)]
    with_id = sum(ours(p) is not None for p in paths)
    t_ours = time_per_file_us(ours, paths, args.rounds)
    t_pyelf = time_per_file_us(pyelftools, paths, max(1, args.rounds // 5))
    print(f"{len(paths)} files in {args.dir}, {with_id} with a build-id")
    print(f"buildidd.buildid: {t_ours:8.1f} us/file")
    print(f"pyelftools:       {t_pyelf:8.1f} us/file  ({t_pyelf / t_ours:.0f}x)")
    if disagree:
        print(f"readers disagree on {len(disagree)} files, e.g. {disagree[:3]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the htlhash (resolve.fileid.file_id) adds to a hand-over, per file.

A hand-over to the store (resolve.handover.HandOverJob.run, a worker thread, never the
recording thread) opens the mapped file, checks its identity and reads its build-id back;
it now also computes the file's htlhash from the same descriptor (two 4 KiB preads and a
SHA-256 over 8 KiB).  This times, per file on open descriptors with a warm page cache:
the build-id read the hand-over already did, the htlhash it adds, and the Go build ID
read a file without a GNU build-id adds.  Mean and 99th percentile in microseconds over
``--count`` shared objects and executables, ``--rounds`` passes after one warm-up.
A measurement, not a test.

Usage: scripts/bench --micro htlhash [--count 500] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import statistics
import time
from pathlib import Path

from buildidd.errors import ElfError
from buildidd.resolve.buildid import read_build_id_fd
from buildidd.resolve.fileid import file_id, read_go_build_id


def files(count: int) -> list[str]:
    out = []
    for top in ("/usr/lib/x86_64-linux-gnu", "/usr/bin"):
        for name in sorted(os.listdir(top)):
            p = os.path.join(top, name)
            try:
                if stat.S_ISREG(os.stat(p).st_mode) and os.access(p, os.R_OK):
                    out.append(p)
            except OSError:
                continue
    step = max(1, len(out) // count)
    return out[::step][:count]


def build_id(fd: int) -> None:
    try:
        read_build_id_fd(fd)
    except ElfError:
        pass


def timed(fn, fds: list[int], rounds: int) -> list[float]:
    per = []
    for fd in fds:
        fn(fd)                                     # warm-up
    for _ in range(rounds):
        for fd in fds:
            t = time.perf_counter_ns()
            fn(fd)
            per.append((time.perf_counter_ns() - t) / 1000)
    return per


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="20 files, one round")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    if args.smoke:
        args.count, args.rounds = 20, 1
    paths = files(args.count)
    fds = [os.open(p, os.O_RDONLY | os.O_CLOEXEC) for p in paths]
    try:
        rows = {"build-id read (already in the hand-over)": timed(build_id, fds, args.rounds),
                "htlhash (added)": timed(file_id, fds, args.rounds),
                "Go build ID read (files without a GNU build-id)": timed(read_go_build_id, fds, args.rounds)}
    finally:
        for fd in fds:
            os.close(fd)
    print(f"{len(paths)} files, {args.rounds} rounds, warm page cache; microseconds per file")
    out = {}
    for name, us in rows.items():
        us.sort()
        out[name] = {"mean_us": statistics.fmean(us), "p99_us": us[max(0, int(len(us) * 0.99) - 1)]}
        print(f"  {name:50s} mean {out[name]['mean_us']:7.2f}  p99 {out[name]['p99_us']:7.2f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0

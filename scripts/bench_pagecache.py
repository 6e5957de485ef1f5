"""Cost of bpf/pagecache.h: kernel ns per build-id read and verifier instructions.

Loads bpf/pagecache_probe.bpf.c with kernel.bpf_stats_enabled=1 and triggers,
on each file, N requests that only look the fd up (the baseline) and N that
also read the build-id; the difference of the program's run_time_ns/run_cnt
(/proc/self/fdinfo of the program fd) is the read's cost.  The verifier's
count is the program's verified_insns minus that of the same program
compiled with -DPC_NO_BUILD_ID.

Usage (root): scripts/bench --micro pagecache [-n 2000] [--cflag -DPC_WIN=4096] [FILE...]
"""

from __future__ import annotations

import argparse
import json
import glob
import os
import statistics
from pathlib import Path

from buildidd.kernel.pagecache import PageCacheProbe, PcStatus, discover_bases

STATS = "/proc/sys/kernel/bpf_stats_enabled"


def probe_fdinfo(probe: PageCacheProbe) -> dict[str, int]:
    """The probe program's /proc/self/fdinfo counters (run_time_ns, run_cnt, verified_insns, ...) by name."""
    out = {}
    with open(f"/proc/self/fdinfo/{probe.prog_fd}") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("run_time_ns", "run_cnt", "verified_insns"):
                out[key] = int(value)
    return out


def per_call_ns(probe: PageCacheProbe, fd: int, n: int, call) -> float:
    before = probe_fdinfo(probe)
    for _ in range(n):
        call(fd)
    after = probe_fdinfo(probe)
    return (after["run_time_ns"] - before["run_time_ns"]) / max(1, after["run_cnt"] - before["run_cnt"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=2000, help="requests of each kind per file")
    ap.add_argument("--cflag", action="append", default=[], help="extra -D for pagecache.h")
    ap.add_argument("files", nargs="*")
    ap.add_argument("--smoke", action="store_true", help="50 requests on 3 files")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    if args.smoke:
        args.n = 50
    files = args.files or sorted(glob.glob("/usr/lib/x86_64-linux-gnu/lib*.so.*"))[:3 if args.smoke else 40]
    base = PageCacheProbe(cflags=("-DPC_NO_BUILD_ID", *args.cflag))
    base_insns = probe_fdinfo(base)["verified_insns"]
    base.close()
    probe = PageCacheProbe(cflags=tuple(args.cflag))
    discover_bases(probe)
    insns = probe_fdinfo(probe)["verified_insns"]
    with open(STATS) as f:
        old = f.read().strip()
    with open(STATS, "w") as f:
        f.write("1")
    costs = []
    try:
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                while os.read(fd, 1 << 20):
                    pass
                if probe.build_id(fd).status != PcStatus.OK:
                    continue
                b = per_call_ns(probe, fd, args.n, probe.baseline)
                r = per_call_ns(probe, fd, args.n, probe.build_id)
                costs.append(r - b)
            finally:
                os.close(fd)
    finally:
        probe.close()
        with open(STATS, "w") as f:
            f.write(old)
    print(f"files read: {len(costs)}; build-id read: median {statistics.median(costs):.0f} ns, "
          f"min {min(costs):.0f}, max {max(costs):.0f} ns per read (bpf_stats, minus baseline)")
    print(f"verifier: {insns} instructions with the read, {base_insns} without: "
          f"{insns - base_insns} for pagecache_build_id()")
    if args.json:
        args.json.write_text(json.dumps({"read_ns_median": statistics.median(costs), "read_ns": costs,
                                         "verified_insns": insns, "verified_insns_without": base_insns}, indent=2))
    return 0

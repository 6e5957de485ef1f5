"""The storms after a start, one by one: what the first sight of a workload's libraries costs it.

Run as root after scripts/setup:  scripts/bench --scenarios first-storm [--reps 4]

scripts/bench starts a fresh daemon for every repetition, so each of its
storms is the first that daemon sees: every library of the storm is met for
the first time in the session, and its build-id goes to the store (a warm
store already holds it: the sighting is checked against the stored copy and
touched).  Here each daemon (and each perf) sees three dlopen storms in a row
(scripts/workloads, 50 libraries x 200 rounds), the workload pinned to CPU 1
and the daemon's threads to CPU 0, and the wall time of each storm is printed
beside perf's, for buildidd as shipped and for buildidd without a store
(``--store-root ""``).  The median over --reps of each storm's time is the
last line of each mode.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

from benchlib import Buildidd, build, remove_tree, storm_argv, warm_store  # noqa: E402
from perfcompare import PerfRecorder, require_quiet_host  # noqa: E402

STORMS = 3
SETTLE_S = 0.3


def timed_runs(argv: list[str]) -> list[float]:
    """Wall seconds of STORMS runs of argv, SETTLE_S apart."""
    out = []
    for _ in range(STORMS):
        t = time.monotonic()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        out.append(time.monotonic() - t)
        time.sleep(SETTLE_S)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--libs", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--smoke", action="store_true", help="one repetition of a tiny storm")
    ap.add_argument("--json", type=Path, help="write the medians here")
    args = ap.parse_args(argv)
    if args.smoke:
        args.reps, args.libs, args.rounds = 1, 4, 3
    if os.geteuid() != 0:
        print("bench_first_storm: run as root", file=sys.stderr)
        return 2
    if (os.cpu_count() or 1) < 2:
        print("bench_first_storm: needs two CPUs (the workload on CPU 1, the daemon on CPU 0)", file=sys.stderr)
        return 2
    if not args.smoke:          # a smoke run asserts no figure: it may run beside other work
        require_quiet_host("bench_first_storm")
    workdir = Path(tempfile.mkdtemp(prefix="buildidd-first-storm-"))
    try:
        w = build.build(workdir / "bin", n_libs=args.libs)
        argv = ["taskset", "-c", "1", *storm_argv(w, 0, args.libs, args.rounds, 0)["dlopen"][0]]
        store = warm_store(workdir)
        times: dict[str, list[list[float]]] = {"perf": [], "buildidd": [], "buildidd, no store": []}
        for rep in range(args.reps):
            for mode in times:
                if mode == "perf":
                    d = PerfRecorder(workdir / "perf.data")
                else:
                    d = Buildidd(workdir, store=store, extra=["--store-root", ""] if "no store" in mode else [])
                    for t in d.ps.threads():
                        os.sched_setaffinity(t.id, {0})
                time.sleep(SETTLE_S)
                got = timed_runs(argv)
                if mode == "perf":
                    d.stop()
                else:
                    d.stop(read=False)
                    d.cleanup()
                times[mode].append(got)
                print(f"  rep {rep + 1}/{args.reps} {mode:<19} " + "  ".join(f"{x:.3f}" for x in got), flush=True)
    finally:
        remove_tree(workdir)
    print(f"\ndlopen storm {args.libs}x{args.rounds}, wall s of storms 1..{STORMS} after the start "
          f"(median of {args.reps}):")
    medians = {}
    for mode, runs in times.items():
        medians[mode] = [statistics.median(r[k] for r in runs) for k in range(STORMS)]
        print(f"  {mode:<19} " + "  ".join(f"{x:.3f}" for x in medians[mode]))
    if args.json:
        args.json.write_text(json.dumps({"libs": args.libs, "rounds": args.rounds, "reps": args.reps,
                                         "storm_s": medians}, indent=2))
    return 0

"""scripts/bench: buildidd's one bench tool, every figure beside perf's where perf does the same work.

Host scenarios (root, after scripts/setup; a real daemon, real workloads, perf beside it):
    scripts/bench [--scenarios NAME,...|all] [--smoke] [--json FILE] [options of the scenarios' modules]
In-process micro-benchmarks (one piece of the daemon timed in a loop, no daemon running):
    scripts/bench --micro NAME[,NAME...] [--smoke] [--json FILE] [options of its module]
    scripts/bench --list                      every scenario and micro-benchmark, and its module

Without --scenarios or --micro it runs the storms (STORMS), as it always did.  The options after
the names go to each named module's own parser (``scripts/bench --scenarios rings --help`` lists
them); a module refuses an option it does not know, so give a module's own options when running
only that module.  --smoke runs each at tiny sizes in seconds and exits 1 when a check fails
(tests/integration/test_bench_scenarios.py runs every one).  --json FILE writes
{"date": ..., "results": {module: its figures}}.

Adding a scenario: one line in SCENARIOS (MICRO for a micro-benchmark) and one module under
scripts/ with
    main(argv: list[str]) -> int   argparse over argv, with --smoke and --json FILE; prints its
                                   figures (perf's beside them where it compares), writes them
                                   as JSON to FILE; 0, or 1 when a --smoke check failed;
    SCENARIOS = (names, ...)       only when one module runs several scenarios: it then takes
                                   --scenarios with the requested subset;
and one case in tests/integration/test_bench_scenarios.py (SMOKE), which fails until it has one.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: Host scenario -> (module under scripts/, what it measures).  One line adds a scenario.
SCENARIOS: dict[str, tuple[str, str]] = {
    "exec": ("bench_storms", "exec storm: workload overhead, daemon CPU/event, memory, READY, completeness"),
    "dlopen": ("bench_storms", "dlopen storm on a warm store, the same figures"),
    "mmap": ("bench_storms", "unpaced mmap storm of one known file, the same figures"),
    "dlopen-cold": ("bench_storms", "dlopen storm on an empty store (a host's first start)"),
    "procs": ("bench_storms", "READY and synthesis completeness with many processes running"),
    "ramp": ("bench_storms", "paced and unpaced mmap storms: rate kept, losses, CPU per event"),
    "idle": ("bench_storms", "an idle host: CPU and wake-ups per second"),
    "farm": ("bench_storms", "the build farm (bench_farm.py): CPU per new program, every program stored"),
    "profile": ("bench_storms", "cProfile of the daemon during an mmap storm"),
    "first-storm": ("bench_first_storm", "the first storms after a start, one by one"),
    "rings": ("bench_rings", "ring size against losses under unpaced mmap storms"),
    "syscall-tax": ("bench_syscall_tax", "what every syscall pays while buildidd records"),
    "kernel-ns": ("bench_kernel_ns", "kernel ns per event of the BPF programs (bpf_stats)"),
    "soak": ("soak", "memory and losses under a steady storm for minutes"),
    "upgrade-race": ("bench_upgrade_race", "binaries renamed over 0 ms after exit: does the store keep them"),
    "footprint": ("bench_footprint", "how cost grows: READY by start and processes, RSS by DSOs, CPU by rate"),
    "inject": ("bench_inject", "buildidd inject against perf inject --buildid-all on one profile"),
    "fleet": ("bench_fleet", "issue 44's goals: three hosts pushing to a real weed bucket, one gone, an outage"),
}
#: Micro-benchmark -> (module under scripts/, what it times).  One line adds one.
MICRO: dict[str, tuple[str, str]] = {
    "handoff": ("bench_handoff", "daemon cost per event: a new file identity (slow path), a known one (fast)"),
    "segment-format": ("bench_segment_format", "a mapping in the session log: JSON line against raw record"),
    "htlhash": ("bench_htlhash", "what the htlhash adds to a hand-over per file, beside the build-id read"),
    "pagecache": ("bench_pagecache", "kernel ns per page-cache build-id read, verifier instructions (root)"),
}
#: What runs without --scenarios or --micro.
STORMS = "exec,dlopen,mmap,dlopen-cold,procs,ramp,idle,farm,profile"


def plan(table: dict[str, tuple[str, str]], names: str) -> dict[str, list[str]]:
    """Requested names ("all": every one of table) -> {module: [its names, in table order]}.
    Raises SystemExit naming the unknown ones."""
    want = list(table) if names == "all" else [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in want if n not in table]
    if unknown:
        raise SystemExit(f"bench: unknown {', '.join(unknown)}; known: {', '.join(table)} (or all)")
    out: dict[str, list[str]] = {}
    for name in table:
        if name in want:
            out.setdefault(table[name][0], []).append(name)
    return out


def run_module(module_name: str, names: list[str], rest: list[str], json_path: Path | None) -> tuple[int, object]:
    """module.main(rest + its --scenarios + --json): (exit status, its figures or the error text).
    A module that raises or exits is reported and the next one runs."""
    module = importlib.import_module(module_name)
    argv = list(rest)
    if hasattr(module, "SCENARIOS"):
        argv += ["--scenarios", ",".join(names)]
    if json_path is not None:
        argv += ["--json", str(json_path)]
    print(f"\n=== {', '.join(names)} ({module_name}.py) ===", flush=True)
    try:
        rc = module.main(argv) or 0
    except SystemExit as e:            # argparse (--help, a bad option) or a refusal (another tracer runs)
        if e.code in (0, None):
            return 0, None
        if not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        return e.code if isinstance(e.code, int) else 1, {"error": str(e.code)}
    except Exception:
        print(traceback.format_exc(), file=sys.stderr)
        return 1, {"error": traceback.format_exc(limit=3)}
    figures = json.loads(json_path.read_text()) if json_path is not None and json_path.exists() else None
    return rc, figures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 add_help=False)
    ap.add_argument("--scenarios", help="host scenarios, comma-separated, or all (default: the storms)")
    ap.add_argument("--micro", help="micro-benchmarks, comma-separated, or all")
    ap.add_argument("--footprint", action="store_true", help="the same as --scenarios footprint")
    ap.add_argument("--list", action="store_true", help="list scenarios and micro-benchmarks")
    ap.add_argument("--json", type=Path, help="write every module's figures here")
    ap.add_argument("-h", "--help", action="store_true")
    args, rest = ap.parse_known_args(argv)
    if args.list or (args.help and not (args.scenarios or args.micro)):
        if args.help:
            ap.print_help()
        for title, table in (("host scenarios (--scenarios)", SCENARIOS), ("micro-benchmarks (--micro)", MICRO)):
            print(f"\n{title}:")
            for name, (module, what) in table.items():
                print(f"  {name:<15} {module + '.py':<24} {what}")
        return 0
    if args.help:
        rest.append("--help")
    sys.path.insert(0, str(HERE))
    if args.micro:
        todo = plan(MICRO, args.micro)
    else:
        todo = plan(SCENARIOS, "footprint" if args.footprint else args.scenarios or STORMS)
    results, failed = {}, []
    with tempfile.TemporaryDirectory(prefix="buildidd-bench-json-") as tmp:
        for module_name, names in todo.items():
            out = Path(tmp) / f"{module_name}.json" if args.json else None
            rc, figures = run_module(module_name, names, rest, out)
            results[module_name] = figures
            if rc:
                failed.append(f"{module_name} ({', '.join(names)}): exit {rc}")
    if args.json:
        args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                         "results": results}, indent=2))
    if failed:
        print("bench: " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The upgrade race: does the store keep binaries that are replaced the moment their process exits?

Run as root after scripts/setup:
    scripts/bench --scenarios upgrade-race [--programs 200] [--libs 20] [--life-ms 30]

Workloads, built with gcc at bench time, each file with its own random build-id:
  exec    each of --programs programs is run once and a new build is renamed over
          it 0 ms after it exits (a package upgrade, a rebuild);
  dlopen  each of --libs libraries is dlopen'd by a process that lives --life-ms,
          and a new build is renamed over it right after the process exits.
Each runs under ``buildidd run`` on a fresh store (the host's first start: every
running DSO is copied meanwhile) and on a warm one (the store already holds what
runs), and under ``perf record -a --buildid-all`` with its own build-id cache
(``perf --buildid-dir``), which perf fills by path when the recording ends.
SIGTERM comes 1 s after the workload.  Printed side by side: the share of the
workload's build-ids each store holds, the build-ids the session named that the
store lacks without a reason (unnamed gaps: must be 0), and the stop's duration.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from buildidd.sessionlog import read_session
from buildidd.store import Store

HERE = Path(__file__).resolve().parent
from perfcompare import perf_record_lock  # noqa: E402
from workloads.upgrade import build_race, race_script  # noqa: E402


def run_buildidd(store: Path, work: Path, script: str, py: str) -> dict:
    """buildidd run around the script; SIGTERM 1 s after it.  The end record's figures."""
    sessions = work / f"sessions-{time.monotonic_ns()}"
    log = work / "daemon.log"
    with open(log, "w") as f:
        p = subprocess.Popen([py, "-m", "buildidd.cli", "run", "--session-root", str(sessions),
                              "--store-root", str(store), "--control-socket", ""], stderr=f)
    deadline = time.monotonic() + 60
    while "recording into" not in log.read_text():
        if p.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"buildidd did not start:\n{log.read_text()}")
        time.sleep(0.05)
    subprocess.run(["sh", "-c", script], check=True)
    time.sleep(1.0)
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=120)
    stop_s = time.monotonic() - t0
    (sdir,) = list(sessions.iterdir())
    records = list(read_session(sdir))
    end = records[-1]
    cov = end.get("store_coverage", {})
    listed = {m["build_id"] for m in cov.get("missing", [])}
    st = Store(store)
    named = {r["build_id"] for r in records if r.get("type") == "mmap" and r.get("build_id")}
    unnamed = sum(1 for b in named if b not in listed and not st.contains(b))
    return {"stop_s": stop_s, "named": cov.get("named"), "held": cov.get("held"), "gaps": cov.get("gaps"),
            "unnamed": unnamed, "pins": end.get("exec_pins", {}),
            "last_error": (end.get("store") or {}).get("last_error")}


def run_perf(cache: Path, work: Path, script: str) -> None:
    """perf record -a --buildid-all around the script, its build-id cache at cache (filled by path
    when the recording ends, as perf does)."""
    env = {k: v for k, v in os.environ.items() if k != "DEBUGINFOD_URLS"}
    with perf_record_lock():
        subprocess.run(["perf", "--buildid-dir", str(cache), "record", "-q", "-a", "--buildid-all", "-e", "dummy",
                        "-o", str(work / "perf.data"), "--", "sh", "-c", script + "sleep 1\n"],
                       check=True, env=env, capture_output=True)


def held(store: Path, bids: list[str]) -> int:
    return sum(1 for b in bids if (store / ".build-id" / b[:2] / b[2:]).exists())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--programs", type=int, default=200)
    ap.add_argument("--libs", type=int, default=20)
    ap.add_argument("--life-ms", type=int, default=30, help="how long each dlopen process lives, ms")
    ap.add_argument("--no-perf", action="store_true")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--smoke", action="store_true", help="10 programs, 3 libraries")
    args = ap.parse_args(argv)
    if args.smoke:
        args.programs, args.libs, args.life_ms = 10, 3, 10
    if os.geteuid() != 0:
        raise SystemExit("run as root")
    tmp = Path(tempfile.mkdtemp(prefix="buildidd-race-"))
    os.chmod(tmp, 0o755)
    rows = []
    try:
        warm = tmp / "warm-store"
        warm_s = "1" if args.smoke else "3"
        subprocess.run([sys.executable, "-m", "buildidd.cli", "run", "--duration", warm_s, "--session-root",
                        str(tmp / "warmup"), "--store-root", str(warm), "--control-socket", ""],
                       check=True, capture_output=True)
        modes = [("buildidd, fresh store", "fresh"), ("buildidd, warm store", "warm")]
        if not args.no_perf and shutil.which("perf"):
            modes.append(("perf record --buildid-all", "perf"))
        for label, mode in modes:
            work = tmp / f"work-{mode}"
            bids = build_race(work, args.programs, args.libs)
            script = race_script(work, args.programs, args.libs, args.life_ms)
            extra: dict = {}
            if mode == "perf":
                store = tmp / "perf-cache"
                run_perf(store, work, script)
                extra = {"cache_entries": sum(1 for _ in (store / ".build-id").glob("*/*"))}
            else:
                store = tmp / "fresh-store" if mode == "fresh" else warm
                extra = run_buildidd(store, work, script, sys.executable)
            rows.append({"mode": label, "exec_held": held(store, bids["exec"]), "exec_n": len(bids["exec"]),
                         "dlopen_held": held(store, bids["dlopen"]), "dlopen_n": len(bids["dlopen"]), **extra})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"upgrade race: {args.programs} programs renamed over 0 ms after exit, {args.libs} libraries "
          f"dlopen'd by {args.life_ms} ms processes then replaced; SIGTERM 1 s after")
    print(f"{'mode':<28} {'exec kept':>14} {'dlopen kept':>14} {'unnamed gaps':>13} {'named gaps':>24} "
          f"{'stop s':>7}")
    for r in rows:
        ex = f"{r['exec_held']}/{r['exec_n']} {100 * r['exec_held'] / max(1, r['exec_n']):.1f}%"
        dl = f"{r['dlopen_held']}/{r['dlopen_n']} {100 * r['dlopen_held'] / max(1, r['dlopen_n']):.1f}%"
        gaps = ", ".join(f"{k} {v}" for k, v in (r.get("gaps") or {}).items()) or ("-" if "gaps" not in r else "0")
        print(f"{r['mode']:<28} {ex:>14} {dl:>14} {r.get('unnamed', '-')!s:>13} {gaps:>24} "
              f"{r['stop_s'] if 'stop_s' in r else float('nan'):>7.2f}")
    for r in rows:
        if r.get("gaps") and r.get("last_error"):
            print(f"({r['mode']}: the store's last error: {r['last_error']})")
        if "cache_entries" in r:
            print(f"({r['mode']}: its cache holds {r['cache_entries']} build-ids, each read by path at the end)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0

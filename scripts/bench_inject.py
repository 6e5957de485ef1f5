"""``buildidd inject`` against ``perf inject --buildid-all`` on one real profile: records/s and peak RSS.

Makes the input as an analyst would: ``buildidd run`` records a session
while ``perf record -a -g -e cpu-clock -c PERIOD`` profiles an exec storm
(scripts/workloads: bidd_storm forking bidd_child) until the perf.data
reaches --size or --max-seconds pass.  Then, one run each, on the same
file (read once before, so both find it in the page cache):

* ``perf inject --buildid-all -i IN -o OUT`` (its own build-id cache dir, empty);
* ``buildidd inject IN SESSION -o OUT --json``.

Each runs after a sync, as a child waited with os.wait4: wall time and ru_maxrss (peak
RSS).  Records are counted once (inject's summary), so records/s of both
divide the same number.  Also printed: inject's summary (mappings matched,
samples in mappings with a build-id).  Stops the daemon and perf it
started; refuses to run beside another tracer (their cost would mix in).

    scripts/bench --scenarios inject [--size 1G] [--max-seconds 150] [--keep DIR]
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

HERE = Path(__file__).resolve().parent

from perfcompare import PerfRecorder, require_quiet_host  # noqa: E402

from workloads import build  # noqa: E402

from buildidd.config import parse_size  # noqa: E402

BUILDIDD = [sys.executable, "-m", "buildidd.cli"]


def start_daemon(d: Path) -> tuple[subprocess.Popen, Path]:
    """``buildidd run`` into d/sessions (no snapshots); returns it and its session directory once it records."""
    log = open(d / "daemon.log", "w+")
    p = subprocess.Popen([*BUILDIDD, "run", "--session-root", str(d / "sessions"), "--store-root", "",
                          "--control-socket", str(d / "ctl.sock")], stdout=log, stderr=log)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = (d / "daemon.log").read_text()
        if "recording into" in text:
            return p, Path(text.split("recording into ", 1)[1].split(" (", 1)[0])
        if p.poll() is not None:
            raise SystemExit(f"buildidd run exited: {text[-1000:]}")
        time.sleep(0.1)
    p.kill()
    raise SystemExit("buildidd run did not start within 60 s")


def record_profile(d: Path, size: int, max_s: float, period: int) -> Path:
    """The profile: perf record -a -g of exec storms until it holds size bytes or max_s pass."""
    w = build.build(d / "workloads", n_libs=8)
    out = d / "profile.data"
    (d / "perf-bid").mkdir(exist_ok=True)
    perf = PerfRecorder(out, base=("-e", "cpu-clock", "-a", "-g", "-c", str(period), "-N", "-m", "8M"),
                        perf=("perf", "--buildid-dir", str(d / "perf-bid")))
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < max_s and out.stat().st_size < size:
            subprocess.run([str(w["storm"]), "500", str(w["child"])], check=True, stdout=subprocess.DEVNULL)
            subprocess.run([str(w["dlopen_storm"]), "2", *[str(w[f"lib{i}"]) for i in range(8)]], check=True,
                           stdout=subprocess.DEVNULL)
    finally:
        perf.finish()
    print(f"profile: {out.stat().st_size / 2**20:.0f} MiB after {time.monotonic() - t0:.0f} s of recording")
    return out


def measured(argv: list[str], stdout=subprocess.DEVNULL) -> tuple[float, int, int]:
    """Run argv after a sync (the last run's dirty pages are not written back during this one);
    (wall s, peak RSS bytes, exit status)."""
    os.sync()
    t0 = time.monotonic()
    p = subprocess.Popen(argv, stdout=stdout, stderr=subprocess.PIPE)
    _pid, status, ru = os.wait4(p.pid, 0)
    wall = time.monotonic() - t0
    err = p.stderr.read().decode(errors="replace")
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        print(f"{argv[0]}: exit {p.returncode}: {err[-500:]}", file=sys.stderr)
    return wall, ru.ru_maxrss * 1024, p.returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1G", help="profile size to reach (bytes, or with K/M/G; default 1G)")
    ap.add_argument("--max-seconds", type=float, default=150, help="longest recording (default 150 s)")
    ap.add_argument("--period", type=int, default=20000, help="cpu-clock sample period, ns (default 20000)")
    ap.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (default: a temporary directory)")
    ap.add_argument("--smoke", action="store_true", help="a profile of a few MiB")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    if args.smoke:
        args.size, args.max_seconds = "1M", 5.0
    if not args.smoke:          # a smoke run asserts no figure: it may run beside other work
        require_quiet_host("bench_inject")
    d = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-inject-"))
    d.mkdir(parents=True, exist_ok=True)
    daemon, session = start_daemon(d)
    try:
        profile = record_profile(d, parse_size(args.size), args.max_seconds, args.period)
    finally:
        daemon.send_signal(signal.SIGINT)
        daemon.wait(timeout=60)
    with open(profile, "rb") as f:            # the page cache holds it for both
        while f.read(8 << 20):
            pass
    (d / "inject-bid").mkdir(exist_ok=True)
    perf_s, perf_rss, perf_rc = measured(["perf", "--buildid-dir", str(d / "inject-bid"), "inject", "--buildid-all",
                                          "-i", str(profile), "-o", str(d / "perf-injected.data")])
    summary_path = d / "summary.json"
    with open(summary_path, "w") as out:
        ours_s, ours_rss, ours_rc = measured([*BUILDIDD, "inject", str(profile), str(session), "-o",
                                              str(d / "buildidd-injected.data"), "--json"], stdout=out)
    if ours_rc != 0:
        return 1
    s = json.loads(summary_path.read_text())
    n = s["records"]
    size_mib = profile.stat().st_size / 2**20
    print(f"input: {size_mib:.0f} MiB, {n} records ({s['mmap_records']} MMAP/MMAP2, {s['samples']['total']} samples)")
    print(f"{'':28}{'wall s':>8}{'records/s':>12}{'MiB/s':>8}{'peak RSS MiB':>14}")
    for name, wall, rss, rc in (("perf inject --buildid-all", perf_s, perf_rss, perf_rc),
                                ("buildidd inject", ours_s, ours_rss, ours_rc)):
        print(f"{name:28}{wall:8.2f}{n / wall:12.0f}{size_mib / wall:8.1f}{rss / 2**20:14.1f}"
              + ("" if rc == 0 else f"  (exit {rc})"))
    print(f"buildidd/perf records/s: {perf_s / ours_s:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"records": n, "profile_mib": size_mib,
                                         "perf": {"wall_s": perf_s, "peak_rss": perf_rss, "exit": perf_rc},
                                         "buildidd": {"wall_s": ours_s, "peak_rss": ours_rss}, "summary": s},
                                        indent=2))
    sm = s["samples"]
    print(f"inject: {s['matched']} of {s['user_mappings']} user-space mappings given a build-id, not matched "
          f"{s['not_matched']}; samples in mappings with a build-id {sm.get('in_mapping_with_build_id')} of "
          f"{sm.get('user')} user-space ({sm.get('share_with_build_id')})")
    if not args.keep:
        shutil.rmtree(d, ignore_errors=True)
    return 0

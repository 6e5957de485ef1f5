"""Soak: buildidd under a steady mapping storm for minutes; does its memory stay flat?

Run as root after scripts/setup:  scripts/bench --scenarios soak [--minutes 10] [--rate 20000]

Runs `buildidd run` (segments rotated and compressed as in production), an mmap
storm paced at --rate mappings/s, and every few seconds an exec storm and a
dlopen round, for --minutes.  Every --sample-seconds (15) it samples the daemon's
RSS and USS and asks its control socket for status; it prints one row per sample
and the RSS growth from the end of the first --settle-seconds (60) to the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
from benchlib import Buildidd, build  # noqa: E402
from perfcompare import require_quiet_host  # noqa: E402

from buildidd.control.client import ControlClient  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--rate", type=int, default=20000, help="paced mmap storm, mappings/s")
    ap.add_argument("--sample-seconds", type=float, default=15.0, help="seconds between samples")
    ap.add_argument("--settle-seconds", type=float, default=60.0,
                    help="growth is counted from the first sample after this many seconds")
    ap.add_argument("--smoke", action="store_true", help="a few seconds, a sample a second")
    ap.add_argument("--json", type=Path, help="write the samples here")
    args = ap.parse_args(argv)
    if args.smoke:
        args.minutes, args.rate, args.sample_seconds, args.settle_seconds = 0.05, 5000, 1.0, 1.0
    if not args.smoke:          # a smoke run asserts no figure: it may run beside other work
        require_quiet_host("soak")
    work = Path(tempfile.mkdtemp(prefix="buildidd-soak-"))
    w = build.build(work / "bin", n_libs=20)
    libs = [str(w[f"lib{i}"]) for i in range(20)]
    ctl = work / "control.sock"
    d = Buildidd(work, extra=["--control-socket", str(ctl), "--segment-max-bytes", str(64 << 20)], compress=True)
    end = time.monotonic() + args.minutes * 60
    storm = subprocess.Popen([str(w["mmap_storm"]), libs[0], str(int(args.rate * args.minutes * 60 * 2)),
                              str(args.rate)], stdout=subprocess.DEVNULL)
    rows = []
    next_sample = time.monotonic()
    t0 = time.monotonic()
    print(f"{'t s':>6} {'RSS MiB':>8} {'USS MiB':>8} {'events':>10} {'ev/s':>8} {'lost':>5} "
          f"{'cache':>6} {'segments':>8}", flush=True)
    try:
        while time.monotonic() < end or (args.smoke and len(rows) < 3):    # a smoke run: 3 samples however slow
            subprocess.run([str(w["storm"]), "50", str(w["child"])], check=True)
            subprocess.run([str(w["dlopen_storm"]), "2", *libs], check=True)
            if time.monotonic() >= next_sample:
                next_sample += args.sample_seconds
                with ControlClient(str(ctl)) as c:
                    s = c.request("status")
                ev = sum(s["events"].values())
                row = (time.monotonic() - t0, d.ps.memory_info().rss / 2**20, d.uss() / 2**20, ev,
                       sum(s["events_per_s"].values()), sum(s["lost"].values()),
                       s["identity_cache"]["entries"], s["log"]["segments_closed"])
                rows.append(row)
                print(f"{row[0]:>6.0f} {row[1]:>8.1f} {row[2]:>8.1f} {row[3]:>10} {row[4]:>8.0f} {row[5]:>5} "
                      f"{row[6]:>6} {row[7]:>8}", flush=True)
            time.sleep(1)
    finally:
        storm.kill()
        storm.wait()
        d.stop(read=False)
        d.cleanup()
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        cols = ("t_s", "rss_mib", "uss_mib", "events", "events_per_s", "lost", "cache_entries", "segments_closed")
        args.json.write_text(json.dumps([dict(zip(cols, r)) for r in rows], indent=1))
    after_1min = [r for r in rows if r[0] >= args.settle_seconds]
    if after_1min:
        first, last = after_1min[0], rows[-1]
        print(f"RSS after the first {args.settle_seconds:g} s {first[1]:.1f} MiB, at the end {last[1]:.1f} MiB "
              f"({last[1] - first[1]:+.1f} MiB over {(last[0] - first[0]) / 60:.1f} min); "
              f"USS {first[2]:.1f} -> {last[2]:.1f} MiB; lost {last[5]}")
    return 0

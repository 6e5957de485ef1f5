"""Ring-buffer size against losses: the smallest per-CPU ring that loses nothing at the storm's maximum rate.

Run as root after scripts/setup:  scripts/bench --scenarios rings [--sizes 256K,512K,1M,2M]

For each size, the real daemon (``buildidd run --config F`` with ``ring_bytes``
= size: one ring of that size per CPU, at most 8) records while unpaced mmap storms (scripts/workloads/mmap_storm.c, as
the ramp scenario runs them: one process, then one per CPU) map and unmap
one library as fast as they can.  Reported per run: the storms' achieved rate,
the daemon's ``lost`` records (kernel-side drops, per cause), the storm
mappings recorded out of those made, and the daemon's RSS at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
from benchlib import Buildidd, build, lost_count, remove_tree, run_mmap_storms, warm_store  # noqa: E402

from buildidd.config import parse_size  # noqa: E402


def run_once(w: dict, workdir: Path, store: Path, ring_bytes: int, procs: int, seconds: float) -> dict:
    """One daemon with rings of ring_bytes each under procs unpaced storms: the row."""
    cfg = workdir / "rings.toml"
    cfg.write_text(f"ring_bytes = {ring_bytes}\n")
    d = Buildidd(workdir, extra=["--config", str(cfg)], store=store)
    time.sleep(0.3)
    count, achieved = run_mmap_storms(w, 0, procs, seconds)
    time.sleep(0.5)
    rss = d.ps.memory_info().rss
    records = d.stop()
    got = sum(1 for x in records if x.get("type") == "mmap" and x.get("path") == str(w["lib0"])
              and x.get("origin") == "mmap")
    causes: dict[str, int] = {}
    for r in records:
        if r.get("type") == "lost":
            for k, v in r["counts"].items():
                causes[k] = causes.get(k, 0) + v
    d.cleanup()
    return {"ring_kib_per_cpu": ring_bytes >> 10, "procs": procs, "achieved_per_s": achieved,
            "made": count, "recorded": got, "lost": lost_count(records), "lost_causes": causes,
            "rss_mib": round(rss / 2**20, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="256K,512K,1M,2M", help="ring size per CPU, comma-separated")
    ap.add_argument("--procs", default="1,2", help="storm processes per run, comma-separated")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--smoke", action="store_true", help="one size, one storm, one short run")
    args = ap.parse_args(argv)
    if args.smoke:
        args.sizes, args.procs, args.reps, args.seconds = "2M", "1", 1, 0.3
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="bench-rings-"))
    rows = []
    try:
        w = build.build(workdir / "w", n_libs=1)
        store = warm_store(workdir)
        for rep in range(args.reps):
            for procs in (int(p) for p in args.procs.split(",")):
                for size in sizes:
                    row = run_once(w, workdir, store, size, procs, args.seconds)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    finally:
        remove_tree(workdir)
    print("\nring KiB/CPU  procs  runs  lost (each run)          achieved maps/s (median)  recorded/made")
    for size in sizes:
        for procs in (int(p) for p in args.procs.split(",")):
            sel = [r for r in rows if r["ring_kib_per_cpu"] == size >> 10 and r["procs"] == procs]
            print(f"{size >> 10:>13}  {procs:>5}  {len(sel):>4}  {str([r['lost'] for r in sel]):<24}"
                  f"  {statistics.median(r['achieved_per_s'] for r in sel):>24,}"
                  f"  {sum(r['recorded'] for r in sel)}/{sum(r['made'] for r in sel)}")
    lossless = [s for s in sizes if all(r["lost"] == 0 for r in rows if r["ring_kib_per_cpu"] == s >> 10)]
    print(f"smallest size with 0 lost in every run: {min(lossless) >> 10} KiB per CPU" if lossless
          else "no size was lossless in every run")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0

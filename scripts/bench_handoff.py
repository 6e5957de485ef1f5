"""Cost per event of resolving a new file identity (the slow path) and of a known one (the fast path).

Drives a Recorder without BPF (as tests/capture/test_fastpath.py does): a
stand-in tracer hands step() raw map records built from bpf/events.h's ctypes
mirror.  MISSES distinct files (copies of one gcc binary, each its own inode)
are mapped once each: every event is resolved through the enricher (since
the worker pool, handed to a worker and waited for); then HITS events of those
same identities go through the C fast path.  Prints µs per event of each.

    scripts/bench --micro handoff [--misses 2000] [--hits 200000]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from buildidd.resolve.procfs import identity_of

from microlib import map_record, offline_recorder
from workloads import build


def _steps(rec: Recorder, raws: list[bytes], batch: int) -> float:
    """Seconds rec.step() took over raws, batch records a step (laying them in the ring not counted)."""
    took = 0.0
    for k in range(0, len(raws), batch):
        rec.tracer.rings.feed(raws[k:k + batch])
        t0 = time.perf_counter()
        rec.step()
        took += time.perf_counter() - t0
        rec.tables.out.clear()
    return took


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--misses", type=int, default=2000)
    ap.add_argument("--hits", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=500, help="events per step")
    ap.add_argument("--smoke", action="store_true", help="a few hundred events")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    if args.smoke:
        args.misses, args.hits, args.batch = 50, 5000, 50
    with tempfile.TemporaryDirectory(prefix="bench-handoff-") as tmp:
        exe = build.program(Path(tmp) / "bin", "child")
        files = []
        for i in range(args.misses):
            p = Path(tmp) / f"f{i}"
            shutil.copy(exe, p)
            fd = os.open(p, os.O_RDONLY)
            files.append((str(p).encode(), identity_of(fd)))
            os.close(fd)
        rec = offline_recorder(Path(tmp) / "s")
        gone_pid = 999_999_999        # no such process: map_files fails at once, the path route reads
        raws = [map_record(ident, path, gone_pid, 10**9 + i) for i, (path, ident) in enumerate(files)]
        miss_s = _steps(rec, raws, args.batch)
        assert rec.enricher.resolved == len(files), rec.summary()
        hits = [map_record(files[i % len(files)][1], b"", gone_pid, 2 * 10**9 + i) for i in range(args.hits)]
        hit_s = _steps(rec, hits, args.batch)
        close = getattr(rec.enricher, "close", None)
        if close is not None:
            close()
    print(f"miss (new identity, resolved): {miss_s / len(raws) * 1e6:.1f} µs/event over {len(raws)}")
    print(f"hit (fast path): {hit_s / len(hits) * 1e6:.3f} µs/event over {len(hits)}")
    if args.json:
        args.json.write_text(json.dumps({"miss_us_per_event": miss_s / len(raws) * 1e6,
                                         "hit_us_per_event": hit_s / len(hits) * 1e6}, indent=2))
    return 0

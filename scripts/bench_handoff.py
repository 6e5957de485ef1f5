#!/usr/bin/env python3
"""Cost per event of resolving a new file identity (the slow path) and of a known one (the fast path).

Drives a Recorder without BPF (as tests/capture/test_fastpath.py does): a
stand-in tracer hands step() raw map records built from bpf/events.h's ctypes
mirror.  MISSES distinct files (copies of one gcc binary, each its own inode)
are mapped once each: every event is resolved through the enricher (since
the worker pool, handed to a worker and waited for); then HITS events of those
same identities go through the C fast path.  Prints µs per event of each.

    .venv/bin/python scripts/bench_handoff.py [--misses 2000] [--hits 200000]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from buildidd.capture.recorder import Recorder
from buildidd.config import Config
from buildidd.kernel.events import EventType, MapEvent, st_dev_to_kdev
from buildidd.resolve.procfs import identity_of

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))    # the checkout: its tests' ring in memory
from tests.capture.ringmem import MemRings  # noqa: E402


class _Feed:
    """Stands in for the tracer and the rings: step() drains .batch."""

    known_full = 0
    fill = 0.0

    def __init__(self):
        self.batch: list[bytes] = []
        self.rings = MemRings(1, size=1 << 22)

    def drain(self):
        out, self.batch = self.batch, []
        return out

    def take(self):
        """Rings.take: what feed() laid into a ring in memory (tests/capture/ringmem.py), read in place."""
        return self.rings.take()

    def mark_known(self, ident, kdev):
        pass

    def forget(self, ident, kdev):
        pass

    def reset_wakeups(self):
        pass


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


def _map_raw(ident, path: bytes, pid: int, t: int) -> bytes:
    ev = MapEvent()
    ev.hdr.type, ev.hdr.pid, ev.hdr.tid, ev.hdr.time_ns, ev.hdr.comm = EventType.MAP, pid, pid, t, b"bench"
    ev.start, ev.len, ev.pgoff, ev.prot, ev.flags, ev.origin = 0x7F0000000000, 4096, 0, 5, 2, 1
    f = ev.file
    f.ino, f.size = ident.ino, ident.size
    f.mtime_sec, f.mtime_nsec = divmod(ident.mtime_ns, 1_000_000_000)
    f.dev, f.generation, f.nlink = st_dev_to_kdev(ident.dev), ident.generation, 1
    ev.path_len = len(path)
    ev.path = path
    return bytes(ev)[:MapEvent.path.offset + len(path)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--misses", type=int, default=2000)
    ap.add_argument("--hits", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=500, help="events per step")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-handoff-") as tmp:
        src = Path(tmp) / "a.c"
        src.write_text("int main(void) { return 0; }\n")
        exe = Path(tmp) / "a"
        subprocess.run(["gcc", "-o", str(exe), str(src), "-Wl,--build-id=sha1"], check=True)
        files = []
        for i in range(args.misses):
            p = Path(tmp) / f"f{i}"
            shutil.copy(exe, p)
            fd = os.open(p, os.O_RDONLY)
            files.append((str(p).encode(), identity_of(fd)))
            os.close(fd)
        rec = Recorder(Config(session_root=str(Path(tmp) / "s"), store_root=""))
        rec.tracer = rec.rings = _Feed()
        rec.recovery.next_check = float("inf")
        gone_pid = 999_999_999        # no such process: map_files fails at once, the path route reads
        raws = [_map_raw(ident, path, gone_pid, 10**9 + i) for i, (path, ident) in enumerate(files)]
        miss_s = _steps(rec, raws, args.batch)
        assert rec.enricher.resolved == len(files), rec.summary()
        hits = [_map_raw(files[i % len(files)][1], b"", gone_pid, 2 * 10**9 + i) for i in range(args.hits)]
        hit_s = _steps(rec, hits, args.batch)
        close = getattr(rec.enricher, "close", None)
        if close is not None:
            close()
    print(f"miss (new identity, resolved): {miss_s / len(raws) * 1e6:.1f} µs/event over {len(raws)}")
    print(f"hit (fast path): {hit_s / len(hits) * 1e6:.3f} µs/event over {len(hits)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

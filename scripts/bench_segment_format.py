"""What a mapping costs the session log: its JSON line (as segments hold them) against its raw record.

Measures the two formats on the same mapping records of one known file (the mmap storm's
common record: the C fast path's), each step of the path a mapping takes after the rings:

- **json**: the line formatted by the fast path (a Recorder driven without BPF, as
  the handoff micro-benchmark does), written to a file, compressed at the daemon's zstd level;
- **raw**: the ring record as the BPF side wrote it (bpf/events.h's struct map_event, its path
  included), joined, written and compressed alike: what a binary segment formatted as JSON
  when read would cost the recording side.

Prints ns per mapping of each step and bytes per mapping before and after compression, beside
perf's figures from scripts/bench, to say how far each format can go.  A loop on a hot cache:
the daemon pays more per step (threads woken, memory left idle), the same for both formats.

    scripts/bench --micro segment-format [--events 200000] [--batch 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

import zstandard

from buildidd.kernel.events import MapEvent
from buildidd.resolve.procfs import identity_of
from buildidd.sessionlog.compress import compressor
from buildidd.sessionlog.segments import ZSTD_LEVEL

from microlib import map_record, offline_recorder
from workloads import build

#: map_event.start's offset (bpf/events.h, through its ctypes mirror)
_START = MapEvent.start.offset


def _records(path: bytes, ident, n: int) -> list[bytes]:
    """n mappings of one file by one process, at page-aligned addresses and rising times, as an
    mmap storm makes them (the addresses and times are what changes from record to record)."""
    rng = random.Random(1)
    out = []
    t = 10**12
    for _ in range(n):
        t += rng.randrange(2000, 6000)
        raw = bytearray(map_record(ident, path, 4242, t))
        start = 0x7F0000000000 + rng.randrange(1 << 28) * 4096
        raw[_START:_START + 8] = start.to_bytes(8, "little")
        out.append(bytes(raw))
    return out


class _Sink:
    """One format's file and zstd stream; what each step of the path took (thread CPU seconds)."""

    def __init__(self, directory: str):
        self.fd, self.name = tempfile.mkstemp(dir=directory)
        self.obj = compressor(ZSTD_LEVEL).compressobj()
        self.record_s = self.write_s = self.zstd_s = 0.0
        self.written = self.packed = 0

    def take(self, block: bytes) -> None:
        """Write block and compress it, as the writer and the finishing thread do."""
        t0 = time.thread_time()
        os.write(self.fd, block)
        t1 = time.thread_time()
        self.packed += len(self.obj.compress(block))
        self.write_s += t1 - t0
        self.zstd_s += time.thread_time() - t1
        self.written += len(block)

    def close(self) -> None:
        self.packed += len(self.obj.flush(zstandard.COMPRESSOBJ_FLUSH_FINISH))
        os.close(self.fd)
        os.unlink(self.name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=2000, help="records per step")
    ap.add_argument("--dir", default="/var/tmp", help="where the segments are written (a disk, not tmpfs)")
    ap.add_argument("--smoke", action="store_true", help="a few thousand records")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    if args.smoke:
        args.events, args.batch = 4000, 500
    with tempfile.TemporaryDirectory(prefix="bench-segfmt-") as tmp:
        lib = build.shared_lib(tmp, 0)
        fd = os.open(lib, os.O_RDONLY)
        ident = identity_of(fd)
        os.close(fd)
        raws = _records(str(lib).encode(), ident, args.events)
        rec = offline_recorder(Path(tmp) / "s")
        rec.tracer.rings.feed(raws[:1])          # the first sighting: resolved, then known
        rec.step()
        rec.tables.out.clear()
        lines, raw = _Sink(args.dir), _Sink(args.dir)
        try:
            for k in range(1, len(raws), args.batch):
                part = raws[k:k + args.batch]
                rec.tracer.rings.feed(part)
                t0 = time.thread_time()
                rec.step()                      # take, the fast path's lines into tables.out
                lines.record_s += time.thread_time() - t0
                lines.take(bytes(rec.tables.out))
                rec.tables.out.clear()
                t0 = time.thread_time()
                block = b"".join(part)          # a binary segment's block: the records as they came
                raw.record_s += time.thread_time() - t0
                raw.take(block)
                del block                       # freed at once, as a step's buffer is reused
        finally:
            lines.close()
            raw.close()
        assert rec.stats.events.get("mmap", 0) == len(raws), rec.stats.events
        n = len(raws) - 1
        rows = [(name, sink.record_s / n * 1e9, sink.write_s / n * 1e9, sink.zstd_s / n * 1e9, sink.written / n,
                 sink.packed / n) for name, sink in (("json", lines), ("raw", raw))]
    print(f"{n} mappings of one known file, {args.batch} a step; zstd level {ZSTD_LEVEL}; written under {args.dir}")
    print(f"{'format':<6} {'record ns':>10} {'write ns':>9} {'zstd ns':>8} {'total ns':>9} "
          f"{'bytes':>6} {'zstd bytes':>10}")
    for name, f, w, z, size, packed in rows:
        print(f"{name:<6} {f:>10.0f} {w:>9.0f} {z:>8.0f} {f + w + z:>9.0f} {size:>6.0f} {packed:>10.1f}")
    j, r = rows
    print(f"raw / json: {(r[1] + r[2] + r[3]) / (j[1] + j[2] + j[3]):.2f} of the ns, {r[4] / j[4]:.2f} of the bytes "
          f"written.  'record ns' is, for json, the whole step (the ring read included); for raw, only the\n"
          f"join of records already copied out of the ring: raw's figure is a lower bound.  The bytes are of\n"
          f"one file mapped by one process at random addresses, the mmap storm's records.")
    if args.json:
        cols = ("record_ns", "write_ns", "zstd_ns", "bytes", "zstd_bytes")
        args.json.write_text(json.dumps({name: dict(zip(cols, vals)) for name, *vals in rows}, indent=2))
    return 0

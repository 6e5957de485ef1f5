"""What the in-process micro-benchmarks share (scripts/bench --micro): a Recorder driven without BPF.

A stand-in for the tracer and its rings (tests/capture/ringmem.py's rings in memory) lets a
benchmark lay raw ring records, built from bpf/events.h's ctypes mirror, in front of
Recorder.step(), as tests/capture/test_fastpath.py does.  Public names only.
"""

from __future__ import annotations

import sys
from pathlib import Path

from buildidd.capture.recorder import Recorder
from buildidd.config import Config
from buildidd.kernel.events import EventType, Identity, MapEvent, st_dev_to_kdev

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))    # the checkout: its tests' ring in memory
from tests.capture.ringmem import MemRings  # noqa: E402

__all__ = ["Feed", "map_record", "offline_recorder"]


class Feed:
    """Stands in for the tracer and the rings: rings.feed(records) lays raw records in one ring in
    memory (4 MiB), which the recorder's next step() takes."""

    known_full = 0
    fill = 0.0

    def __init__(self):
        self.batch: list[bytes] = []
        self.rings = MemRings(1, size=1 << 22)

    def drain(self):
        out, self.batch = self.batch, []
        return out

    def take(self):
        """Rings.take: what feed() laid into the ring in memory, read in place."""
        return self.rings.take()

    def mark_known(self, ident, kdev):
        pass

    def forget(self, ident, kdev):
        pass

    def reset_wakeups(self):
        pass


def offline_recorder(session_root: Path) -> Recorder:
    """A Recorder writing under session_root with no store, fed by a Feed (its .tracer) and never
    checking its rings for recovery."""
    rec = Recorder(Config(session_root=str(session_root), store_root=""))
    rec.tracer = rec.rings = Feed()
    rec.recovery.next_check = float("inf")
    return rec


def map_record(ident: Identity, path: bytes, pid: int, time_ns: int) -> bytes:
    """One raw struct map_event (bpf/events.h) of an r-x private mapping of the file ident at path
    (bytes; empty: the path left out, as the BPF side does for a known file) by pid at time_ns
    (ns since boot), cut after its path as the ring holds it."""
    ev = MapEvent()
    ev.hdr.type, ev.hdr.pid, ev.hdr.tid, ev.hdr.time_ns, ev.hdr.comm = EventType.MAP, pid, pid, time_ns, b"bench"
    ev.start, ev.len, ev.pgoff, ev.prot, ev.flags, ev.origin = 0x7F0000000000, 4096, 0, 5, 2, 1
    f = ev.file
    f.ino, f.size = ident.ino, ident.size
    f.mtime_sec, f.mtime_nsec = divmod(ident.mtime_ns, 1_000_000_000)
    f.dev, f.generation, f.nlink = st_dev_to_kdev(ident.dev), ident.generation, 1
    ev.path_len = len(path)
    ev.path = path
    return bytes(ev)[:MapEvent.path.offset + len(path)]

"""Which of a profile's samples fall in mappings that carry a build-id: inject's "samples covered".

perf report rebuilds each process's address space from the MMAP/MMAP2,
FORK and COMM records, then finds each sample's map by pid and ip
(tools/perf/util/machine.c, thread__find_map).  This is the same walk, kept
small: per pid a sorted list of mappings ``[start, start + len)``, each
with the serial number of its mapping record; a FORK of a new process
(pid != ppid) copies its parent's list.  Samples are counted per mapping
record (:attr:`Coverage.hits`), so the walk can run before it is known
which records get a build-id (:meth:`Coverage.counts` is told at the end).  perf writes the records
of each CPU's ring buffer one after another within a round
(PERF_RECORD_FINISHED_ROUND), so a sample may come before the mapping
record of an earlier time: samples are resolved at the end of each round
(at most :data:`MAX_PENDING` held).

Sample layout (perf_event.h, PERF_RECORD_SAMPLE): ``{u64 id}`` if
PERF_SAMPLE_IDENTIFIER, ``{u64 ip}`` if PERF_SAMPLE_IP, ``{u32 pid, tid}``
if PERF_SAMPLE_TID, then the rest.  The sample's cpumode is
``header.misc & 7`` (PERF_RECORD_MISC_USER = 2).
"""

from __future__ import annotations

import struct
from array import array
from bisect import bisect_left, bisect_right
from dataclasses import dataclass

from buildidd.offline.perfabi import EVENT_HEADER, PERF_SAMPLE_IDENTIFIER, PERF_SAMPLE_IP, PERF_SAMPLE_TID
from buildidd.offline.perffile import Attr

#: Samples held until the end of their round.
MAX_PENDING = 1 << 18
#: Mappings tracked over all processes (beyond: forks are not copied, and the counts say so).
MAX_ENTRIES = 1 << 22
_FORK = struct.Struct("<II")          # pid, ppid: the head of perfabi.TASK_BODY


@dataclass(frozen=True)
class SampleLayout:
    """Where a sample's ip is (byte offset in the record); pid follows it."""

    ip_at: int

    @classmethod
    def of(cls, attrs: list[Attr]) -> SampleLayout | None:
        """The layout all events share, or ``None`` when they differ or lack IP or TID."""
        bits = {a.sample_type & (PERF_SAMPLE_IDENTIFIER | PERF_SAMPLE_IP | PERF_SAMPLE_TID) for a in attrs}
        if len(bits) != 1:
            return None
        b = bits.pop()
        if not b & PERF_SAMPLE_IP or not b & PERF_SAMPLE_TID:
            return None
        return cls(EVENT_HEADER.size + (8 if b & PERF_SAMPLE_IDENTIFIER else 0))


class _Maps:
    """One process's mappings: sorted starts; start → (end, serial of the mapping record)."""

    __slots__ = ("starts", "info")

    def __init__(self, starts: list[int] | None = None, info: dict | None = None):
        self.starts = starts if starts is not None else []
        self.info = info if info is not None else {}

    def add(self, start: int, end: int, serial: int) -> int:
        """Insert [start, end) over what it overlaps; returns the change in entries."""
        starts, info = self.starts, self.info
        i = bisect_left(starts, start)
        j = bisect_left(starts, end, lo=i)
        for s in starts[i:j]:
            del info[s]
        removed = j - i
        del starts[i:j]
        if i > 0:
            prev = starts[i - 1]
            pend, pserial = info[prev]
            if pend > start:
                info[prev] = (start, pserial)
        starts.insert(i, start)
        info[start] = (end, serial)
        return 1 - removed

    def find(self, ip: int) -> tuple[int, int] | None:
        i = bisect_right(self.starts, ip) - 1
        if i < 0:
            return None
        entry = self.info[self.starts[i]]
        return entry if ip < entry[0] else None

    def copy(self) -> _Maps:
        return _Maps(list(self.starts), dict(self.info))


class Coverage:
    """Counts samples by where they fall (see the module doc).  layout ``None``: samples are only counted.

    The walker (perffile.PerfFile.walk) appends each user-space sample's ``(ip, pid)`` to :attr:`pending`;
    :meth:`flush` resolves them.
    """

    def __init__(self, layout: SampleLayout | None):
        self.layout = layout
        self.procs: dict[int, _Maps] = {}
        self.entries = 0
        self.pending: list[tuple[int, int]] = []
        self.hits = array("L")          # samples per mapping record, by serial
        self.user = self.unmapped = 0
        self.truncated = False

    def map(self, pid: int, start: int, length: int) -> int:
        """A user-space mapping record: its serial number (0, 1, ...)."""
        serial = len(self.hits)
        self.hits.append(0)
        if self.entries >= MAX_ENTRIES:
            self.truncated = True
            return serial
        maps = self.procs.get(pid)
        if maps is None:
            maps = self.procs[pid] = _Maps()
        self.entries += maps.add(start, start + length, serial)
        return serial

    def fork(self, rec) -> None:
        """A PERF_RECORD_FORK: a new process starts with a copy of its parent's mappings."""
        if len(rec) < EVENT_HEADER.size + _FORK.size:
            return
        pid, ppid = _FORK.unpack_from(rec, EVENT_HEADER.size)
        parent = self.procs.get(ppid)
        if pid == ppid or parent is None or pid in self.procs:
            return
        if self.entries + len(parent.starts) > MAX_ENTRIES:
            self.truncated = True
            return
        self.procs[pid] = parent.copy()
        self.entries += len(parent.starts)

    def flush(self) -> None:
        """Resolve the held samples against the mappings known now."""
        procs, hits = self.procs, self.hits
        self.user += len(self.pending)
        for ip, pid in self.pending:
            maps = procs.get(pid)
            hit = maps.find(ip) if maps is not None else None
            if hit is None:
                self.unmapped += 1
            else:
                hits[hit[1]] += 1
        self.pending.clear()

    def counts(self, total: int, has_bid: bytearray) -> dict:
        """The counts: total samples (given), user-space ones by their mapping: with a build-id (has_bid[serial]
        true), without, none."""
        if self.layout is None:
            return {"total": total, "resolved": False,
                    "why": "events differ in their sample layout or lack PERF_SAMPLE_IP/TID"}
        with_bid = sum(n for n, b in zip(self.hits, has_bid) if b)
        mapped = sum(self.hits)
        return {"total": total, "resolved": True, "user": self.user, "in_mapping_with_build_id": with_bid,
                "in_mapping_without_build_id": mapped - with_bid, "outside_known_mappings": self.unmapped,
                "share_with_build_id": round(with_bid / mapped, 4) if mapped else None,
                "truncated": self.truncated}

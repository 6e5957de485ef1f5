"""Loss recovery: drops become ``lost`` records, then a /proc rescan recovers live mappings.

The BPF side counts the events it could not send (kernel.tracer.DropReport).
Every Config.drop_check_interval_s the recorder asks; a loss is written as a
``lost`` record (counts per cause, the gap's time range), and a rescan of
/proc/PID/maps follows (at most one per RESCAN_MIN_INTERVAL_S) that records
every executable file mapping not already known live, with origin
"recovered".  The same scan synthesizes, at start, the mappings of the
processes already running (origin "synthesized", as perf record synthesizes
existing tasks) when the BPF task_vma iterator (kernel.synth) cannot, and the
tracked processes in follow mode.
"""

from __future__ import annotations

import collections
import os
import time
from typing import Callable

from buildidd import clock
from buildidd.capture.tables import Stats, Tables
from buildidd.kernel.events import EventType, RawEvent
from buildidd.kernel.tracer import DropReport, Tracer
from buildidd.resolve import procfs
from buildidd.resolve.enrich import Enricher, Resolution
from buildidd.sessionlog.records import RECOVERED, SYNTHESIZED, dict_line

MAP_SHARED, MAP_PRIVATE = 0x01, 0x02

#: record_map(event, origin, Resolution): how the recorder records one mapping.
RecordMap = Callable[[RawEvent, str, Resolution], None]


class LossRecovery:
    """Drop checks, ``lost`` records and the /proc scans.

    Args:
        tables: the recorder's Tables (live mappings; lines).
        stats: the session's counters (lost, recovered, synthesized, synth_skipped).
        enricher: resolves the scanned mappings (opened through map_files).
        record_map: writes one mapping record (the recorder's).
        tracked: follow mode's set of pids (scanned instead of all of /proc), or None.
    """

    #: At most one recovery rescan of /proc/*/maps per this many seconds: a
    #: storm that keeps overflowing the rings must not also pay a rescan of
    #: every process four times a second.
    RESCAN_MIN_INTERVAL_S = 5.0

    def __init__(self, tables: Tables, stats: Stats, enricher: Enricher, record_map: RecordMap,
                 tracked: set[int] | None):
        self.tables = tables
        self.stats = stats
        self.enricher = enricher
        self.record_map = record_map
        self.tracked = tracked
        #: time.monotonic() of the next drop check (the recorder's step decides when it is due)
        self.next_check = 0.0
        self._rescan_pending = False
        self._next_rescan = 0.0

    @property
    def rescan_pending(self) -> bool:
        """True when drops were reported and their rescan waits for RESCAN_MIN_INTERVAL_S."""
        return self._rescan_pending

    def on_drops(self, report: DropReport) -> None:
        """Record what the BPF side dropped since the last check; rescan /proc when due."""
        now = time.monotonic()
        if report.total:
            for cause, n in report.counts.items():
                self.stats.lost[cause] = self.stats.lost.get(cause, 0) + n
            self.tables.emit(dict_line({"type": "lost", "time_ns": clock.boot_ns(), "counts": report.counts,
                                        "first_ns": report.first_ns, "last_ns": report.last_ns,
                                        "recovery": "rescan of /proc/*/maps follows (origin recovered)"}))
            self._rescan_pending = True
        if self._rescan_pending and now >= self._next_rescan:
            self._rescan_pending = False
            self._next_rescan = now + self.RESCAN_MIN_INTERVAL_S
            self.scan(RECOVERED)

    def synthesize(self, tracer: Tracer, record_raws: Callable[[list[bytes]], None],
                   flush: Callable[[], None], last_errors: collections.deque, deadline_s: float) -> None:
        """Record the executable file mappings of every running process but this one (origin
        "synthesized"), as perf synthesizes running tasks.

        Read by the BPF task_vma iterator (Tracer.synthesize) a chunk at a
        time, with the kernel's build-ids; record_raws records each chunk like
        ring records (the recorder's fast and slow paths) and flush writes its
        lines, so memory stays bounded however many processes run.  Each chunk
        may wait deadline_s (seconds) in all for user-space resolutions, as a
        recording step does (what misses it is a ``timeout`` record, completed
        later by a ``resolution`` record).  When the iterator cannot be used,
        the /proc/PID/maps scan does it instead, with no such budget (a
        mapping it cannot resolve in time would be skipped), noted in
        last_errors (a deque of dicts); mappings the iterator recorded before
        it failed midway are live by then and not recorded again.
        """
        me = os.getpid().to_bytes(4, "little")          # event_header.pid

        def sink(records: list[bytes]) -> None:
            self.enricher.begin_step(deadline_s)
            raws = [r for r in records if r[4:8] != me]
            record_raws(raws)
            flush()
            self.stats.synthesized += len(raws)

        try:
            got = tracer.synthesize(sink)
        except OSError as e:
            last_errors.append({"time_ns": clock.boot_ns(),
                                "error": f"task_vma iterator: {e}; /proc/PID/maps scan instead"})
            self.enricher.begin_step(float("inf"))
            self.scan(SYNTHESIZED, skip_live=True)
            flush()
            return
        if got.malformed:
            self.stats.decode_errors += 1
            last_errors.append({"time_ns": clock.boot_ns(),
                                "error": f"task_vma iterator: {got.malformed} bytes after the last whole record"})

    def scan(self, origin: str, skip_live: bool | None = None) -> None:
        """Record the executable file mappings in /proc/PID/maps of every process (or the tracked ones).

        origin: SYNTHESIZED (at start) or RECOVERED (after a loss).  skip_live
        (default: origin is RECOVERED): mappings already live (same start and
        inode) are skipped.  The daemon's own
        process is skipped in host mode.  A process that is gone or cannot be
        read is skipped.
        """
        if skip_live is None:
            skip_live = origin == RECOVERED
        pids = list(self.tracked) if self.tracked is not None else list(procfs.pids())
        me = os.getpid()
        for pid in pids:
            if pid == me and self.tracked is None:
                continue
            try:
                maps = procfs.exec_file_mappings(pid)
            except OSError:
                continue
            comm = procfs.read_comm(pid)
            uid = procfs.read_uid(pid)
            live = {(s, int.from_bytes(k[:8], "little")) for s, k in self.tables.live.get(pid, ())} \
                if skip_live else set()
            for m in maps:
                if (m.start, m.ino) in live:
                    continue
                self._record_scanned(pid, (comm, uid), m, origin)

    def _record_scanned(self, pid: int, task: tuple[str, int], m: procfs.MapsEntry, origin: str) -> None:
        # Opened and read on a resolution worker (the mapped file may be on a
        # slow or hostile file system): skipped when gone, refused or late.
        got = self.enricher.resolve_scanned(pid, (m.start, m.end), m.path)
        if got is None:
            self.stats.synth_skipped += 1
            return
        ident, res = got
        ev = RawEvent(EventType.MAP, pid, pid, clock.boot_ns(), task[0], m.start, m.end - m.start, m.offset,
                      m.prot, MAP_SHARED if m.perms[3] == "s" else MAP_PRIVATE, None, ident,
                      0 if m.deleted else 1, 0, m.path, uid=task[1])
        if origin == RECOVERED:
            self.stats.recovered += 1
        else:
            self.stats.synthesized += 1
        self.record_map(ev, origin, res)

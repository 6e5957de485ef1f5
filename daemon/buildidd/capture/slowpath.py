"""What the C fast path leaves to Python: one raw record at a time.

A mapping whose identity has no final answer yet (it is resolved here, and,
once final, gets a fast entry so the next ones stay in C), a mapping from a
tid whose held exec is of another file, a second exec from one tid, a
malformed record.  Written byte for byte as the
fast path writes (tests/capture/test_fastpath.py).
"""

from __future__ import annotations

from typing import Callable

from buildidd import clock
from buildidd.capture.execjoin import ExecJoin
from buildidd.capture.tables import FastEntry, Stats, Tables
from buildidd.kernel.events import (DecodeError, EventType, MapOrigin, RawEvent, answer_key, decode, decode_task,
                                     exec_file_key, exec_head, file_key)
from buildidd.memo import LruCache, text_bytes
from buildidd.resolve.enrich import Enricher, Resolution
from buildidd.sessionlog.records import ORIGIN_NAMES, file_id_line, mmap_line, res_tail, task_line


#: A ``resolution`` record: the answer for an identity whose mappings were
#: recorded with error "timeout" (its worker answered after the deadline):
#: time_ns (ns since boot, when the answer came), then the identity and
#: build-id fields of the mapping records (Resolution.json_tail: dev, ino,
#: ino_generation, size, mtime_ns, build_id, build_id_source, error, and
#: go_build_id / file_id when known).  It completes every earlier mapping
#: and exec record of that identity in the session.
RESOLUTION_LINE = b'{"type":"resolution","time_ns":%d,%s}'

#: Mappings made by execve: each confirms its file's exec pin (Tables.note_exec).
_EXEC_ORIGINS = (MapOrigin.EXEC_MAIN, MapOrigin.EXEC_INTERP)

#: Fast entries of kernel answers (answer_key longer than the identity key)
#: kept at most; the oldest go first.  (Identity entries follow the enricher's cache.)
KERNEL_FAST_MAX = 65536
#: ... and the bytes they hold at most (fast_cost): each keeps its answer's path and JSON tail.
KERNEL_FAST_MAX_BYTES = 6 << 20
#: Bytes of a FastEntry, its key object and their dict entries besides the strings counted by length.
_FAST_FIXED_BYTES = 560


def fast_cost(akey: bytes, res: Resolution) -> int:
    """Bytes one kernel answer's fast entry holds (memo.Cost): its key, the path and the JSON tail
    (as text in the Resolution and as bytes in the FastEntry) by length, plus a constant."""
    return len(akey) + text_bytes(res.path) + 2 * text_bytes(res.json_tail) + _FAST_FIXED_BYTES


class SlowPath:
    """Records raw ring records in Python (any type).

    Args:
        tables: the recorder's Tables (lines, fast entries, live mappings).
        stats: counts events and decode errors.
        enricher: resolves mappings.
        join: the exec join (holds execs; a mapping completes them).
        named: named(build_id_hex, path, uid): told of every build-id recorded, and of the htlhash of a
            file without one (the store's key for it), with the uid of the task that mapped it
            (store.coverage.Coverage.named, which charges it to that uid); None: nobody is.
    """

    def __init__(self, tables: Tables, stats: Stats, enricher: Enricher, join: ExecJoin,
                 named: Callable[[str, str, int], None] | None = None):
        self.tables = tables
        self.stats = stats
        self.enricher = enricher
        self.join = join
        #: the fast entries of kernel answers, oldest first (only put: C's hits do not refresh them);
        #: one evicted leaves tables.fast too
        self.kernel_fast: LruCache[bytes, Resolution] = LruCache(
            "kernel_fast", KERNEL_FAST_MAX, max_bytes=KERNEL_FAST_MAX_BYTES, cost=fast_cost,
            on_evict=lambda akey, _res: tables.fast.pop(akey, None))
        self.named = named

    def record(self, raw: bytes) -> None:
        """Record one raw ring record the fast path left to Python (any record type)."""
        etype = raw[0]
        try:
            if etype >= EventType.FORK:       # fork, exit, comm
                task = decode_task(raw)
            elif etype == EventType.EXEC:
                head = exec_head(raw)
            else:
                ev = decode(raw)
        except DecodeError:
            self.stats.decode_errors += 1
            return
        if etype >= EventType.FORK:
            if task.type == EventType.EXIT:
                self.tables.drop_live(task.pid)
            self.tables.emit(task_line(task))
            self.stats.count(EventType(task.type).name.lower())
        elif etype == EventType.EXEC:
            self.join.hold(raw, head)
            self.tables.note_exec(head.pid, head.uid, exec_file_key(raw), head.time_ns)
        else:
            # A mapping whose identity has no final answer yet (or an exec'd one).
            if ev.origin in _EXEC_ORIGINS:
                self.tables.note_exec(ev.pid, ev.uid, file_key(ev.identity), ev.time_ns)
            res = self.enricher.resolve(ev)
            self.join.complete(ev, res)
            self.record_map(ev, ORIGIN_NAMES.get(ev.origin, "mmap"), res)

    def record_map(self, ev: RawEvent, origin: str, res: Resolution) -> None:
        """Write a mapping record (origin: its "origin"), note it live, and give its identity a fast entry.

        The entry is made when res is final: the fast path then writes what
        this writes (each record with its own path, read for its event).
        """
        self.enricher.count(res)
        self.stats.count("mmap")
        key = res.build_id or res.file_id     # a file without a GNU build-id is stored under its htlhash
        if key and self.named is not None:
            self.named(key, ev.path, ev.uid)
        key = file_key(ev.identity)
        self.tables.add_live(ev.pid, ev.start, key)
        fast = self.tables.fast
        akey = answer_key(key, ev)
        if res.final and ev.origin is not None and akey not in fast:
            fast[akey] = FastEntry((res, None if res.build_id else res.error or "unknown", res_tail(res)))
            if akey is not key:
                self.kernel_fast.put(akey, res)
        self.tables.emit(mmap_line(ev, origin, res))

    def record_resolutions(self, answers: list[tuple[object, Resolution]]) -> None:
        """Write a ``resolution`` record for each late answer (Enricher.take_late), then a ``file_id``
        record for each htlhash the hand-overs computed since (Enricher.take_file_keys)."""
        now = clock.boot_ns()
        for _ident, res in answers:
            self.stats.count("resolution")
            self.tables.emit(RESOLUTION_LINE % (now, res_tail(res)))
        for key in self.enricher.take_file_keys():
            self.stats.count("file_id")
            self.tables.emit(file_id_line(now, key))

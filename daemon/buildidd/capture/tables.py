"""The state the recorder's parts share, and the C fast path's one argument.

:class:`Tables` holds what the loop (recorder.py), the exec join
(execjoin.py), loss recovery (rescan.py) and the C fast path (_fastpath.c)
all read or write: the pending lines (one buffer), the fast path's identity table, the
held execs, the live mappings per process.  ``_fastpath.run(raws, start,
tables)`` reads these attributes by name.  :class:`Stats` are the session's
counters.  The named types that cross into C (HeldExec, FastEntry, RunCounts)
are defined in _fastpath.c as struct sequences and re-exported here.
"""

from __future__ import annotations

import logging
import struct
import time
from dataclasses import dataclass, field

from buildidd.capture import _fastpath
from buildidd.capture._fastpath import FastEntry, HeldExec, LineBuffer, RunCounts
from buildidd.memo import Memo
from buildidd.sessionlog.records import (COMM_JSON, COMM_LINE, EXEC_LINE, EXEC_PREFIX, EXIT_LINE, FILENAME_JSON,
                                         FORK_LINE, KERNEL_STATUS_JSON, MMAP_LINE, ORIGIN_NAMES, PATH_CUT_JSON,
                                         PATH_JSON)

__all__ = ["FastEntry", "HeldExec", "RunCounts", "Stats", "Tables", "LIVE_MAX", "ORIGINS"]

_fastpath.configure(MMAP_LINE, FORK_LINE, EXIT_LINE, COMM_LINE, EXEC_LINE, EXEC_PREFIX, KERNEL_STATUS_JSON)

_BY_VALUE = {int(k): v for k, v in ORIGIN_NAMES.items()}
#: Record "origin" by map_event.origin, as the fast path reads it (index 0
#: and values past the end: "mmap", as ORIGIN_NAMES.get(origin, "mmap")).
ORIGINS: tuple[bytes, ...] = tuple(_BY_VALUE.get(i, "mmap").encode() for i in range(max(_BY_VALUE) + 1))

#: Exec confirmations kept per step in Tables.execs at most (fastpath/records.c: EXECS_MAX).
EXECS_MAX = 65536
#: ino and dev (kernel dev_t) in an identity key (struct file_id, bpf/events.h).
_KEY_INO_DEV = struct.Struct("=Q20xI")

#: Live mappings kept per process for the rescan after a loss (_fastpath.c: LIVE_MAX).
LIVE_MAX = 4096
#: Processes whose live mappings are kept (Tables.trim_live): above, exits were lost.
LIVE_PIDS_MAX = 65536
#: Live mappings kept in all (every pid's): one user's processes could otherwise keep LIVE_MAX
#: each, for as many processes as they may run.  A mapping not kept is only recorded again
#: (origin "recovered") if a rescan follows a loss while it is mapped.
LIVE_ENTRIES_MAX = 16384
#: What one live mapping holds (its tuple, vm_start, identity key bytes, the set's slot), bytes:
#: the estimate status reports (Tables.memory).
LIVE_ENTRY_BYTES = 256
#: Seconds between two log lines about events of one exception type that could not be recorded.
EVENT_ERROR_LOG_EVERY_S = 60.0

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Tables:
    """The recorder's shared tables (see the module docstring).

    Attributes:
        missing: the enricher's mappings without a build-id, reason -> count
            (Enricher.missing: the fast path counts into it).
        out: session-log lines not yet written, each followed by b"\n", in one
            _fastpath.LineBuffer (the C fast path formats its lines straight into it;
            :attr:`lines` lists them).
        fast: identity key (kernel.events.file_key bytes) -> FastEntry, for
            identities with a final answer (their lines' identity and build-id fields).
        held: tid -> HeldExec, execs waiting for their executable's mapping.
        live: pid (tgid) -> {(vm_start, identity key)} of its recorded
            mappings (at most LIVE_MAX), for the rescan after a loss.
        live_entries: the mappings in live (all pids; the C fast path keeps it too);
            live_max_entries: none is added beyond it (LIVE_ENTRIES_MAX).
        comm_json, filename_json, path_json: the memos of records.py (raw
            comm / raw exec filename / raw path -> JSON bytes).
        path_cut_json: records.PATH_CUT_JSON (what follows a path: read whole, cut).
        origins: ORIGINS.
        step: steps begun so far (a held exec carries the one it came in).
        execs: (pid, uid, file dev as the kernel's dev_t, ino, time_ns) of each exec the kernel
            completed this step (EXEC records, EXEC_MAIN/EXEC_INTERP mappings), at most EXECS_MAX:
            the exec pins' confirmations (resolve.execpins.ExecPins.recorded), cleared each step.
    """

    missing: dict[str, int]
    out: LineBuffer = field(default_factory=LineBuffer)
    fast: dict[bytes, FastEntry] = field(default_factory=dict)
    held: dict[int, HeldExec] = field(default_factory=dict)
    live: dict[int, set[tuple[int, bytes]]] = field(default_factory=dict)
    live_entries: int = 0
    live_max_entries: int = LIVE_ENTRIES_MAX
    comm_json: Memo = COMM_JSON
    filename_json: Memo = FILENAME_JSON
    path_json: Memo = PATH_JSON
    path_cut_json: tuple[bytes, bytes] = PATH_CUT_JSON
    origins: tuple[bytes, ...] = ORIGINS
    step: int = 0
    execs: list[tuple[int, int, int, int, int]] = field(default_factory=list)

    def note_exec(self, pid: int, uid: int, key: bytes, time_ns: int) -> None:
        """Append an exec to :attr:`execs` (as the fast path does): pid (tgid) exec'd as uid the file of
        the identity key (kernel.events.file_key bytes) at time_ns."""
        if len(self.execs) < EXECS_MAX:
            ino, kdev = _KEY_INO_DEV.unpack_from(key)
            self.execs.append((pid, uid, kdev, ino, time_ns))

    def emit(self, line: bytes) -> None:
        """Queue one session-log line (no newline; the recorder writes them at the end of a step)."""
        self.out.append(line)

    @property
    def lines(self) -> list[bytes]:
        """The pending lines, without their newlines (a copy)."""
        return bytes(self.out).split(b"\n")[:-1]

    def drop_oldest_lines(self, max_bytes: int) -> int:
        """Drop the oldest pending lines until the rest (newline each) fit in max_bytes; how many went."""
        out = self.out
        excess = len(out) - max_bytes
        if excess <= 0:
            return 0
        cut = bytes(out).find(b"\n", excess - 1) + 1 or len(out)     # whole lines only
        return out.drop_front(cut)

    def add_live(self, pid: int, start: int, key: bytes) -> None:
        """Remember a recorded mapping of pid at start (bytes) of the identity key."""
        if self.live_entries >= self.live_max_entries:
            return                          # full: no set is made for a new pid either
        live = self.live.get(pid)
        if live is None:
            live = self.live[pid] = set()
        if len(live) < LIVE_MAX:
            had = len(live)
            live.add((start, key))
            self.live_entries += len(live) - had

    def drop_live(self, pid: int) -> None:
        """Forget pid's live mappings (it exited, or exec'd)."""
        gone = self.live.pop(pid, None)
        if gone is not None:
            self.live_entries -= len(gone)

    def trim_live(self, max_pids: int = LIVE_PIDS_MAX) -> int:
        """Forget the live mappings of the longest-known pids beyond max_pids; how many pids went.

        An exit the recorder never saw (lost) leaves a pid's entry behind;
        this bounds them.  A pid forgotten while alive has its mappings
        recorded again by the next rescan (origin "recovered").
        """
        live = self.live
        excess = len(live) - max_pids
        for _ in range(max(0, excess)):
            self.drop_live(next(iter(live)))
        return max(0, excess)

    def memory(self) -> dict:
        """What the per-identity tables hold (JSON-ready): {"fast": {"entries"}, "live": {"entries",
        "pids", "max_entries", "bytes", "max_bytes"}, "held": {"entries"}}; live's bytes are LIVE_ENTRY_BYTES each
        (the fast entries' bytes are counted by the caches that bound them: identity, kernel_fast)."""
        return {"fast": {"entries": len(self.fast)},
                "live": {"entries": self.live_entries, "pids": len(self.live), "max_entries": self.live_max_entries,
                         "bytes": self.live_entries * LIVE_ENTRY_BYTES,
                         "max_bytes": self.live_max_entries * LIVE_ENTRY_BYTES},
                "held": {"entries": len(self.held)}}


@dataclass
class Stats:
    """Counters of one session (reported in the end record and by status)."""

    events: dict[str, int] = field(default_factory=dict)
    decode_errors: int = 0
    lost: dict[str, int] = field(default_factory=dict)
    recovered: int = 0
    synthesized: int = 0
    synth_skipped: int = 0
    log_write_errors: int = 0
    log_lines_dropped: int = 0
    priority_boosts: int = 0
    #: events that raised while being recorded, by exception type name
    event_errors: dict[str, int] = field(default_factory=dict)
    #: pids whose live mappings were forgotten (Tables.trim_live)
    live_pids_dropped: int = 0
    _error_log_next: dict[str, float] = field(default_factory=dict, repr=False, compare=False)

    def count(self, name: str, n: int = 1) -> None:
        """Count n recorded events of type name ("mmap", "exec", "fork", ...)."""
        ev = self.events
        ev[name] = ev.get(name, 0) + n

    def event_error(self, e: Exception) -> None:
        """One event raised e while being recorded: count it by type; log it at most once a minute per type."""
        name = type(e).__name__
        n = self.event_errors[name] = self.event_errors.get(name, 0) + 1
        now = time.monotonic()
        if now >= self._error_log_next.get(name, 0.0):
            self._error_log_next[name] = now + EVENT_ERROR_LOG_EVERY_S
            log.error("an event could not be recorded (%s, %d so far): %s", name, n, e, exc_info=e)

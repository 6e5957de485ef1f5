"""Lines the session writer could not write yet, and the records it had to drop.

When a write fails (ENOSPC, EIO, ...) the writer keeps what the kernel did
not accept here, line by line, and resumes at the exact byte where the kernel
stopped: a line half written before the failure is completed, never written
again and never left torn.  The backlog is bounded (``max_bytes``); a record
offered while it is full is dropped and counted, and the run of drops (a
*gap*) ends with a ``lost`` record in the session, placed where the dropped
records would have been: after every record kept, before the next one.

Its ``lost`` record has the shape of the capture stage's (see
:mod:`buildidd.sessionlog.records`)::

    {"type": "lost", "time_ns": <when the gap ended>, "counts": {"disk_full": N},
     "first_ns": <gap start>, "last_ns": <gap end>, "recovery": "none: ..."}

``first_ns``/``last_ns`` (ns since boot) cover the gap: from the earlier of
the first failure of this outage and the first dropped record's ``time_ns``,
to the later of the last drop and the last dropped record's ``time_ns``.
"""

from __future__ import annotations

import collections
import errno
import json
import re
from collections.abc import Sequence

__all__ = ["Backlog", "Outage", "loss_cause"]

#: ``time_ns`` of a dropped record, read from its bytes (only dropped records are looked at).
_TIME_NS_RE = re.compile(rb'"time_ns":(\d{1,20})[,}]')

#: Bytes joined into one ``os.write`` when draining the backlog.
DRAIN_CHUNK_BYTES = 1 << 20


def loss_cause(error: OSError) -> str:
    """The ``lost`` cause for a failed write: ``disk_full`` for ENOSPC and
    EDQUOT, ``io_error`` for anything else (EIO, EROFS, ...)."""
    return "disk_full" if error.errno in (errno.ENOSPC, errno.EDQUOT) else "io_error"


class Backlog:
    """Unwritten lines in order, the partial first one, and the open gap of drops.

    Not thread-safe: the writer uses it under its lock.

    Args:
        max_bytes: bytes of records held at most (a ``lost`` record is always
            accepted, and the rest of a line already partly written is kept).
    """

    def __init__(self, max_bytes: int):
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.max_bytes = max_bytes
        # (line with its b"\n", is_record): is_record False for a lost record of ours.
        self._lines: collections.deque[tuple[bytes, bool]] = collections.deque()
        self.nbytes = 0            # bytes of _lines, the written prefix of the head included
        self.head_done = 0         # bytes of the first line already in the segment
        self.records = 0           # records (is_record) in _lines
        # The open gap: records dropped since the last lost record.
        self.gap_dropped = 0
        self.gap_cause = "disk_full"
        self.gap_first_ns: int | None = None
        self.gap_last_ns: int | None = None
        #: records dropped in total, by cause
        self.lost: dict[str, int] = {}

    def __bool__(self) -> bool:
        return bool(self._lines)

    def keep_rest(self, lines: Sequence[bytes], written: int) -> int:
        """Keep the lines of a batch the kernel accepted only ``written`` bytes of.

        ``lines`` are the batch's records without ``b"\\n"``, written as
        ``b"\\n".join(lines) + b"\\n"``.  Returns how many lines were written
        whole; the line the write stopped in is kept with its written prefix
        (it is completed, never rewritten), and the lines after it are offered
        (see :meth:`offer`).
        """
        done = 0
        offset = written
        for line in lines:
            size = len(line) + 1
            if offset < size:
                break
            offset -= size
            done += 1
        if done < len(lines):
            if offset:
                self._append(lines[done] + b"\n", True)
                self.head_done = offset
                rest = lines[done + 1:]
            else:
                rest = lines[done:]
            self.offer(rest, failure_ns=None, now_ns=None)
        return done

    def offer(self, lines: Sequence[bytes], *, failure_ns: int | None, now_ns: int | None) -> int:
        """Keep the records ``lines`` (without ``b"\\n"``) while there is room; drop the rest.

        A record kept after drops first closes the gap (:meth:`close_gap`).

        Args:
            failure_ns: when the current outage began (ns since boot), to
                start a gap's time range; ``None``: unknown yet.
            now_ns: now (ns since boot), the latest time of a drop.

        Returns:
            the number of records dropped.
        """
        dropped = 0
        for line in lines:
            size = len(line) + 1
            if self.nbytes + size <= self.max_bytes:
                if self.gap_dropped:
                    self.close_gap(now_ns if now_ns is not None else self.gap_last_ns or 0)
                self._append(line + b"\n", True)
                continue
            dropped += 1
            self._note_drop(line, failure_ns, now_ns)
        return dropped

    def _note_drop(self, line: bytes, failure_ns: int | None, now_ns: int | None) -> None:
        self.gap_dropped += 1
        self.lost[self.gap_cause] = self.lost.get(self.gap_cause, 0) + 1
        times = [t for t in (failure_ns, now_ns) if t is not None]
        m = _TIME_NS_RE.search(line)
        if m is not None:
            times.append(int(m.group(1)))
        if times:
            lo, hi = min(times), max(times)
            self.gap_first_ns = lo if self.gap_first_ns is None else min(self.gap_first_ns, lo)
            self.gap_last_ns = hi if self.gap_last_ns is None else max(self.gap_last_ns, hi)

    def close_gap(self, now_ns: int) -> None:
        """Append the ``lost`` record of the open gap (nothing when no record was dropped)."""
        if not self.gap_dropped:
            return
        record = {"type": "lost", "time_ns": now_ns, "counts": {self.gap_cause: self.gap_dropped},
                  "first_ns": self.gap_first_ns if self.gap_first_ns is not None else now_ns,
                  "last_ns": max(self.gap_last_ns or now_ns, now_ns),
                  "recovery": "none: records offered while the session log could not be written"}
        self._append(json.dumps(record, separators=(",", ":")).encode() + b"\n", False)
        self.gap_dropped = 0
        self.gap_first_ns = self.gap_last_ns = None

    def chunk(self) -> bytes:
        """The next bytes to write: the head's unwritten part and the lines
        after it, up to about :data:`DRAIN_CHUNK_BYTES`."""
        parts = []
        size = 0
        for line, _ in self._lines:
            parts.append(line)
            size += len(line)
            if size >= DRAIN_CHUNK_BYTES:
                break
        data = b"".join(parts)
        return data[self.head_done:]

    def consume(self, n: int) -> int:
        """``n`` bytes of :meth:`chunk` were written; returns the records completed."""
        completed = 0
        n += self.head_done
        while self._lines and n >= len(self._lines[0][0]):
            line, is_record = self._lines.popleft()
            n -= len(line)
            self.nbytes -= len(line)
            if is_record:
                self.records -= 1
                completed += 1
        self.head_done = n
        return completed

    def drop_all(self) -> int:
        """Count every record still held as lost (the writer closes without
        the disk coming back); returns how many.  The open gap stays counted."""
        n = self.records
        if n:
            self.lost[self.gap_cause] = self.lost.get(self.gap_cause, 0) + n
        self._lines.clear()
        self.nbytes = self.head_done = self.records = 0
        return n

    def _append(self, line: bytes, is_record: bool) -> None:
        self._lines.append((line, is_record))
        self.nbytes += len(line)
        if is_record:
            self.records += 1


class Outage:
    """Whether the session log is failing now, since when, and when it was last logged.

    Args:
        log_interval_s: seconds between two log messages about it.
        logger: where to log.
    """

    def __init__(self, log_interval_s: float, logger):
        self.log_interval_s = log_interval_s
        self.log = logger
        self.cause: str | None = None        # loss_cause() of the failure, None while writing works
        self.since_ns: int | None = None     # ns since boot of its first failure
        self.last_error: str | None = None   # text of the latest failure
        self.failures = 0                    # failed calls in this outage
        self._next_log_s = 0.0

    def failed(self, what: str, error: OSError, now_ns: int, now_s: float, backlog: Backlog) -> None:
        """Note a failure of ``what`` (a path, a verb); logs at most once per interval."""
        if self.cause is None:
            self.cause = loss_cause(error)
            self.since_ns = now_ns
            self.failures = 0
            if not backlog.gap_dropped:
                backlog.gap_cause = self.cause
        self.failures += 1
        self.last_error = f"{what}: {error.strerror or error}"
        if now_s >= self._next_log_s:
            self._next_log_s = now_s + self.log_interval_s
            self.log.warning("session log cannot be written (%s) since %.1f s: %s; %d records waiting, "
                             "%d dropped so far (logged at most every %.0f s)", self.cause,
                             (now_ns - self.since_ns) / 1e9, self.last_error, backlog.records,
                             sum(backlog.lost.values()), self.log_interval_s)

    def recovered(self, now_ns: int, backlog: Backlog) -> None:
        """Writing works again: log it once and reset."""
        if self.cause is None:
            return
        self.log.warning("session log writable again after %.1f s (%s, %d failed writes); %d records dropped",
                         (now_ns - self.since_ns) / 1e9, self.cause, self.failures, sum(backlog.lost.values()))
        self.cause = self.since_ns = None
        self._next_log_s = 0.0

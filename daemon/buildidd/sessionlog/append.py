"""Appending lines to a session's segments through faults: resume where the kernel stopped.

:class:`Appender` is the write engine of :class:`~.writer.SessionWriter`
(which holds the lock and checks the lines): one ``os.write`` per batch on
the hot path; after a failed write (ENOSPC, EIO, ...) the rest waits in the
:class:`~.backlog.Backlog` and is written from the byte where the kernel
stopped, at the next batch or from a retry thread; the outage is counted and
logged at a bounded rate (:class:`~.backlog.Outage`).
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable, Sequence

from buildidd import clock as boot_clock
from buildidd.errors import SessionLogError
from buildidd.sessionlog.backlog import Backlog, Outage
from buildidd.sessionlog.chain import SegmentChain
from buildidd.sessionlog.segments import SegmentFile

__all__ = ["Appender"]

log = logging.getLogger(__name__)

#: Seconds between two attempts to write the backlog when no new record comes.
RETRY_INTERVAL_S = 1.0
#: Seconds between two log messages about a session log that cannot be written.
LOG_INTERVAL_S = 60.0


class Appender:
    """Writes batches of lines to a :class:`SegmentChain`, keeping what fails for later.

    Every method but the retry thread runs under the writer's lock.

    Args:
        chain: the session's segments.
        backlog: where unwritten lines wait (bounded).
        lock: the writer's lock, taken by the retry thread.
        closed: tells the retry thread the writer is closed.

    Attributes:
        records_written: records wholly in a segment.
        write_errors: failed writes and failed segment creations.
        outage: the current failure, if any.
    """

    def __init__(self, chain: SegmentChain, backlog: Backlog, lock: threading.Lock,
                 closed: Callable[[], bool]):
        self.chain = chain
        self.backlog = backlog
        self.outage = Outage(LOG_INTERVAL_S, log)
        self.records_written = 0
        self.write_errors = 0
        self._lock = lock
        self._closed = closed
        self._retry: threading.Thread | None = None
        self.retry_stop = threading.Event()

    def append(self, lines: Sequence[bytes]) -> None:
        """Write ``lines`` (records without ``b"\\n"``) after everything before them.

        Never raises for an I/O error: what is not written waits in the
        backlog, what does not fit in it is dropped and counted.
        """
        self.append_block(b"\n".join([*lines, b""]), len(lines), lines)    # one copy, ends in b"\n"

    def append_block(self, block, records: int, lines: Sequence[bytes] | None = None) -> None:
        """Write ``block`` (bytes-like), ``records`` whole records each ending in ``b"\\n"``,
        after everything before them.

        ``lines``: the same records without their newlines when the caller has them; else the
        block is split only when a write fails.  Never raises for an I/O error (see :meth:`append`).
        """
        backlog = self.backlog
        if backlog:
            self.drain()
        segment = None if backlog else self._writable()
        if segment is None:
            backlog.offer(_records(block, lines), failure_ns=self.outage.since_ns, now_ns=boot_clock.boot_ns())
            self._start_retry()
            return
        written, error = self.chain.write(block)
        if error is None:
            segment.stats.records += records
            self.records_written += records
            self.outage.recovered(boot_clock.boot_ns(), backlog)
            return
        done = backlog.keep_rest(_records(block, lines), written)
        segment.stats.records += done
        self.records_written += done
        self._failed(segment.stats.path, error)
        self._start_retry()

    def drain(self) -> None:
        """Write the backlog from where the kernel stopped, then the gap's ``lost`` record."""
        backlog = self.backlog
        while backlog:
            # Never rotate here: the backlog's first line may be half written.
            segment = self.chain.segment or self._writable()
            if segment is None:
                return
            written, error = self.chain.write(backlog.chunk())
            done = backlog.consume(written)
            segment.stats.records += done
            self.records_written += done
            if error is not None:
                self._failed(segment.stats.path, error)
                return
            if not backlog and backlog.gap_dropped:
                backlog.close_gap(boot_clock.boot_ns())
        self.outage.recovered(boot_clock.boot_ns(), backlog)

    def _failed(self, what, error: OSError) -> None:
        self.write_errors += 1
        self.outage.failed(str(what), error, boot_clock.boot_ns(), time.monotonic(), self.backlog)

    def _writable(self) -> SegmentFile | None:
        """The segment to write to (rotated, opened); None when it cannot be created (counted)."""
        try:
            return self.chain.writable()
        except SessionLogError as e:
            cause = e.__cause__ if isinstance(e.__cause__, OSError) else OSError(errno.EIO, str(e))
            self._failed(self.chain.directory, cause)
            return None

    def _start_retry(self) -> None:
        if self._retry is None:
            self._retry = threading.Thread(target=self._retry_loop, name="buildidd-sessionlog-retry", daemon=True)
            self._retry.start()

    def _retry_loop(self) -> None:
        while not self.retry_stop.wait(RETRY_INTERVAL_S):
            with self._lock:
                if self._closed():
                    return
                self.drain()
                if not self.backlog:
                    self._retry = None
                    return


def _records(block: bytes | bytearray, lines: Sequence[bytes] | None) -> Sequence[bytes]:
    """The records of a block (each ending in b"\\n") without their newlines: lines when given."""
    return lines if lines is not None else bytes(block).split(b"\n")[:-1]

"""The session writer: appends JSON-lines records to the segments of one session.

Pipeline stage: enrichment → **session log** → clients (``buildidd show``,
``zstdcat DIR/*.zst | jq``).  This module knows bytes and lines, not record
types; :mod:`buildidd.sessionlog.records` gives the JSON form of a record, and
:mod:`.segments` the layout of a session directory.

Rotation.  The writer rotates to the next segment before a batch when the open
segment holds at least ``max_segment_bytes`` bytes or its first byte was
written ``max_segment_age_s`` seconds ago or more; a batch is never split.
A closed segment is compressed in the background (:mod:`.compress`).

Faults (ENOSPC, EIO, ...).  ``write_lines`` issues one ``os.write`` per
batch (more only when the kernel accepts part of it).  When a write fails,
what the kernel did not accept goes to a bounded backlog (:mod:`.backlog`) and
the writer resumes at the exact byte where the kernel stopped, at the next
call or from a retry thread (every :data:`.append.RETRY_INTERVAL_S`): no record is
written twice and a line half written is completed, not torn.  While the
backlog is full, further records are dropped and counted, and a ``lost``
record with cause ``disk_full`` (``io_error`` for other errors) and the gap's
time range is written once space returns.  The condition is logged once per
:data:`.append.LOG_INTERVAL_S` and shown by :attr:`SessionWriter.stats`.  Only a
crash (or a close while the disk is still full) can tear the last line; the
reader skips such a line and reports it through ``on_torn``; a closed
segment is always line-aligned (its torn tail is terminated before
compression).

Locking.  The writer holds an exclusive ``flock`` on its session directory
while open, so :func:`~.seal.seal_unclosed_sessions` never touches a session
being written; its close leaves the :data:`~.segments.CLOSED_MARKER` file.

Durability: records reach the page cache at each ``write_lines``; a segment is
``fsync``-ed when it is closed (rotation, :meth:`SessionWriter.close`): by the
finishing thread (:class:`~.compress.SegmentFinisher`), off the recording
thread, before it compresses it.  A
process crash loses nothing that ``write_lines`` returned for; a power loss
may lose the open segment's unsynced tail and a closed segment that the
finishing thread has not synced yet.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import zstandard

from buildidd.errors import SessionLogError
from buildidd.sessionlog.append import Appender
from buildidd.sessionlog.backlog import Backlog
from buildidd.sessionlog.chain import RotationLimits, SegmentChain
from buildidd.sessionlog.compress import SegmentFinisher
from buildidd.sessionlog.writebehind import WINDOW_BYTES, WriteBehind
from buildidd.sessionlog.segments import (
    MAX_LINE_BYTES, SEGMENT_GLOB, ZSTD_LEVEL, SegmentStats, create_session_dir,
    lock_session_dir, segment_name, write_closed_marker,
)

__all__ = ["MAX_LINE_BYTES", "SEGMENT_GLOB", "SegmentStats", "SessionWriter"]

log = logging.getLogger(__name__)

#: Default bound of the backlog of unwritten records, in bytes.
DEFAULT_MAX_PENDING_BYTES = 16 << 20


class SessionWriter:
    """Appends JSON-lines records to the segments of one session directory.

    One writer per directory (it holds the directory's ``flock``).
    ``write_lines``, ``write``, ``rotate`` and ``close`` may be called from
    several threads (they hold a lock); closed segments are compressed on one
    background thread, so ``write_lines`` never waits for compression; a
    backlog left by a failed write is retried from another thread.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_segment_bytes: int = 64 << 20,
        max_segment_age_s: float = 3600.0,
        compress: bool = True,
        zstd_level: int = ZSTD_LEVEL,
        clock: Callable[[], float] = time.monotonic,
    ):
        """Create the session directory (or adopt an empty one) and lock it.

        Args:
            directory: the session directory; created with mode ``0o750``
                (less the umask), parents too.
            max_segment_bytes: rotate before a batch when the open segment
                holds at least this many bytes.  A segment can exceed it by
                one batch.
            max_segment_age_s: rotate before a batch when the open segment's
                first byte was written at least this many seconds ago
                (measured with ``clock``).
            compress: compress closed segments to ``.jsonl.zst``.
            zstd_level: zstd compression level (1-22; default segments.ZSTD_LEVEL).
            clock: monotonic time in seconds; tests pass a fake one.

        The backlog kept while writes fail holds
        :data:`DEFAULT_MAX_PENDING_BYTES` (see :meth:`set_max_pending_bytes`); the page cache
        keeps :data:`.writebehind.WINDOW_BYTES` of the open segment (``write_behind.set_window``).

        Raises:
            SessionLogError: the directory cannot be created, read or locked,
                or already holds segments (a session directory is never reused).
            ValueError: a size, age or level out of range.
        """
        limits = RotationLimits(max_segment_bytes, max_segment_age_s)
        if compress and not 1 <= zstd_level <= zstandard.MAX_COMPRESSION_LEVEL:
            raise ValueError(f"zstd_level must be in 1..{zstandard.MAX_COMPRESSION_LEVEL}, got {zstd_level}")
        self._backlog = Backlog(DEFAULT_MAX_PENDING_BYTES)
        self._dir = Path(directory)
        self._clock = clock
        create_session_dir(self._dir)
        try:
            self._dir_fd = lock_session_dir(self._dir)
        except OSError as e:
            raise SessionLogError(f"{self._dir}: cannot lock session directory (another writer?): "
                                  f"{e.strerror}") from e
        self._lock = threading.Lock()
        self._closed = False
        #: Releases the open segment's older pages (:mod:`.writebehind`); set_window(0) turns it off.
        self.write_behind = WriteBehind(WINDOW_BYTES)
        finisher = SegmentFinisher(self._dir, zstd_level if compress else None, self.write_behind)
        self._chain = SegmentChain(self._dir, limits, finisher, clock, self.write_behind)
        self._appender = Appender(self._chain, self._backlog, self._lock, lambda: self._closed)

    # -- writing ---------------------------------------------------------

    def set_limits(self, max_segment_bytes: int, max_segment_age_s: float) -> None:
        """Change the rotation limits (bytes, seconds); they apply from the next write.

        Raises:
            ValueError: a limit is not positive.
        """
        limits = RotationLimits(max_segment_bytes, max_segment_age_s)
        with self._lock:
            self._chain.limits = limits

    def set_max_pending_bytes(self, max_pending_bytes: int) -> None:
        """Bytes of records kept while writes fail; more are dropped and counted (:mod:`.backlog`).

        Raises:
            ValueError: not positive.
        """
        if max_pending_bytes <= 0:
            raise ValueError(f"max_pending_bytes must be > 0, got {max_pending_bytes}")
        with self._lock:
            self._backlog.max_bytes = max_pending_bytes

    def write_lines(self, lines: Sequence[bytes], *, trusted: bool = False) -> None:
        """Append already-encoded records as one batch.

        Args:
            lines: each a complete JSON object, without newline, at most
                :data:`MAX_LINE_BYTES` bytes.  The batch is written as
                ``b"\\n".join(lines) + b"\\n"`` with one ``os.write`` (looping
                only on a short write), into one segment.
            trusted: the caller guarantees the line rules (its records are
                JSON-encoded, so no raw newline, and bounded), so the per-byte
                checks are skipped (a per-byte scan of every record on the hot path).

        Rotates first when the open segment holds at least
        ``max_segment_bytes`` bytes or is ``max_segment_age_s`` seconds old
        (never while a backlog is waiting).  A write that fails (ENOSPC, EIO,
        ...) does not raise: what was not written waits in the backlog and is
        written later from where the kernel stopped, records beyond the
        backlog's bound are dropped and counted (``records_lost``), see the
        module docstring.  Do not offer the same lines again.

        Raises:
            SessionLogError: after :meth:`close`.
            ValueError: a line contains ``b"\\n"`` or is too long.
        """
        if not lines:
            return
        if not trusted:
            if any(b"\n" in line for line in lines):
                raise ValueError("a record contains a newline byte")
            if max(map(len, lines)) > MAX_LINE_BYTES:
                raise ValueError(f"a record is longer than {MAX_LINE_BYTES} bytes")
        with self._lock:
            if self._closed:
                raise SessionLogError(f"{self._dir}: session writer is closed")
            self._appender.append(lines)

    def write_block(self, block, records: int) -> None:
        """Append records already encoded and joined: ``block`` (bytes-like) is ``records`` whole
        lines, each a JSON object followed by ``b"\\n"`` (the recorder's own, formatted in one
        buffer, capture/tables.py; the line rules are the caller's, as with ``trusted=True``).
        Written as :meth:`write_lines` writes a batch.

        Raises:
            SessionLogError: after :meth:`close`.
            ValueError: ``block`` does not end in ``b"\\n"``.
        """
        with memoryview(block) as view:      # released on return: the caller may reuse block
            if not view:
                return
            if view[-1] != 0x0A:
                raise ValueError("a block of records must end in a newline")
            with self._lock:
                if self._closed:
                    raise SessionLogError(f"{self._dir}: session writer is closed")
                self._appender.append_block(view, records)

    def write(self, record: dict) -> None:
        """Encode ``record`` as compact JSON and append it (see :meth:`write_lines`).

        Raises:
            SessionLogError: as :meth:`write_lines`.
            TypeError: ``record`` holds a value JSON cannot encode.
        """
        self.write_lines([json.dumps(record, separators=(",", ":")).encode()])

    # -- closing ---------------------------------------------------------

    def rotate(self) -> None:
        """Close the open segment (synced and compressed in the background) and
        start the next one at the next write.  Does nothing when the open
        segment is empty or none is open, or while a backlog waits (its first
        line may be half written).

        Raises:
            SessionLogError: ``close`` of the segment failed (counted in
                ``write_errors``, as is a failed ``fsync`` on the finishing
                thread); the segment is closed anyway
                and the writer goes on with the next one.
        """
        with self._lock:
            if self._closed:
                raise SessionLogError(f"{self._dir}: session writer is closed")
            if self._backlog:
                self._appender.drain()
            segment = self._chain.segment
            if segment is not None and segment.stats.size_bytes > 0 and not self._backlog:
                self._chain.close_current()

    def close(self) -> None:
        """Write what waits in the backlog (one last try; the rest is counted
        lost), close the last segment, wait until every closed segment is
        final (synced, compressed), write the :data:`~.segments.CLOSED_MARKER` and
        release the directory's lock.  Idempotent.  An empty last segment
        (left by a failed first write) is removed.

        Raises:
            SessionLogError: ``close`` of the last segment failed.  A failed
                ``fsync`` is only counted (``write_errors``), compression
                failures too (``compress_errors``).
        """
        error: SessionLogError | None = None
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._appender.retry_stop.set()
            if self._backlog:
                self._appender.drain()
            if self._backlog:
                n = self._backlog.drop_all()
                log.warning("%s: closing with %d records never written (%s)", self._dir, n,
                            self._appender.outage.cause)
            try:
                self._chain.finish()
            except SessionLogError as e:
                error = e
            finally:
                self.write_behind.close()
        stats = self.stats
        write_closed_marker(self._dir, {"clean": True, "records_written": stats["records_written"],
                                        "bytes_written": stats["bytes_written"],
                                        "finish_cpu_ns": stats["finish_cpu_ns"],
                                        "finished_bytes": stats["finished_bytes"],
                                        "records_lost": stats["records_lost"]})
        os.close(self._dir_fd)
        if error is not None:
            raise error

    def __enter__(self) -> SessionWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- introspection ---------------------------------------------------

    @property
    def stats(self) -> dict:
        """A snapshot of the writer's counters (JSON-ready, for ``status``).

        Keys: ``records_written`` (records wholly written), ``bytes_written``
        (bytes accepted by the kernel), ``segments_closed``,
        ``segments_compressed``, ``write_errors`` (failed write/open/fsync
        calls), ``compress_errors`` (segments left uncompressed), ``finish_cpu_ns`` and
        ``finished_bytes`` (CPU ns the finishing thread spent making closed segments final:
        reading, zstd, fsync; and their ``.jsonl`` bytes),
        ``current_segment`` (path of the open segment as ``str``, or
        ``None``), ``next_segment`` (when none is open: the path the next
        record opens, else ``None``), ``pending_records``/``pending_bytes`` (the backlog),
        ``records_lost`` (records dropped, by cause: ``disk_full``,
        ``io_error``), ``failing`` (the cause while writes fail, else
        ``None``), ``failing_since_ns`` (ns since boot), ``last_write_error``,
        ``page_cache_released_bytes`` (bytes written back and dropped behind the writer,
        :mod:`.writebehind`), ``page_cache_release_errors``, ``page_cache_release_skipped`` (ranges
        left to the kernel while the thread was behind).
        """
        chain = self._chain
        segment = chain.segment
        compressed, compress_errors, sync_errors = chain.finisher.counts
        finish_cpu_ns, finished_bytes = chain.finisher.cost
        backlog, outage = self._backlog, self._appender.outage
        return {
            "records_written": self._appender.records_written,
            "bytes_written": chain.bytes_written,
            "segments_closed": chain.segments_closed,
            "segments_compressed": compressed,
            "write_errors": self._appender.write_errors + chain.close_errors + sync_errors,
            "compress_errors": compress_errors,
            "finish_cpu_ns": finish_cpu_ns,
            "finished_bytes": finished_bytes,
            "current_segment": str(segment.stats.path) if segment is not None else None,
            "next_segment": str(chain.directory / segment_name(chain.next_number)) if segment is None else None,
            "pending_records": backlog.records,
            "pending_bytes": backlog.nbytes,
            "records_lost": dict(backlog.lost),
            "failing": outage.cause,
            "failing_since_ns": outage.since_ns,
            "last_write_error": outage.last_error,
            "page_cache_released_bytes": self.write_behind.released_bytes,
            "page_cache_release_errors": self.write_behind.errors,
            "page_cache_release_skipped": self.write_behind.skipped,
        }

    @property
    def current_segment_stats(self) -> SegmentStats | None:
        """A copy of the open segment's :class:`SegmentStats`, or ``None``."""
        segment = self._chain.segment
        return replace(segment.stats) if segment is not None else None

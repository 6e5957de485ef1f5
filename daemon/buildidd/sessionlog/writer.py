"""The session writer: appends JSON-lines records to the segments of one session.

Pipeline stage: enrichment → **session log** → clients (``buildidd show``,
``zstdcat DIR/*.zst | jq``).  This module knows bytes and lines, not record
types; :mod:`buildidd.sessionlog.records` gives the JSON form of a record, and
:mod:`.segments` the layout of a session directory.

Rotation.  The writer rotates to the next segment before a batch when the open
segment holds at least ``max_segment_bytes`` bytes or its first byte was
written ``max_segment_age_s`` seconds ago or more; a batch is never split.
A closed segment is compressed in the background (:mod:`.compress`).

Torn lines.  ``write_lines`` issues one ``os.write`` per batch (more only when
the kernel accepts part of it), so a crash tears at most the batch being
written: the open segment may end in a partial line.  When the disk fills in
the middle of a batch, the bytes already accepted stay (a prefix of the batch:
complete records, then possibly one partial line); the writer remembers that
the segment does not end with ``b"\\n"`` and starts its next successful write
with ``b"\\n"``, so the partial line becomes one bad line of its own and never
swallows the following record.  The reader skips a line that is not a JSON
object and reports it through ``on_torn``; a closed segment is always
line-aligned (its torn tail is terminated before compression).

Durability: records reach the page cache at each ``write_lines``; a segment is
``fsync``-ed when it is closed (rotation, :meth:`SessionWriter.close`).  A
process crash loses nothing that ``write_lines`` returned for; a power loss
may lose the open segment's unsynced tail.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import zstandard

from buildidd.errors import SessionLogError
from buildidd.sessionlog.compress import SegmentCompressor
from buildidd.sessionlog.segments import (
    MAX_LINE_BYTES, SEGMENT_GLOB, SegmentFile, SegmentStats, create_session_dir,
)

__all__ = ["MAX_LINE_BYTES", "SEGMENT_GLOB", "SegmentStats", "SessionWriter"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RotationLimits:
    """When the writer closes the open segment, checked before each batch.

    Attributes:
        max_segment_bytes: the segment holds at least this many bytes (it can
            exceed it by one batch).
        max_segment_age_s: its first byte was written at least this many
            seconds ago, by the writer's clock.

    Raises:
        ValueError: a limit is not positive.
    """

    max_segment_bytes: int
    max_segment_age_s: float

    def __post_init__(self) -> None:
        if self.max_segment_bytes <= 0:
            raise ValueError(f"max_segment_bytes must be > 0, got {self.max_segment_bytes}")
        if self.max_segment_age_s <= 0:
            raise ValueError(f"max_segment_age_s must be > 0, got {self.max_segment_age_s}")

    def due(self, stats: SegmentStats, clock: Callable[[], float]) -> bool:
        """Whether the non-empty segment ``stats`` is to be closed now (``clock()`` in seconds)."""
        return stats.size_bytes > 0 and (
            stats.size_bytes >= self.max_segment_bytes
            or clock() - stats.started_s >= self.max_segment_age_s
        )


class SessionWriter:
    """Appends JSON-lines records to the segments of one session directory.

    One writer per directory.  ``write_lines``, ``write``, ``rotate`` and
    ``close`` may be called from several threads (they hold a lock); closed
    segments are compressed on one background thread, so ``write_lines`` never
    waits for compression.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_segment_bytes: int = 64 << 20,
        max_segment_age_s: float = 3600.0,
        compress: bool = True,
        zstd_level: int = 3,
        clock: Callable[[], float] = time.monotonic,
    ):
        """Create the session directory (or adopt an empty one).

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
            zstd_level: zstd compression level (1-22).
            clock: monotonic time in seconds; tests pass a fake one.

        Raises:
            SessionLogError: the directory cannot be created or read, or
                already holds segments (a session directory is never reused).
            ValueError: a size, age or level out of range.
        """
        self._limits = RotationLimits(max_segment_bytes, max_segment_age_s)
        if compress and not 1 <= zstd_level <= zstandard.MAX_COMPRESSION_LEVEL:
            raise ValueError(f"zstd_level must be in 1..{zstandard.MAX_COMPRESSION_LEVEL}, got {zstd_level}")
        self._dir = Path(directory)
        self._clock = clock
        create_session_dir(self._dir)
        self._lock = threading.Lock()
        self._closed = False
        self._next_number = 0
        self._segment: SegmentFile | None = None
        # Counters; they change only under self._lock.
        self._records_written = 0
        self._bytes_written = 0
        self._segments_closed = 0
        self._write_errors = 0
        self._compressor = SegmentCompressor(self._dir, zstd_level) if compress else None

    # -- writing ---------------------------------------------------------

    def set_limits(self, max_segment_bytes: int, max_segment_age_s: float) -> None:
        """Change the rotation limits (bytes, seconds); they apply from the next write.

        Raises:
            ValueError: a limit is not positive.
        """
        limits = RotationLimits(max_segment_bytes, max_segment_age_s)
        with self._lock:
            self._limits = limits

    def write_lines(self, lines: Sequence[bytes], *, trusted: bool = False) -> None:
        """Append already-encoded records as one batch.

        Args:
            lines: each a complete JSON object, without newline, at most
                :data:`MAX_LINE_BYTES` bytes.  The batch is written as
                ``b"\\n".join(lines) + b"\\n"`` with one ``os.write`` (looping
                only on a short write), into one segment.
            trusted: the caller guarantees the line rules (its records are
                JSON-encoded, so no raw newline, and bounded), so the per-byte
                checks are skipped; they cost ~1 µs per record on the hot path.

        Rotates first when the open segment holds at least
        ``max_segment_bytes`` bytes or is ``max_segment_age_s`` seconds old.

        Raises:
            SessionLogError: an ``OSError`` (ENOSPC, EIO, ...) while rotating,
                opening the segment or writing; counted in ``write_errors``.
                The writer stays usable and the next call tries again.  A
                prefix of the failed batch may be in the segment (see the
                module docstring: the next successful write terminates a
                partial line with ``b"\\n"``), so retrying the same batch
                can store its first records twice.  Also raised after
                :meth:`close`.
            ValueError: a line contains ``b"\\n"`` or is too long.
        """
        if not lines:
            return
        data = b"\n".join(lines) + b"\n"
        if not trusted:
            if data.count(b"\n") != len(lines):
                raise ValueError("a record contains a newline byte")
            if max(map(len, lines)) > MAX_LINE_BYTES:
                raise ValueError(f"a record is longer than {MAX_LINE_BYTES} bytes")
        with self._lock:
            if self._closed:
                raise SessionLogError(f"{self._dir}: session writer is closed")
            if self._segment is not None and self._limits.due(self._segment.stats, self._clock):
                self._close_segment()  # raises SessionLogError, counted
            if self._segment is None:
                self._open_segment()  # raises SessionLogError, counted
            segment = self._segment
            if not segment.stats.tail_complete:
                data = b"\n" + data
            self._write_all(segment, data)
            segment.stats.records += len(lines)
            self._records_written += len(lines)

    def write(self, record: dict) -> None:
        """Encode ``record`` as compact JSON and append it (see :meth:`write_lines`).

        Raises:
            SessionLogError: as :meth:`write_lines`.
            TypeError: ``record`` holds a value JSON cannot encode.
        """
        self.write_lines([json.dumps(record, separators=(",", ":")).encode()])

    def _write_all(self, segment: SegmentFile, data: bytes) -> None:
        """Write ``data`` to the open segment; account accepted bytes, count a failure."""
        before = segment.stats.size_bytes
        try:
            segment.write_all(data, self._clock)
        except SessionLogError:
            self._write_errors += 1
            raise
        finally:
            self._bytes_written += segment.stats.size_bytes - before

    def _open_segment(self) -> None:
        try:
            self._segment = SegmentFile.create(self._dir, self._next_number)
        except SessionLogError:
            self._write_errors += 1
            raise

    # -- closing ---------------------------------------------------------

    def rotate(self) -> None:
        """Close the open segment (it is compressed in the background) and
        start the next one at the next write.  Does nothing when the open
        segment is empty or none is open.

        Raises:
            SessionLogError: ``fsync`` or ``close`` of the segment failed
                (counted in ``write_errors``); the segment is closed anyway
                and the writer goes on with the next one.
        """
        with self._lock:
            if self._closed:
                raise SessionLogError(f"{self._dir}: session writer is closed")
            if self._segment is not None and self._segment.stats.size_bytes > 0:
                self._close_segment()

    def _close_segment(self) -> None:
        """Terminate, fsync and close the open segment; queue it for compression.

        Always leaves no segment open and advances the segment number; raises
        :class:`SessionLogError` afterwards if fsync/close failed.
        """
        segment = self._segment
        self._segment = None
        self._next_number = segment.stats.number + 1
        before = segment.stats.size_bytes
        error: OSError | None = None
        try:
            # An uncompressed segment is final: its directory entry is synced now.
            segment.close(sync_dir=self._compressor is None)
        except OSError as e:
            error = e
        self._bytes_written += segment.stats.size_bytes - before
        self._segments_closed += 1
        if self._compressor is not None:
            self._compressor.submit(segment.stats.path)
        if error is not None:
            self._write_errors += 1
            raise SessionLogError(f"{segment.stats.path}: cannot close segment: {error.strerror}") from error

    def close(self) -> None:
        """Close the last segment (fsync, compress) and wait until every closed
        segment is compressed.  Idempotent.  An empty last segment (left by a
        failed first write) is removed.

        Raises:
            SessionLogError: ``fsync``/``close`` of the last segment failed.
                Compression failures are only counted (``compress_errors``).
        """
        error: SessionLogError | None = None
        with self._lock:
            if self._closed:
                return
            self._closed = True
            segment = self._segment
            if segment is not None and segment.stats.size_bytes == 0:
                self._segment = None
                segment.discard()
            elif segment is not None:
                try:
                    self._close_segment()
                except SessionLogError as e:
                    error = e
        if self._compressor is not None:
            self._compressor.close()
        if error is not None:
            raise error

    def __enter__(self) -> SessionWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- introspection ---------------------------------------------------

    @property
    def stats(self) -> dict:
        """A snapshot of the writer's counters.

        Keys: ``records_written`` (records of fully written batches),
        ``bytes_written`` (bytes accepted by the kernel, torn parts
        included), ``segments_closed``, ``segments_compressed``,
        ``write_errors`` (failed write/open/fsync calls),
        ``compress_errors`` (segments left uncompressed), ``current_segment``
        (path of the open segment as ``str``, or ``None``).
        """
        segment = self._segment
        compressed, compress_errors = self._compressor.counts if self._compressor is not None else (0, 0)
        return {
            "records_written": self._records_written,
            "bytes_written": self._bytes_written,
            "segments_closed": self._segments_closed,
            "segments_compressed": compressed,
            "write_errors": self._write_errors,
            "compress_errors": compress_errors,
            "current_segment": str(segment.stats.path) if segment is not None else None,
        }

    @property
    def current_segment_stats(self) -> SegmentStats | None:
        """A copy of the open segment's :class:`SegmentStats`, or ``None``."""
        segment = self._segment
        return replace(segment.stats) if segment is not None else None

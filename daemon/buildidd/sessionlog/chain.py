"""The segments of one session in sequence: the open one, rotation, closing, compression.

Used by :class:`~.writer.SessionWriter` under its lock; this module knows the
segment files, the writer knows lines, the backlog and faults.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from buildidd.errors import SessionLogError
from buildidd.sessionlog.compress import SegmentFinisher
from buildidd.sessionlog.segments import SegmentFile, SegmentStats
from buildidd.sessionlog.writebehind import WriteBehind

__all__ = ["RotationLimits", "SegmentChain"]

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


class SegmentChain:
    """The open segment of a session directory and the numbering of the next ones.

    Args:
        directory: the session directory.
        limits: when to rotate.
        finisher: syncs (and compresses) closed segments.
        clock: monotonic seconds (for the segment's age).
        write_behind: releases the open segment's older pages (None: the page cache keeps them).

    Attributes:
        segment: the open :class:`SegmentFile`, or ``None``.
        bytes_written: bytes accepted by the kernel, all segments.
        segments_closed: segments closed so far.
        close_errors: failed ``close`` of a segment.
    """

    def __init__(self, directory: Path, limits: RotationLimits, finisher: SegmentFinisher,
                 clock: Callable[[], float], write_behind: WriteBehind | None = None):
        self.directory = directory
        self.limits = limits
        self.finisher = finisher
        self.clock = clock
        self.write_behind = write_behind
        self.segment: SegmentFile | None = None
        self.next_number = 0
        self.bytes_written = 0
        self.segments_closed = 0
        self.close_errors = 0

    def writable(self) -> SegmentFile:
        """The open segment, after rotating it when due; a new one when none is open.

        A failed close of the rotated segment is logged and counted (it is
        closed anyway).

        Raises:
            SessionLogError: the new segment cannot be created (its
                ``__cause__`` is the OSError).
        """
        if self.segment is not None and self.limits.due(self.segment.stats, self.clock):
            try:
                self.close_current()
            except SessionLogError as e:
                log.warning("%s", e)
        if self.segment is None:
            self.segment = SegmentFile.create(self.directory, self.next_number)
        return self.segment

    def write(self, data: bytes) -> tuple[int, OSError | None]:
        """Write ``data`` to the open segment (:meth:`SegmentFile.write`); bytes are accounted, and
        those the kernel accepted are fed to the finisher (compressed as they come)."""
        segment = self.segment
        written, error = segment.write(data, self.clock)
        self.bytes_written += written
        if written:
            self.finisher.feed(segment.stats.path, memoryview(data)[:written])
        if self.write_behind is not None:
            self.write_behind.written(segment.fd, segment.stats.size_bytes)
        return written, error

    def close_current(self) -> None:
        """Terminate and close the open segment; queue it to the finisher (fsync, compression).

        Always leaves no segment open and advances the segment number.

        Raises:
            SessionLogError: close failed (counted in ``close_errors``); the
                segment is queued all the same.
        """
        segment = self.segment
        self.segment = None
        if self.write_behind is not None:
            self.write_behind.segment_closed()
        self.next_number = segment.stats.number + 1
        before = segment.stats.size_bytes
        error: OSError | None = None
        try:
            segment.close()
        except OSError as e:
            error = e
        self.bytes_written += segment.stats.size_bytes - before
        self.segments_closed += 1
        self.finisher.submit(segment.stats.path)
        if error is not None:
            self.close_errors += 1
            raise SessionLogError(f"{segment.stats.path}: cannot close segment: {error.strerror}") from error

    def finish(self) -> None:
        """Close the last segment (an empty one is removed) and wait until every segment is final.

        Raises:
            SessionLogError: as :meth:`close_current`; compression still ends.
        """
        segment = self.segment
        try:
            if segment is not None and segment.stats.size_bytes == 0:
                self.segment = None
                segment.discard()
            elif segment is not None:
                self.close_current()
        finally:
            self.finisher.close()

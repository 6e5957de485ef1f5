"""The session log as the recorder writes it: a step's lines at once, rotation between steps.

Lines queue in Tables.out while a step records; :meth:`LogSink.flush`
writes them at the end of the step.  A failed write keeps them (bounded by
Config.pending_lines_max_bytes, the oldest dropped first) for the next step.
Rotation asked from another thread (the control socket) happens on the
recording thread, between steps.
"""

from __future__ import annotations

import collections
import logging
import threading
from pathlib import Path
from typing import Callable

from buildidd import clock
from buildidd.capture.tables import Stats, Tables
from buildidd.config import Config
from buildidd.errors import SessionLogError
from buildidd.sessionlog import SessionWriter

log = logging.getLogger(__name__)


class LogSink:
    """Writes Tables.out to a SessionWriter; counts failures in stats and last_errors.

    Args:
        tables: where the lines queue.
        stats: log_write_errors, log_lines_dropped.
        last_errors: a bounded deque of {"time_ns", "error"} dicts.
    """

    def __init__(self, tables: Tables, stats: Stats, last_errors: collections.deque):
        self.tables = tables
        self.stats = stats
        self.last_errors = last_errors
        self.writer: SessionWriter | None = None
        self.max_pending_bytes = 0
        self._rotate_wanted = threading.Event()
        self._rotate_done = threading.Event()

    def open(self, session_dir: Path, config: Config) -> None:
        """Create the session's writer (Raises SessionLogError: the directory cannot be made)."""
        self.max_pending_bytes = config.pending_lines_max_bytes
        self.writer = SessionWriter(session_dir, max_segment_bytes=config.segment_max_bytes,
                                    max_segment_age_s=config.segment_max_age_s, compress=config.compress)
        self.writer.write_behind.set_window(config.segment_cache_bytes)
        self.writer.set_max_pending_bytes(config.pending_lines_max_bytes)

    def set_limits(self, config: Config) -> None:
        """Apply reloaded rotation limits (from the next segment), the pending-lines bound and the
        page-cache window."""
        self.max_pending_bytes = config.pending_lines_max_bytes
        if self.writer is not None:
            self.writer.set_limits(config.segment_max_bytes, config.segment_max_age_s)
            self.writer.set_max_pending_bytes(config.pending_lines_max_bytes)
            self.writer.write_behind.set_window(config.segment_cache_bytes)

    def flush(self) -> None:
        """Write the queued lines; on failure keep them (bounded) for the next call."""
        tables = self.tables
        if not tables.out or self.writer is None:
            return
        try:
            self.writer.write_block(tables.out, tables.out.lines)
        except SessionLogError as e:
            self.stats.log_write_errors += 1
            self.last_errors.append({"time_ns": clock.boot_ns(), "error": f"session log: {e}"})
            if self.stats.log_write_errors <= 3 or self.stats.log_write_errors % 1000 == 0:
                log.warning("session log write failed (%d times): %s", self.stats.log_write_errors, e)
            self.stats.log_lines_dropped += tables.drop_oldest_lines(self.max_pending_bytes)
            return
        tables.out.clear()

    def rotate(self) -> None:
        """Flush, close the current segment (compressed in the background) and start the next.

        A failure (fsync or close of the old segment) is counted in last_errors;
        the writer carries on in a new segment.
        """
        self.flush()
        if self.writer is not None:
            try:
                self.writer.rotate()
            except SessionLogError as e:
                self.stats.log_write_errors += 1
                self.last_errors.append({"time_ns": clock.boot_ns(), "error": f"rotate: {e}"})

    def request_rotate(self, timeout_s: float, wake: Callable[[], None] | None = None) -> bool:
        """Ask the recording thread to rotate at its next step (wake: ends its quiet wait, called
        once asked); True once done (any thread)."""
        self._rotate_done.clear()
        self._rotate_wanted.set()
        if wake is not None:
            wake()
        return self._rotate_done.wait(timeout_s)

    def rotate_pending(self) -> bool:
        """True when another thread asked for a rotation that has not happened yet."""
        return self._rotate_wanted.is_set()

    def rotate_if_requested(self) -> None:
        """On the recording thread, after a step: rotate when another thread asked."""
        if self._rotate_wanted.is_set():
            self._rotate_wanted.clear()
            try:
                self.rotate()
            finally:
                self._rotate_done.set()

    def current_segment(self) -> str | None:
        """Path of the segment being written, or None."""
        return self.writer.stats.get("current_segment") if self.writer is not None else None

    def stats_or_none(self) -> dict | None:
        """The writer's counters (JSON-ready), or None before open / after close."""
        return dict(self.writer.stats) if self.writer is not None else None

    def close(self) -> None:
        """Flush and close the writer (idempotent)."""
        if self.writer is not None:
            self.flush()
            self.writer.close()
            self.writer = None

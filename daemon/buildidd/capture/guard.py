"""Keeping the recording loop honest: its own failures bounded, its progress visible, shutdown bounded.

One event that cannot be recorded is counted by the part that met it
(tables.Stats.event_error) and the loop goes on.  A step that fails as a
whole (the rings, the fast path, the log) is counted here; FAILURES_MAX in a
row end the session with an ``end`` record that says why.  The time of the
last completed step is what the systemd watchdog is pinged on
(cli/record.py): a thread stuck in a step stops the pings and systemd
restarts the unit instead of a hung daemon looking alive.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from buildidd.errors import BuildiddError

log = logging.getLogger(__name__)


class LoopGuard:
    """Consecutive step failures and the time of the last completed step.

    Attributes:
        last_progress: time.monotonic() when the last step completed (or the guard was made).
        loop_errors: steps that failed, by exception type name.
        end_reason: why the loop gave up, or None.
    """

    #: Steps failing in a row that end the session.
    FAILURES_MAX = 50
    #: Seconds between two log lines about failing steps.
    LOG_EVERY_S = 10.0

    def __init__(self):
        self.last_progress = time.monotonic()
        self.loop_errors: dict[str, int] = {}
        self.end_reason: str | None = None
        self._in_a_row = 0
        self._next_log = 0.0

    def step_done(self) -> None:
        """A step completed."""
        self._in_a_row = 0
        self.last_progress = time.monotonic()

    def step_failed(self, e: Exception) -> None:
        """A step raised e: count it, log it (rate-limited).

        Raises:
            BuildiddError: FAILURES_MAX steps failed in a row (end_reason says so).
        """
        name = type(e).__name__
        self.loop_errors[name] = self.loop_errors.get(name, 0) + 1
        self._in_a_row += 1
        now = time.monotonic()
        if now >= self._next_log:
            self._next_log = now + self.LOG_EVERY_S
            log.error("recording step failed (%d in a row): %s: %s", self._in_a_row, name, e, exc_info=e)
        if self._in_a_row >= self.FAILURES_MAX:
            self.end_reason = f"{self._in_a_row} recording steps failed in a row; the last: {name}: {e}"
            raise BuildiddError(self.end_reason) from e

    def progressing(self, within_s: float) -> bool:
        """True when a step completed within the last within_s seconds."""
        return time.monotonic() - self.last_progress <= within_s


def call_within(fn: Callable[[], None], timeout_s: float, name: str) -> bool:
    """Run fn on a daemon thread and wait at most timeout_s seconds; True when it returned.

    For a shutdown step that may block on a file (the snapshotter copying
    from a slow file system): the process then exits without it.  An
    exception fn raises is logged.
    """
    def run():
        try:
            fn()
        except Exception as e:     # logged: the thread has no caller to raise to
            log.error("%s failed: %s", name, e, exc_info=e)

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        log.warning("%s did not finish within %.1f s; left behind", name, timeout_s)
        return False
    return True

"""The store's counters and its rate-limited warnings, shared by its parts (one per Store)."""

from __future__ import annotations

import logging
import time

log = logging.getLogger("buildidd.store")

COUNTER_NAMES = (
    "added", "already_present", "verify_failed", "identity_mismatch", "copy_errors",
    "reflinks", "bytes_copied", "debuginfo_added", "debuginfo_mismatch", "debuginfo_errors",
    "kallsyms_added", "removed", "removed_bytes", "log_suppressed",
    "conflicts", "promoted", "alts_added", "untrusted", "private",
    "skipped_too_large", "skipped_quota", "skipped_uid_share", "skipped_alt_limit", "evicted", "evicted_in_use",
    "evicted_for_root")
"""Every counter of :attr:`Tally.counters`; :class:`buildidd.store.Store` documents each."""


class Tally:
    """Counts since construction, by name, and warnings logged at a limited rate.

    Attributes:
        counters: ``{name: count}`` for every name of :data:`COUNTER_NAMES`.
    """

    #: Warnings logged per :data:`LOG_WINDOW_S`, at most; the rest are counted (``log_suppressed``).
    LOG_BURST = 10
    LOG_WINDOW_S = 60.0

    def __init__(self) -> None:
        self.counters: dict[str, int] = dict.fromkeys(COUNTER_NAMES, 0)
        self._log_window_start = 0.0
        self._log_count = 0

    def count(self, name: str, n: int = 1) -> None:
        """Add n to the counter name (one of :data:`COUNTER_NAMES`)."""
        self.counters[name] += n

    def warn(self, msg: str, *args) -> None:
        """log.warning at most LOG_BURST times per LOG_WINDOW_S seconds; the rest are counted."""
        now = time.monotonic()
        if now - self._log_window_start >= self.LOG_WINDOW_S:
            self._log_window_start = now
            self._log_count = 0
        if self._log_count < self.LOG_BURST:
            self._log_count += 1
            log.warning(msg, *args)
        else:
            self.counters["log_suppressed"] += 1


class LogLimiter:
    """Per-file log lines limited per key (e.g. a refusal's reason): the first :attr:`burst` lines of
    a key in each :attr:`window_s` seconds are logged, the rest counted, and the count of a window is
    logged in one line when the key's next window opens (or :meth:`flush` is called).

    Attributes:
        suppressed: lines not logged, by key, since construction.
    """

    def __init__(self, logger: logging.Logger, burst: int = 3, window_s: float = 60.0):
        self.logger = logger
        self.burst = burst
        self.window_s = window_s
        self.suppressed: dict[str, int] = {}
        self._windows: dict[str, list] = {}    # key -> [window start (monotonic s), logged, suppressed]

    def log(self, key: str, level: int, msg: str, *args) -> bool:
        """Log msg % args at level unless key's burst is used up in this window; True when logged."""
        now = time.monotonic()
        w = self._windows.get(key)
        if w is None or now - w[0] >= self.window_s:
            if w is not None:
                self._summary(key, w)
            w = self._windows[key] = [now, 0, 0]
        if w[1] < self.burst:
            w[1] += 1
            self.logger.log(level, msg, *args)
            return True
        w[2] += 1
        self.suppressed[key] = self.suppressed.get(key, 0) + 1
        return False

    def flush(self) -> None:
        """Log the count of every window's suppressed lines (e.g. at shutdown)."""
        for key, w in self._windows.items():
            self._summary(key, w)
        self._windows.clear()

    def _summary(self, key: str, w: list) -> None:
        if w[2]:
            self.logger.log(logging.WARNING, "%d more lines like the above (%s) in %.0f s not logged one by one; "
                            "counted in buildidd status", w[2], key, min(self.window_s, time.monotonic() - w[0]))
            w[2] = 0

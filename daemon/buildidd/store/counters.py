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
    "skipped_too_large", "skipped_quota", "skipped_uid_share", "skipped_alt_limit", "evicted", "evicted_in_use")
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

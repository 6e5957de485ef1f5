"""Coverage: which build-ids a session named, and why the store lacks any of them.

Every build-id the recorder writes into a mapping record is *named*; the
hand-over and the snapshot worker then say what became of it: *held* (copied
now, or a copy was there already) or a *gap* with its reason.  At the end of
a session (and in ``status``) every named build-id that the store does not
hold is listed with the last reason given for it, so that no missing binary
goes uncounted.  The reasons (:data:`GAP_REASONS`) are fixed strings; the
store's own refusals (``quota``, ``uid_share``, ``too_large``, ``alt_limit``)
pass through under their own names.  A file without a GNU build-id is tracked
under its htlhash (``file_id``), the key the store keeps it under.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["Coverage", "GAP_REASONS", "HELD"]

HELD = "held"
"""The state of a build-id the store holds (copied, or present already)."""

GAP_REASONS = {
    "replaced_before_pin": "the process was gone and its path named another file before the file was reached",
    "process_gone": "the process was gone and its path too before the file was reached",
    "unreachable": "no route to the file (refused, or its identity no longer matched)",
    "handover_dropped": "the hand-over queue was full",
    "queue_full": "the snapshot queue was full",
    "uid_budget": "the uid that mapped or exec'd it held its share of the hand-over or snapshot queue "
                  "(queue_uid_share)",
    "file_cap": "no descriptor was left for it (pinned files at their cap) and its path no longer served",
    "gone": "queued without a descriptor, and by the copy its path named another file",
    "failed": "the copy failed (I/O error, full disk)",
    "shutdown": "the daemon stopped before it was copied (stop budget spent)",
    "in_progress": "a hand-over or copy is still under way (status only)",
    "quota": "the store's quota",
    "uid_share": "its owner's share of the store",
    "too_large": "over store_file_max_bytes",
    "alt_limit": "too many other contents claim this build-id",
}
"""Gap reason → what it means (README's table)."""

MISSING_LISTED_MAX = 1000
"""Gaps listed one by one in a report at most (all are counted)."""


class Coverage:
    """The ledger of one session's build-ids (see the module docstring); any thread.

    Args:
        max_entries: build-ids tracked at most; beyond, new ones are counted (``untracked``) only.
    """

    def __init__(self, max_entries: int = 1 << 20):
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._state: dict[str, tuple[str, str]] = {}     # build-id hex -> (state, path)
        self.untracked = 0

    def named(self, build_id: str, path: str) -> None:
        """The session wrote build_id (hex) for a mapping of path (recording thread; a dict lookup)."""
        if build_id in self._state:
            return
        with self._lock:
            if len(self._state) >= self.max_entries:
                self.untracked += 1
                return
            self._state.setdefault(build_id, ("in_progress", path))

    def outcome(self, build_id: str, state: str, path: str | None = None) -> None:
        """What became of build_id: :data:`HELD` or a gap reason.  A gap never replaces HELD (a
        later sighting that failed does not undo a copy)."""
        with self._lock:
            old = self._state.get(build_id)
            if old is None:
                if len(self._state) >= self.max_entries:
                    self.untracked += 1
                    return
                old = ("in_progress", path or "")
            if old[0] == HELD and state != HELD:
                return
            self._state[build_id] = (state, path or old[1])

    def state(self, build_id: str) -> str | None:
        """build_id's state (HELD, a gap reason, ``in_progress``), or None when not named."""
        got = self._state.get(build_id)
        return got[0] if got else None

    def report(self, holds: Callable[[str], bool], *, final: bool) -> dict:
        """Counts and the gaps (JSON-ready).

        Args:
            holds: True when the store holds a build-id (Store.contains); asked of every
                build-id not known to be held.
            final: the session is over: what is still ``in_progress`` counts as ``shutdown``.
        Returns:
            {"named": n, "held": n, "gaps": {reason: n}, "missing": [{"build_id", "path",
            "reason"}, ...] (at most MISSING_LISTED_MAX), "untracked": n}.
        """
        with self._lock:
            items = list(self._state.items())
        held, gaps, missing = 0, {}, []
        for bid, (state, path) in items:
            if state == HELD or _holds(holds, bid):
                held += 1
                continue
            if final and state == "in_progress":
                state = "shutdown"
            gaps[state] = gaps.get(state, 0) + 1
            if len(missing) < MISSING_LISTED_MAX:
                missing.append({"build_id": bid, "path": path, "reason": state})
        return {"named": len(items), "held": held, "gaps": gaps, "missing": missing,
                "untracked": self.untracked}


def _holds(holds: Callable[[str], bool], bid: str) -> bool:
    try:
        return holds(bid)
    except (OSError, ValueError):
        return False

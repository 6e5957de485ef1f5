"""Housekeeping: session retention, then the store quota, never dropping what a kept session references.

It joins the two siblings below capture: the session log says which sessions
to delete and which build-ids the kept ones reference
(:func:`buildidd.sessionlog.enforce_retention`,
:func:`buildidd.sessionlog.session_build_ids`); the store removes the least
recently referenced entries that none of them reference
(:meth:`buildidd.store.Store.enforce_quota`).  The snapshot worker runs it
(:class:`buildidd.store.Snapshotter`'s ``housekeeping`` callable); without a
store, :class:`RetentionTimer` runs the retention alone on its own thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from buildidd.errors import SessionLogError
from buildidd.sessionlog import enforce_retention, session_build_ids
from buildidd.store import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetentionPolicy:
    """Which sessions to keep.

    Attributes:
        session_root: the directory holding the sessions; ``None``: no
            retention, and only the current session's build-ids are protected.
        current_session: the session being written (never deleted; its
            build-ids come from the snapshotter, not from reading it).
        max_age_s: seconds since a session was last written; ``None``: no limit.
        max_total_bytes: bytes of all sessions together; ``None``: no limit.
    """

    session_root: str | os.PathLike | None = None
    current_session: str | os.PathLike | None = None
    max_age_s: float | None = None
    max_total_bytes: int | None = None


class Housekeeping:
    """Retention and quota, as a :data:`buildidd.store.snapshotter.Housekeeping` callable.

    Remembers each closed session's build-ids (a closed session does not
    change), so a session is read once per daemon run.
    """

    def __init__(self, store: Store, policy: RetentionPolicy):
        self.store = store
        self.session_root = Path(policy.session_root) if policy.session_root else None
        self.current_session = Path(policy.current_session) if policy.current_session else None
        self.max_age_s = policy.max_age_s
        self.max_total_bytes = policy.max_total_bytes
        self._session_ids: dict[str, set[str]] = {}   # closed session name → its build-ids

    def __call__(self, referenced: set[str], stats: dict[str, int]) -> None:
        """Delete expired sessions, then enforce the store's quota protecting every build-id still referenced.

        Args:
            referenced: build-ids the current session references (hex); read, not changed.
            stats: counters; ``retention_removed`` (sessions deleted) and
                ``quota_removed`` (store entries removed) are added to.

        Raises:
            SessionLogError: a session cannot be listed, read or deleted.
            StoreError: an entry cannot be removed.
        """
        if self.session_root is not None and self.session_root.is_dir():
            keep = {self.current_session} if self.current_session else set()
            removed = enforce_retention(self.session_root, max_age_s=self.max_age_s,
                                        max_total_bytes=self.max_total_bytes, keep=keep)
            stats["retention_removed"] += len(removed)
        protected = set(referenced)
        if self.session_root is not None and self.session_root.is_dir():
            for sdir in self.session_root.iterdir():
                if not sdir.is_dir() or (self.current_session and sdir == self.current_session):
                    continue
                ids = self._session_ids.get(sdir.name)
                if ids is None:
                    ids = self._session_ids[sdir.name] = session_build_ids(sdir)
                protected |= ids
        stats["quota_removed"] += len(self.store.enforce_quota(protected))


class RetentionTimer:
    """Session retention on a thread of its own, for a recorder without a store.

    With a store, :class:`Housekeeping` runs on the snapshotter's thread; without
    one nothing else would delete old sessions.  Runs retention at once, then
    every ``interval_s`` seconds, until ``should_stop()`` is true (checked every
    second).  A failure is logged and retried at the next interval.

    Args:
        policy: which sessions to keep (its ``session_root`` must be set).
        interval_s: seconds between two runs.
        should_stop: true once the session is closed (e.g. the recorder's log writer is gone).
    """

    def __init__(self, policy: RetentionPolicy, interval_s: float, should_stop: Callable[[], bool]):
        self.policy = policy
        self.interval_s = interval_s
        self.should_stop = should_stop
        self.removed = 0
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="buildidd-retention", daemon=True)

    def start(self) -> RetentionTimer:
        """Start the thread; returns self."""
        self._thread.start()
        return self

    def run_once(self) -> None:
        """Delete the sessions the policy says to; never raises (the error is kept in last_error)."""
        p = self.policy
        if p.session_root is None or not os.path.isdir(p.session_root):
            return
        keep = {p.current_session} if p.current_session else set()
        try:
            self.removed += len(enforce_retention(p.session_root, max_age_s=p.max_age_s,
                                                  max_total_bytes=p.max_total_bytes, keep=keep))
        except SessionLogError as e:
            self.last_error = str(e)
            log.warning("session retention failed: %s", e)

    def _run(self) -> None:
        next_run = 0.0
        while not self.should_stop():
            if time.monotonic() >= next_run:
                self.run_once()
                next_run = time.monotonic() + self.interval_s
            time.sleep(1.0)


def retention_without_store(cfg, session_dir: Path, should_stop: Callable[[], bool]) -> RetentionTimer:
    """A started :class:`RetentionTimer` for the sessions beside ``session_dir`` (Config ``cfg``'s
    limits, the snapshotter's housekeeping interval)."""
    from buildidd.store import SnapshotPolicy

    policy = RetentionPolicy(session_root=session_dir.parent, current_session=session_dir,
                             max_age_s=cfg.session_max_age_s or None,
                             max_total_bytes=cfg.session_max_total_bytes or None)
    return RetentionTimer(policy, SnapshotPolicy.housekeeping_interval_s, should_stop).start()

"""Housekeeping: session retention, then the store quota, never dropping what a kept session references.

It joins the two siblings below capture: the session log says which sessions
to delete and which build-ids the kept ones reference
(:func:`buildidd.sessionlog.enforce_retention`,
:func:`buildidd.sessionlog.session_build_ids`); the store removes the least
recently referenced entries that none of them reference
(:meth:`buildidd.store.Store.enforce_quota`).  The snapshot worker runs it
(:class:`buildidd.store.Snapshotter`'s ``housekeeping`` callable).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from buildidd.sessionlog import enforce_retention, session_build_ids
from buildidd.store import Store


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

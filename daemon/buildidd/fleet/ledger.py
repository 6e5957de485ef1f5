"""The ledger: what this host knows the bucket holds, so that each build-id is checked once and then never.

Objects in the bucket never change (a canonical one is never overwritten), so
an answer, once had, holds for good.  The ledger is one SQLite database per
destination (endpoint, bucket, prefix, host), ``STATE_DIR/ledger-<sha>.sqlite``,
root's and 0600, with three tables:

``done(name, stamp)``        a store entry (name ``entry:HEX:canonical|host``) or a session file
                             (``session:NAME/FILE``) fully pushed, with what it was then (the entry's
                             origin stamp and the push policy; the segment's size): a changed stamp
                             means push again
``counters(name, value)``    cumulative counts (bytes sent, objects, conflicts, errors by cause, ...)
``uploads(upload_id, key)``  multipart uploads begun and not yet completed or aborted: a pass aborts
                             those a failure or a crash left (their parts take space in the bucket)

It survives restarts: the local store and sessions are the queue, the ledger
says how far the queue was pushed.  Writes are committed at once (a crash
loses at most the answer being written; the next pass asks again).
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import threading
from pathlib import Path

from buildidd.errors import PushError

__all__ = ["Ledger", "ledger_path"]


def ledger_path(state_dir: str | os.PathLike, destination: str) -> Path:
    """``STATE_DIR/ledger-<first 16 hex of sha256(destination)>.sqlite``: one ledger per destination."""
    return Path(state_dir) / f"ledger-{hashlib.sha256(destination.encode()).hexdigest()[:16]}.sqlite"


class Ledger:
    """The state of pushes to one destination (see the module docstring); thread-safe.

    Args:
        path: the database file (its directory is made 0700 when absent).
        destination: what it describes (stored, and checked on open).

    Raises:
        PushError: ``config``: the database cannot be opened or is another destination's.
    """

    def __init__(self, path: str | os.PathLike, destination: str):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            os.close(fd)
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("CREATE TABLE IF NOT EXISTS done (name TEXT PRIMARY KEY, stamp TEXT NOT NULL)")
            self._db.execute("CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL)")
            self._db.execute("CREATE TABLE IF NOT EXISTS uploads (upload_id TEXT PRIMARY KEY, key TEXT NOT NULL)")
            self._db.execute("CREATE TABLE IF NOT EXISTS about (name TEXT PRIMARY KEY, value TEXT NOT NULL)")
            self._db.execute("INSERT OR IGNORE INTO about VALUES ('destination', ?)", (destination,))
            (have,) = self._db.execute("SELECT value FROM about WHERE name = 'destination'").fetchone()
        except (OSError, sqlite3.Error) as e:
            raise PushError("config", f"{self.path}: cannot open the push ledger: {e}") from e
        if have != destination:
            raise PushError("config", f"{self.path}: a ledger of {have!r}, not {destination!r}")
        self._lock = threading.Lock()

    def stamp(self, name: str) -> str | None:
        """The stamp name was pushed with, or None."""
        with self._lock:
            row = self._db.execute("SELECT stamp FROM done WHERE name = ?", (name,)).fetchone()
        return row[0] if row else None

    def stamps(self, prefix: str) -> dict[str, str]:
        """Every done name starting with prefix, and its stamp."""
        with self._lock:
            rows = self._db.execute("SELECT name, stamp FROM done WHERE name >= ? AND name < ?",
                                    (prefix, prefix + "\uffff")).fetchall()
        return dict(rows)

    def mark(self, name: str, stamp: str) -> None:
        """Record name as pushed with stamp (replacing an older stamp)."""
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO done VALUES (?, ?)", (name, stamp))

    def add(self, counts: dict[str, int]) -> None:
        """Add counts to the cumulative counters."""
        with self._lock:
            self._db.executemany("INSERT INTO counters VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET "
                                 "value = value + excluded.value", [(k, v) for k, v in counts.items() if v])

    def counters(self) -> dict[str, int]:
        """The cumulative counters, by name."""
        with self._lock:
            return dict(self._db.execute("SELECT name, value FROM counters ORDER BY name").fetchall())

    def begin_upload(self, key: str, upload_id: str) -> None:
        """Remember a multipart upload begun (before its first part is sent)."""
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO uploads VALUES (?, ?)", (upload_id, key))

    def end_upload(self, upload_id: str) -> None:
        """Forget a multipart upload completed or aborted."""
        with self._lock:
            self._db.execute("DELETE FROM uploads WHERE upload_id = ?", (upload_id,))

    def uploads(self) -> list[tuple[str, str]]:
        """(key, upload_id) of the multipart uploads begun and never ended."""
        with self._lock:
            return [(k, u) for u, k in self._db.execute("SELECT upload_id, key FROM uploads").fetchall()]

    def close(self) -> None:
        with self._lock:
            self._db.close()

"""What the snapshotter remembers of a session's sightings, bounded in bytes.

:class:`Sightings`: the sightings (resolve.resolution.Sighting) submitted this
session (a sighting is queued once) and their build-ids (the live session's
references, which housekeeping keeps).  :class:`SettledMemory`: what
SettledView.settled() found for a build-id (:class:`Settled`), so that a later
sighting is answered from a readlink and a stat.  A user picks how long the
paths they map are (up to PATH_MAX) and how many distinct files they map: each
memory is bounded in bytes (paths and build-ids counted by length,
memo.text_bytes, plus a constant per entry), not only in entries.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

from buildidd.kernel.events import Identity
from buildidd.memo import text_bytes
from buildidd.resolve.resolution import Sighting
from buildidd.store.origin import Origin

__all__ = ["Settled", "SettledMemory", "Sightings", "SourceFile", "file_of"]

#: Bytes of one remembered sighting, or of one build-id, besides its text (the tuple, two ints, the
#: set slot).
SEEN_FIXED_BYTES = 200
#: Bytes of one settled answer besides its paths (the Settled tuple, its Origin and stamp, the entry).
SETTLED_FIXED_BYTES = 1200


class SourceFile(NamedTuple):
    """What names one unchanged source file (compared whole, as a tuple, with an origin's facts)."""
    path: str
    dev: int
    ino: int
    size: int                   #: bytes
    mtime_ns: int
    ctime_ns: int


def file_of(ident: Identity | None, path: str | None) -> SourceFile | None:
    """The SourceFile of a sighting (its identity and path), or None when either is unknown."""
    if ident is None or path is None:
        return None
    return SourceFile(path, ident.dev, ident.ino, ident.size, ident.mtime_ns, ident.ctime_ns)


class Settled(NamedTuple):
    """What SettledView.settled() found for a build-id, remembered while its stamp holds."""
    found_at: float             #: time.monotonic() when found settled
    stamp: tuple                #: the entry's Store.origin_stamp then
    touched_at: float           #: time.monotonic() of the last touch (0.0: none yet)
    source: SourceFile | None   #: the file it is settled for (file_of), None for every one
    origin: Origin              #: the entry's origin.json as read then


def settled_cost(build_id: str, found: Settled) -> int:
    """Bytes one settled answer holds: its build-id, the sighting's path and the origin's path by
    length, plus SETTLED_FIXED_BYTES."""
    source_path = found.source.path if found.source else None
    return text_bytes(build_id) + text_bytes(source_path) + text_bytes(found.origin.path) + SETTLED_FIXED_BYTES


class Sightings:
    """The sightings submitted this session, and their build-ids.  No lock of its own: its one
    owner (Snapshotter) holds its lock (Snapshotter._cv) around every call and read.

    Args:
        max_entries: sightings kept at most.
        max_bytes: bytes kept at most (sightings and build-ids; see the module docstring).
    Attributes:
        build_ids: the set of build-ids submitted (the housekeeping's ``referenced``; read it).
        bytes: what the sightings and build-ids hold (estimate).
    """

    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.build_ids: set[str] = set()
        self._sightings: set[Sighting] = set()
        self.bytes = 0

    def __contains__(self, seen: Sighting) -> bool:
        return seen in self._sightings

    def __len__(self) -> int:
        return len(self._sightings)

    def add(self, seen: Sighting) -> bool:
        """Remember seen and its build-id; False (nothing kept) when that would pass max_entries or
        max_bytes."""
        build_id = seen.build_id
        cost = text_bytes(seen.path) + SEEN_FIXED_BYTES
        if build_id not in self.build_ids:
            cost += text_bytes(build_id) + SEEN_FIXED_BYTES
        if len(self._sightings) >= self.max_entries or self.bytes + cost > self.max_bytes:
            return False
        self.build_ids.add(build_id)
        self._sightings.add(seen)
        self.bytes += cost
        return True

    def memory(self) -> dict:
        """{"entries", "build_ids", "bytes", "max_bytes"} (JSON-ready)."""
        return {"entries": len(self._sightings), "build_ids": len(self.build_ids), "bytes": self.bytes,
                "max_bytes": self.max_bytes}


class SettledMemory:
    """build-id -> Settled, within max_entries and max_bytes (settled_cost each); beyond either, the
    memory is dropped whole first (an answer is only read again from the store).  Any thread."""

    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        #: Guarded by _lock.
        self._found: dict[str, Settled] = {}
        #: Guarded by _lock.
        self.bytes = 0

    def get(self, build_id: str) -> Settled | None:
        """What was found for build_id, or None (one dict lookup)."""
        with self._lock:
            return self._found.get(build_id)

    def __getitem__(self, build_id: str) -> Settled:
        with self._lock:
            return self._found[build_id]

    def __len__(self) -> int:
        with self._lock:
            return len(self._found)

    def put(self, build_id: str, found: Settled) -> None:
        """Keep found for build_id (replacing what was)."""
        cost = settled_cost(build_id, found)
        with self._lock:
            old = self._found.get(build_id)
            if old is not None:
                self.bytes -= settled_cost(build_id, old)
            if len(self._found) >= self.max_entries or self.bytes + cost > self.max_bytes:
                self._found.clear()
                self.bytes = 0
            self._found[build_id] = found
            self.bytes += cost

    def memory(self) -> dict:
        """{"entries", "bytes", "max_bytes"} (JSON-ready)."""
        with self._lock:
            return {"entries": len(self._found), "bytes": self.bytes, "max_bytes": self.max_bytes}

"""The settled-file view of the store: whether a sighting needs its file copied at all.

A sighting is *settled* when the store needs no file for it: the store holds
a trusted, public copy of its build-id (nothing another file could improve),
or its main copy was made from that very file, unchanged since.  A settled
sighting only touches its entry (the quota's recency).  Asked by the
hand-over workers (resolve.handover.StoreView: a call back from resolve into
the store, given to the hand-over job's constructor) and by the snapshot
thread, and cheap enough for the recording thread: while an answer is
remembered (:class:`~buildidd.store.sightings.SettledMemory`), one dict lookup and
one ``stat`` of the store's own entry (Store.origin_stamp), never a call on a
user's path.
"""

from __future__ import annotations

import time

from buildidd.errors import StoreError
from buildidd.kernel.events import Identity
from buildidd.store.sightings import Settled, SettledMemory, file_of
from buildidd.store.store import Store

__all__ = ["SETTLED_TTL_S", "SettledView"]

#: Seconds a settled answer is kept while its entry's stamp is unchanged, and between two touches of
#: a settled entry (the quota's recency needs no finer grain).
SETTLED_TTL_S = 300.0
#: Settled answers kept at most (the memory is dropped whole beyond).
SETTLED_MAX = 65536
#: ... and the bytes they hold at most (sightings.settled_cost): each keeps the sighting's path and
#: its origin's.
SETTLED_MAX_BYTES = 2 << 20


class SettledView:
    """The store, as a hand-over or a copy asks it whether a file is needed (see the module docstring).

    Args:
        store: the Store read (Store.stamped_origin, origin_stamp, origin, touch: each safe from
            any thread).
    Thread safety: any thread may call every method.  The only mutable field, the memory of
    answers, is a SettledMemory, which guards itself (its own lock); two threads that find the
    same answer at once both store it, the same value.
    """

    def __init__(self, store: Store):
        self.store = store
        #: build-id -> what settled() found (Settled): settled() and stored_file_id() answer again
        #: from a readlink and a stat while the stamp is the same.  Guards itself.
        self.answers = SettledMemory(SETTLED_MAX, SETTLED_MAX_BYTES)

    def settled(self, build_id: str, ident: Identity | None = None, path: str | None = None) -> bool:
        """True when a sighting of build_id (hex) needs no file: the store holds a trusted, public
        copy (nothing another file could improve), or, given the sighting's file (ident, path), its
        main copy was made from that very file, unchanged since (same path, dev, inode, size, mtime
        and ctime: the owner and mode are the same, so its origin facts would be too).

        Reads the store's entry once (Store.stamped_origin); while its Store.origin_stamp stays the
        same (no removal, eviction or new copy since), for SETTLED_TTL_S, the answer is
        remembered.  Any thread may ask; an error reading the store is a False."""
        try:
            known = self.answers.get(build_id)
            if known is not None and time.monotonic() - known.found_at < SETTLED_TTL_S \
                    and known.source in (None, file_of(ident, path)) \
                    and known.stamp == self.store.origin_stamp(build_id):
                return True
            found = self.store.stamped_origin(build_id)
        except (ValueError, OSError, StoreError):
            return False
        if found is None:
            return False
        stamp, present = found
        if present.trusted and not present.private:
            source = None                   # settled for every sighting
        elif present.ctime_ns and file_of(ident, path) == (present.path, present.dev, present.ino,
                                                            present.size_bytes, present.mtime_ns, present.ctime_ns):
            source = file_of(ident, path)   # settled for this file only
        else:
            return False
        self.answers.put(build_id, Settled(time.monotonic(), stamp, known.touched_at if known else 0.0, source,
                                          present))
        return True

    def touch(self, build_id: str) -> None:
        """Store.touch a settled entry (its recency for the quota), at most once per SETTLED_TTL_S.

        Raises:
            StoreError, ValueError: as Store.touch (the entry was evicted since, say).
        """
        known = self.answers.get(build_id)
        now = time.monotonic()
        if known is not None and now - known.touched_at < SETTLED_TTL_S:
            return
        self.store.touch(build_id)
        if known is not None:
            self.answers.put(build_id, known._replace(touched_at=now))

    def stored_file_id(self, build_id: str, ident: Identity) -> str | None:
        """The htlhash (32 hex) the store recorded for build_id's main copy when that copy was made from
        this very file (origin's dev, inode, size and mtime equal ident's), else None; any thread may ask.
        A settled entry's origin is the one settled() read, while its stamp is the same."""
        try:
            known = self.answers.get(build_id)
            if known is not None and known.stamp == self.store.origin_stamp(build_id):
                o = known.origin
            else:
                o = self.store.origin(build_id)
        except (ValueError, OSError, StoreError):
            return None
        if o is None or not o.file_id or (o.dev, o.ino, o.size_bytes, o.mtime_ns) != (
                ident.dev, ident.ino, ident.size, ident.mtime_ns):
            return None
        return o.file_id

"""Size accounting, recency, the quota and eviction; the sweep of a crash's temporary files.

Recency: :meth:`Quota.touch` sets the entry directory's mtime to now; an
entry's ``last_ref_ns`` is that mtime (ns since the epoch), which is also the
time it was added.  It needs no index file and survives restarts.

Two ways of removing:

* :meth:`Quota.enforce`, run by housekeeping: the least recently referenced
  entries first, never one a retained session references (``protected``).
* :meth:`Quota.reserve`, before each copy, charged to its source's owner: the
  space the copy will take on disk (the source's ``st_blocks * 512``) must fit
  under the quota, and, for an owner other than root, under that owner's share
  of it (``uid_share * quota_bytes``).  To make room it evicts only what
  :mod:`buildidd.store.eviction` allows: for a user's copy that user's own
  entries (unreferenced ones, then referenced ones no process maps); for
  root's copy users' unreferenced entries (the biggest user first), then
  root's own.  An entry evicted although a session references it is counted
  in ``evicted_in_use`` and logged.  When what is allowed would not free
  enough, nothing is evicted and the copy is refused (``uid_share`` or
  ``quota``).

Sizes are what files take on disk (``st_blocks * 512``), kept as running
totals (per owner too) computed by one walk at the first use, so that
:meth:`Quota.size_bytes` answers without walking the store.
"""

from __future__ import annotations

import os
import shutil
import threading
import time

from buildidd.errors import StoreError, StoreRefusedError
from buildidd.fsio import fsync_dir
from buildidd.resolve import procfs
from buildidd.store import eviction
from buildidd.store.counters import Tally
from buildidd.store.layout import KALLSYMS_DSO, TEMP_INFIX, Entry, Layout, alt_dirs, dir_usage, entry_usage
from buildidd.store.origin import read_origin


class Usage:
    """Running totals of what the store takes (apparent and disk bytes, disk bytes per owner other than root).

    The subclass sets ``layout``, ``_lock``, ``_totals`` (None until the first walk) and ``_per_uid``.
    """

    layout: Layout
    _lock: threading.RLock
    _totals: tuple[int, int] | None
    _per_uid: dict[int, int]


    def _ensure_totals(self) -> None:
        if self._totals is not None:
            return
        size = disk = 0
        per_uid: dict[int, int] = {}
        for e in self.layout.entries():
            for unit in [e.directory, *alt_dirs(e.directory)]:
                a, d = dir_usage(unit)
                size, disk = size + a, disk + d
                origin = read_origin(unit)
                if origin is not None and origin.payer != 0:
                    per_uid[origin.payer] = per_uid.get(origin.payer, 0) + d
        self._totals = (size, disk)
        self._per_uid = per_uid

    def account(self, uid: int | None, size_bytes: int, disk_bytes: int) -> None:
        """Add (or, negative, remove) one copy's bytes to the running totals; uid its source's owner."""
        with self._lock:
            if self._totals is None:
                return  # the first use walks the store and sees it
            self._totals = (self._totals[0] + size_bytes, self._totals[1] + disk_bytes)
            if uid:
                self._per_uid[uid] = max(0, self._per_uid.get(uid, 0) + disk_bytes)

    def account_dir(self, unit, uid: int | None, sign: int = 1) -> None:
        """:meth:`account` the files directly in directory unit."""
        a, d = dir_usage(unit)
        self.account(uid, sign * a, sign * d)

    def disk_bytes(self) -> int:
        """Bytes the entries take on disk (``st_blocks * 512``), from the running total."""
        with self._lock:
            self._ensure_totals()
            return self._totals[1]

    def uid_bytes(self, uid: int) -> int:
        """Bytes on disk of the copies whose source uid owned (0 for root: not counted)."""
        with self._lock:
            self._ensure_totals()
            return self._per_uid.get(uid, 0)



class Quota(Usage):
    """Removes entries: one by one, or least recently referenced first while over the quota.

    Attributes:
        quota_bytes: :meth:`enforce`'s limit on :meth:`size_bytes`; ``None``: none.
        over_quota: after :meth:`enforce`, ``True`` when the store still
            exceeds the quota because what is left is protected.
    """

    def __init__(self, layout: Layout, tally: Tally, lock: threading.RLock, quota_bytes: int | None,
                 uid_share: float = 1.0):
        self.layout = layout
        self.tally = tally
        self.quota_bytes = quota_bytes
        self.uid_share = uid_share
        self.over_quota = False
        self._lock = lock
        self._protected: set[str] = set()
        self._totals: tuple[int, int] | None = None   # (apparent, disk) bytes of every entry
        self._per_uid: dict[int, int] = {}             # disk bytes by owner other than root
        self._owners: dict[str, int | None] = {}       # build-id -> owner (self.owner), entries in the store

    # -- room before a copy ------------------------------------------------------

    def reserve(self, need_bytes: int, uid: int, keep_bid: str) -> None:
        """Make sure a copy taking need_bytes on disk, charged to uid, fits; evict to make room.

        The copy must fit under the quota and, for uid other than 0, under uid's
        share of it (``uid_share * quota_bytes``).  To make room it evicts what
        :mod:`buildidd.store.eviction` allows, in its order: for a user only that
        user's own entries, for root users' unreferenced entries (the biggest
        user first), then root's.  When all that is allowed would not free
        enough, nothing is evicted and the copy is refused.

        Args:
            need_bytes: what the copy will take on disk (the source's ``st_blocks * 512``).
            uid: to whom the copy is charged (``Origin.payer``).
            keep_bid: the build-id being added to (never evicted for it).

        Raises:
            StoreRefusedError: ``uid_share`` (the copy does not fit in uid's share even after
                evicting uid's own evictable entries) or ``quota`` (it does not fit under the
                quota); counted as ``skipped_uid_share``, ``skipped_quota``.
            StoreError: an entry cannot be removed.
        """
        with self._lock:
            if self.quota_bytes is None:
                return
            self._ensure_totals()
            share = int(self.uid_share * self.quota_bytes) if uid != 0 and self.uid_share < 1 else None
            held = self._per_uid.get(uid, 0) if uid != 0 else 0
            over_share = held + need_bytes - share if share is not None else 0
            over_quota = self._totals[1] + need_bytes - self.quota_bytes
            want = max(over_share, over_quota)
            if want <= 0:
                return
            hopeless = need_bytes > (share if share is not None else self.quota_bytes)
            chosen, freed = self._plan(uid, keep_bid, want, hopeless)
            if freed < want:
                if freed < over_share:
                    self.tally.count("skipped_uid_share")
                    raise StoreRefusedError("uid_share", f"uid {uid} has {held} bytes in the store, {freed} of them "
                                            f"evictable; {need_bytes} more exceed its share of {share} bytes")
                self.tally.count("skipped_quota")
                raise StoreRefusedError("quota", f"{need_bytes} bytes do not fit under the quota of "
                                        f"{self.quota_bytes} bytes ({self._totals[1]} used, {freed} of them "
                                        f"evictable for uid {uid})")
            for e, referenced in chosen:
                self._evict_one(e, uid, referenced)

    def _plan(self, uid: int, keep_bid: str, want: int, hopeless: bool) -> tuple[list, int]:
        """What to evict for uid's copy (eviction.order, eviction.select); nothing when hopeless."""
        if hopeless:
            return [], 0
        entries = [e for e in self.layout.entries() if e.build_id_hex != keep_bid]
        mapped: set[tuple[int, int]] | None = None

        def is_mapped(e: Entry) -> bool:
            nonlocal mapped
            if mapped is None:
                mapped = mapped_files()
            return _is_mapped(e, mapped)

        candidates = eviction.order(entries, self.owner, uid, self._protected, self._per_uid)
        return eviction.select(candidates, want, is_mapped)

    def _evict_one(self, e: Entry, uid: int, referenced: bool) -> None:
        owner = self.owner(e)
        self.remove(e.build_id_hex)
        self.tally.count("evicted")
        if owner != uid:
            self.tally.count("evicted_for_root")
        if referenced:
            self.tally.count("evicted_in_use")
            self.tally.warn("store %s: evicted %s (%s, uid %s), which a session references, to make room "
                            "for a copy of uid %d", self.layout.root, e.build_id_hex, e.path, owner, uid)

    def owner(self, e: Entry) -> int | None:
        """The uid every copy in entry e comes from (its main copy and alt/*), or None: several, or one
        without an ``origin.json``.  Remembered until the entry changes (:meth:`forget`, :meth:`remove`)."""
        with self._lock:
            if e.build_id_hex in self._owners:
                return self._owners[e.build_id_hex]
            uids = set()
            for unit in [e.directory, *alt_dirs(e.directory)]:
                origin = read_origin(unit)
                uids.add(origin.payer if origin is not None else None)
            found = uids.pop() if len(uids) == 1 else None
            self._owners[e.build_id_hex] = found
            return found

    def forget(self, bid: str) -> None:
        """Entry bid changed (a copy added, promoted, its origin rewritten): its owner is read again."""
        with self._lock:
            self._owners.pop(bid, None)

    def touch(self, bid: str) -> None:
        """Mark an entry referenced now: its directory's mtime (and atime) := now.

        Raises:
            StoreError: the build-id is not in the store, or utime failed.
        """
        directory = self.layout.entry_dir(bid)
        if directory is None:
            raise StoreError(f"{bid}: not in the store")
        now_ns = time.time_ns()
        try:
            os.utime(directory, ns=(now_ns, now_ns))
        except OSError as e:
            raise StoreError(f"{directory}: cannot touch: {e.strerror}") from e

    def size_bytes(self) -> int:
        """Sum of the entries' ``size_bytes`` (apparent), from the running total."""
        with self._lock:
            self._ensure_totals()
            return self._totals[0]

    def remove(self, bid: str) -> int:
        """Remove an entry: its link first (it disappears at once), then its directory.

        Empty parent directories up to the root are removed too (perf's
        ``build_id_cache__remove_s`` leaves them).

        Returns:
            bytes freed (the entry's ``size_bytes``); 0 when it was absent.

        Raises:
            StoreError: the link or directory cannot be removed.
        """
        root = self.layout.root
        with self._lock:
            directory = self.layout.entry_dir(bid)
            link = self.layout.linkname(bid)
            self._owners.pop(bid, None)
            if directory is None:
                return 0
            size = entry_usage(directory)[0]
            for unit in [directory, *alt_dirs(directory)]:
                origin = read_origin(unit)
                self.account_dir(unit, origin.payer if origin is not None else None, -1)
            try:
                os.unlink(link)
                fsync_dir(link.parent)
                shutil.rmtree(directory)
            except OSError as e:
                raise StoreError(f"{bid}: cannot remove: {e.strerror}") from e
            parent = directory.parent
            while parent != root and os.path.commonpath([root, parent]) == str(root):
                try:
                    os.rmdir(parent)
                except OSError:
                    break
                parent = parent.parent
            self.tally.count("removed")
            self.tally.count("removed_bytes", size)
            return size

    def enforce(self, protected: set[str]) -> list[str]:
        """Remove least recently referenced entries not in ``protected`` while over the quota.

        Order: ascending ``last_ref_ns``, then build-id.  A protected entry is
        never removed here, even when that leaves the store over its quota:
        :attr:`over_quota` then says so.  No quota: nothing is removed.
        Sizes are disk bytes (``Entry.disk_bytes``).  ``protected`` is kept
        for :meth:`reserve` (see :mod:`buildidd.store.eviction`).

        Args:
            protected: build-ids (hex, any case) that retained sessions reference.

        Returns:
            The build-ids removed, in removal order.

        Raises:
            TypeError: protected holds something other than str (bytes would
                silently protect nothing).
            StoreError: an entry cannot be removed (those removed before are
                in the exception's ``removed`` attribute).
        """
        keep = set()
        for b in protected:
            if not isinstance(b, str):
                raise TypeError(f"protected build-ids are hex str, got {type(b).__name__}")
            keep.add(b.lower())
        removed: list[str] = []
        with self._lock:
            self._protected = keep
            if self.quota_bytes is None:
                self.over_quota = False
                return removed
            entries = self.layout.entries()
            total = sum(e.disk_bytes for e in entries)
            for e in sorted(entries, key=lambda e: (e.last_ref_ns, e.build_id_hex)):
                if total <= self.quota_bytes:
                    break
                if e.build_id_hex in keep:
                    continue
                try:
                    self.remove(e.build_id_hex)
                    total -= e.disk_bytes
                except StoreError as err:
                    err.removed = removed
                    raise
                removed.append(e.build_id_hex)
            self.over_quota = total > self.quota_bytes
            if self.over_quota:
                self.tally.warn("store %s: %d bytes over its quota of %d bytes, all of it protected",
                                self.layout.root, total - self.quota_bytes, self.quota_bytes)
            return removed

    def sweep_temps(self) -> int:
        """Remove temporary files left by a crash (``.NAME.buildidd-tmp-XXXX``); how many.

        Walks the whole store: call it at start, before adding.  The walk keeps its own stack, not
        Python's: the store mirrors the paths of the files it holds (perf's layout), and a user can
        map a file at a path thousands of directories deep (os.walk recurses once per level).
        """
        count = 0
        with self._lock:
            todo = [str(self.layout.root)]
            while todo:
                directory = todo.pop()
                try:
                    with os.scandir(directory) as it:
                        entries = list(it)
                except OSError as e:
                    self.tally.warn("%s: cannot list: %s", directory, e.strerror)
                    continue
                for entry in entries:
                    # A temporary link to an entry directory is a symlink: listed, never followed.
                    if not (entry.name.startswith(".") and TEMP_INFIX in entry.name):
                        if entry.is_dir(follow_symlinks=False):
                            todo.append(entry.path)
                        continue
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            shutil.rmtree(entry.path)   # a promotion's entry, built aside (see entries)
                        else:
                            os.unlink(entry.path)
                        count += 1
                    except OSError as e:
                        self.tally.warn("%s: cannot remove: %s", entry.path, e.strerror)
        return count


def mapped_files() -> set[tuple[int, int]]:
    """(st_dev, st_ino) of every file some process maps now (every /proc/PID/maps; gone processes skipped)."""
    out: set[tuple[int, int]] = set()
    for pid in procfs.pids():
        try:
            maps = procfs.read_maps(pid)
        except OSError:
            continue
        out.update((m.dev, m.ino) for m in maps if m.ino)
    return out


def _is_mapped(e: Entry, mapped: set[tuple[int, int]]) -> bool:
    """Whether a process maps the source of e's main copy or of one of its alternatives (kernel: always)."""
    if e.path == KALLSYMS_DSO:
        return True
    for unit in [e.directory, *alt_dirs(e.directory)]:
        origin = read_origin(unit)
        if origin is not None and (origin.dev, origin.ino) in mapped:
            return True
    return False

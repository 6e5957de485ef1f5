"""Size accounting, recency, the quota and eviction; the sweep of a crash's temporary files.

Recency: :meth:`Quota.touch` sets the entry directory's mtime to now; an
entry's ``last_ref_ns`` is that mtime (ns since the epoch), which is also the
time it was added.  It needs no index file and survives restarts.

Two ways of removing:

* :meth:`Quota.enforce`, run by housekeeping: the least recently referenced
  entries first, never one a retained session references (``protected``).
* :meth:`Quota.reserve`, before each copy: the space the copy will take on
  disk (the source's ``st_blocks``) must fit under the quota, and, for an
  owner other than root, under that owner's share of it
  (``uid_share * quota_bytes``; refused with ``uid_share``, never evicting for
  it).  To make room it evicts, oldest first, entries nothing protects, then
  entries that sessions reference but no process maps now (their source's
  device and inode are in no /proc/PID/maps), counted in ``evicted_in_use``
  and logged.  When even that is not enough the copy is refused (``quota``).

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
from buildidd.resolve import procfs
from buildidd.store.counters import Tally
from buildidd.store.install import fsync_dir
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
                if origin is not None and origin.uid != 0:
                    per_uid[origin.uid] = per_uid.get(origin.uid, 0) + d
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

    # -- room before a copy ------------------------------------------------------

    def reserve(self, need_bytes: int, uid: int, keep_bid: str) -> None:
        """Make sure a copy taking need_bytes on disk, from a file uid owns, fits; evict to make room.

        Args:
            need_bytes: what the copy will take on disk (the source's ``st_blocks * 512``).
            uid: the source's owner; a uid other than 0 is held to its share.
            keep_bid: the build-id being added to (never evicted for it).

        Raises:
            StoreRefusedError: ``uid_share`` or ``quota`` (counted as ``skipped_uid_share``,
                ``skipped_quota``).
            StoreError: an entry cannot be removed.
        """
        with self._lock:
            if self.quota_bytes is None:
                return
            self._ensure_totals()
            if uid != 0 and self.uid_share < 1:
                share = int(self.uid_share * self.quota_bytes)
                if self._per_uid.get(uid, 0) + need_bytes > share:
                    self.tally.count("skipped_uid_share")
                    raise StoreRefusedError("uid_share", f"uid {uid} has {self._per_uid.get(uid, 0)} bytes in the "
                                            f"store; {need_bytes} more exceed its share of {share} bytes")
            if self._totals[1] + need_bytes > self.quota_bytes:
                self._evict(self._totals[1] + need_bytes - self.quota_bytes, keep_bid)
            if self._totals[1] + need_bytes > self.quota_bytes:
                self.tally.count("skipped_quota")
                raise StoreRefusedError("quota", f"{need_bytes} bytes do not fit under the quota of "
                                        f"{self.quota_bytes} bytes ({self._totals[1]} used, the rest in use)")

    def _evict(self, want_bytes: int, keep_bid: str) -> None:
        """Remove entries, oldest first, until want_bytes are freed: unprotected ones, then unmapped ones."""
        entries = sorted((e for e in self.layout.entries() if e.build_id_hex != keep_bid),
                         key=lambda e: (e.last_ref_ns, e.build_id_hex))
        freed = 0
        for e in entries:
            if freed >= want_bytes:
                return
            if e.build_id_hex not in self._protected:
                freed += self._evict_one(e)
        mapped = None
        for e in entries:
            if freed >= want_bytes:
                return
            if e.build_id_hex not in self._protected or not e.directory.exists():
                continue
            if mapped is None:
                mapped = mapped_files()
            if _is_mapped(e, mapped):
                continue
            freed += self._evict_one(e)
            self.tally.count("evicted_in_use")
            self.tally.warn("store %s: evicted %s (%s), which a session references, to make room",
                            self.layout.root, e.build_id_hex, e.path)

    def _evict_one(self, e: Entry) -> int:
        before = self._totals[1]
        self.remove(e.build_id_hex)
        self.tally.count("evicted")
        return before - self._totals[1]

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
            if directory is None:
                return 0
            size = entry_usage(directory)[0]
            for unit in [directory, *alt_dirs(directory)]:
                origin = read_origin(unit)
                self.account_dir(unit, origin.uid if origin is not None else None, -1)
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
        for :meth:`reserve`, which evicts protected entries last.

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

        Walks the whole store: call it at start, before adding.
        """
        count = 0
        with self._lock:
            for dirpath, dirnames, filenames in os.walk(self.layout.root):
                # A temporary link to an entry directory is listed in dirnames (os.walk does not follow it).
                for name in dirnames + filenames:
                    temp = os.path.join(dirpath, name)
                    is_temp = name.startswith(".") and TEMP_INFIX in name
                    if not is_temp:
                        continue
                    try:
                        if os.path.isdir(temp) and not os.path.islink(temp):
                            shutil.rmtree(temp)   # a promotion's entry, built aside (see entries)
                        else:
                            os.unlink(temp)
                        count += 1
                    except OSError as e:
                        self.tally.warn("%s: cannot remove: %s", temp, e.strerror)
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

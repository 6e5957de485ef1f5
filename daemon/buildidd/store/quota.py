"""Size accounting, recency, the quota and eviction; the sweep of a crash's temporary files.

Recency: :meth:`Quota.touch` sets the entry directory's mtime to now; an
entry's ``last_ref_ns`` is that mtime (ns since the epoch), which is also the
time it was added.  It needs no index file and survives restarts.  The quota
removes the least recently referenced entries first, never one a retained
session references (the caller says which: ``protected``).
"""

from __future__ import annotations

import os
import shutil
import threading
import time

from buildidd.errors import StoreError
from buildidd.store.counters import Tally
from buildidd.store.install import fsync_dir
from buildidd.store.layout import TEMP_INFIX, Layout, files_size


class Quota:
    """Removes entries: one by one, or least recently referenced first while over the quota.

    Attributes:
        quota_bytes: :meth:`enforce`'s limit on :meth:`size_bytes`; ``None``: none.
        over_quota: after :meth:`enforce`, ``True`` when the store still
            exceeds the quota because what is left is protected.
    """

    def __init__(self, layout: Layout, tally: Tally, lock: threading.RLock, quota_bytes: int | None):
        self.layout = layout
        self.tally = tally
        self.quota_bytes = quota_bytes
        self.over_quota = False
        self._lock = lock

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
        """Sum of the entries' ``size_bytes``."""
        return sum(e.size_bytes for e in self.layout.entries())

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
            size = files_size(directory)
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
        never removed, even when that leaves the store over its quota:
        :attr:`over_quota` then says so.  No quota: nothing is removed.

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
            if self.quota_bytes is None:
                self.over_quota = False
                return removed
            entries = self.layout.entries()
            total = sum(e.size_bytes for e in entries)
            for e in sorted(entries, key=lambda e: (e.last_ref_ns, e.build_id_hex)):
                if total <= self.quota_bytes:
                    break
                if e.build_id_hex in keep:
                    continue
                try:
                    total -= self.remove(e.build_id_hex)
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
                    if not is_temp or (os.path.isdir(temp) and not os.path.islink(temp)):
                        continue
                    try:
                        os.unlink(temp)
                        count += 1
                    except OSError as e:
                        self.tally.warn("%s: cannot remove: %s", temp, e.strerror)
        return count

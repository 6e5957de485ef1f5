"""The htlhashes hand-overs compute, queued for the recording thread's ``file_id`` records.

A file whose build-id the kernel read was never read by a worker, so its
``file_id`` (htlhash, resolve.fileid) is computed by its hand-over (a worker
thread, resolve.handover) and queued here as a :class:`FileKey`, once per
identity; the recording thread takes them (:meth:`FileKeys.take`) and writes
each as a ``file_id`` record (sessionlog.records.file_id_line).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from buildidd.kernel.events import Identity
from buildidd.memo import LruCache

__all__ = ["FileKey", "FileKeys"]

#: File identities whose htlhash was queued as a ``file_id`` record, remembered at most (each entry
#: an Identity, no path: KEYED_ENTRY_BYTES each, within KEYED_MAX_BYTES).
FILE_IDS_MAX = 65536
#: FileKeys waiting for the recording thread at most (it drains them every step; no path in one).
FILE_KEYS_QUEUED_MAX = 4096
#: What one entry of the ``file_id_keyed`` memory holds (an Identity and its dict entry), bytes ...
KEYED_ENTRY_BYTES = 320
#: ... and the bytes it keeps at most (an identity forgotten only has its file_id record written again).
KEYED_MAX_BYTES = 2 << 20


@dataclass(frozen=True, slots=True)
class FileKey:
    """The htlhash of a file whose build-id the kernel read (or judged), computed by its hand-over:
    the session's ``file_id`` record (sessionlog.records.file_id_line).

    Attributes:
        identity: the file's; build_id: lower-case hex, or None (a kernel verdict without one);
        file_id: 32 hex digits (resolve.fileid.file_id); go_build_id: its Go build ID, or None.
    """

    identity: Identity
    build_id: str | None
    file_id: str
    go_build_id: str | None = None


class FileKeys:
    """The queue of FileKeys: hand-over workers put (any number of them), the recording thread takes.

    Every field below is guarded by :attr:`_lock` (callers never hold it: each method takes it).
    Attributes:
        keyed: identities whose key was queued (LruCache ``file_id_keyed``, bounded in bytes; its
            stats: :meth:`keyed_stats`).
        dropped: keys not queued, the queue holding FILE_KEYS_QUEUED_MAX (``file_ids_dropped``).
    """

    def __init__(self):
        self._lock = threading.Lock()
        #: Guarded by _lock.
        self.keyed: LruCache[Identity, bool] = LruCache("file_id_keyed", FILE_IDS_MAX, max_bytes=KEYED_MAX_BYTES,
                                                         cost=lambda _ident, _v: KEYED_ENTRY_BYTES)
        #: Guarded by _lock.
        self._queue: deque[FileKey] = deque()
        #: Guarded by _lock.
        self.dropped = 0

    def known(self, ident: Identity) -> bool:
        """Whether ident's key was queued already (any thread)."""
        with self._lock:
            return ident in self.keyed

    def put(self, key: FileKey) -> None:
        """Queue key for its file_id record unless its identity has one queued already (any thread);
        beyond FILE_KEYS_QUEUED_MAX it is counted in :attr:`dropped` only."""
        with self._lock:
            if key.identity in self.keyed:
                return
            self.keyed.put(key.identity, True)
            if len(self._queue) >= FILE_KEYS_QUEUED_MAX:
                self.dropped += 1
                return
            self._queue.append(key)

    def take(self) -> list[FileKey]:
        """The keys queued since the last call, oldest first (the recording thread)."""
        with self._lock:
            out = list(self._queue)
            self._queue.clear()
        return out

    def keyed_stats(self) -> dict:
        """The ``file_id_keyed`` memory's LruCache.stats (any thread)."""
        with self._lock:
            return self.keyed.stats()

    def __len__(self) -> int:
        """Keys waiting (any thread)."""
        with self._lock:
            return len(self._queue)

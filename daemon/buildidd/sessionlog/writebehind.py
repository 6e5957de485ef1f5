"""Write-behind: the open segment's older bytes pushed to disk and dropped from the page cache.

A session log is written once and read rarely, but every byte written stays
in the page cache until memory pressure evicts it: a recording daemon would
grow the host's page cache by the whole session (crowding out the cache of
the programs it records) and keep up to the kernel's dirty limit of it
unwritten.  Worse for its own cost: each new page-cache page is memory not
touched recently, and on a guest with free page reporting
(page_reporting_order on the kernel command line) such a page costs a fault
in the host on first use: writing the log into fresh pages then dominates the
daemon's CPU (copy_folio_from_iter_atomic in a profile of the daemon).

So, as each segment grows, every :data:`WINDOW_BYTES` the range written
before it is handed to one background thread, which starts its writeback and
waits for it (``sync_file_range(2)`` WAIT_BEFORE | WRITE | WAIT_AFTER: data
only, no journal commit) and then drops it, with the segment's earlier synced
ranges again (``posix_fadvise`` DONTNEED; the kernel drops clean pages only,
and whole folios only, so one straddling a range's start waits for the
next: see release_range).  The pages freed are the ones the next
writes reuse.  The recording thread only compares two integers and, once per
window, dups the fd and queues the range.  What this costs is disk writes
a little earlier than writeback would have made them; a range that cannot
be synced (EIO) stays in the page cache and is counted.  The segment's last
window stays cached until the segment is final: the finisher (.compress)
drops the synced ``.jsonl`` (or its ``.jsonl.zst``) then.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import queue
import threading

from buildidd.kernel.sched import make_current_thread_background

__all__ = ["WriteBehind", "WINDOW_BYTES", "drop_cached_file", "release_range"]

log = logging.getLogger(__name__)

#: Bytes of the open segment kept in the page cache behind the writer (a multiple of the page size).
WINDOW_BYTES = 4 << 20
#: Ranges waiting for the thread at most; beyond, a range is left to the kernel (counted as skipped).
MAX_QUEUED = 64
#: sync_file_range(2) flags (include/uapi/linux/fs.h).
SYNC_FILE_RANGE_WAIT_BEFORE = 1
SYNC_FILE_RANGE_WRITE = 2
SYNC_FILE_RANGE_WAIT_AFTER = 4

_libc = ctypes.CDLL(None, use_errno=True)
_libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]


def release_range(fd: int, start: int, length: int, drop_from: int | None = None) -> None:
    """Write [start, start + length) of fd's file to disk, wait for it, and drop the pages of
    [drop_from, start + length) from the page cache (drop_from: start when None; at most start).

    drop_from lets a caller cover its earlier synced ranges again: DONTNEED
    drops whole folios only (mm/fadvise.c: invalidate_mapping_pages skips a
    folio that is not wholly inside the range), and a large folio (ext4 makes
    them since 6.x) that straddles start stays cached until a later pass from
    the segment's first synced byte covers it.  That pass walks the folios
    still cached, not the whole range.

    Raises:
        OSError: sync_file_range or posix_fadvise failed (the pages then stay cached).
    """
    flags = SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER
    if _libc.sync_file_range(fd, start, length, flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"sync_file_range: {os.strerror(err)}")
    first = start if drop_from is None else min(max(drop_from, 0), start)
    os.posix_fadvise(fd, first, start + length - first, os.POSIX_FADV_DONTNEED)


def drop_cached_file(path) -> None:
    """Drop the synced file path's pages from the page cache (posix_fadvise DONTNEED: clean
    pages only).  Never raises: a file that cannot be opened keeps its pages."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


class WriteBehind:
    """Releases the segments' bytes older than the last window, on one background thread.

    Args:
        window_bytes: bytes kept behind the writer (rounded down to pages; 0 turns it off).

    Attributes (read by SessionWriter.stats):
        released_bytes: bytes written back and dropped (written by the thread).
        skipped: ranges left to the kernel because the thread was MAX_QUEUED behind.
        errors: ranges that could not be queued, synced or dropped.
    """

    def __init__(self, window_bytes: int = WINDOW_BYTES):
        self.set_window(window_bytes)
        self.released_bytes = 0
        self.skipped = 0
        self.errors = 0
        self._mark = 0                # bytes of the open segment already handed over
        self._drop_from = 0           # first byte of the run of ranges handed over without a gap
        self._segment = 0             # which segment a range belongs to (the thread's failed_end is per segment)
        self._queue: queue.Queue[tuple[int, int, int, int, int] | None] = queue.Queue(MAX_QUEUED)
        self._thread: threading.Thread | None = None

    def set_window(self, window_bytes: int) -> None:
        """Keep window_bytes (rounded down to pages) behind the writer from now on; 0: off.

        Raises:
            ValueError: window_bytes is negative.
        """
        if window_bytes < 0:
            raise ValueError(f"window_bytes must be >= 0, got {window_bytes}")
        self.window_bytes = window_bytes - window_bytes % mmap.PAGESIZE

    def segment_closed(self) -> None:
        """The open segment was closed (the writer, under its lock): the next one starts at 0.
        (Its fd number is no identity: the next segment usually gets the same one.)"""
        self._mark = 0
        self._drop_from = 0
        self._segment += 1

    def written(self, fd: int, size_bytes: int) -> None:
        """The segment open as fd now holds size_bytes bytes (the writer, under its lock).

        Never raises: a range that cannot be queued is left to the kernel.
        """
        if not self.window_bytes or size_bytes - self._mark < 2 * self.window_bytes:
            return
        end = (size_bytes - self.window_bytes) // mmap.PAGESIZE * mmap.PAGESIZE
        start, self._mark = self._mark, end
        try:
            dup = os.dup(fd)
        except OSError:
            self.errors += 1
            self._drop_from = end     # [start, end) is not synced: no later drop covers it
            return
        try:
            self._queue.put_nowait((dup, start, end - start, self._drop_from, self._segment))
        except queue.Full:
            os.close(dup)
            self.skipped += 1
            self._drop_from = end
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="buildidd-sessionlog-writebehind",
                                            daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Release what is queued, then stop the thread (idempotent)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        make_current_thread_background()
        segment, failed_end = -1, 0     # the end of the segment's last range whose sync failed
        while (item := self._queue.get()) is not None:
            fd, start, length, drop_from, item_segment = item
            if item_segment != segment:
                segment, failed_end = item_segment, 0
            try:
                # From the first byte of the ranges synced without a gap (a range skipped
                # when the queue was full, or one whose sync failed, is never dropped).
                release_range(fd, start, length, drop_from=max(drop_from, failed_end))
                self.released_bytes += length
            except OSError as e:
                failed_end = start + length
                self.errors += 1
                if self.errors == 1:
                    log.warning("session log pages not released (they stay in the page cache): %s", e)
            finally:
                os.close(fd)

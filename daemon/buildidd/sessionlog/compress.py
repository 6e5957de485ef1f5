"""Closed segments made final (fsync, compression) on one background thread per writer.

Closing a segment (the writer): terminate a torn last line with ``b"\\n"``,
close.  Then, here: ``fsync`` the ``.jsonl`` (here, not on the recording
thread, which an ``fsync`` of a whole segment would stall); without
compression ``fsync`` the directory and stop there; else compress
into ``….jsonl.zst.tmp`` (one zstd frame with checksum), ``fsync``,
``rename`` to ``….jsonl.zst``, ``fsync`` the directory, unlink the
``.jsonl``.  A crash at any point leaves either the
``.jsonl`` alone, or the ``.jsonl`` next to a ``.zst.tmp`` or a complete
``.zst``: the reader then reads the ``.jsonl`` and ignores the rest, so no
record is read twice.  A segment that cannot be compressed stays a readable
``.jsonl`` and is counted.

While a segment is open, the writer feeds this thread what it wrote
(:meth:`SegmentFinisher.feed`), and the ``.zst.tmp`` is made from those bytes
as they come (:mod:`.stream`), not read back from a file whose pages the
write-behind has dropped; what the thread has not taken yet is bounded
(:data:`STREAM_PENDING_MAX`), beyond which that segment is compressed from its
file at close, as before.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from pathlib import Path

import zstandard

from buildidd.errors import SessionLogError
from buildidd.kernel.sched import make_current_thread_background
from buildidd.sessionlog.writebehind import WriteBehind, drop_cached_file
from buildidd.fsio import fsync_dir
from buildidd.sessionlog.segments import READ_CHUNK_BYTES
from buildidd.sessionlog.stream import SegmentStream

__all__ = ["STREAM_PENDING_MAX", "SegmentFinisher", "compress_segment", "sync_segment"]

log = logging.getLogger(__name__)

#: Bytes fed to the finishing thread and not compressed yet, at most: beyond, the segment they
#: belong to is compressed from its file when closed (the thread fell behind the writer).
STREAM_PENDING_MAX = 8 << 20
#: Fed bytes are handed to the finishing thread this many at a time (and at the segment's close):
#: one wake-up of it per batch, not one per write (a trickle of records would wake it at every step).
FEED_BATCH_BYTES = 512 << 10


class SegmentFinisher:
    """Makes the closed segments of one session directory final, in order, on one thread.

    A closed segment is ``fsync``-ed here, never on the recording thread (an
    ``fsync`` of a full segment blocks for as long as the disk takes to write
    it, long enough for a small ring to overflow under a mapping storm), then compressed
    (:func:`compress_segment`) or, without compression, its directory entry
    synced (:func:`sync_segment`).  The thread starts at the first
    :meth:`submit` and runs as background work
    (:func:`~buildidd.kernel.sched.make_current_thread_background`), so ``submit``
    never waits.

    Args:
        directory: the session directory (``fsync``-ed after each rename).
        zstd_level: zstd compression level (1-22; the writer checks it), or
            ``None``: segments stay ``.jsonl``.
        write_behind: the writer's (:mod:`.writebehind`); while its window is on, a final
            segment's pages (the ``.jsonl`` kept, or the ``.jsonl.zst``) are dropped from the
            page cache: the last window, which the write-behind leaves to the segment's close.
    """

    def __init__(self, directory: Path, zstd_level: int | None, write_behind: WriteBehind | None = None):
        self._dir = directory
        self._zstd_level = zstd_level
        self._write_behind = write_behind
        #: ("feed", path, [bytes]), ("close", path), ("abandon", path), or None to end
        self._queue: queue.Queue[tuple | None] = queue.Queue()
        self._streams: dict[Path, SegmentStream] = {}     # the finishing thread's
        self._pending = 0                                  # bytes fed, not taken yet (under _counter_lock)
        self._unstreamed: set[Path] = set()                # open segments left to compress_segment
        self._batch: list[bytes] = []                      # fed, not handed over yet (writer's side)
        self._batch_path: Path | None = None
        self._batch_bytes = 0
        self._worker: threading.Thread | None = None
        # Changed by the finishing thread, under self._counter_lock.
        self._counter_lock = threading.Lock()
        # One compression context for every segment (made by the finishing
        # thread, used by it alone): its buffers are not freed and allocated
        # again for each one (see buildidd.heap).
        self._cctx: zstandard.ZstdCompressor | None = None
        self._segments_compressed = 0
        self._compress_errors = 0
        self._sync_errors = 0
        self._finish_cpu_ns = 0
        self._finished_bytes = 0

    def feed(self, path: Path, data) -> None:
        """The bytes (bytes-like) the writer just wrote at the end of the open segment ``path``,
        in order: compressed on this thread as they come (no-op without compression).  Beyond
        STREAM_PENDING_MAX bytes waiting, the segment is left to be compressed from its file."""
        if self._zstd_level is None or not len(data) or path in self._unstreamed:
            return
        if self._batch_path != path:
            self._hand_over()
            self._batch_path = path
        self._batch.append(bytes(data))
        self._batch_bytes += len(data)
        if self._batch_bytes >= FEED_BATCH_BYTES:
            self._hand_over()

    def _hand_over(self) -> None:
        """Queue the fed bytes not handed over yet (writer's side), or abandon their segment's stream
        when the thread is STREAM_PENDING_MAX behind."""
        path, chunks, size = self._batch_path, self._batch, self._batch_bytes
        self._batch, self._batch_bytes = [], 0
        if path is None or not chunks:
            return
        with self._counter_lock:
            if self._pending + size > STREAM_PENDING_MAX:
                self._unstreamed.add(path)
                item: tuple = ("abandon", path)
            else:
                self._pending += size
                item = ("feed", path, chunks)
        self._start()
        self._queue.put(item)

    def submit(self, path: Path) -> None:
        """Queue the closed ``.jsonl`` segment ``path`` to be synced (and compressed)."""
        if self._batch_path == path:
            self._hand_over()
        self._start()
        self._queue.put(("close", path))

    def _start(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(
                target=self._finish_loop, name="buildidd-sessionlog-finish", daemon=True
            )
            self._worker.start()

    def close(self) -> None:
        """Wait until every submitted segment is final (or has failed)."""
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join()

    @property
    def counts(self) -> tuple[int, int, int]:
        """``(segments_compressed, compress_errors, sync_errors)``, a consistent snapshot.

        ``sync_errors``: uncompressed segments whose ``fsync`` failed (a
        compressed one's failure is a ``compress_errors``).
        """
        with self._counter_lock:
            return self._segments_compressed, self._compress_errors, self._sync_errors

    @property
    def cost(self) -> tuple[int, int]:
        """``(finish_cpu_ns, finished_bytes)``: the finishing thread's CPU (ns, the thread's own
        clock: reading, zstd compression, fsync) and the ``.jsonl`` bytes of the segments it made
        final, so far; the daemon's CPU per event counts its share (scripts/bench)."""
        with self._counter_lock:
            return self._finish_cpu_ns, self._finished_bytes

    def _finish_loop(self) -> None:
        make_current_thread_background()
        while (item := self._queue.get()) is not None:
            kind, path = item[0], item[1]
            cpu0 = time.thread_time_ns()
            if kind != "close":
                self._stream(kind, path, item[2] if kind == "feed" else [])
                with self._counter_lock:
                    self._finish_cpu_ns += time.thread_time_ns() - cpu0
                continue
            try:
                size = path.stat().st_size
            except OSError:
                size = 0
            try:
                self._finish(path)
            except Exception as e:
                # One segment that cannot be finished must not stop the next
                # ones; its .jsonl stays readable.  Counted once, by mode.
                with self._counter_lock:
                    if self._zstd_level is None:
                        self._sync_errors += 1
                    else:
                        self._compress_errors += 1
                if isinstance(e, (OSError, SessionLogError)):
                    log.warning("%s: finishing the segment failed: %s", path, e)
                else:
                    log.exception("%s: finishing the segment failed", path)
            with self._counter_lock:
                self._finish_cpu_ns += time.thread_time_ns() - cpu0
                self._finished_bytes += size

    def _stream(self, kind: str, path: Path, chunks: list[bytes]) -> None:
        """A feed of the open segment path (compressed into its SegmentStream), or its abandon."""
        if kind == "feed":
            with self._counter_lock:
                self._pending -= sum(map(len, chunks))
            if self._cctx is None:
                self._cctx = compressor(self._zstd_level)
            stream = self._streams.get(path)
            if stream is None:
                stream = self._streams[path] = SegmentStream(path, self._cctx)
            for data in chunks:
                stream.write(data)
        else:
            stream = self._streams.pop(path, None)
            if stream is not None:
                stream.abandon()

    def _finish(self, path: Path) -> None:
        """Sync (and compress) a closed segment: from its stream when all of it was fed, else
        from its file.

        Raises:
            OSError: the fsync failed (uncompressed); SessionLogError:
                compression failed (the ``.jsonl`` stays).
        """
        stream = self._streams.pop(path, None)
        streamed = stream is not None and path not in self._unstreamed
        self._unstreamed.discard(path)
        if self._zstd_level is None:
            sync_segment(path)
            final = path
        elif streamed and stream.failed is None and (final := _finish_stream(stream)) is not None:
            with self._counter_lock:
                self._segments_compressed += 1
        else:
            if stream is not None:
                stream.abandon()
            if self._cctx is None:
                self._cctx = compressor(self._zstd_level)
            final = compress_segment(path, self._zstd_level, self._cctx)
            with self._counter_lock:
                self._segments_compressed += 1
        if self._write_behind is not None and self._write_behind.window_bytes:
            drop_cached_file(final)


def _finish_stream(stream: SegmentStream) -> Path | None:
    """stream.finish(); None when it failed (logged): the caller compresses the file instead."""
    try:
        return stream.finish()
    except SessionLogError as e:
        log.warning("%s: the stream of its bytes cannot be finished (%s); compressing the file",
                    stream.path, e.__cause__ or e)
        return None


def sync_segment(path: Path) -> None:
    """``fsync`` the closed segment ``path`` and its directory: the segment is final, uncompressed.

    Raises:
        OSError: open or ``fsync`` failed.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(path.parent)


def compressor(zstd_level: int) -> zstandard.ZstdCompressor:
    """The zstd context segments are compressed with: level 1-22, with a content checksum."""
    return zstandard.ZstdCompressor(level=zstd_level, write_checksum=True)


def compress_segment(path: Path, zstd_level: int, cctx: zstandard.ZstdCompressor | None = None) -> Path:
    """Compress the closed ``.jsonl`` segment ``path`` into ``.jsonl.zst`` and unlink it.

    Read into a :class:`~.stream.SegmentStream`, made final by its steps (those of the module
    docstring): ``fsync`` of ``path``, ``.zst.tmp`` (one zstd frame with checksum; a torn last line
    gets its ``b"\\n"``), ``fsync``, ``rename``, ``fsync`` of the directory, unlink of the
    ``.jsonl``.  A ``.zst`` already beside ``path`` (a crash before the unlink) is replaced.

    Args:
        path: the segment, ``segment-NNNNNN.jsonl``.
        zstd_level: 1-22.
        cctx: a context from :func:`compressor` to reuse (one thread at a time); default a new one.

    Returns:
        the ``.jsonl.zst`` path.

    Raises:
        SessionLogError: reading, writing or renaming failed; the ``.jsonl``
            stays, no ``.zst.tmp`` is left.
    """
    stream = SegmentStream(path, cctx if cctx is not None else compressor(zstd_level))
    try:
        with open(path, "rb") as src:
            while chunk := src.read(READ_CHUNK_BYTES):
                stream.write(chunk)
    except OSError as e:
        stream.abandon()
        raise SessionLogError(f"{path}: compression failed, keeping it uncompressed: {e}") from e
    return stream.finish()      # the frame of what was read, made final as the writer's stream is

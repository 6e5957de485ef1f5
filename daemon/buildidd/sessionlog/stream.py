"""An open segment compressed while it is written, from the bytes the writer wrote.

Compressing a closed segment from its file (:func:`.compress.compress_segment`)
reads it back, and the write-behind (:mod:`.writebehind`) has already dropped
its pages from the page cache: every byte is then read from disk again, which
cost the daemon more CPU than zstd itself.  The finishing thread instead
receives each batch the writer wrote (:meth:`.compress.SegmentFinisher.feed`)
and compresses it into ``….jsonl.zst.tmp`` as it comes; when the segment is
closed, :meth:`SegmentStream.finish` ends the frame and makes it final with the
same steps and the same crash guarantees as :func:`.compress.compress_segment`
(the ``.jsonl`` is synced first and unlinked last).  The frame holds exactly
the bytes the kernel accepted into the ``.jsonl``, in order.
"""

from __future__ import annotations

import os
from pathlib import Path

import zstandard

from buildidd.errors import SessionLogError
from buildidd.fsio import fsync_dir, write_all
from buildidd.sessionlog.segments import FILE_MODE

__all__ = ["SegmentStream"]


class SegmentStream:
    """The zstd frame of one open ``.jsonl`` segment, written to ``….jsonl.zst.tmp`` as data comes.

    One thread uses it (the finishing thread).  A failure makes it :attr:`failed`: the segment is
    then compressed from its file at close instead (:func:`.compress.compress_segment`).

    Args:
        path: the segment, ``segment-NNNNNN.jsonl``.
        cctx: the finisher's compression context (:func:`.compress.compressor`).
    """

    def __init__(self, path: Path, cctx: zstandard.ZstdCompressor):
        self.path = path
        self.tmp = path.with_name(path.name + ".zst.tmp")
        self._obj = cctx.compressobj()
        self._fd: int | None = None
        self._last = 0x0A          # the last byte fed ("\n" for none): a torn tail is terminated
        self.fed = 0               # bytes fed
        #: the OSError or ZstdError that stopped it, else None
        self.failed: Exception | None = None

    def write(self, data: bytes) -> None:
        """Compress the next bytes of the segment (those the kernel accepted, in order)."""
        if self.failed is not None or not data:
            return
        try:
            if self._fd is None:
                self._fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW,
                                   FILE_MODE)
            write_all(self._fd, self._obj.compress(data))
            self._last = data[-1]
            self.fed += len(data)
        except (OSError, zstandard.ZstdError) as e:
            self.abandon()
            self.failed = e

    def finish(self) -> Path:
        """End the frame and make the segment final: ``fsync`` the ``.jsonl``, end the frame (a
        torn last line gets its ``b"\\n"``), ``fsync`` the ``.zst.tmp``, ``rename`` it to
        ``….jsonl.zst``, ``fsync`` the directory, unlink the ``.jsonl``.  Returns the ``.jsonl.zst``.

        The ``.jsonl`` must hold exactly the bytes fed (and the ``b"\\n"`` its close may have
        added to a torn last line): a file of another size (bytes the writer did not write)
        raises, and the caller compresses the file instead.

        Raises:
            SessionLogError: a step failed, the stream had (:attr:`failed`), or the file is not
                what was fed; the ``.jsonl`` stays and no ``.zst.tmp`` is left.
        """
        zst = self.path.with_name(self.path.name + ".zst")
        try:
            if self.failed is not None:
                raise self.failed
            src = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            try:
                size = os.fstat(src).st_size
                if size != self.fed and not (size == self.fed + 1 and self._last != 0x0A):
                    raise OSError(5, f"{size} bytes in the file, {self.fed} written by the writer")
                os.fsync(src)            # the closed segment is on disk before anything else
            finally:
                os.close(src)
            if self._fd is None:
                self._fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW,
                                   FILE_MODE)
            tail = self._obj.compress(b"\n") if self._last != 0x0A else b""
            write_all(self._fd, tail + self._obj.flush(zstandard.COMPRESSOBJ_FLUSH_FINISH))
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
            os.rename(self.tmp, zst)
            fsync_dir(self.path.parent)
            os.unlink(self.path)
        except (OSError, zstandard.ZstdError) as e:
            self.abandon()
            raise SessionLogError(f"{self.path}: compression failed, keeping it uncompressed: {e}") from e
        return zst

    def abandon(self) -> None:
        """Close and remove the ``.zst.tmp`` (the segment stays a ``.jsonl``); idempotent, never raises."""
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
        try:
            self.tmp.unlink(missing_ok=True)
        except OSError:
            pass

"""Segments on disk: names, modes, the line limit, and the open segment's file.

On-disk layout of one session directory (mode ``0o750``, files ``0o640``)::

    segment-000000.jsonl.zst     closed segment, one zstd frame with checksum
    segment-000001.jsonl.zst
    segment-000002.jsonl         the open segment (or a closed one whose
                                 compression failed or was cut by a crash)
    segment-000001.jsonl.zst.tmp compression in progress (never read)

A segment is a sequence of lines, each one JSON object terminated by
``b"\\n"``.  Segment numbers start at 0 and have no gaps; readers order by the
number.  The writer (:mod:`.writer`) appends to the open segment, the
compressor (:mod:`.compress`) turns closed ones into ``.jsonl.zst``, the
reader (:mod:`.reader`) reads both.
"""

from __future__ import annotations

import errno
import fcntl
import fnmatch
import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from buildidd.errors import SessionLogError
from buildidd.fsio import fsync_dir

__all__ = ["MAX_LINE_BYTES", "SEGMENT_GLOB", "ZSTD_LEVEL", "SegmentFile", "SegmentStats", "create_session_dir",
           "CLOSED_MARKER", "lock_session_dir", "write_closed_marker"]

log = logging.getLogger(__name__)

#: Glob matching every file a writer creates in a session directory: open and
#: closed segments and in-progress ``.zst.tmp`` files.  Use
#: :func:`~.reader.list_segments` for the set of segments to read.
SEGMENT_GLOB = "segment-[0-9]*.jsonl*"
#: zstd level of closed segments: on the recorder's JSON lines level 1 compresses both faster and
#: smaller than the library's default 3 (their records repeat whole fields; docs/benchmarks.md).
ZSTD_LEVEL = 1

#: Longest accepted line in bytes, without its ``b"\\n"``.  The writer refuses
#: longer records; the reader skips longer lines as corrupt, which bounds its
#: memory.
MAX_LINE_BYTES = 1 << 20

#: Hidden file a session directory gets once it is closed: written by the
#: writer's close, or by :func:`~.seal.seal_unclosed_sessions` for a session
#: that a crash left open.  One JSON object: ``{"clean": bool, ...}``.
CLOSED_MARKER = ".closed"

#: A readable segment's name: group 1 its number, group 2 ``.zst`` when compressed.
SEGMENT_RE = re.compile(r"segment-(\d{6,})\.jsonl(\.zst)?")
FILE_MODE = 0o640
DIR_MODE = 0o750
#: Bytes read per call from a ``.jsonl`` segment, and from a ``.zst`` segment
#: while compressing it.
READ_CHUNK_BYTES = 256 << 10


def segment_name(number: int) -> str:
    """The open (uncompressed) segment's file name for segment ``number``."""
    return f"segment-{number:06d}.jsonl"


def create_session_dir(directory: Path) -> None:
    """Create the session directory (mode ``0o750`` less the umask, parents
    too) or adopt an empty one; ``fsync`` its parent when it was created.

    Raises:
        SessionLogError: the directory cannot be created or read, or already
            holds segments (a session directory is never reused).
    """
    try:
        existed = directory.is_dir()
        os.makedirs(directory, mode=DIR_MODE, exist_ok=True)
        if not existed:
            fsync_dir(directory.parent)
        present = sorted(n for n in os.listdir(directory) if fnmatch.fnmatchcase(n, SEGMENT_GLOB))
    except OSError as e:
        raise SessionLogError(f"{directory}: cannot create session directory: {e.strerror}") from e
    if present:
        raise SessionLogError(
            f"{directory}: already holds segments ({present[0]}, ...); a session directory is not reused"
        )


def lock_session_dir(directory: Path) -> int:
    """Open ``directory`` and take an exclusive ``flock`` on it, without waiting.

    The writer holds this lock for its lifetime, and the kernel drops it when
    the process dies (even by SIGKILL), so a session directory whose lock can
    be taken is not being written (see :mod:`.seal`).

    Returns:
        the directory's file descriptor (close it to release the lock).

    Raises:
        BlockingIOError: another open file description holds the lock (a live writer).
        OSError: the directory cannot be opened.
    """
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd


def write_closed_marker(directory: Path, body: dict) -> None:
    """Write :data:`CLOSED_MARKER` in ``directory`` holding ``body`` as JSON
    (``{"clean": bool, ...}``).  A failure (a full disk) is only logged: the
    marker spares the next start a look at the session's last record."""
    data = json.dumps(body, separators=(",", ":")).encode() + b"\n"
    try:
        fd = os.open(directory / CLOSED_MARKER, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
                     | os.O_NOFOLLOW, FILE_MODE)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
    except OSError as e:
        log.warning("%s: cannot write %s: %s", directory, CLOSED_MARKER, e.strerror)


@dataclass
class SegmentStats:
    """The open segment of a :class:`~.writer.SessionWriter`.

    Attributes:
        number: segment number, 0 for the first segment of the session.
        path: the segment's ``.jsonl`` file.
        size_bytes: bytes written to the file by this writer, including the
            accepted part of a failed batch.
        records: records of fully written batches.
        started_s: ``clock()`` value in seconds when the segment's first byte
            was written; ``None`` while the segment is empty.
        tail_complete: ``False`` when the file ends in a partial line left by a
            failed write; the writer resumes that line where it stopped.
    """

    number: int
    path: Path
    size_bytes: int = 0
    records: int = 0
    started_s: float | None = None
    tail_complete: bool = True


class SegmentFile:
    """The open segment: its file descriptor and its :class:`SegmentStats`.

    Used by one writer under its lock; every byte the kernel accepts is
    accounted in ``stats.size_bytes``, also when a later part of a write fails.
    """

    __slots__ = ("fd", "stats")

    def __init__(self, fd: int, stats: SegmentStats):
        self.fd = fd
        self.stats = stats

    @classmethod
    def create(cls, directory: Path, number: int) -> SegmentFile:
        """Create segment ``number`` in ``directory`` (``O_EXCL``, append-only, ``0o640``).

        Raises:
            SessionLogError: the file exists or cannot be created.
        """
        path = directory / segment_name(number)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC,
                         FILE_MODE)
        except OSError as e:
            raise SessionLogError(f"{path}: cannot create segment: {e.strerror}") from e
        return cls(fd, SegmentStats(number=number, path=path))

    def write(self, data: bytes, clock: Callable[[], float]) -> tuple[int, OSError | None]:
        """Write ``data`` at the end of the segment, looping on short writes.

        Bytes the kernel accepted are accounted in ``stats.size_bytes`` even
        when a later part fails, and ``stats.tail_complete`` tells whether they
        end a line; ``stats.started_s`` is set from ``clock()`` at the first byte.

        Returns:
            ``(bytes accepted, None)`` when all of ``data`` was written, else
            ``(bytes accepted, the OSError)``: ENOSPC, EIO, ... (a write that
            accepts no byte is reported as EIO).  Never raises for a write error:
            the caller resumes from the returned offset.
        """
        stats = self.stats
        view = memoryview(data)
        written = 0
        error: OSError | None = None
        try:
            while written < len(data):
                n = os.write(self.fd, view[written:])
                if n == 0:
                    raise OSError(errno.EIO, "write accepted no bytes")
                if stats.started_s is None:
                    stats.started_s = clock()
                written += n
        except OSError as e:
            error = e
        if written:
            stats.size_bytes += written
            stats.tail_complete = data[written - 1] == 0x0A
        return written, error

    def discard(self) -> None:
        """Close and remove the segment, which holds nothing (left by a failed
        first write).  Failure is only logged: an empty ``.jsonl`` is a valid
        segment, harmless if left."""
        try:
            os.close(self.fd)
            self.stats.path.unlink()
        except OSError as e:
            log.warning("%s: cannot remove empty segment: %s", self.stats.path, e.strerror)

    def close(self) -> None:
        """Terminate a torn last line with ``b"\\n"`` and close; no ``fsync``
        (:class:`~.compress.SegmentFinisher` syncs the closed segment off the
        recording thread).

        The descriptor is closed whatever happens.  A torn line that cannot be
        terminated is only logged: the compressor terminates it inside the
        ``.zst`` instead, and an uncompressed segment keeps it (readers skip it).

        Raises:
            OSError: ``close`` failed.
        """
        stats = self.stats
        if not stats.tail_complete:
            try:
                os.write(self.fd, b"\n")
                stats.size_bytes += 1
                stats.tail_complete = True
            except OSError as e:
                log.warning("%s: cannot terminate torn last line: %s", stats.path, e.strerror)
        os.close(self.fd)

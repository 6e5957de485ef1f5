"""The session log: one directory per session, JSON-lines records in segments.

Pipeline stage: enrichment → **session log** → clients (``buildidd show``,
``zstdcat DIR/*.zst | jq``).  This module knows bytes and lines, not record
types; :mod:`buildidd.records` gives the JSON form of a record.

On-disk layout of one session directory (mode ``0o750``, files ``0o640``)::

    segment-000000.jsonl.zst     closed segment, one zstd frame with checksum
    segment-000001.jsonl.zst
    segment-000002.jsonl         the open segment (or a closed one whose
                                 compression failed or was cut by a crash)
    segment-000001.jsonl.zst.tmp compression in progress (never read)

A segment is a sequence of lines, each one JSON object terminated by
``b"\\n"``.  Segment numbers start at 0 and have no gaps; readers order by the
number.  The writer rotates to the next segment before a batch when the open
segment holds at least ``max_segment_bytes`` bytes or its first byte was
written ``max_segment_age_s`` seconds ago or more; a batch is never split.

Closing a segment: terminate a torn last line with ``b"\\n"``, ``fsync``,
close; then, on the compression thread: compress into ``….jsonl.zst.tmp``,
``fsync``, ``rename`` to ``….jsonl.zst``, ``fsync`` the directory, unlink the
``.jsonl``.  A crash at any point leaves either the ``.jsonl`` alone, or the
``.jsonl`` next to a ``.zst.tmp`` or a complete ``.zst``: the reader then
reads the ``.jsonl`` and ignores the rest, so no record is read twice.

Torn lines.  ``write_lines`` issues one ``os.write`` per batch (more only when
the kernel accepts part of it), so a crash tears at most the batch being
written: the open segment may end in a partial line.  When the disk fills in
the middle of a batch, the bytes already accepted stay (a prefix of the batch:
complete records, then possibly one partial line); the writer remembers that
the segment does not end with ``b"\\n"`` and starts its next successful write
with ``b"\\n"``, so the partial line becomes one bad line of its own and never
swallows the following record.  The reader skips a line that is not a JSON
object and reports it through ``on_torn``; a closed segment is always
line-aligned (its torn tail is terminated before compression).

Durability: records reach the page cache at each ``write_lines``; a segment is
``fsync``-ed when it is closed (rotation, :meth:`SessionWriter.close`).  A
process crash loses nothing that ``write_lines`` returned for; a power loss
may lose the open segment's unsynced tail.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import zstandard

from buildidd.kernel.sched import make_current_thread_idle
from buildidd.errors import SessionLogError

__all__ = [
    "MAX_LINE_BYTES",
    "SEGMENT_GLOB",
    "SegmentStats",
    "SessionWriter",
    "list_segments",
    "read_session",
]

log = logging.getLogger(__name__)

#: Glob matching every file a writer creates in a session directory: open and
#: closed segments and in-progress ``.zst.tmp`` files.  Use
#: :func:`list_segments` for the set of segments to read.
SEGMENT_GLOB = "segment-[0-9]*.jsonl*"

#: Longest accepted line in bytes, without its ``b"\\n"``.  The writer refuses
#: longer records; the reader skips longer lines as corrupt, which bounds its
#: memory.
MAX_LINE_BYTES = 1 << 20

_SEGMENT_RE = re.compile(r"segment-(\d{6,})\.jsonl(\.zst)?")
_FILE_MODE = 0o640
_DIR_MODE = 0o750
#: Bytes read per call from a ``.jsonl`` segment, and from a ``.zst`` segment
#: while compressing it.
_READ_CHUNK_BYTES = 256 << 10
#: Compressed bytes fed to the decompressor per call.  A zstd block decodes to
#: at most 128 KiB and needs at least 4 bytes (RLE block, RFC 8878 §3.1.1.2),
#: so one call yields at most 32 MiB even for a hostile file; typically
#: 10-100 KiB.
_ZSTD_INPUT_CHUNK_BYTES = 1 << 10


def _segment_name(number: int) -> str:
    return f"segment-{number:06d}.jsonl"


def _fsync_dir(path: Path) -> None:
    """fsync a directory so that entries created, renamed or removed in it persist."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class SegmentStats:
    """The open segment of a :class:`SessionWriter`.

    Attributes:
        number: segment number, 0 for the first segment of the session.
        path: the segment's ``.jsonl`` file.
        size_bytes: bytes written to the file by this writer, including the
            accepted part of a failed batch.
        records: records of fully written batches.
        started_s: ``clock()`` value in seconds when the segment's first byte
            was written; ``None`` while the segment is empty.
        tail_complete: ``False`` when the file ends in a partial line left by a
            failed write; the next write starts with ``b"\\n"``.
    """

    number: int
    path: Path
    size_bytes: int = 0
    records: int = 0
    started_s: float | None = None
    tail_complete: bool = True


class SessionWriter:
    """Appends JSON-lines records to the segments of one session directory.

    One writer per directory.  ``write_lines``, ``write``, ``rotate`` and
    ``close`` may be called from several threads (they hold a lock); closed
    segments are compressed on one background thread, so ``write_lines`` never
    waits for compression.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_segment_bytes: int = 64 << 20,
        max_segment_age_s: float = 3600.0,
        compress: bool = True,
        zstd_level: int = 3,
        clock: Callable[[], float] = time.monotonic,
    ):
        """Create the session directory (or adopt an empty one).

        Args:
            directory: the session directory; created with mode ``0o750``
                (less the umask), parents too.
            max_segment_bytes: rotate before a batch when the open segment
                holds at least this many bytes.  A segment can exceed it by
                one batch.
            max_segment_age_s: rotate before a batch when the open segment's
                first byte was written at least this many seconds ago
                (measured with ``clock``).
            compress: compress closed segments to ``.jsonl.zst``.
            zstd_level: zstd compression level (1-22).
            clock: monotonic time in seconds; tests pass a fake one.

        Raises:
            SessionLogError: the directory cannot be created or read, or
                already holds segments (a session directory is never reused).
            ValueError: a size, age or level out of range.
        """
        if max_segment_bytes <= 0:
            raise ValueError(f"max_segment_bytes must be > 0, got {max_segment_bytes}")
        if max_segment_age_s <= 0:
            raise ValueError(f"max_segment_age_s must be > 0, got {max_segment_age_s}")
        if compress and not 1 <= zstd_level <= zstandard.MAX_COMPRESSION_LEVEL:
            raise ValueError(f"zstd_level must be in 1..{zstandard.MAX_COMPRESSION_LEVEL}, got {zstd_level}")
        self._dir = Path(directory)
        self._max_segment_bytes = max_segment_bytes
        self._max_segment_age_s = max_segment_age_s
        self._compress = compress
        self._zstd_level = zstd_level
        self._clock = clock

        try:
            existed = self._dir.is_dir()
            os.makedirs(self._dir, mode=_DIR_MODE, exist_ok=True)
            if not existed:
                _fsync_dir(self._dir.parent)
            present = sorted(n for n in os.listdir(self._dir) if fnmatch.fnmatchcase(n, SEGMENT_GLOB))
        except OSError as e:
            raise SessionLogError(f"{self._dir}: cannot create session directory: {e.strerror}") from e
        if present:
            raise SessionLogError(
                f"{self._dir}: already holds segments ({present[0]}, ...); a session directory is not reused"
            )

        self._lock = threading.Lock()
        self._closed = False
        self._next_number = 0
        self._segment: SegmentStats | None = None
        self._fd = -1
        # Counters; the first five change only under self._lock.
        self._records_written = 0
        self._bytes_written = 0
        self._segments_closed = 0
        self._write_errors = 0
        # Changed by the compression thread, under self._counter_lock.
        self._counter_lock = threading.Lock()
        self._segments_compressed = 0
        self._compress_errors = 0
        self._queue: queue.Queue[Path | None] = queue.Queue()
        self._worker: threading.Thread | None = None

    # -- writing ---------------------------------------------------------

    def set_limits(self, max_segment_bytes: int, max_segment_age_s: float) -> None:
        """Change the rotation limits (bytes, seconds); they apply from the next write."""
        if max_segment_bytes <= 0 or max_segment_age_s <= 0:
            raise ValueError("rotation limits must be positive")
        with self._lock:
            self._max_segment_bytes = max_segment_bytes
            self._max_segment_age_s = max_segment_age_s

    def write_lines(self, lines: Sequence[bytes], *, trusted: bool = False) -> None:
        """Append already-encoded records as one batch.

        Args:
            lines: each a complete JSON object, without newline, at most
                :data:`MAX_LINE_BYTES` bytes.  The batch is written as
                ``b"\\n".join(lines) + b"\\n"`` with one ``os.write`` (looping
                only on a short write), into one segment.

        trusted: the caller guarantees the line rules (its records are
            JSON-encoded, so no raw newline, and bounded), so the per-byte
            checks are skipped; they cost ~1 µs per record on the hot path.

        Rotates first when the open segment holds at least
        ``max_segment_bytes`` bytes or is ``max_segment_age_s`` seconds old.

        Raises:
            SessionLogError: an ``OSError`` (ENOSPC, EIO, ...) while rotating,
                opening the segment or writing; counted in ``write_errors``.
                The writer stays usable and the next call tries again.  A
                prefix of the failed batch may be in the segment (see the
                module docstring: the next successful write terminates a
                partial line with ``b"\\n"``), so retrying the same batch
                can store its first records twice.  Also raised after
                :meth:`close`.
            ValueError: a line contains ``b"\\n"`` or is too long.
        """
        if not lines:
            return
        data = b"\n".join(lines) + b"\n"
        if not trusted:
            if data.count(b"\n") != len(lines):
                raise ValueError("a record contains a newline byte")
            if max(map(len, lines)) > MAX_LINE_BYTES:
                raise ValueError(f"a record is longer than {MAX_LINE_BYTES} bytes")
        with self._lock:
            if self._closed:
                raise SessionLogError(f"{self._dir}: session writer is closed")
            segment = self._segment
            if segment is not None and segment.size_bytes > 0 and (
                segment.size_bytes >= self._max_segment_bytes
                or self._clock() - segment.started_s >= self._max_segment_age_s
            ):
                self._close_segment()  # raises SessionLogError, counted
            if self._segment is None:
                self._open_segment()  # raises SessionLogError, counted
            segment = self._segment
            if not segment.tail_complete:
                data = b"\n" + data
            self._write_all(segment, data)
            segment.records += len(lines)
            self._records_written += len(lines)

    def write(self, record: dict) -> None:
        """Encode ``record`` as compact JSON and append it (see :meth:`write_lines`).

        Raises:
            SessionLogError: as :meth:`write_lines`.
            TypeError: ``record`` holds a value JSON cannot encode.
        """
        self.write_lines([json.dumps(record, separators=(",", ":")).encode()])

    def _write_all(self, segment: SegmentStats, data: bytes) -> None:
        """Write ``data`` at the end of the open segment, looping on short writes.

        Bytes the kernel accepted are accounted even when a later part fails,
        and ``segment.tail_complete`` tells whether they end a line.
        """
        view = memoryview(data)
        written = 0
        try:
            while written < len(data):
                n = os.write(self._fd, view[written:])
                if n == 0:
                    raise OSError(errno.EIO, "write accepted no bytes")
                if segment.started_s is None:
                    segment.started_s = self._clock()
                written += n
        except OSError as e:
            self._write_errors += 1
            raise SessionLogError(
                f"{segment.path}: write failed after {written} of {len(data)} bytes: {e.strerror}"
            ) from e
        finally:
            if written:
                segment.size_bytes += written
                self._bytes_written += written
                segment.tail_complete = data[written - 1] == 0x0A

    def _open_segment(self) -> None:
        path = self._dir / _segment_name(self._next_number)
        try:
            fd = os.open(
                path,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC,
                _FILE_MODE,
            )
        except OSError as e:
            self._write_errors += 1
            raise SessionLogError(f"{path}: cannot create segment: {e.strerror}") from e
        self._fd = fd
        self._segment = SegmentStats(number=self._next_number, path=path)

    # -- closing ---------------------------------------------------------

    def rotate(self) -> None:
        """Close the open segment (it is compressed in the background) and
        start the next one at the next write.  Does nothing when the open
        segment is empty or none is open.

        Raises:
            SessionLogError: ``fsync`` or ``close`` of the segment failed
                (counted in ``write_errors``); the segment is closed anyway
                and the writer goes on with the next one.
        """
        with self._lock:
            if self._closed:
                raise SessionLogError(f"{self._dir}: session writer is closed")
            if self._segment is not None and self._segment.size_bytes > 0:
                self._close_segment()

    def _close_segment(self) -> None:
        """Terminate, fsync and close the open segment; queue it for compression.

        Always leaves no segment open and advances the segment number; raises
        :class:`SessionLogError` afterwards if fsync/close failed.
        """
        segment, fd = self._segment, self._fd
        self._segment, self._fd = None, -1
        self._next_number = segment.number + 1
        if not segment.tail_complete:
            try:
                os.write(fd, b"\n")
                segment.size_bytes += 1
                self._bytes_written += 1
                segment.tail_complete = True
            except OSError as e:
                # The compressor terminates the line inside the .zst instead;
                # an uncompressed segment keeps its torn tail (readers skip it).
                log.warning("%s: cannot terminate torn last line: %s", segment.path, e.strerror)
        error: OSError | None = None
        try:
            os.fsync(fd)
        except OSError as e:
            error = e
        try:
            os.close(fd)
        except OSError as e:
            error = error or e
        if error is None and not self._compress:
            try:
                _fsync_dir(self._dir)
            except OSError as e:
                error = e
        self._segments_closed += 1
        if self._compress:
            self._enqueue(segment.path)
        if error is not None:
            self._write_errors += 1
            raise SessionLogError(f"{segment.path}: cannot close segment: {error.strerror}") from error

    def close(self) -> None:
        """Close the last segment (fsync, compress) and wait until every closed
        segment is compressed.  Idempotent.  An empty last segment (left by a
        failed first write) is removed.

        Raises:
            SessionLogError: ``fsync``/``close`` of the last segment failed.
                Compression failures are only counted (``compress_errors``).
        """
        error: SessionLogError | None = None
        with self._lock:
            if self._closed:
                return
            self._closed = True
            segment = self._segment
            if segment is not None and segment.size_bytes == 0:
                fd = self._fd
                self._segment, self._fd = None, -1
                try:
                    os.close(fd)
                    segment.path.unlink()
                except OSError as e:
                    # An empty .jsonl is a valid segment: harmless if left.
                    log.warning("%s: cannot remove empty segment: %s", segment.path, e.strerror)
            elif segment is not None:
                try:
                    self._close_segment()
                except SessionLogError as e:
                    error = e
            worker = self._worker
        if worker is not None:
            self._queue.put(None)
            worker.join()
        if error is not None:
            raise error

    def __enter__(self) -> SessionWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- compression -----------------------------------------------------

    def _enqueue(self, path: Path) -> None:
        if self._worker is None:
            self._worker = threading.Thread(
                target=self._compress_loop, name="buildidd-sessionlog-zstd", daemon=True
            )
            self._worker.start()
        self._queue.put(path)

    def _compress_loop(self) -> None:
        make_current_thread_idle()
        while (path := self._queue.get()) is not None:
            try:
                self._compress_segment(path)
            except Exception:
                # One segment that cannot be compressed must not stop the
                # compression of the next ones; its .jsonl stays readable.
                with self._counter_lock:
                    self._compress_errors += 1
                log.exception("%s: compression failed", path)

    def _compress_segment(self, path: Path) -> None:
        """Compress a closed segment; on failure keep the ``.jsonl`` and count it."""
        zst = path.with_name(path.name + ".zst")
        tmp = path.with_name(path.name + ".zst.tmp")
        try:
            cctx = zstandard.ZstdCompressor(level=self._zstd_level, write_checksum=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, _FILE_MODE)
            with open(path, "rb") as src, open(fd, "wb") as dst:
                with cctx.stream_writer(dst, closefd=False) as zw:
                    last = b"\n"
                    while chunk := src.read(_READ_CHUNK_BYTES):
                        zw.write(chunk)
                        last = chunk[-1:]
                    if last != b"\n":
                        # A torn tail the writer could not terminate (disk full).
                        zw.write(b"\n")
                dst.flush()
                os.fsync(dst.fileno())
            os.rename(tmp, zst)
            _fsync_dir(self._dir)
            os.unlink(path)
        except (OSError, zstandard.ZstdError) as e:
            with self._counter_lock:
                self._compress_errors += 1
            log.warning("%s: compression failed, keeping it uncompressed: %s", path, e)
            try:
                tmp.unlink(missing_ok=True)  # absent: failed before creating it, or after the rename
            except OSError as e2:
                log.warning("%s: cannot remove: %s", tmp, e2.strerror)
            return
        with self._counter_lock:
            self._segments_compressed += 1

    # -- introspection ---------------------------------------------------

    @property
    def stats(self) -> dict:
        """A snapshot of the writer's counters.

        Keys: ``records_written`` (records of fully written batches),
        ``bytes_written`` (bytes accepted by the kernel, torn parts
        included), ``segments_closed``, ``segments_compressed``,
        ``write_errors`` (failed write/open/fsync calls),
        ``compress_errors`` (segments left uncompressed), ``current_segment``
        (path of the open segment as ``str``, or ``None``).
        """
        segment = self._segment
        with self._counter_lock:
            compressed, compress_errors = self._segments_compressed, self._compress_errors
        return {
            "records_written": self._records_written,
            "bytes_written": self._bytes_written,
            "segments_closed": self._segments_closed,
            "segments_compressed": compressed,
            "write_errors": self._write_errors,
            "compress_errors": compress_errors,
            "current_segment": str(segment.path) if segment is not None else None,
        }

    @property
    def current_segment_stats(self) -> SegmentStats | None:
        """A copy of the open segment's :class:`SegmentStats`, or ``None``."""
        segment = self._segment
        return replace(segment) if segment is not None else None


# -- reading ---------------------------------------------------------------


def list_segments(directory: str | os.PathLike) -> list[Path]:
    """The readable segments of a session, in segment-number order.

    For each number, the ``.jsonl`` if present (open segment, failed
    compression, or a crash before the ``.jsonl`` was unlinked), else the
    ``.jsonl.zst``.  ``.zst.tmp`` files and other names are ignored.

    Raises:
        SessionLogError: the directory cannot be listed.
    """
    directory = Path(directory)
    try:
        names = os.listdir(directory)
    except OSError as e:
        raise SessionLogError(f"{directory}: cannot list session: {e.strerror}") from e
    chosen: dict[int, str] = {}
    for name in names:
        m = _SEGMENT_RE.fullmatch(name)
        if m is None:
            continue
        number = int(m.group(1))
        if m.group(2) is None or number not in chosen:
            chosen[number] = name
    return [directory / chosen[n] for n in sorted(chosen)]


class _CorruptSegment(Exception):
    """A compressed segment ends early or fails to decode."""


class _LineSplitter:
    """Cuts a byte stream into lines of at most :data:`MAX_LINE_BYTES` bytes.

    Holds at most ``MAX_LINE_BYTES`` bytes of an unfinished line; longer lines
    are dropped while they stream by and come out as ``None``.
    """

    def __init__(self) -> None:
        self.next_lineno = 1
        self._pending = bytearray()
        self._skipping = False

    def feed(self, chunk: bytes) -> Iterator[tuple[int, bytes | None]]:
        """Yield ``(line_number, line or None if too long)`` for each line ended in ``chunk``."""
        start = 0
        while (nl := chunk.find(b"\n", start)) >= 0:
            if self._skipping:
                line = None
                self._skipping = False
            elif self._pending:
                self._pending += chunk[start:nl]
                line = bytes(self._pending) if len(self._pending) <= MAX_LINE_BYTES else None
                self._pending.clear()
            else:
                line = chunk[start:nl] if nl - start <= MAX_LINE_BYTES else None
            yield self.next_lineno, line
            self.next_lineno += 1
            start = nl + 1
        if start < len(chunk) and not self._skipping:
            self._pending += chunk[start:]
            if len(self._pending) > MAX_LINE_BYTES:
                self._pending.clear()
                self._skipping = True

    def finish(self) -> tuple[int, bytes | None] | None:
        """The unterminated last line, if any, as in :meth:`feed`."""
        if self._skipping:
            return self.next_lineno, None
        if self._pending:
            return self.next_lineno, bytes(self._pending)
        return None


def _jsonl_chunks(f) -> Iterator[bytes]:
    while chunk := f.read(_READ_CHUNK_BYTES):
        yield chunk


def _zst_chunks(f) -> Iterator[bytes]:
    """Decompressed chunks of a ``.zst`` file of one or more frames.

    Raises:
        _CorruptSegment: a frame fails to decode (bad block, checksum
            mismatch, garbage) or the file ends inside a frame or is empty.
    """
    dctx = zstandard.ZstdDecompressor()
    dobj = dctx.decompressobj()
    frame_fed = False  # the current decompressobj has been given input
    any_input = False
    while True:
        data = f.read(_ZSTD_INPUT_CHUNK_BYTES)
        if not data:
            break
        any_input = True
        while data:
            try:
                out = dobj.decompress(data)
            except zstandard.ZstdError as e:
                raise _CorruptSegment(str(e)) from e
            frame_fed = True
            if out:
                yield out
            if not dobj.eof:
                break
            # The frame ended inside this chunk: go on with the next frame.
            data = dobj.unused_data
            dobj = dctx.decompressobj()
            frame_fed = False
    if not any_input:
        raise _CorruptSegment("empty compressed segment")
    if frame_fed and not dobj.eof:
        raise _CorruptSegment("file ends inside a zstd frame")


def _open_segment_for_read(path: Path):
    """Open a segment; a ``.jsonl`` compressed and removed meanwhile is read as ``.zst``."""
    try:
        return path, open(path, "rb")
    except FileNotFoundError:
        if path.suffix != ".jsonl":
            raise
        zst = path.with_name(path.name + ".zst")
        return zst, open(zst, "rb")


def read_session(
    directory: str | os.PathLike,
    *,
    on_torn: Callable[[str, int], None] | None = None,
) -> Iterator[dict]:
    """Yield every record of a session, in order.

    Segments are read in number order (see :func:`list_segments`): ``.jsonl``
    directly, ``.jsonl.zst`` through a streaming zstd decoder.  Memory stays
    bounded: at most :data:`MAX_LINE_BYTES` of a line plus one decoded chunk.
    A live session can be read; a segment compressed while the reader runs is
    read from its ``.zst``.

    Args:
        directory: the session directory.
        on_torn: called as ``on_torn(segment_path, line_number)`` (line
            numbers from 1 within the segment) for each line that is skipped:
            not JSON, not an object, or longer than :data:`MAX_LINE_BYTES`
            (typically the last line of a segment torn by a crash); and once
            for a ``.zst`` segment that is truncated or corrupt, with the
            number of the first line not decoded, after the records decoded
            before the damage.  ``None``: such lines are logged at WARNING
            level.

    Raises:
        SessionLogError: the directory or a segment cannot be read (I/O error).
    """

    def report(path: Path, lineno: int) -> None:
        if on_torn is not None:
            on_torn(str(path), lineno)
        else:
            log.warning("%s:%d: skipped a torn or corrupt line", path, lineno)

    def parse(line: bytes | None) -> dict | None:
        if line is None:
            return None
        try:
            value = json.loads(line)
        except (ValueError, RecursionError):  # JSONDecodeError, UnicodeDecodeError
            return None
        return value if isinstance(value, dict) else None

    for listed in list_segments(directory):
        try:
            path, f = _open_segment_for_read(listed)
        except OSError as e:
            raise SessionLogError(f"{listed}: cannot open segment: {e.strerror}") from e
        with f:
            splitter = _LineSplitter()
            chunks = _zst_chunks(f) if path.suffix == ".zst" else _jsonl_chunks(f)
            try:
                for chunk in chunks:
                    for lineno, line in splitter.feed(chunk):
                        record = parse(line)
                        if record is None:
                            report(path, lineno)
                        else:
                            yield record
            except _CorruptSegment as e:
                log.warning("%s: corrupt compressed segment: %s", path, e)
                report(path, splitter.next_lineno)
                continue
            except OSError as e:
                raise SessionLogError(f"{path}: cannot read segment: {e.strerror}") from e
            tail = splitter.finish()
            if tail is not None:
                # A complete JSON object lacking only its newline is a whole
                # record (no prefix of an object is an object).
                record = parse(tail[1])
                if record is None:
                    report(path, tail[0])
                else:
                    yield record

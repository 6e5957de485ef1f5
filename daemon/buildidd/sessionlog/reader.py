"""The session reader: every record of a session, in order, in bounded memory.

Segments are read in number order (:func:`list_segments`): ``.jsonl``
directly, ``.jsonl.zst`` through a streaming zstd decoder.  A line that is not
a JSON object (typically the last line of a segment torn by a crash, see
:mod:`.writer`) is skipped and reported; a truncated or corrupt ``.zst``
yields the records before the damage and is reported once.  A segment
compressed while the reader runs is read from its ``.zst``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import zstandard

from buildidd.errors import SessionLogError
from buildidd.sessionlog.segments import MAX_LINE_BYTES, READ_CHUNK_BYTES, SEGMENT_RE

__all__ = ["list_segments", "read_segment", "read_session"]

log = logging.getLogger(__name__)

#: Compressed bytes fed to the decompressor per call.  A zstd block decodes to
#: at most 128 KiB and needs at least 4 bytes (RLE block, RFC 8878 §3.1.1.2),
#: so one call yields at most 32 MiB even for a hostile file, and far less
#: for the segments the writer makes.
_ZSTD_INPUT_CHUNK_BYTES = 1 << 10


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
        m = SEGMENT_RE.fullmatch(name)
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
    while chunk := f.read(READ_CHUNK_BYTES):
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

    for listed in list_segments(directory):
        yield from read_segment(listed, on_torn=on_torn)


def read_segment(listed: Path, *, on_torn: Callable[[str, int], None] | None = None) -> Iterator[dict]:
    """Yield every record of one segment (``.jsonl`` or ``.jsonl.zst``), in order.

    As :func:`read_session` for one segment: a ``.jsonl`` compressed
    meanwhile is read from its ``.zst``; torn or corrupt lines go to
    ``on_torn`` (or the log).

    Raises:
        SessionLogError: the segment cannot be opened or read.
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
            return
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

"""The session's gap file: every build-id the store lacks at the session's end, one JSON line each.

The end record counts the gaps and lists only the first few (in bytes); the
full list goes beside the segments, written once at the session's end::

    gaps.jsonl.zst     (gaps.jsonl when the session's segments are not compressed)

One ``gap`` record a line, in the end record's order (root's first, the uid
with the most gaps last): ``{"type": "gap", "build_id", "path", "reason",
"uid"}`` and ``"path_cut": true`` when the path kept only its end.  The file
is written to a temporary name, synced, renamed and the directory synced, so
a reader sees the whole file or none.  Its uncompressed size is bounded
(``max_bytes``: the ledger's budget): gaps that do not fit are counted, not
written.  The end record's ``store_coverage.gaps_file`` names it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import zstandard

from buildidd.errors import SessionLogError
from buildidd.fsio import replace_file
from buildidd.sessionlog.reader import read_segment
from buildidd.sessionlog.segments import FILE_MODE, MAX_LINE_BYTES, ZSTD_LEVEL

__all__ = ["GAPS_NAME", "GAPS_NAMES", "find_gap_file", "read_gaps", "write_gaps"]

GAPS_NAME = "gaps.jsonl"
"""The gap file's name (``.zst`` added when compressed)."""
GAPS_NAMES = (GAPS_NAME + ".zst", GAPS_NAME)
"""The names a reader looks for, in this order."""


def write_gaps(session_dir: str | os.PathLike, gaps: Iterable[dict], *, compress: bool,
               max_bytes: int) -> dict:
    """Write the gap file of session_dir atomically (see the module docstring).

    Args:
        gaps: gap items (store.gapreport.gap_item), in listing order; each gets ``"type": "gap"``.
        compress: zstd (level ZSTD_LEVEL, with checksum), as the session's segments.
        max_bytes: uncompressed bytes at most; gaps past it are counted in ``omitted``.
    Returns:
        {"name": file name, "gaps": records written, "omitted": gaps left out, "bytes": uncompressed
        size, "stored_bytes": size on disk}.
    Raises:
        SessionLogError: the file cannot be written (nothing is left behind but what was there).
    """
    directory = Path(session_dir)
    name = GAPS_NAMES[0] if compress else GAPS_NAME
    lines: list[bytes] = []
    size = omitted = 0
    for gap in gaps:
        line = json.dumps({"type": "gap", **gap}, separators=(",", ":")).encode() + b"\n"
        if omitted or size + len(line) > max_bytes or len(line) > MAX_LINE_BYTES:
            omitted += 1
            continue
        lines.append(line)
        size += len(line)
    data = b"".join(lines)
    if compress:
        data = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True).compress(data)
    _write_atomic(directory / name, data)
    return {"name": name, "gaps": len(lines), "omitted": omitted, "bytes": size, "stored_bytes": len(data)}


def _write_atomic(path: Path, data: bytes) -> None:
    try:
        replace_file(path.parent, path.name, data, FILE_MODE)
    except OSError as e:
        raise SessionLogError(f"{path}: cannot write the gap file: {e.strerror}") from e


def find_gap_file(session_dir: str | os.PathLike) -> Path | None:
    """The session's gap file (GAPS_NAMES, first found; a symlink is not taken), or None."""
    for name in GAPS_NAMES:
        path = Path(session_dir) / name
        if path.is_file() and not path.is_symlink():
            return path
    return None


def read_gaps(session_dir: str | os.PathLike, *,
              on_torn: Callable[[str, int], None] | None = None) -> Iterator[dict]:
    """The ``gap`` records of a session's gap file, in order (nothing when it has none).

    Read as a segment is (reader.read_segment: lines of at most MAX_LINE_BYTES, zstd streamed),
    so memory stays bounded whatever the file holds; a line that is not a ``gap`` object goes to
    on_torn (or the log).

    Raises:
        SessionLogError: the file cannot be read.
    """
    path = find_gap_file(session_dir)
    if path is None:
        return
    for record in read_segment(path, on_torn=on_torn):
        if record.get("type") == "gap":
            yield record
        elif on_torn is not None:
            on_torn(str(path), 0)

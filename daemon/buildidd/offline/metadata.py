"""Which build-ids a path had, when, on which host: the recorded history, in debuginfod's /metadata shape.

elfutils debuginfod 0.190+ answers ``GET /metadata?key=file|glob&value=V``
with ``{"results": [{"type": "executable"|"debuginfo", "buildid": HEX,
"file": PATH, "archive": PATH?}, ...], "complete": bool}`` from the files it
scanned (debuginfod.cxx, handle_metadata: ``file`` is an exact path,
``glob`` an SQLite GLOB pattern, ``complete`` false when the answer was cut
short).  The sessions know more than any scan: every build-id a path was
mapped or executed with, and when.  :func:`metadata` answers from them: one
``executable`` result per (build-id, path), with the extra fields clients
ignore: ``first_seen``/``last_seen`` (ISO 8601, UTC, wall clock), ``host``
(where it was first seen) and ``held`` (the store has its bytes).  Used by ``buildidd serve``
(``/metadata``) and ``buildidd which``.

Bounded: at most :data:`MAX_RESULTS` results (``complete`` false beyond) and
:data:`MAX_SESSIONS` sessions read, newest first; a session that cannot be
read makes the answer incomplete, never an error.
"""

from __future__ import annotations

import fnmatch
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from buildidd.errors import BuildiddError, UsageError
from buildidd.sessionlog import list_segments, read_session

__all__ = ["KEYS", "MAX_RESULTS", "MAX_SESSIONS", "metadata"]

#: The query keys debuginfod's /metadata takes.
KEYS = ("file", "glob")
#: Results at most in one answer.
MAX_RESULTS = 1000
#: Sessions read at most, newest first.
MAX_SESSIONS = 256
#: A glob or path longer than this is refused (PATH_MAX).
MAX_VALUE_BYTES = 4096


@dataclass
class _Seen:
    first_wall_ns: int | None
    last_wall_ns: int | None
    host: str | None
    htlhash: bool = False       # the key is the file's htlhash (file_id): it has no GNU build-id


def _matcher(key: str, value: str) -> Callable[[str], bool]:
    """key ``file``: the exact path; ``glob``: fnmatch's case-sensitive glob (``*`` also crosses ``/``,
    as SQLite's GLOB does).

    Raises:
        UsageError: an unknown key, or an empty or overlong value.
    """
    if key not in KEYS:
        raise UsageError(f"metadata key {key!r}: give one of {', '.join(KEYS)}")
    if not value or len(value.encode("utf-8", "surrogateescape")) > MAX_VALUE_BYTES:
        raise UsageError(f"metadata value: give a path or a glob of 1 to {MAX_VALUE_BYTES} bytes")
    if key == "file":
        return value.__eq__
    return lambda path: fnmatch.fnmatchcase(path, value)


def _iso(wall_ns: int | None) -> str | None:
    if wall_ns is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall_ns / 1e9))


def _sessions(session_root: str | os.PathLike) -> list[Path]:
    """The session directories under session_root, newest first (names start with their UTC start)."""
    try:
        names = sorted(os.listdir(session_root), reverse=True)
    except FileNotFoundError:
        return []
    root = Path(session_root)
    return [root / n for n in names
            if not n.startswith(".") and not (root / n).is_symlink() and (root / n).is_dir()
            and list_segments(root / n)]


def metadata(session_root: str | os.PathLike, key: str, value: str,
             held: Callable[[str], bool] | None = None) -> dict:
    """The /metadata answer for key (``file`` or ``glob``) and value, from the sessions under session_root.

    Args:
        held: True when the store holds a build-id (Store.contains), for the ``held`` field; None: not asked.
    Returns:
        ``{"results": [{"type": "executable", "buildid", "file", "first_seen", "last_seen", "host", "held"}],
        "complete": bool}``, results sorted by path, then first_seen.  A file without a GNU build-id
        is given by its htlhash (the record's ``file_id``, which serve answers for), with
        ``"key": "htlhash"``.
    Raises:
        UsageError: a bad key or value (the caller's 400, or exit 2).
    """
    match = _matcher(key, value)
    seen: dict[tuple[str, str], _Seen] = {}
    complete = True
    sessions = _sessions(session_root)
    if len(sessions) > MAX_SESSIONS:
        sessions, complete = sessions[:MAX_SESSIONS], False
    for directory in sessions:
        try:
            complete &= _scan(directory, match, seen)
        except (OSError, BuildiddError):
            complete = False
    results = []
    for (bid, path), s in sorted(seen.items(), key=lambda kv: (kv[0][1], kv[1].first_wall_ns or 0)):
        if len(results) >= MAX_RESULTS:
            complete = False
            break
        item = {"type": "executable", "buildid": bid, "file": path, "first_seen": _iso(s.first_wall_ns),
                "last_seen": _iso(s.last_wall_ns), "host": s.host}
        if s.htlhash:
            item["key"] = "htlhash"     # a file without a GNU build-id: serve's /buildid/<htlhash>/ has it
        if held is not None:
            try:
                item["held"] = bool(held(bid))
            except (OSError, ValueError):
                item["held"] = False
        results.append(item)
    return {"results": results, "complete": complete}


def _scan(directory: Path, match: Callable[[str], bool], seen: dict[tuple[str, str], _Seen]) -> bool:
    """Add directory's (build-id, path) sightings that match to seen; False when it was cut short
    (more distinct pairs than MAX_RESULTS)."""
    offset, host = None, None
    for r in read_session(directory):
        kind = r.get("type")
        if kind == "session":
            offset = r.get("boot_to_wall_offset_ns") if isinstance(r.get("boot_to_wall_offset_ns"), int) else None
            host = r.get("host") if isinstance(r.get("host"), str) else None
            continue
        if kind not in ("mmap", "exec"):
            continue
        bid, path = r.get("build_id") or r.get("file_id"), r.get("path")   # no GNU build-id: its htlhash
        if not isinstance(bid, str) or not isinstance(path, str) or not match(path):
            continue
        t = r.get("time_ns")
        wall = t + offset if isinstance(t, int) and offset is not None else None
        s = seen.get((bid, path))
        if s is None:
            if len(seen) >= MAX_RESULTS:
                return False
            seen[(bid, path)] = _Seen(wall, wall, host, not r.get("build_id"))
            continue
        if wall is not None:
            if s.first_wall_ns is None or wall < s.first_wall_ns:
                s.first_wall_ns, s.host = wall, host      # the host where it was first seen
            s.last_wall_ns = wall if s.last_wall_ns is None else max(s.last_wall_ns, wall)
    return True

"""Retention of sessions: old ones deleted by age and total size; the build-ids a session references.

The store's quota must never drop an entry a retained session needs:
:func:`session_build_ids` says which those are (the capture stage's
housekeeping joins the two).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

from buildidd.errors import SessionLogError
from buildidd.sessionlog.reader import read_session
from buildidd.fsio import fsync_dir

log = logging.getLogger(__name__)


def session_build_ids(session_dir: str | os.PathLike) -> set[str]:
    """Every build-id a session references (lower-case hex).

    From ``mmap`` and ``exec`` records (``build_id``, else the ``file_id`` of a file without one: the
    htlhash the store keeps it under; also from ``file_id`` records) and the ``session``
    record (``kernel_build_id`` and the values of ``module_build_ids``), so
    that the kernel's entry is protected as well.  Reads the whole session
    (closed segments are decompressed): callers should remember the answer
    for a closed session.

    Raises:
        SessionLogError: the session cannot be read.
    """
    ids: set[str] = set()

    def add(value) -> None:
        if isinstance(value, str) and value:
            ids.add(value.lower())

    for record in read_session(session_dir):
        kind = record.get("type")
        if kind in ("mmap", "exec", "file_id"):
            add(record.get("build_id") or record.get("file_id"))   # no GNU build-id: its htlhash keys it
        elif kind == "session":
            add(record.get("kernel_build_id"))
            modules = record.get("module_build_ids")
            if isinstance(modules, dict):
                for value in modules.values():
                    add(value)
    return ids


def _session_usage(directory: str) -> tuple[int, int]:
    """(bytes of the files under directory, newest mtime ns of it and its files)."""
    total = 0
    newest = os.stat(directory).st_mtime_ns
    for dirpath, _dirnames, filenames in os.walk(directory):
        for name in filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            total += st.st_size
            newest = max(newest, st.st_mtime_ns)
    return total, newest


def sessions_usage(session_root: str | os.PathLike) -> tuple[int, int]:
    """(sessions, bytes of their files) under session_root, counted as :func:`enforce_retention` counts
    them (the limit ``session_max_total_bytes`` applies to these bytes); (0, 0) when it cannot be listed."""
    try:
        with os.scandir(session_root) as it:
            dirs = [e.path for e in it if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)]
    except OSError:
        return 0, 0
    total = n = 0
    for d in dirs:
        try:
            total += _session_usage(d)[0]
            n += 1
        except OSError:
            continue   # deleted meanwhile
    return n, total


def enforce_retention(session_root: str | os.PathLike, *, max_age_s: float | None,
                      max_total_bytes: int | None, keep: Iterable[str | os.PathLike],
                      now_s: float | None = None) -> list[Path]:
    """Delete whole session directories, oldest first, by age and by total size.

    A session is every subdirectory of session_root (not a symlink, not
    hidden).  Its age is ``now_s`` minus its last modification (the newest
    mtime of the directory and its files: when it was last written); its size
    the sum of its files' ``st_size``.  In order of last modification (then
    name), a session is deleted when it is older than ``max_age_s`` or the
    total of all sessions (kept ones included) exceeds ``max_total_bytes``.
    Sessions named in ``keep`` are never deleted.

    Args:
        session_root: the directory holding the sessions.
        max_age_s: seconds; ``None``: no age limit.
        max_total_bytes: bytes; ``None``: no size limit.
        keep: session directories (paths or names) never to delete, e.g. the current one.
        now_s: seconds since the epoch; default ``time.time()``.

    Returns:
        The directories deleted, oldest first.

    Raises:
        SessionLogError: session_root cannot be listed or a session cannot be
            deleted; the exception's ``removed`` attribute lists the
            directories deleted before.
    """
    root = Path(session_root)
    keep_names = {os.path.basename(os.path.normpath(os.fspath(k))) for k in keep}
    now = time.time() if now_s is None else now_s
    sessions = []
    try:
        with os.scandir(root) as it:
            candidates = [e for e in it if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)]
    except OSError as e:
        raise SessionLogError(f"{root}: cannot list sessions: {e.strerror}") from e
    for e in candidates:
        try:
            size, newest_ns = _session_usage(e.path)
        except OSError:
            continue  # vanished meanwhile
        sessions.append((newest_ns, e.name, Path(e.path), size))
    sessions.sort()
    total = sum(s[3] for s in sessions)
    removed: list[Path] = []
    for newest_ns, name, path, size in sessions:
        if name in keep_names:
            continue
        too_old = max_age_s is not None and now - newest_ns / 1e9 > max_age_s
        too_big = max_total_bytes is not None and total > max_total_bytes
        if not (too_old or too_big):
            break  # the rest are newer and the total only shrinks
        try:
            shutil.rmtree(path)
        except OSError as e:
            err = SessionLogError(f"{path}: cannot delete session: {e.strerror}")
            err.removed = removed
            raise err from e
        total -= size
        removed.append(path)
        log.info("deleted session %s (%d bytes, last written %.0f s ago)", path, size, now - newest_ns / 1e9)
    if removed:
        try:
            fsync_dir(root)
        except OSError as e:
            log.warning("%s: fsync after deleting sessions: %s", root, e.strerror)
    return removed

"""Sealing sessions a crash left open: run at the daemon's start, before it writes.

A session whose writer died (kill -9, a crash, a power loss) has no ``end``
record, its last segment is an uncompressed ``.jsonl`` (maybe ending in a torn
line), and segments whose compression was cut (or failed on a full disk) stay
``.jsonl`` beside leftover ``.zst.tmp`` files.  :func:`seal_unclosed_sessions`
puts such a session in the state a clean close leaves:

1. leftover ``.zst.tmp`` files are removed;
2. a session without :data:`~.segments.CLOSED_MARKER` whose last record is not
   ``end`` gets one appended to its last segment (a torn last line is
   terminated first, so it stays one bad line)::

       {"type": "end", "clean": false, "time_ns": <last record's time_ns>,
        "sealed_at_ns": <ns since boot at sealing>, "torn_lines": N,
        "reason": "not closed cleanly (daemon killed or crashed); sealed at the next start"}

   A clean ``end`` (the recorder's) has no ``clean`` key; ``"clean": false``
   is the marker of a session that was not closed cleanly;
3. every ``.jsonl`` segment is compressed (when compression is on);
4. :data:`~.segments.CLOSED_MARKER` is written (``{"clean": false, ...}`` for
   a sealed session, ``{"clean": true}`` for one found already ended), so the
   next start does not read it again;
5. the modification times of the files and of the directory are set back to
   what they were, so retention by age still sees when it was last written.

A session being written holds its directory's ``flock`` (see
:func:`~.segments.lock_session_dir`) and is skipped; so is a directory that
holds no segment.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from buildidd import clock
from buildidd.errors import SessionLogError
from buildidd.fsio import fsync_dir
from buildidd.sessionlog.compress import compress_segment
from buildidd.sessionlog.reader import list_segments, read_segment
from buildidd.sessionlog.segments import (
    CLOSED_MARKER, SEGMENT_RE, ZSTD_LEVEL, lock_session_dir, write_closed_marker,
)

__all__ = ["SealReport", "seal_unclosed_sessions"]

log = logging.getLogger(__name__)


@dataclass
class SealReport:
    """What :func:`seal_unclosed_sessions` did to one session directory.

    Attributes:
        path: the session directory.
        sealed: an ``end`` record with ``"clean": false`` was appended.
        torn_lines: lines of the session skipped as torn or corrupt (only
            counted when the session was read, i.e. when it had no marker).
        compressed: ``.jsonl`` segments compressed now.
        error: why the session could not be fully sealed, or ``None``.
    """

    path: Path
    sealed: bool = False
    torn_lines: int = 0
    compressed: int = 0
    error: str | None = None


def seal_unclosed_sessions(session_root: str | os.PathLike, *, exclude: Iterable[str | os.PathLike] = (),
                           compress: bool = True, zstd_level: int = ZSTD_LEVEL) -> list[SealReport]:
    """Seal every session under ``session_root`` that was not closed (see the module docstring).

    Args:
        session_root: the directory holding the sessions; absent: nothing to do.
        exclude: session directories (paths or names) not to touch.
        compress: compress ``.jsonl`` segments (the daemon's ``compress`` setting).
        zstd_level: 1-22.

    Returns:
        one report per session directory that needed work (or failed), in name order.

    Raises:
        SessionLogError: session_root exists but cannot be listed.  A session
            that cannot be sealed is reported (``error``) and logged, not raised.
    """
    root = Path(session_root)
    skip = {os.path.basename(os.path.normpath(os.fspath(e))) for e in exclude}
    try:
        with os.scandir(root) as it:
            candidates = sorted(e.name for e in it if not e.name.startswith(".") and e.name not in skip
                                and e.is_dir(follow_symlinks=False))
    except FileNotFoundError:
        return []
    except OSError as e:
        raise SessionLogError(f"{root}: cannot list sessions: {e.strerror}") from e
    reports = []
    for name in candidates:
        report = _seal_one(root / name, compress, zstd_level)
        if report is not None:
            reports.append(report)
    return reports


def _seal_one(directory: Path, compress: bool, zstd_level: int) -> SealReport | None:
    try:
        names = os.listdir(directory)
    except OSError as e:
        return SealReport(directory, error=f"cannot list: {e.strerror}")
    if not any(SEGMENT_RE.fullmatch(n) for n in names):
        return None  # not a session (or an empty one)
    try:
        lock_fd = lock_session_dir(directory)
    except BlockingIOError:
        return None   # a live writer holds it
    except OSError as e:
        return SealReport(directory, error=f"cannot lock: {e.strerror}")
    report = SealReport(directory)
    try:
        times = _mtimes(directory)
        closed = CLOSED_MARKER in names
        if not closed:
            _seal_end(directory, report)
        if compress:
            _compress_all(directory, report, zstd_level)
        if not closed:
            write_closed_marker(directory, {"clean": not report.sealed, "sealed_at_ns": clock.boot_ns(),
                                            "torn_lines": report.torn_lines})
        if report.sealed or report.compressed or not closed:
            _restore_mtimes(directory, times)
    except (OSError, SessionLogError) as e:
        report.error = str(e)
        log.warning("%s: cannot seal session: %s", directory, e)
    finally:
        os.close(lock_fd)
    if report.sealed or report.compressed or report.error:
        log.info("session %s: %s%d segments compressed, %d torn lines%s", directory,
                 "sealed (not closed cleanly), " if report.sealed else "", report.compressed,
                 report.torn_lines, f", error: {report.error}" if report.error else "")
        return report
    return None


def _last_record(directory: Path, report: SealReport) -> dict | None:
    """The session's last record (reading back from the last segment), counting torn lines."""
    def torn(_path: str, _lineno: int) -> None:
        report.torn_lines += 1

    for segment in reversed(list_segments(directory)):
        last = None
        for record in read_segment(segment, on_torn=torn):
            last = record
        if last is not None:
            return last
    return None


def _seal_end(directory: Path, report: SealReport) -> None:
    """Append the ``"clean": false`` end record unless the session has an ``end``."""
    for leftover in directory.glob("segment-*.jsonl.zst.tmp"):
        leftover.unlink()
    last = _last_record(directory, report)
    if last is not None and last.get("type") == "end":
        return
    segments = list_segments(directory)
    target = segments[-1]
    if target.suffix != ".jsonl":  # the last one was compressed (a rotation, then the crash)
        number = int(SEGMENT_RE.fullmatch(target.name).group(1)) + 1
        target = directory / f"segment-{number:06d}.jsonl"
    record = {"type": "end", "clean": False,
              "time_ns": last.get("time_ns") if isinstance(last, dict) else None,
              "sealed_at_ns": clock.boot_ns(), "torn_lines": report.torn_lines,
              "reason": "not closed cleanly (daemon killed or crashed); sealed at the next start"}
    line = json.dumps(record, separators=(",", ":")).encode() + b"\n"
    fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW, 0o640)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line  # the torn line stays one bad line of its own
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(directory)
    report.sealed = True


def _compress_all(directory: Path, report: SealReport, zstd_level: int) -> None:
    """Compress every ``.jsonl`` segment (a stale ``.zst`` beside it is replaced)."""
    for leftover in directory.glob("segment-*.jsonl.zst.tmp"):
        leftover.unlink()
    for segment in list_segments(directory):
        if segment.suffix == ".jsonl":
            compress_segment(segment, zstd_level)
            report.compressed += 1


def _mtimes(directory: Path) -> tuple[int, int]:
    """(newest mtime ns of the directory's segment files, the directory's own mtime ns)."""
    newest = 0
    for path in directory.iterdir():
        if SEGMENT_RE.fullmatch(path.name):
            newest = max(newest, path.stat().st_mtime_ns)
    return newest, directory.stat().st_mtime_ns


def _restore_mtimes(directory: Path, times: tuple[int, int]) -> None:
    newest, dir_mtime = times
    for path in directory.iterdir():
        if SEGMENT_RE.fullmatch(path.name) or path.name == CLOSED_MARKER:
            os.utime(path, ns=(newest, newest), follow_symlinks=False)
    os.utime(directory, ns=(max(newest, dir_mtime), max(newest, dir_mtime)))

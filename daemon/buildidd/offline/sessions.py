"""Sessions on disk: the facts a listing and an archive manifest give about each.

One streaming pass over a session's records (:func:`buildidd.sessionlog.read_session`,
bounded memory: one line and one decoded chunk at a time) collects what
``buildidd sessions`` prints and what ``buildidd archive`` writes into its
manifest: host, boot id, kernel, time range, record counts by type, lost events,
and every build-id the session references with the paths it was seen at (for a
file without a GNU build-id, its htlhash: the ``file_id`` the store keeps it under).

Memory grows with the number of *distinct* build-ids (and at most
:data:`MAX_PATHS_PER_BUILD_ID` paths each, :data:`MAX_UNRESOLVED` unresolved
paths), never with the number of records.
"""

from __future__ import annotations

from collections.abc import Callable

import json
import os
import stat
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from buildidd import clock
from buildidd.offline.manifest import CLOSED_MARKER, CLOSED_MARKER_MAX_BYTES
from buildidd.offline.resolutions import TIMEOUT, identity_of
from buildidd.sessionlog import find_gap_file, list_segments, read_gaps, read_session

__all__ = ["MAX_PATHS_PER_BUILD_ID", "MAX_UNRESOLVED", "BuildIdUse", "SessionFacts", "SessionInfo",
           "list_sessions", "read_marker", "session_dirs", "read_marker_bytes", "session_facts", "session_info"]

#: Paths kept per build-id (a build-id mapped from more paths keeps the first ones).
MAX_PATHS_PER_BUILD_ID = 16
#: (path, error) pairs without a build-id kept for the manifest; the rest are only counted.
MAX_UNRESOLVED = 1000

#: Uids whose gap counts a listing takes from an end record at most (the recorder writes 16).
MAX_UIDS = 64

#: kind of a referenced build-id: a mapped file, the running kernel, a loaded module.
KIND_FILE, KIND_KERNEL, KIND_MODULE = "file", "kernel", "module"


@dataclass
class SessionInfo:
    """One session, as ``buildidd sessions`` lists it.

    Attributes:
        name: the session directory's name.
        path: the session directory.
        host, boot_id, kernel_release, machine, kernel_build_id: from the
            ``session`` record (host.describe()); ``None`` when absent.
        boot_to_wall_offset_ns: the session record's offset, ns (wall = boot + offset).
        first_time_ns, last_time_ns: smallest and largest ``time_ns`` of any
            record, ns since boot; ``None`` for a session without records.
        size_bytes: sum of the segment files' sizes (compressed as stored).
        records: record count by ``type``.
        build_ids: distinct build-ids referenced (mappings, execs, kernel, modules).
        build_ids_stored: how many of them the store holds (None: no store was asked).
        lost: events the kernel side dropped (sum of the ``lost`` records' counts).
        throttled: records the per-user budgets held back (sum of the ``throttled`` records').
        torn_lines: lines skipped as torn or corrupt while reading.
        closed: the session has an ``end`` record, or its directory the closed
            marker (``.closed``) that the session writer's close, or the sealing
            of a crashed session at the next start, leaves.
        clean: whether it was closed cleanly: the ``end`` record's ``clean``
            (absent in the recorder's own end record: ``True``; ``false`` in the
            one the sealing appends), else the marker's ``clean``; ``None`` while
            not closed (live, or killed and not sealed yet).
        sealed: closed by the sealing at the next start, not by the daemon
            (the ``end`` record, or the marker, has ``sealed_at_ns`` and is not clean).
        gaps: build-ids the session named that the store lacked at its end (the end record's
            ``store_coverage``); None: not counted (no store, or not closed by the daemon).
        gaps_by_uid: uid (text) -> those gaps, for the uids the end record counts one by one.
        gaps_file: the gap file's name (sessionlog.gapfile), None when the session has none;
            gaps_in_file: its gap records, read now.
    """

    name: str
    path: Path
    host: str | None = None
    boot_id: str | None = None
    kernel_release: str | None = None
    machine: str | None = None
    kernel_build_id: str | None = None
    boot_to_wall_offset_ns: int | None = None
    first_time_ns: int | None = None
    last_time_ns: int | None = None
    size_bytes: int = 0
    records: dict[str, int] = field(default_factory=dict)
    build_ids: int = 0
    build_ids_stored: int | None = None
    lost: int = 0
    throttled: int = 0
    torn_lines: int = 0
    closed: bool = False
    clean: bool | None = None
    sealed: bool = False
    gaps: int | None = None
    gaps_by_uid: dict[str, int] = field(default_factory=dict)
    gaps_file: str | None = None
    gaps_in_file: int = 0

    def wall_ns(self, time_ns: int | None) -> int | None:
        """A boot-time ns of this session as ns since the epoch (None when either is unknown)."""
        if time_ns is None or self.boot_to_wall_offset_ns is None:
            return None
        return clock.wall_ns(time_ns, self.boot_to_wall_offset_ns)

    def to_json(self) -> dict:
        """JSON-ready form (``path`` as text, wall-clock times added as ``first_wall_ns``/``last_wall_ns``)."""
        return {"name": self.name, "path": str(self.path), "host": self.host, "boot_id": self.boot_id,
                "kernel_release": self.kernel_release, "machine": self.machine,
                "kernel_build_id": self.kernel_build_id, "boot_to_wall_offset_ns": self.boot_to_wall_offset_ns,
                "first_time_ns": self.first_time_ns, "last_time_ns": self.last_time_ns,
                "first_wall_ns": self.wall_ns(self.first_time_ns), "last_wall_ns": self.wall_ns(self.last_time_ns),
                "size_bytes": self.size_bytes, "records": dict(self.records), "build_ids": self.build_ids,
                "build_ids_stored": self.build_ids_stored, "lost": self.lost, "throttled": self.throttled, "torn_lines": self.torn_lines, "closed": self.closed, "clean": self.clean,
                "sealed": self.sealed, "gaps": self.gaps, "gaps_by_uid": dict(self.gaps_by_uid),
                "gaps_file": self.gaps_file, "gaps_in_file": self.gaps_in_file}


@dataclass
class BuildIdUse:
    """How a session references one build-id.

    Attributes:
        build_id_hex: lower-case hex.
        kind: :data:`KIND_FILE` (mmap/exec records), :data:`KIND_KERNEL`
            (the session record's ``kernel_build_id``), :data:`KIND_MODULE`.
        paths: the paths it was mapped or executed from (for a module, its
            name), first seen first, at most :data:`MAX_PATHS_PER_BUILD_ID`.
        records: mmap and exec records naming it.
    """

    build_id_hex: str
    kind: str
    paths: list[str] = field(default_factory=list)
    records: int = 0

    def add_path(self, path) -> None:
        if isinstance(path, str) and path and path not in self.paths and len(self.paths) < MAX_PATHS_PER_BUILD_ID:
            self.paths.append(path)


@dataclass
class SessionFacts:
    """What an archive manifest needs: the listing's facts plus the references.

    Attributes:
        info: the :class:`SessionInfo`.
        uses: build-id hex → :class:`BuildIdUse`, in first-seen order.
        unresolved: (path, error) → mappings, for mmap/exec records without a
            build-id, at most :data:`MAX_UNRESOLVED` pairs.
        unresolved_dropped: such records whose pair did not fit.
    """

    info: SessionInfo
    uses: dict[str, BuildIdUse] = field(default_factory=dict)
    unresolved: dict[tuple[str, str], int] = field(default_factory=dict)
    unresolved_dropped: int = 0


def _is_hex(value) -> bool:
    return isinstance(value, str) and 0 < len(value) <= 128 and all(c in "0123456789abcdefABCDEF" for c in value)


class _Scan:
    """Accumulates one session's facts record by record."""

    def __init__(self, info: SessionInfo, with_uses: bool):
        self.facts = SessionFacts(info)
        self.with_uses = with_uses
        self.ids: set[str] = set()
        self.counts: Counter[str] = Counter()
        self.timeouts: dict[tuple, set[str]] = {}     # identity -> paths of mappings recorded with "timeout"

    def use(self, bid: str, kind: str) -> BuildIdUse | None:
        bid = bid.lower()
        self.ids.add(bid)
        if not self.with_uses:
            return None
        use = self.facts.uses.get(bid)
        if use is None:
            use = self.facts.uses[bid] = BuildIdUse(bid, kind)
        return use

    def record(self, r: dict) -> None:
        info = self.facts.info
        kind = r.get("type")
        self.counts[kind if isinstance(kind, str) else "?"] += 1
        t = r.get("time_ns")
        if isinstance(t, int) and not isinstance(t, bool) and t >= 0:
            info.first_time_ns = t if info.first_time_ns is None else min(info.first_time_ns, t)
            info.last_time_ns = t if info.last_time_ns is None else max(info.last_time_ns, t)
        if kind in ("mmap", "exec"):
            self._mapping(r)
        elif kind == "session":
            self._session(r)
        elif kind == "lost":
            counts = r.get("counts")
            if isinstance(counts, dict):
                info.lost += sum(v for v in counts.values() if isinstance(v, int) and v > 0)
        elif kind == "throttled":
            n = r.get("records")
            if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                info.throttled += n
        elif kind == "resolution":
            self._resolution(r)
        elif kind == "file_id" and not r.get("build_id"):
            fid = r.get("file_id")
            if _is_hex(fid) and len(fid) == 32:      # the htlhash a kernel verdict's file is stored under
                self.use(fid, KIND_FILE)
        elif kind == "end":
            info.closed = True
            info.clean = r.get("clean") is not False
            info.sealed = not info.clean and "sealed_at_ns" in r
            self._coverage(r.get("store_coverage"))

    def _coverage(self, cov) -> None:
        """The end record's gap counts: the total and by uid (hostile input: only ints taken)."""
        if not isinstance(cov, dict) or not isinstance(cov.get("gaps"), dict):
            return
        info = self.facts.info
        info.gaps = sum(n for n in cov["gaps"].values() if isinstance(n, int) and n > 0)
        by_uid = cov.get("by_uid")
        if isinstance(by_uid, dict):
            for uid, c in list(by_uid.items())[:MAX_UIDS]:
                gaps = c.get("gaps") if isinstance(c, dict) else None
                if isinstance(gaps, dict):
                    info.gaps_by_uid[str(uid)[:16]] = sum(n for n in gaps.values() if isinstance(n, int) and n > 0)

    def _mapping(self, r: dict) -> None:
        bid = r.get("build_id")
        path = r.get("path") if r.get("type") == "mmap" else r.get("path") or r.get("filename")
        if r.get("error") == TIMEOUT and self.with_uses:
            key = identity_of(r)
            if key is not None and (key in self.timeouts or len(self.timeouts) < MAX_UNRESOLVED):
                self.timeouts.setdefault(key, set()).add(path if isinstance(path, str) else "?")
        if _is_hex(bid):
            use = self.use(bid, KIND_FILE)
            if use is not None:
                use.records += 1
                use.add_path(path)
            return
        fid = r.get("file_id")
        if _is_hex(fid) and len(fid) == 32:      # a file without a GNU build-id, stored under its htlhash
            use = self.use(fid, KIND_FILE)
            if use is not None:
                use.records += 1
                use.add_path(path)
        if self.with_uses:
            key = (path if isinstance(path, str) else "?", str(r.get("error") or "no_build_id"))
            facts = self.facts
            if key in facts.unresolved or len(facts.unresolved) < MAX_UNRESOLVED:
                facts.unresolved[key] = facts.unresolved.get(key, 0) + 1
            else:
                facts.unresolved_dropped += 1

    def _resolution(self, r: dict) -> None:
        """A late build-id (or htlhash): referenced by the paths its identity's timed-out mappings had."""
        bid = r.get("build_id")
        if not _is_hex(bid):
            bid = r.get("file_id")
            if not (_is_hex(bid) and len(bid) == 32):
                return
        use = self.use(bid, KIND_FILE)
        if use is not None:
            for path in sorted(self.timeouts.get(identity_of(r), ())):
                use.add_path(path)
            use.records += 1

    def _session(self, r: dict) -> None:
        info = self.facts.info
        for name in ("host", "boot_id", "kernel_release", "machine"):
            if isinstance(r.get(name), str) and getattr(info, name) is None:
                setattr(info, name, r[name])
        offset = r.get("boot_to_wall_offset_ns")
        if isinstance(offset, int) and info.boot_to_wall_offset_ns is None:
            info.boot_to_wall_offset_ns = offset
        kbid = r.get("kernel_build_id")
        if _is_hex(kbid):
            info.kernel_build_id = info.kernel_build_id or kbid.lower()
            use = self.use(kbid, KIND_KERNEL)
            if use is not None:
                use.add_path("[kernel.kallsyms]")
        modules = r.get("module_build_ids")
        if isinstance(modules, dict):
            for name, mbid in modules.items():
                if _is_hex(mbid):
                    use = self.use(mbid, KIND_MODULE)
                    if use is not None:
                        use.add_path(name)


def _segments_size(session_dir: Path) -> int:
    total = 0
    for seg in list_segments(session_dir):
        try:
            total += os.stat(seg).st_size
        except FileNotFoundError:  # compressed (and unlinked) since it was listed
            continue
    return total


def read_marker_bytes(session_dir: Path) -> bytes | None:
    """The bytes of the session directory's closed marker (``.closed``), or ``None`` when it has none, it is
    not a regular file (never followed: ``O_NOFOLLOW``), cannot be read, or is over CLOSED_MARKER_MAX_BYTES."""
    try:
        fd = os.open(session_dir / CLOSED_MARKER, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.pread(fd, CLOSED_MARKER_MAX_BYTES + 1, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data if len(data) <= CLOSED_MARKER_MAX_BYTES else None


def read_marker(session_dir: Path) -> dict | None:
    """The session directory's closed marker as a JSON object (``{"clean": bool, ...}``), or ``None``
    (see :func:`read_marker_bytes`; also for one that is not a JSON object)."""
    data = read_marker_bytes(session_dir)
    try:
        body = json.loads(data) if data is not None else None
    except (ValueError, RecursionError):
        return None
    return body if isinstance(body, dict) else None


def _apply_marker(info: SessionInfo, marker: dict | None) -> None:
    """Fill closed/clean/sealed from the marker where the records left them unknown."""
    if marker is None:
        return
    info.closed = True
    if info.clean is None and isinstance(marker.get("clean"), bool):
        info.clean = marker["clean"]
        info.sealed = not info.clean and "sealed_at_ns" in marker


def _scan(session_dir: str | os.PathLike, with_uses: bool,
          holds: Callable[[str], bool] | None = None) -> SessionFacts:
    directory = Path(session_dir)
    scan = _Scan(SessionInfo(name=directory.name, path=directory), with_uses)

    def torn(_segment: str, _line: int) -> None:
        scan.facts.info.torn_lines += 1

    for record in read_session(directory, on_torn=torn):
        scan.record(record)
    info = scan.facts.info
    info.records = dict(scan.counts)
    info.build_ids = len(scan.ids)
    if holds is not None:
        info.build_ids_stored = sum(1 for bid in scan.ids if holds(bid))
    info.size_bytes = _segments_size(directory)
    _apply_marker(info, read_marker(directory))
    gap_file = find_gap_file(directory)
    if gap_file is not None:
        info.gaps_file = gap_file.name
        info.gaps_in_file = sum(1 for _ in read_gaps(directory, on_torn=torn))
    return scan.facts


def session_facts(session_dir: str | os.PathLike) -> SessionFacts:
    """The listing facts and every build-id reference of one session (one streaming pass).

    Build-ids come from ``mmap``/``exec`` records (``build_id``, with ``path``:
    for an exec the ELF that ran, else its ``filename``), ``resolution`` records
    (a late build-id, with the paths of the mappings of that file identity
    recorded with ``timeout``), and the ``session`` record (``kernel_build_id``,
    the values of ``module_build_ids``): the same set as the store's
    retention protects.

    Raises:
        SessionLogError: the session or a segment cannot be read.
    """
    return _scan(session_dir, with_uses=True)


def session_info(session_dir: str | os.PathLike, holds: Callable[[str], bool] | None = None) -> SessionInfo:
    """The listing facts of one session (:class:`SessionInfo`); paths are not kept.  holds: True
    when the store holds a build-id (Store.contains), to count ``build_ids_stored``.

    Raises:
        SessionLogError: the session or a segment cannot be read.
    """
    return _scan(session_dir, with_uses=False, holds=holds).info


def list_sessions(session_root: str | os.PathLike,
                  holds: Callable[[str], bool] | None = None) -> list[SessionInfo]:
    """Every session under session_root, in name order (names start with their UTC start time);
    holds as :func:`session_info`'s.

    A session is a subdirectory (not hidden, not a symlink) holding at least
    one segment.  A missing root is an empty list.

    Raises:
        SessionLogError: a session or a segment cannot be read.
    """
    return [session_info(d, holds) for d in session_dirs(session_root) if list_segments(d)]


def session_dirs(session_root: str | os.PathLike) -> list[Path]:
    """The session directories under session_root, in name order: its subdirectories that are neither
    hidden nor symlinks (with segments or not).  A missing root is an empty list.

    Raises:
        OSError: session_root cannot be listed (other than missing).
    """
    root = Path(session_root)
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    return [root / name for name in names
            if not name.startswith(".") and not (root / name).is_symlink() and (root / name).is_dir()]

"""``buildidd archive``: one session and every binary it references, in one tar + zstd stream.

Like ``perf archive`` (which tars the build-id cache entries of a perf.data
file's DSOs), but complete: the manifest lists every build-id the session
references, with its paths and what the archive holds of it, and the reason
when it holds nothing.  The member layout and the manifest are described in
:mod:`buildidd.offline.manifest`.

A live session can be archived: each segment is opened and its size taken
before the session is scanned, and exactly that many bytes are archived, so the
manifest lists at least every build-id the archived records reference.  Store
files are immutable once published (the store writes under a temporary name
and renames); one that vanishes during the archive (quota) aborts it.

``--exclude-upstream URL``: binaries a debuginfod server already serves are
left out and listed as ``upstream``.  Each build-id is asked for with HEAD
``URL/buildid/HEX/executable`` (``/debuginfo`` for a held debuginfo file);
elfutils' debuginfod 0.188 answers HEAD with 400, so a 400, 405 or 501 is
asked again with a GET whose connection is closed once the status line and
headers are read (the body is never read).  Requests run in parallel with a
short timeout; the first one decides whether the upstream is reachable at
all: an unreachable upstream excludes nothing, which the manifest's
``upstream`` field and a warning say.
"""

from __future__ import annotations

import http.client
import io
import logging
import os
import pwd
import stat
import tarfile
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import zstandard

from buildidd import __version__
from buildidd.errors import ArchiveError, SessionLogError
from buildidd.offline import manifest as mf
from buildidd.offline.manifest import ARCHIVED, UPSTREAM, BuildIdRef, FileRef, Manifest, SegmentRef
from buildidd.offline.sessions import SessionFacts, read_marker_bytes, session_facts
from buildidd.sessionlog import list_segments
from buildidd.store import DEBUG_NAME, ELF_NAME, PROBES_NAME, Store
from buildidd.store.origin import Origin, private_cause, read_origin

__all__ = ["ARCHIVE_MODE", "create_archive_file", "parse_mode", "write_archive", "check_upstream", "UpstreamCheck",
           "ZSTD_LEVEL"]

log = logging.getLogger(__name__)

#: zstd level of archives (3: zstd's default, fast enough to keep up with the disk on one core).
ZSTD_LEVEL = 3
#: Bytes per read when copying a file into the archive.
COPY_CHUNK_BYTES = 1 << 20
#: Seconds each upstream request may take (connect, then each read).
UPSTREAM_TIMEOUT_S = 3.0
#: Upstream requests in flight at once.
UPSTREAM_PARALLEL = 16
#: debuginfod's kind for each entry file that an upstream may serve.
_UPSTREAM_KIND = {ELF_NAME: "executable", DEBUG_NAME: "debuginfo"}

#: An archive file's mode unless told otherwise: its owner's alone (it carries the host's exec history).
ARCHIVE_MODE = 0o600

Progress = Callable[[int, int], None]
"""Called as ``progress(bytes_done, bytes_total)`` after each chunk written."""


def parse_mode(text: str) -> int:
    """An archive's ``--mode``: permission bits in octal (``0640``, ``640``), at most ``0o777``.
    Raises ValueError: not octal digits, or set-id/sticky bits (the archive is data, never run)."""
    if not text or any(c not in "01234567" for c in text.removeprefix("0o")):
        raise ValueError(f"mode {text!r}: give permission bits in octal, e.g. 0640")
    mode = int(text.removeprefix("0o"), 8)
    if mode > 0o777:
        raise ValueError(f"mode {text!r}: only permission bits (at most 0777), no set-id or sticky bits")
    return mode


def create_archive_file(path: str | os.PathLike, mode: int = ARCHIVE_MODE):
    """A new file at path (``O_EXCL``, never through a symlink) with exactly mode (fchmod: the umask does
    not widen or narrow it), open for binary writing.

    Raises:
        OSError: it exists, or cannot be created.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, mode)
        return os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise


# --- the upstream check ----------------------------------------------------------


@dataclass
class UpstreamCheck:
    """What an upstream debuginfod was asked and answered.

    Attributes:
        url: the base URL given.
        reachable: an HTTP answer came back to the first request.
        error: why it is not reachable (or the first per-request error).
        served: ``(build_id_hex, kind)`` pairs answered 200.
        errors: requests that got no HTTP answer (those files stay in the archive).
    """

    url: str
    reachable: bool = False
    error: str | None = None
    served: frozenset = frozenset()
    errors: int = 0

    def to_json(self, excluded: int) -> dict:
        return {"url": self.url, "reachable": self.reachable, "error": self.error,
                "excluded": excluded, "errors": self.errors}


def _status(url: urllib.parse.SplitResult, path: str, method: str, timeout_s: float) -> int:
    cls = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
    conn = cls(url.hostname, url.port, timeout=timeout_s)
    try:
        conn.request(method, path, headers={"User-Agent": f"buildidd/{__version__}"})
        return conn.getresponse().status       # status line and headers only; the body is never read
    finally:
        conn.close()


def _served(url: urllib.parse.SplitResult, bid: str, kind: str, timeout_s: float) -> bool:
    """Whether the upstream answers 200 for /buildid/BID/KIND (HEAD, else a GET closed after the headers).

    Raises:
        OSError, http.client.HTTPException: no HTTP answer.
    """
    path = f"{url.path.rstrip('/')}/buildid/{bid}/{kind}"
    status = _status(url, path, "HEAD", timeout_s)
    if status in (400, 405, 501):              # elfutils 0.188 answers HEAD with 400
        status = _status(url, path, "GET", timeout_s)
    return status == 200


def check_upstream(url: str, wanted: list[tuple[str, str]], *, timeout_s: float = UPSTREAM_TIMEOUT_S,
                   parallel: int = UPSTREAM_PARALLEL) -> UpstreamCheck:
    """Ask a debuginfod server which of ``wanted`` it serves.

    Args:
        url: ``http://host:port[/prefix]`` (or https).
        wanted: ``(build_id_hex, kind)`` pairs, kind ``executable`` or ``debuginfo``.
        timeout_s: per-request timeout, seconds.
        parallel: requests in flight at once.

    Returns:
        An :class:`UpstreamCheck`; when the first request gets no HTTP answer
        the upstream is unreachable and nothing is served.

    Raises:
        ArchiveError: ``bad_upstream_url``: not an http(s) URL with a host.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ArchiveError("bad_upstream_url", f"--exclude-upstream {url!r}: not an http:// or https:// URL")
    check = UpstreamCheck(url)
    if not wanted:
        check.reachable = True
        return check
    served, errors = set(), 0
    try:
        if _served(parts, *wanted[0], timeout_s):
            served.add(wanted[0])
    except (OSError, http.client.HTTPException) as e:
        check.error = f"{type(e).__name__}: {e}"
        return check
    check.reachable = True

    def one(item: tuple[str, str]) -> bool | None:
        try:
            return _served(parts, *item, timeout_s)
        except (OSError, http.client.HTTPException) as e:
            log.debug("upstream %s: %s/%s: %s", url, *item, e)
            return None

    with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(wanted) - 1))) as pool:
        for item, answer in zip(wanted[1:], pool.map(one, wanted[1:])):
            if answer is None:
                errors += 1
            elif answer:
                served.add(item)
    check.served, check.errors = frozenset(served), errors
    if errors:
        check.error = f"{errors} request(s) got no answer; those files stay in the archive"
    return check


# --- what the archive holds ----------------------------------------------------------


Sources = dict[str, dict[str, Path]]
"""Where each archived file is read from: ``{build-id: {name in the entry: path in the store}}``."""


def _entry_sources(store: Store, bid: str, main: Path, share_private: bool) -> dict[str, Path]:
    """The files to archive for an entry: its main directory's files (the ``elf`` being ``Store.best``'s
    trusted-first copy), and as ``debug`` the store's best debug copy when it is another file (the host's
    debuginfo, or an unstripped copy kept under ``alt/``) and may be shared."""
    directory = main.parent
    out = {}
    for name in mf.ENTRY_FILES:
        if name != DEBUG_NAME and stat.S_ISREG(_lstat_mode(directory / name)):
            out[name] = directory / name
    debug = store.best(bid, "debug")
    if debug is not None and debug != main and (share_private or not store.is_private(bid, "debug")):
        out[DEBUG_NAME] = debug
    return {name: out[name] for name in mf.ENTRY_FILES if name in out}


def _lstat_mode(path: Path) -> int:
    try:
        return os.lstat(path).st_mode
    except FileNotFoundError:
        return 0


def _ref(use, store: Store | None, share_private: bool, sources: Sources) -> BuildIdRef:
    """The manifest line of one referenced build-id, with the store's files when held (their paths into sources)."""
    ref = BuildIdRef(build_id=use.build_id_hex, kind=use.kind, paths=list(use.paths), records=use.records)
    if store is None:
        ref.reason = "no_store"
        return ref
    try:
        main = store.best(use.build_id_hex, "elf")
    except ValueError:
        ref.reason = "invalid_build_id"
        return ref
    if main is None:
        ref.reason = "not_in_store"
        return ref
    ref.provenance = store.provenance(use.build_id_hex)
    ref.key = store.key_kind(use.build_id_hex) or ref.key
    ref.quality = store.quality(use.build_id_hex)
    try:
        if not share_private and store.is_private(use.build_id_hex, "elf"):
            ref.reason = "private"
            _private_facts(ref, read_origin(main.parent))
            return ref
        files = _entry_sources(store, use.build_id_hex, main, share_private)
        ref.files = [FileRef(name, os.lstat(path).st_size) for name, path in files.items()]
        ref.entry = mf.check_entry(os.path.relpath(main.parent, store.root), use.build_id_hex)
    except (OSError, ValueError) as e:
        ref.files, ref.reason = [], f"unreadable: {e}"
        return ref
    sources[use.build_id_hex] = files
    ref.status = ARCHIVED
    return ref


def _private_facts(ref: BuildIdRef, origin: Origin | None) -> None:
    """Fill ref's owner (a name on this host) and what made its copy private: as the store recorded it, or,
    for an entry stored before that was recorded, as the source's path is now (store.origin.private_cause)."""
    if origin is None:
        return
    try:
        ref.owner = pwd.getpwuid(origin.uid).pw_name
    except (KeyError, OverflowError):
        ref.owner = f"uid {origin.uid}"
    cause = (origin.private_by, origin.private_by_mode) if origin.private_by else private_cause(
        origin.path, origin.mode)
    if cause is not None:
        ref.private_by = cause[0]
        ref.private_by_mode = cause[1] if cause[1] >= 0 else None


def _apply_upstream(refs: list[BuildIdRef], check: UpstreamCheck) -> int:
    """Mark the files the upstream serves; returns the number of build-ids now ``upstream``."""
    excluded = 0
    for ref in refs:
        for f in ref.files:
            kind = _UPSTREAM_KIND.get(f.name)
            f.upstream = kind is not None and (ref.build_id, kind) in check.served
        if any(f.upstream and f.name == ELF_NAME for f in ref.files):
            ref.status = UPSTREAM
            excluded += 1
            for f in ref.files:                # perf's probes cache is derived from the binary
                f.upstream = f.upstream or f.name == PROBES_NAME
    return excluded


def _upstream_wanted(refs: list[BuildIdRef]) -> list[tuple[str, str]]:
    return [(ref.build_id, _UPSTREAM_KIND[f.name]) for ref in refs if ref.kind == "file"
            for f in ref.files if f.name in _UPSTREAM_KIND]


@dataclass
class _Segment:
    fd: int
    name: str
    size_bytes: int


def _open_segments(session_dir: Path) -> list[_Segment]:
    """Open every segment and take its size now (a compressed-and-unlinked one is listed again)."""
    for _attempt in range(3):
        opened: list[_Segment] = []
        try:
            for path in list_segments(session_dir):
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
                opened.append(_Segment(fd, path.name, os.fstat(fd).st_size))
            return opened
        except FileNotFoundError:
            for s in opened:
                os.close(s.fd)
        except OSError as e:
            for s in opened:
                os.close(s.fd)
            raise SessionLogError(f"{session_dir}: cannot open a segment: {e.strerror}") from e
    raise SessionLogError(f"{session_dir}: segments keep changing; try again")


def build_manifest(facts: SessionFacts, segments: list[SegmentRef], store: Store | None,
                   check: UpstreamCheck | None = None, *, share_private: bool = False,
                   sources: Sources | None = None) -> Manifest:
    """The manifest of a session (facts from :func:`session_facts`) against a store.

    Args:
        facts: the session's facts.
        segments: the segments that will be archived.
        store: the build-id store, or ``None`` (everything ``missing``: ``no_store``).
        check: an upstream check whose served files are excluded, or ``None``.
        share_private: include copies the store marked private; otherwise they are ``missing``
            with the reason ``private`` (``Config.store_share_private``).
        sources: filled with where each archived file is read from (see :data:`Sources`).
    """
    info = facts.info.to_json()
    info.pop("path", None)
    sources = {} if sources is None else sources
    refs = [_ref(use, store, share_private, sources) for use in facts.uses.values()]
    m = Manifest(session=info, segments=segments, build_ids=refs, created_wall_ns=time.time_ns(),
                 buildidd_version=__version__, store_root=str(store.root) if store is not None else None,
                 unresolved=[{"path": p, "error": e, "records": n} for (p, e), n in facts.unresolved.items()])
    if facts.unresolved_dropped:
        m.unresolved.append({"path": None, "error": "more not listed", "records": facts.unresolved_dropped})
    if check is not None:
        m.upstream = check.to_json(_apply_upstream(refs, check))
    return m


# --- writing ---------------------------------------------------------------------------


class _Counted(io.RawIOBase):
    """Exactly ``size`` bytes of an fd from offset 0 (pread), reporting progress."""

    def __init__(self, fd: int, size: int, what: str, tick: Callable[[int], None]):
        super().__init__()
        self.fd, self.size, self.what, self.tick, self.pos = fd, size, what, tick, 0

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        n = self.size - self.pos if n < 0 else min(n, self.size - self.pos)
        data = os.pread(self.fd, min(n, COPY_CHUNK_BYTES), self.pos) if n > 0 else b""
        if n > 0 and not data:
            raise ArchiveError("source_changed", f"{self.what}: shorter than its {self.size} bytes")
        self.pos += len(data)
        self.tick(len(data))
        return data


def _info(name: str, size: int, mode: int = 0o644, mtime: float | None = None) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mode, ti.mtime = size, mode, int(mtime if mtime is not None else time.time())
    ti.uname = ti.gname = ""
    return ti


class _Writer:
    """The tar stream into the zstd stream into ``out``, with a progress count."""

    def __init__(self, out, total: int, progress: Progress | None):
        self.zw = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True).stream_writer(
            out, closefd=False)
        self.tar = tarfile.open(fileobj=self.zw, mode="w|", format=tarfile.PAX_FORMAT)
        self.done, self.total, self.progress = 0, total, progress

    def tick(self, n: int) -> None:
        self.done += n
        if self.progress is not None and n:
            self.progress(self.done, self.total)

    def add_bytes(self, name: str, data: bytes) -> None:
        self.tar.addfile(_info(name, len(data)), io.BytesIO(data))
        self.tick(len(data))

    def add_fd(self, name: str, fd: int, size: int, mode: int, mtime: float) -> None:
        self.tar.addfile(_info(name, size, mode, mtime), _Counted(fd, size, name, self.tick))

    def add_link(self, name: str, target: str) -> None:
        ti = _info(name, 0, 0o777)
        ti.type, ti.linkname = tarfile.SYMTYPE, target
        self.tar.addfile(ti)

    def close(self) -> None:
        self.tar.close()
        self.zw.flush(zstandard.FLUSH_FRAME)
        self.zw.close()


def _add_entry(w: _Writer, ref: BuildIdRef, files: dict[str, Path]) -> None:
    for f in ref.files:
        if f.upstream:
            continue
        path = files[f.name]
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as e:
            raise ArchiveError("source_changed", f"{path}: left the store during the archive: {e.strerror}") from e
        try:
            st = os.fstat(fd)
            if st.st_size != f.size_bytes:
                raise ArchiveError("source_changed", f"{path}: size changed during the archive")
            w.add_fd(mf.cache_member(ref.entry, f.name), fd, f.size_bytes, stat.S_IMODE(st.st_mode) & 0o755,
                     st.st_mtime)
        finally:
            os.close(fd)


def write_archive(session_dir: str | os.PathLike, store: Store | None, out, *,
                  exclude_upstream: str | None = None, progress: Progress | None = None,
                  share_private: bool = False) -> Manifest:
    """Write a session and the store entries of its build-ids to ``out`` as tar + zstd.

    Args:
        session_dir: the session directory (closed or live).
        store: the build-id store the session's daemon snapshotted into, or
            ``None`` (an archive of the segments alone; every build-id ``missing``).
        out: a binary file object open for writing (a file, a socket's
            writer, an HTTP response body); only ``write`` and ``flush`` are
            called, and it is not closed.
        exclude_upstream: a debuginfod URL: files it serves are left out
            (see the module docstring).
        progress: called as ``progress(bytes_done, bytes_total)`` (uncompressed
            bytes of the files archived).
        share_private: archive copies the store marked private (``Config.store_share_private``);
            otherwise they are listed ``missing`` with the reason ``private``.  Of the
            copies one build-id may have, the store's best is archived
            (:meth:`~buildidd.store.Store.best`: trusted first).

    Returns:
        The :class:`Manifest` written as the first member.

    Raises:
        SessionLogError: the session cannot be read.
        ArchiveError: ``source_changed`` (a store file vanished or changed
            size during the archive), ``bad_upstream_url``.
        OSError: writing to ``out`` failed.
    """
    session_dir = Path(session_dir)
    marker = read_marker_bytes(session_dir)     # before the segments: a marker read first says they are final
    segments = _open_segments(session_dir)
    try:
        facts = session_facts(session_dir)
        seg_refs = [SegmentRef(mf.segment_member(session_dir.name, s.name), s.size_bytes) for s in segments]
        sources: Sources = {}
        manifest = build_manifest(facts, seg_refs, store, share_private=share_private, sources=sources)
        if marker is not None:
            manifest.closed_marker = SegmentRef(mf.closed_marker_member(session_dir.name), len(marker))
        if exclude_upstream is not None:
            check = check_upstream(exclude_upstream, _upstream_wanted(manifest.build_ids))
            if not check.reachable:
                log.warning("upstream %s unreachable (%s): nothing excluded", exclude_upstream, check.error)
            manifest.upstream = check.to_json(_apply_upstream(manifest.build_ids, check))
        held = [r for r in manifest.build_ids if any(not f.upstream for f in r.files)]
        total = sum(s.size_bytes for s in segments) + sum(
            f.size_bytes for r in held for f in r.files if not f.upstream)
        w = _Writer(out, total, progress)
        w.add_bytes(mf.MANIFEST_NAME, manifest.to_json())
        for s, ref in zip(segments, seg_refs):
            w.add_fd(ref.member, s.fd, s.size_bytes, 0o640, os.fstat(s.fd).st_mtime)
        if marker is not None:
            w.add_bytes(manifest.closed_marker.member, marker)
        for ref in held:
            _add_entry(w, ref, sources[ref.build_id])
        for ref in held:
            w.add_link(mf.link_member(ref.build_id), mf.link_target(ref.entry))
        w.close()
    finally:
        for s in segments:
            os.close(s.fd)
    return manifest

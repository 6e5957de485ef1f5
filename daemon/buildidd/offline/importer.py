"""``buildidd import``: verify an archive, then install it into a perf build-id cache and a session root.

The archive is hostile until proven otherwise.  It is read once, as a stream
(tar inside zstd, :mod:`buildidd.offline.manifest`), and every member is
checked before a byte of it is written, into a staging directory inside each
target (``DIR/.buildidd-import-XXXX``); only when the whole archive has been
verified are the staged files renamed into place.  A refused archive leaves
nothing behind, and nothing is ever written outside the two targets.

Refusals, each an :class:`~buildidd.errors.ArchiveError` with its ``reason``:

``absolute_path``      a member name starting with ``/``
``dotdot``             a ``..`` component in a member name or a link target
``bad_name``           an empty or ``.`` component, NUL, or a name over 4096 bytes
``symlink_escape``     a symlink whose target leaves the archive's tree
``bad_link``           a ``.build-id`` symlink whose target is not its entry
``hard_link``          any hard link (archives never hold one)
``device``             a character or block device
``fifo``               a FIFO
``sparse``             a sparse member (GNU ``S``, pax ``GNU.sparse.*``): its holes
                       would expand beyond the stored bytes the limits count
``unsupported_member`` another member type (contiguous, ...)
``too_many_members``   more than ``ImportLimits.max_members`` members
``too_large``          a member, the manifest, a pax header or the whole
                       stream beyond its limit
``zstd_bomb``          the decompressed stream grows beyond ``max_ratio``
                       times the compressed bytes read (past a floor)
``bad_manifest``       no manifest first, or a malformed one
``unlisted_member``    a member the manifest does not list, or listed twice
``size_mismatch``      a member whose size differs from the manifest's
``build_id_mismatch``  an ELF member whose build-id (read back with
                       buildidd.resolve.buildid) is not the one it is filed under
``missing_member``     the stream ended before every listed member came
``corrupt``            the zstd stream or the tar is damaged or truncated
``not_an_archive``     the file does not start with a zstd frame (a text file, a gzip, a
                       plain tar): it is not what ``buildidd archive`` writes
``unreadable``         the archive file cannot be opened
``target_symlink``     a directory on the way to a target file is a symlink
``session_exists``     a different session of that name is already there
``bad_marker``         the session's closed marker is not a JSON object with a boolean ``clean``
``untrusted``          with ``untrusted="refuse"``: an archived entry whose provenance is not
                       ``trusted`` (see below)

The tar checks are this module's own.  The standard library's PEP 706
``tarfile.data_filter`` is applied as well when the running Python has it
(3.11.4 and later; Debian's 3.11.2 does not).

Layout installed: perf's build-id cache, gdb's ``.build-id`` tree beside it,
and the host's file times (:mod:`buildidd.offline.trees`).

Trust: the manifest gives each archived build-id the provenance of the store's
copies on the host (``trusted``, ``untrusted``, ``conflict``, ``unknown``;
:data:`buildidd.store.PROVENANCES`).  What is not ``trusted`` (an absent
provenance included: an older archive's) is, by ``untrusted``: ``mark``
(installed, with the word in ``DIR/<path>/<build-id>/provenance``, and listed
in the report), ``skip`` (not installed, listed) or ``refuse`` (the whole
archive refused).  A build-id is only a file's claim; only a trusted copy
says a system binary made it.

The session keeps its closed marker (``.closed``): the archive's copy, or, for
an archive without one (made before markers existed) of a session that ended,
one recreated from the manifest (``{"clean": …, "recreated_by": "buildidd import"}``),
so that an imported session is recognizable as closed.
"""

from __future__ import annotations

import json
import os
import secrets
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from buildidd.errors import ArchiveError, ElfError
from buildidd.fsio import remove_tree, write_all
from buildidd.offline import manifest as mf
from buildidd.offline.manifest import MISSING, UPSTREAM, Manifest
from buildidd.offline.trees import GDB_DIR, STAGE_PREFIX, install_links, keep_time, safe_dirs
from buildidd.offline.untar import (ZSTD_PEEK_BYTES, Bounded, ImportLimits, check_name, check_symlink, check_type,
                                   check_zstd_magic, tarinfo_class)
from buildidd.resolve.buildid import read_build_id_fd
from buildidd.resolve.fileid import file_id
from buildidd.store.origin import KEY_GNU, KEY_HTLHASH
from buildidd.store import BUILD_ID_DIR, ELF_NAME, TRUSTED

__all__ = ["ImportLimits", "ImportReport", "PROVENANCE_NAME", "UNTRUSTED_POLICIES", "import_archive", "import_members"]  # ImportLimits lives in offline.untar

UNTRUSTED_POLICIES = ("mark", "skip", "refuse")
"""What import does with an entry whose provenance is not ``trusted`` (see the module docstring)."""

PROVENANCE_NAME = "provenance"
"""The file that marks an installed entry's provenance when it is not ``trusted``."""

_COPY_CHUNK_BYTES = 1 << 20
#: tarfile's PEP 706 filter, where this Python has it (3.11.4+, 3.12+).
_DATA_FILTER = getattr(tarfile, "data_filter", None)


@dataclass
class ImportReport:
    """What an import did.

    Attributes:
        manifest: the archive's verified manifest.
        session_dir: the session's directory under the session root.
        session_new: the session was installed (``False``: the same one was there).
        installed: build-ids whose entries were installed (new files).
        present: build-ids whose files were all in the cache already.
        upstream: build-ids the archive left to an upstream debuginfod.
        missing: build-ids the archive does not hold (see the manifest's reasons).
        untrusted: archived build-ids whose provenance is not ``trusted`` (marked, or skipped).
        bytes: bytes of the files installed.
    """

    manifest: Manifest
    session_dir: Path
    session_new: bool = False
    installed: list[str] = field(default_factory=list)
    present: list[str] = field(default_factory=list)
    upstream: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    untrusted: list[str] = field(default_factory=list)
    bytes: int = 0


# --- what the manifest says the stream holds ------------------------------------------------


@dataclass
class _Expect:
    size: int
    rel: tuple[str, ...]          # path under the staging (and final) root
    session: bool                 # under the session root (else the cache)
    build_id: str | None = None
    fname: str | None = None
    key: str = KEY_GNU


def _expected(m: Manifest) -> tuple[dict[str, _Expect], dict[str, str]]:
    files: dict[str, _Expect] = {}
    name = m.session["name"]
    for s in m.segments:
        files[s.member] = _Expect(s.size_bytes, (name, s.member.rsplit("/", 1)[1]), True)
    if m.closed_marker is not None:
        files[m.closed_marker.member] = _Expect(m.closed_marker.size_bytes, (name, mf.CLOSED_MARKER), True)
    links = {}
    for ref in m.build_ids:
        held = [f for f in ref.files if not f.upstream]
        for f in held:
            files[mf.cache_member(ref.entry, f.name)] = _Expect(
                f.size_bytes, (*ref.entry.split("/"), f.name), False, ref.build_id, f.name, ref.key)
        if held:
            links[mf.link_member(ref.build_id)] = mf.link_target(ref.entry)
    return files, links


# --- staging and installing -------------------------------------------------------------------


class _Staging:
    """Staging directories inside both targets; removed whatever happens."""

    def __init__(self, debug_dir: Path, session_root: Path):
        tag = STAGE_PREFIX + secrets.token_hex(6)
        self.roots = {False: debug_dir / tag, True: session_root / tag}
        self.made: list[Path] = []        # target directories this import created, deepest first
        for r in self.roots.values():
            missing = [d for d in (r.parent, *r.parent.parents) if not os.path.lexists(d)]
            r.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
            self.made.extend(missing)
            os.mkdir(r, 0o700)

    def write(self, exp: _Expect, src, mode: int, mtime: float | None = None) -> Path:
        d = safe_dirs(self.roots[exp.session], exp.rel[:-1], create=True)
        path = d / exp.rel[-1]
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        try:
            left = exp.size
            while left:
                chunk = src.read(min(left, _COPY_CHUNK_BYTES))
                if not chunk:
                    raise ArchiveError("corrupt", f"{'/'.join(exp.rel)}: stream ended {left} bytes early")
                write_all(fd, chunk)
                left -= len(chunk)
            if exp.fname in mf.ELF_FILES:
                _verify_build_id(fd, exp)
            keep_time(fd, mtime)
            os.fsync(fd)
        finally:
            os.close(fd)
        return path

    def cleanup(self, failed: bool) -> None:
        """Remove the staging directories, and after a refusal the (empty) targets this import made."""
        for r in self.roots.values():
            remove_tree(r)          # it mirrors the archive's paths: deeper than shutil.rmtree recurses
        for d in sorted(self.made, key=lambda d: len(d.parts), reverse=True) if failed else ():
            try:
                os.rmdir(d)
            except OSError:       # not empty: another import or the user wrote there meanwhile
                continue


def _verify_build_id(fd: int, exp: _Expect) -> None:
    if exp.key == KEY_HTLHASH and exp.fname == ELF_NAME:
        _verify_htlhash(fd, exp)
        return
    try:
        got = read_build_id_fd(fd)
    except ElfError as e:
        raise ArchiveError("build_id_mismatch", f"{'/'.join(exp.rel)}: not a readable ELF file ({e}), "
                           f"filed under build-id {exp.build_id}") from e
    if got is None or got.hex != exp.build_id:
        raise ArchiveError("build_id_mismatch", f"{'/'.join(exp.rel)}: has build-id "
                           f"{got.hex if got else 'none'}, filed under {exp.build_id}")


def _verify_htlhash(fd: int, exp: _Expect) -> None:
    """An entry filed under an htlhash: the file's file_id is that, and it has no GNU build-id."""
    got = file_id(fd)
    try:
        gnu = read_build_id_fd(fd)
    except ElfError:
        gnu = None
    if got != exp.build_id or gnu is not None:
        raise ArchiveError("build_id_mismatch", f"{'/'.join(exp.rel)}: has htlhash {got} and build-id "
                           f"{gnu.hex if gnu else 'none'}, filed under the htlhash {exp.build_id}")


def _plan_session(m: Manifest, session_root: Path) -> Path | None:
    """The session's final directory, or None when the same session is there already.

    Raises:
        ArchiveError: ``session_exists`` a different session has that name.
    """
    final = session_root / m.session["name"]
    if not os.path.lexists(final):
        return final
    have = {}
    if final.is_dir() and not final.is_symlink():
        have = {p.name: p.stat().st_size for p in final.iterdir() if mf.SEGMENT_RE.fullmatch(p.name)}
    want = {s.member.rsplit("/", 1)[1]: s.size_bytes for s in m.segments}
    if have != want:
        raise ArchiveError("session_exists", f"{final}: a different session of that name exists")
    return None


def _closed_marker(m: Manifest, staged_session: Path) -> None:
    """Check the staged session's closed marker, or recreate one for a session that ended (see the module docstring).

    Raises:
        ArchiveError: ``bad_marker``.
    """
    path = staged_session / mf.CLOSED_MARKER
    if m.closed_marker is not None:
        with open(path, "rb") as f:
            data = f.read(mf.CLOSED_MARKER_MAX_BYTES + 1)
        try:
            body = json.loads(data)
        except (ValueError, RecursionError) as e:
            raise ArchiveError("bad_marker", f"{mf.closed_marker_member(m.session['name'])}: not JSON: {e}") from e
        if not isinstance(body, dict) or not isinstance(body.get("clean"), bool):
            raise ArchiveError("bad_marker", f"{mf.closed_marker_member(m.session['name'])}: "
                               "not an object with a boolean 'clean'")
    elif m.session.get("closed") is True:
        body = {"clean": m.session.get("clean") is not False, "recreated_by": "buildidd import"}
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
        try:
            write_all(fd, json.dumps(body, separators=(",", ":")).encode() + b"\n")
        finally:
            os.close(fd)


def _trusted(m: Manifest, policy: str, report: ImportReport) -> list:
    """The archived refs to install under the untrusted policy; the others' build-ids go to report.untrusted.

    Raises:
        ArchiveError: ``untrusted`` under ``refuse``, when one is not trusted.
    """
    held = [r for r in m.build_ids if any(not f.upstream for f in r.files)]
    doubtful = [r for r in held if r.provenance != TRUSTED]
    report.untrusted = [r.build_id for r in doubtful]
    if doubtful and policy == "refuse":
        r = doubtful[0]
        raise ArchiveError("untrusted", f"{len(doubtful)} archived build-id(s) not from a trusted system file, "
                           f"first {r.build_id} ({r.provenance or 'no provenance'}, {', '.join(r.paths[:2])})")
    return [r for r in held if r.provenance == TRUSTED] if policy == "skip" else held


def _mark(entry: Path, ref) -> None:
    """Write the entry's provenance beside its files (``provenance``: one word and a newline)."""
    if ref.provenance == TRUSTED:
        return
    tmp = entry / f".{PROVENANCE_NAME}{STAGE_PREFIX}{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        write_all(fd, f"{ref.provenance or 'unknown'}\n".encode())
    finally:
        os.close(fd)
    os.replace(tmp, entry / PROVENANCE_NAME)


def _install(m: Manifest, staging: _Staging, debug_dir: Path, session_root: Path, report: ImportReport,
             policy: str = "mark") -> None:
    name = m.session["name"]
    held = _trusted(m, policy, report)
    final_session = _plan_session(m, session_root)
    if final_session is not None:
        _closed_marker(m, staging.roots[True] / name)
    for ref in held:                       # refuse before the first rename
        safe_dirs(debug_dir, tuple(ref.entry.split("/")), create=False)
        safe_dirs(debug_dir, (BUILD_ID_DIR, ref.build_id[:2]), create=False)
        safe_dirs(debug_dir, (GDB_DIR, BUILD_ID_DIR, ref.build_id[:2]), create=False)
    if final_session is not None:
        os.rename(staging.roots[True] / name, final_session)
        report.session_new = True
    for ref in held:
        entry = safe_dirs(debug_dir, tuple(ref.entry.split("/")), create=True)
        new = 0
        for f in ref.files:
            if f.upstream or os.path.lexists(entry / f.name):
                continue
            os.rename(staging.roots[False].joinpath(*ref.entry.split("/"), f.name), entry / f.name)
            new += 1
            report.bytes += f.size_bytes
        install_links(debug_dir, ref)
        _mark(entry, ref)
        (report.installed if new else report.present).append(ref.build_id)


def _read_manifest(tf: tarfile.TarFile, ti: tarfile.TarInfo, limits: ImportLimits) -> Manifest:
    if ti.name != mf.MANIFEST_NAME or not ti.isreg():
        raise ArchiveError("bad_manifest", f"not a buildidd archive: its first member is {ti.name!r}, not a "
                           f"{mf.MANIFEST_NAME} file")
    if ti.size > limits.max_manifest_bytes:
        raise ArchiveError("too_large", f"manifest of {ti.size} bytes (limit {limits.max_manifest_bytes})")
    return Manifest.from_json(tf.extractfile(ti).read())


def _receive(tf: tarfile.TarFile, staging: _Staging, limits: ImportLimits) -> Manifest:
    """Check every member and stage the files; returns the manifest."""
    manifest, files, links, done = None, {}, {}, set()
    for count, ti in enumerate(tf, 1):
        if count > limits.max_members:
            raise ArchiveError("too_many_members", f"more than {limits.max_members} members")
        ti.name = check_name(ti.name)
        check_type(ti)
        if _DATA_FILTER is not None:
            try:
                _DATA_FILTER(ti, str(staging.roots[False]))
            except tarfile.FilterError as e:
                raise ArchiveError("unsafe_member", f"member {ti.name!r}: {e}") from e
        if manifest is None:
            manifest = _read_manifest(tf, ti, limits)
            files, links = _expected(manifest)
            continue
        if ti.isdir():
            continue
        if ti.issym():
            check_symlink(ti, links)
            continue
        exp = files.get(ti.name)
        if exp is None or ti.name in done:
            raise ArchiveError("unlisted_member", f"member {ti.name!r}: not in the manifest"
                               + (" (a second time)" if ti.name in done else ""))
        if ti.size > limits.max_member_bytes:
            raise ArchiveError("too_large", f"member {ti.name!r}: {ti.size} bytes (limit {limits.max_member_bytes})")
        if ti.size != exp.size:
            raise ArchiveError("size_mismatch", f"member {ti.name!r}: {ti.size} bytes, manifest says {exp.size}")
        staging.write(exp, tf.extractfile(ti), (ti.mode & 0o755) | 0o400, ti.mtime)
        done.add(ti.name)
    if manifest is None:
        raise ArchiveError("bad_manifest", "empty archive: no manifest")
    left = sorted(set(files) - done)
    if left:
        raise ArchiveError("missing_member", f"{len(left)} listed member(s) absent, first {left[0]!r}")
    return manifest


def import_archive(path: str | os.PathLike, *, debug_dir: str | os.PathLike, session_root: str | os.PathLike,
                   limits: ImportLimits = ImportLimits(), untrusted: str = "mark") -> ImportReport:
    """Verify an archive, then install its store entries into a perf build-id cache and its session.

    Args:
        path: the archive (``buildidd archive`` output).
        debug_dir: the build-id cache to install into (perf's ``~/.debug``); created.
        session_root: where the session's directory goes; created.
        limits: the bounds of :class:`ImportLimits`.
        untrusted: what becomes of entries whose provenance is not ``trusted``: one of
            :data:`UNTRUSTED_POLICIES` (see the module docstring).

    Returns:
        An :class:`ImportReport`.

    Raises:
        ArchiveError: the archive is refused (reasons in the module docstring);
            nothing was installed.
        OSError: the archive cannot be opened, or a target cannot be written.
    """
    if untrusted not in UNTRUSTED_POLICIES:
        raise ValueError(f"untrusted must be one of {UNTRUSTED_POLICIES}, not {untrusted!r}")
    debug_dir, session_root = Path(os.path.abspath(debug_dir)), Path(os.path.abspath(session_root))
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ArchiveError("unreadable", f"{path}: cannot open the archive: {e.strerror}") from e
    with f:
        check_zstd_magic(path, f.peek(ZSTD_PEEK_BYTES))
        staging = _Staging(debug_dir, session_root)
        failed = True
        try:
            tf = tarfile.open(fileobj=Bounded(f, limits), mode="r|", tarinfo=tarinfo_class(limits))
            manifest = _receive(tf, staging, limits)
            report = ImportReport(manifest, session_root / manifest.session["name"])
            _install(manifest, staging, debug_dir, session_root, report, untrusted)
            failed = False
        except (tarfile.TarError, EOFError) as e:
            raise ArchiveError("corrupt", f"{path}: damaged, or not a buildidd archive: not a readable tar stream: "
                                          f"{e}") from e
        except RecursionError as e:
            raise ArchiveError("corrupt", f"{path}: nested tar headers") from e
        except ArchiveError as e:
            if str(path) in e.message:
                raise
            raise ArchiveError(e.reason, f"{path}: {e.message}") from e
        finally:
            staging.cleanup(failed)
    for ref in manifest.build_ids:
        if ref.status == UPSTREAM:
            report.upstream.append(ref.build_id)
        elif ref.status == MISSING:
            report.missing.append(ref.build_id)
    return report


def import_members(manifest: Manifest, open_member, *, debug_dir: str | os.PathLike,
                   session_root: str | os.PathLike, untrusted: str = "mark",
                   limits: ImportLimits = ImportLimits()) -> ImportReport:
    """Like :func:`import_archive`, with each file fetched by name instead of read from a tar stream.

    The same staging, checks (each ELF file's build-id or htlhash, each file's exact size, the
    closed marker) and install as an archive's; the fleet's read side (fleet.fetch) uses it.

    Args:
        manifest: the session's manifest, checked (Manifest.from_json) and sized by the caller.
        open_member: ``open_member(member, size_bytes)`` -> a context manager giving an object with
            ``read(n)``: the archive member's bytes (``session/NAME/segment-…``, ``cache/<entry>/elf``).
        debug_dir, session_root, untrusted, limits: as for :func:`import_archive`.

    Raises:
        ArchiveError: a file is refused (``too_large``, ``build_id_mismatch``, ``corrupt``: short); nothing
            was installed.
        OSError: a target cannot be written.
    """
    if untrusted not in UNTRUSTED_POLICIES:
        raise ValueError(f"untrusted must be one of {UNTRUSTED_POLICIES}, not {untrusted!r}")
    debug_dir, session_root = Path(os.path.abspath(debug_dir)), Path(os.path.abspath(session_root))
    files, _links = _expected(manifest)
    staging = _Staging(debug_dir, session_root)
    failed = True
    try:
        for member, exp in files.items():
            if exp.size > limits.max_member_bytes:
                raise ArchiveError("too_large", f"{member}: {exp.size} bytes (limit {limits.max_member_bytes})")
            with open_member(member, exp.size) as src:
                staging.write(exp, src, 0o755 if exp.fname in mf.ELF_FILES else 0o644)
        report = ImportReport(manifest, session_root / manifest.session["name"])
        _install(manifest, staging, debug_dir, session_root, report, untrusted)
        failed = False
    finally:
        staging.cleanup(failed)
    for ref in manifest.build_ids:
        (report.upstream if ref.status == UPSTREAM else report.missing if ref.status == MISSING else []).append(
            ref.build_id)
    return report

"""Atomic, verified installs of files into the store.

The bytes are copied by :mod:`buildidd.store.copydata` (a reflink, else the data extents, holes kept).
Every file is mode 0o640 (:data:`~buildidd.store.layout.FILE_MODE`) and every
directory 0o750 (0o700 for a private copy), owned by root and the store's
group, whatever the umask and the source's mode: a copy of a setuid binary is
not setuid, and one of a user's 0o755 binary is not readable by other users.

Durability and atomicity: every file is written under a temporary name in its
final directory (``.NAME.buildidd-tmp-XXXX``, ``O_EXCL``), ``fsync``-ed,
checked, ``rename``-d into place, and the directory ``fsync``-ed; the link is
made last, as a symlink under a temporary name renamed over the final one.
Every file takes that one path, :meth:`Installer.atomic_file`, with its one
clean-up (perf's tools/perf/util/build-id.c ``build_id_cache__add`` is the
model: one add path, one clean-up); every link takes :meth:`Installer.symlink`.
So an entry is visible (:meth:`buildidd.store.Store.contains`) only when
complete, and no file is ever half-written under its final name.  A crash can
leave temporary files (:meth:`buildidd.store.Store.sweep_temps` removes them)
and an entry directory without a link (invisible; re-adding the build-id
reuses it).  What one add made is listed in an :class:`Installed`, so that a
later step's failure can undo it (:meth:`Installer.undo`).

Deferred durability (a batch of new entries, :mod:`buildidd.store.batch`): while
:attr:`Installer.deferred` is set, :meth:`Installer.atomic_file` renames without the
file's and the directory's ``fsync``; the batch makes the whole file system durable
with one ``syncfs`` (:func:`syncfs`) before it makes any link to those files, so that a
link still names only durable files.  Only a new entry's directory, which no link names
yet, is written that way: after a crash in a batch, such a directory may hold a torn
file under its final name, invisible, and replaced when the build-id is added again.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from buildidd.errors import StoreError
from buildidd.fsio import fsync_dir, write_all
from buildidd.kernel.events import Identity
from buildidd.resolve.procfs import identity_of, mismatch
from buildidd.store.copydata import COPY_CHUNK_BYTES, copy_data
from buildidd.store.counters import Tally
from buildidd.store.layout import DIR_MODE, FILE_MODE, PRIVATE_DIR_MODE, TEMP_INFIX, Layout
from buildidd.store.origin import KEY_GNU, dir_closed
from buildidd.store.verify import copy_mismatch

_PROC_READ_MAX_BYTES = 256 << 20
"""Bytes read at most from a /proc file (kallsyms grows with the modules loaded)."""


_libc = ctypes.CDLL(None, use_errno=True)


def syncfs(path: str | os.PathLike) -> None:
    """syncfs(2) the file system holding directory path: every dirty file, directory and inode on it is
    written and the device's cache flushed (Linux 2.6.39; Python's os has no wrapper).

    Raises:
        OSError: path cannot be opened, or syncfs failed (EIO, ENOSPC, EDQUOT: an earlier writeback error).
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if _libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), str(path))
    finally:
        os.close(fd)


def temp_name(final: Path) -> Path:
    """A fresh temporary name beside final: ``.NAME.buildidd-tmp-XXXXXXXXXXXX`` (Store.sweep_temps removes
    those a crash left)."""
    return final.with_name(f".{final.name}{TEMP_INFIX}{secrets.token_hex(6)}")


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@dataclass(frozen=True)
class AddResult:
    """What an add did.

    Attributes:
        added: a new entry was made; ``False``: the build-id was present.
        path: the entry's main file (``elf``, or ``kallsyms`` for the kernel).
        reflinked: the main file was cloned (``FICLONE``), no data copied.
        bytes: bytes added to the store by this call: the files' sizes (elf or
            kallsyms, debug or vmlinux, modules, probes); 0 when nothing was added.
        debuginfo: a ``debug`` (or, for the kernel, ``vmlinux``) file was added.
    """

    added: bool
    path: Path | None
    reflinked: bool
    bytes: int
    debuginfo: bool


@dataclass
class Installed:
    """Files and directories one add made, to be undone if a later step fails."""

    files: list[Path] = field(default_factory=list)
    dirs: list[Path] = field(default_factory=list)


@dataclass(frozen=True)
class CopyRequest:
    """One verified copy of an open file into the store.

    Attributes:
        src_fd: the source, an open readable regular file (its offset is not used).
        before: ``os.fstat(src_fd)`` taken before copying; compared after.
        final: the copy's final path (its directory exists).
        build_id_hex: the build-id the copy must have (lower-case hex).
        what: how the source is named in errors (its path).
        identity: when given, ``identity_of(src_fd)`` must still match it after copying.
        key: how build_id_hex names the file (store.origin.KEYS): ``gnu``, its GNU build-id; ``htlhash``,
            the copy's file_id (resolve.fileid), and then the copy must have no GNU build-id.
    """

    src_fd: int
    before: os.stat_result
    final: Path
    build_id_hex: str
    what: str
    identity: Identity | None = None
    key: str = KEY_GNU


class Installer:
    """Writes files into the store: verified copies, streams, small files, the link; undoes a failed add.

    Attributes:
        throttle: ``None``, or called as ``throttle(n)`` after each chunk of
            ``n`` bytes copied (see :attr:`buildidd.store.Store.throttle`).
        deferred: True while a batch writes a new entry (:mod:`buildidd.store.batch`): :meth:`atomic_file`
            makes no ``fsync`` (the batch's ``syncfs`` does, before any link to the file).
    """

    def __init__(self, layout: Layout, tally: Tally, gid: int | None = None):
        """gid: the group every file and directory is given (``None``: left as created)."""
        self.layout = layout
        self.tally = tally
        self.gid = gid
        self.throttle: Callable[[int], None] | None = None
        self.deferred = False

    def own(self, target: int | Path, mode: int) -> None:
        """chmod target (an fd or a path, not followed) to mode and chown it to root:gid (when root).

        Raises:
            OSError: the call failed.
        """
        if isinstance(target, int):
            os.fchmod(target, mode)
            if self.gid is not None and os.geteuid() == 0:
                os.fchown(target, 0, self.gid)
            return
        os.chmod(target, mode, follow_symlinks=False)
        if self.gid is not None and os.geteuid() == 0:
            os.chown(target, 0, self.gid, follow_symlinks=False)

    def check_identity(self, fd: int, want: Identity, path: str, when: str) -> None:
        """Raise StoreError (counted) unless fd is still the file the kernel mapped."""
        try:
            got = identity_of(fd)
        except OSError as e:
            self.tally.count("copy_errors")
            raise StoreError(f"{path}: cannot stat the source: {e.strerror}") from e
        why = mismatch(want, got)
        if why is not None:
            self.tally.count("identity_mismatch")
            raise StoreError(f"{path}: not the identified file {when}: {why}")

    def makedirs(self, directory: Path, done: Installed, mode: int = DIR_MODE) -> None:
        """mkdir -p, remembering the directories made; each made gets root:gid and DIR_MODE (0o750), the last
        one mode even if it existed.  For a private entry (PRIVATE_DIR_MODE) so do ``ROOT/<path>`` (which
        lists its build-ids) and each directory made for a closed source directory (origin.dir_closed)."""
        missing = []
        d = directory
        while not d.is_dir():
            missing.append(d)
            if d.parent == d:
                break
            d = d.parent
        for d in reversed(missing):
            try:
                os.mkdir(d, 0o700)
                self.own(d, mode if d == directory or (mode == PRIVATE_DIR_MODE and (
                    d == directory.parent or dir_closed(self.layout.root, d))) else DIR_MODE)
            except FileExistsError:
                if not d.is_dir():
                    self.tally.count("copy_errors")
                    raise StoreError(f"{d}: exists and is not a directory") from None
                continue
            except OSError as e:
                self.tally.count("copy_errors")
                raise StoreError(f"{d}: cannot create: {e.strerror}") from e
            done.dirs.append(d)
        if not missing:
            try:
                self.own(directory, mode)
            except OSError as e:
                self.tally.count("copy_errors")
                raise StoreError(f"{directory}: cannot set its mode: {e.strerror}") from e

    @contextlib.contextmanager
    def atomic_file(self, final: Path, mode: int, done: Installed, *, what: str | os.PathLike | None = None,
                    sync_dir: bool = True) -> Iterator[int]:
        """The one way a file enters the store: yields the fd (read-write) of a new temporary file beside final
        (:func:`temp_name`, ``O_EXCL``), already given mode and root:gid (:meth:`own`).  The caller writes and
        checks it in the ``with`` body; when the body returns, the file is ``fsync``-ed, renamed to final,
        listed in done, and (sync_dir) the directory ``fsync``-ed (neither fsync while :attr:`deferred`).
        When the body raises or a step fails, the temporary file is removed and final is untouched: the one
        clean-up.

        Args:
            what: how the data's source is named in errors (default: final).
            sync_dir: False when the caller fsyncs the directory once for several files, before anything
                links to them.

        Raises:
            StoreError: the body's own StoreError, unchanged; an OSError of the body or of a step, counted
                in ``copy_errors`` and named (the temporary file cannot be made, the data cannot be written,
                the rename or the directory's fsync failed).
        """
        temp = temp_name(final)
        try:
            fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as e:
            self.tally.count("copy_errors")
            raise StoreError(f"{final}: cannot create a temporary file: {e.strerror}") from e
        failed = f"{what if what is not None else final}: cannot write into the store"
        renamed = False
        try:
            self.own(fd, mode)
            yield fd
            if not self.deferred:
                os.fsync(fd)
            failed = f"{final}: cannot rename into place"
            os.rename(temp, final)
            renamed = True
            done.files.append(final)
            if sync_dir and not self.deferred:
                failed = f"{final.parent}: cannot sync the directory"
                fsync_dir(final.parent)
        except OSError as e:
            self.tally.count("copy_errors")
            raise StoreError(f"{failed}: {e.strerror}") from e
        finally:
            os.close(fd)
            if not renamed:
                _unlink_quietly(temp)

    def install_copy(self, req: CopyRequest, done: Installed, *, sync_dir: bool = True) -> tuple[bool, int]:
        """Copy req.src_fd to req.final through :meth:`atomic_file`, verified, source's mtime; (reflinked, bytes).

        sync_dir=False: the directory is not fsync-ed after the rename (the caller does it once for
        the entry's files, before anything links to them).

        Raises:
            StoreError: verify failure, the source changed (counted in ``identity_mismatch``), or an OS error.
        """
        before, what, size = req.before, req.what, req.before.st_size
        with self.atomic_file(req.final, FILE_MODE, done, what=what, sync_dir=sync_dir) as dst:
            reflinked, reached = copy_data(req.src_fd, dst, size, self._copied)
            os.utime(dst, ns=(before.st_mtime_ns, before.st_mtime_ns))   # for archives, Last-Modified, gdb
            after = os.fstat(req.src_fd)
            if reached < size or os.fstat(dst).st_size != size or (
                    after.st_size, after.st_mtime_ns, after.st_ino, after.st_dev) != (
                    before.st_size, before.st_mtime_ns, before.st_ino, before.st_dev):
                self.tally.count("identity_mismatch")
                raise StoreError(f"{what}: changed while being copied (copied {reached} of {size} bytes)")
            if req.identity is not None:
                self.check_identity(req.src_fd, req.identity, what, "after copying")
            self._verify(dst, req)
        if reflinked:
            self.tally.count("reflinks")
        return reflinked, size

    def _verify(self, dst: int, req: CopyRequest) -> None:
        """Raise StoreError (``verify_failed``) unless the copy is what req's key names (store.verify)."""
        why = copy_mismatch(dst, req.build_id_hex, req.key)
        if why is not None:
            self.tally.count("verify_failed")
            raise StoreError(f"{req.what}: {why}")

    def _copied(self, n: int) -> None:
        self.tally.count("bytes_copied", n)
        if self.throttle is not None:
            self.throttle(n)

    def install_stream(self, source: Path, final: Path, mode: int, done: Installed,
                       *, check: Callable[[bytes], None] | None = None) -> int:
        """Copy a file read sequentially (a /proc file: st_size 0) to final through :meth:`atomic_file`;
        bytes written.

        ``check(first_chunk)`` (``b""`` for an empty file) may raise to refuse the file.

        Raises:
            StoreError: longer than 256 MiB, refused by check, or an OS error.
        """
        try:
            src = open(source, "rb", buffering=0)
        except OSError as e:
            self.tally.count("copy_errors")
            raise StoreError(f"{source}: cannot open: {e.strerror}") from e
        total = 0
        with src, self.atomic_file(final, mode, done, what=source) as dst:
            while chunk := src.read(COPY_CHUNK_BYTES):
                if total == 0 and check is not None:
                    check(chunk)
                write_all(dst, chunk)
                total += len(chunk)
                if total > _PROC_READ_MAX_BYTES:
                    raise StoreError(f"{source}: longer than {_PROC_READ_MAX_BYTES} bytes")
                self._copied(len(chunk))
            if total == 0 and check is not None:
                check(b"")
        return total

    def install_bytes(self, final: Path, data: bytes, mode: int, done: Installed, *, sync_dir: bool = True) -> int:
        """Write data to final through :meth:`atomic_file`; bytes written.

        sync_dir=False: the directory is not fsync-ed (the caller does it once for several files).

        Raises:
            StoreError: an OS error (counted in ``copy_errors``).
        """
        with self.atomic_file(final, mode, done, sync_dir=sync_dir) as fd:
            write_all(fd, data)
        return len(data)

    def publish(self, bid: str, target: str) -> None:
        """Make (or replace) ``.build-id/xx/rest -> target`` atomically; the entry becomes visible.

        Raises:
            StoreError: an OS error (counted in ``copy_errors``).
        """
        self.symlink(self.layout.linkname(bid), target)

    def symlink(self, link: Path, target: str, *, sync: bool = True) -> None:
        """Make (or replace) link -> target atomically: a symlink under :func:`temp_name`, renamed over link,
        and (sync) link's directory fsync-ed (made first, root:gid, when missing).  sync=False: the caller
        makes it durable (a batch's syncfs).

        Raises:
            StoreError: an OS error (counted in ``copy_errors``).
        """
        self.makedirs(link.parent, Installed())
        temp = temp_name(link)
        try:
            os.symlink(target, temp)
            os.rename(temp, link)
            if sync:
                fsync_dir(link.parent)
        except OSError as e:
            _unlink_quietly(temp)
            self.tally.count("copy_errors")
            raise StoreError(f"{link}: cannot link: {e.strerror}") from e

    def undo(self, done: Installed) -> None:
        """Remove what a failed add made: its files, then its directories (deepest first)."""
        for f in done.files:
            try:
                os.unlink(f)
            except OSError as e:
                if e.errno != errno.ENOENT:
                    self.tally.warn("%s: cannot remove after a failed add: %s", f, e.strerror)
        for d in reversed(done.dirs):
            try:
                os.rmdir(d)
            except OSError:
                break

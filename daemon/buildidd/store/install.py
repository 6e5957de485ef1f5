"""Atomic, verified installs of files into the store.

perf *hard-links* ``elf`` and ``debug`` to the original when both are on one
file system, and copies with mode 0o755 otherwise (util/copyfile.c
``copyfile()``).  A hard link is not a snapshot (an in-place rewrite of the
original changes it), so the store always copies: a reflink (``FICLONE``)
where the file system shares extents, else ``copy_file_range``/``sendfile``/
``pread``.  Holes stay holes: data is copied extent by extent
(``SEEK_DATA``/``SEEK_HOLE``) and the copy is cut to the source's size with
``ftruncate``, so a 300 MB sparse file with 76 KiB of data takes about 76 KiB.
Every file is mode 0o640 (:data:`~buildidd.store.layout.FILE_MODE`) and every
directory 0o750 (0o700 for a private copy), owned by root and the store's
group, whatever the umask and the source's mode: a copy of a setuid binary is
not setuid, and one of a user's 0o755 binary is not readable by other users.

Durability and atomicity: every file is written under a temporary name in its
final directory (``.NAME.buildidd-tmp-XXXX``, ``O_EXCL``), ``fsync``-ed,
checked, ``rename``-d into place, and the directory ``fsync``-ed; the link is
made last, as a symlink under a temporary name renamed over the final one.
So an entry is visible (:meth:`buildidd.store.Store.contains`) only when
complete, and no file is ever half-written under its final name.  A crash can
leave temporary files (:meth:`buildidd.store.Store.sweep_temps` removes them)
and an entry directory without a link (invisible; re-adding the build-id
reuses it).  What one add made is listed in an :class:`Installed`, so that a
later step's failure can undo it (:meth:`Installer.undo`).
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from buildidd.errors import StoreError
from buildidd.kernel.events import Identity
from buildidd.resolve.procfs import identity_of, mismatch
from buildidd.store.counters import Tally
from buildidd.store.layout import DIR_MODE, FILE_MODE, PRIVATE_DIR_MODE, TEMP_INFIX, Layout
from buildidd.store.origin import KEY_GNU, dir_closed
from buildidd.store.verify import copy_mismatch

COPY_CHUNK_BYTES = 1 << 20
"""Bytes per copy step when not reflinking; ``Store.throttle`` is called after each."""

FICLONE = 0x40049409
"""ioctl FICLONE = _IOW(0x94, 9, int): share the source's extents (include/uapi/linux/fs.h)."""

_SEEK_DATA_UNSUPPORTED = frozenset({errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS, errno.ESPIPE})

#: errnos meaning "this way of copying does not work here, try the next".
_REFLINK_FALLBACK = frozenset({errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.EBADF,
                               errno.ENOSYS, errno.EPERM, errno.ETXTBSY})
_COPY_FALLBACK = frozenset({errno.EOPNOTSUPP, errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EBADF})

_PROC_READ_MAX_BYTES = 256 << 20
"""Bytes read at most from a /proc file (kallsyms is ~10 MB with many modules)."""


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory (makes a rename or unlink in it durable).

    Raises:
        OSError: it cannot be opened or synced.
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_name(final: Path) -> Path:
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


class DataCopier:
    """The data-copying half of :class:`Installer` (reflink, then extents with holes kept); sets nothing."""

    tally: Tally
    throttle: Callable[[int], None] | None

    def _copy_data(self, src: int, dst: int, size: int, what: str) -> bool:
        """Copy size bytes from offset 0 of src to dst; True when reflinked (FICLONE).

        Order: FICLONE (whole file, shares extents: btrfs, XFS, bcachefs);
        ``copy_file_range`` (in-kernel; may itself share extents or do
        server-side copy on NFS); ``sendfile``; ``pread``/``pwrite``.  A way
        that fails with an errno meaning "not here" (EXDEV, EOPNOTSUPP, EINVAL,
        …) is dropped for the rest of this file; ENOSPC and EIO are raised.
        """
        if size > 0:
            try:
                fcntl.ioctl(dst, FICLONE, src)
                return True
            except OSError as e:
                if e.errno not in _REFLINK_FALLBACK:
                    raise
        os.ftruncate(dst, size)  # the holes: a sparse source gives a sparse copy
        probe = _own_description(src)
        try:
            return self._copy_extents(src, dst, probe, size, what)
        finally:
            if probe is not None:
                os.close(probe)

    def _copy_extents(self, src: int, dst: int, probe: int | None, size: int, what: str) -> bool:
        """Copy the data extents of src (found with SEEK_DATA/SEEK_HOLE on probe, when given) to dst."""
        ways = [_copy_file_range, _sendfile, _pread_pwrite]
        offset = 0
        while offset < size:
            if probe is not None:
                offset = _next_data(probe, offset, size)
                if offset >= size:
                    break
            end = _next_hole(probe, offset, size) if probe is not None else size
            want = min(COPY_CHUNK_BYTES, end - offset)
            try:
                n = ways[0](src, dst, offset, want)
            except OSError as e:
                if e.errno in _COPY_FALLBACK and len(ways) > 1:
                    ways.pop(0)
                    continue
                raise
            if n == 0:
                if len(ways) > 1:  # copy_file_range answers 0 where it cannot copy (some file systems)
                    ways.pop(0)
                    continue
                self.tally.count("identity_mismatch")
                raise StoreError(f"{what}: ended at {offset} of {size} bytes while being copied")
            offset += n
            self._copied(n)
        return False

    def _copied(self, n: int) -> None:
        self.tally.count("bytes_copied", n)
        if self.throttle is not None:
            self.throttle(n)


class Installer(DataCopier):
    """Writes files into the store: verified copies, streams, small files, the link; undoes a failed add.

    Attributes:
        throttle: ``None``, or called as ``throttle(n)`` after each chunk of
            ``n`` bytes copied (see :attr:`buildidd.store.Store.throttle`).
    """

    def __init__(self, layout: Layout, tally: Tally, gid: int | None = None):
        """gid: the group every file and directory is given (``None``: left as created)."""
        self.layout = layout
        self.tally = tally
        self.gid = gid
        self.throttle: Callable[[int], None] | None = None

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

    def install_copy(self, req: CopyRequest, done: Installed, *, sync_dir: bool = True) -> tuple[bool, int]:
        """Copy req.src_fd to req.final through a temporary file, verified, source's mtime; (reflinked, bytes).

        sync_dir=False: the directory is not fsync-ed after the rename (the caller does it once for
        the entry's files, before anything links to them).

        Raises:
            StoreError: verify failure, the source changed, or an OS error.
        """
        before, final, what = req.before, req.final, req.what
        size = before.st_size
        temp = _temp_name(final)
        try:
            dst = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as e:
            self.tally.count("copy_errors")
            raise StoreError(f"{final}: cannot create a temporary file: {e.strerror}") from e
        try:
            try:
                self.own(dst, FILE_MODE)
                reflinked = self._copy_data(req.src_fd, dst, size, what)
                os.utime(dst, ns=(before.st_mtime_ns, before.st_mtime_ns))   # for archives, Last-Modified, gdb
                os.fsync(dst)
                after = os.fstat(req.src_fd)
                copied = os.fstat(dst).st_size
            except OSError as e:
                self.tally.count("copy_errors")
                raise StoreError(f"{what}: cannot copy into the store: {e.strerror}") from e
            if (after.st_size, after.st_mtime_ns, after.st_ino, after.st_dev) != (
                    before.st_size, before.st_mtime_ns, before.st_ino, before.st_dev) or copied != size:
                self.tally.count("identity_mismatch")
                raise StoreError(f"{what}: changed while being copied")
            if req.identity is not None:
                self.check_identity(req.src_fd, req.identity, what, "after copying")
            self._verify(dst, req)
            try:
                os.rename(temp, final)
                done.files.append(final)
                if sync_dir:
                    fsync_dir(final.parent)
            except OSError as e:
                self.tally.count("copy_errors")
                raise StoreError(f"{final}: cannot rename into place: {e.strerror}") from e
        finally:
            os.close(dst)
            if final not in done.files:
                _unlink_quietly(temp)
        if reflinked:
            self.tally.count("reflinks")
        return reflinked, size

    def _verify(self, dst: int, req: CopyRequest) -> None:
        """Raise StoreError (``verify_failed``) unless the copy is what req's key names (store.verify)."""
        why = copy_mismatch(dst, req.build_id_hex, req.key)
        if why is not None:
            self.tally.count("verify_failed")
            raise StoreError(f"{req.what}: {why}")

    def install_stream(self, source: Path, final: Path, mode: int, done: Installed,
                       *, check: Callable[[bytes], None] | None = None) -> int:
        """Copy a file read sequentially (a /proc file: st_size 0) to final; bytes written.

        ``check(first_chunk)`` (``b""`` for an empty file) may raise to refuse the file.

        Raises:
            StoreError: longer than 256 MiB, refused by check, or an OS error.
        """
        temp = _temp_name(final)
        total = 0
        try:
            with open(source, "rb", buffering=0) as src:
                dst = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                try:
                    self.own(dst, mode)
                    first = True
                    while True:
                        chunk = src.read(COPY_CHUNK_BYTES)
                        if not chunk:
                            break
                        if first and check is not None:
                            check(chunk)
                        first = False
                        _write_all(dst, chunk)
                        total += len(chunk)
                        if total > _PROC_READ_MAX_BYTES:
                            raise StoreError(f"{source}: longer than {_PROC_READ_MAX_BYTES} bytes")
                        self._copied(len(chunk))
                    if first and check is not None:
                        check(b"")
                    os.fsync(dst)
                finally:
                    os.close(dst)
            os.rename(temp, final)
            done.files.append(final)
            fsync_dir(final.parent)
        except OSError as e:
            self.tally.count("copy_errors")
            raise StoreError(f"{source}: cannot copy into the store: {e.strerror}") from e
        finally:
            if final not in done.files:
                _unlink_quietly(temp)
        return total

    def install_bytes(self, final: Path, data: bytes, mode: int, done: Installed, *, sync_dir: bool = True) -> int:
        """Write data to final through a temporary file; bytes written.

        sync_dir=False: the directory is not fsync-ed (the caller does it once for several files).

        Raises:
            StoreError: an OS error (counted in ``copy_errors``).
        """
        temp = _temp_name(final)
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                self.own(fd, mode)
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(temp, final)
            done.files.append(final)
            if sync_dir:
                fsync_dir(final.parent)
        except OSError as e:
            self.tally.count("copy_errors")
            raise StoreError(f"{final}: cannot write: {e.strerror}") from e
        finally:
            if final not in done.files:
                _unlink_quietly(temp)
        return len(data)

    def publish(self, bid: str, target: str) -> None:
        """Make (or replace) ``.build-id/xx/rest -> target`` atomically; the entry becomes visible.

        Raises:
            StoreError: an OS error (counted in ``copy_errors``).
        """
        link = self.layout.linkname(bid)
        self.makedirs(link.parent, Installed())
        temp = _temp_name(link)
        try:
            os.symlink(target, temp)
            os.rename(temp, link)
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


# --- the ways of copying, tried in order by Installer._copy_data -------------------


def _own_description(fd: int) -> int | None:
    """A second open file description of fd's file (through /proc/self/fd), so that SEEK_DATA/SEEK_HOLE
    do not move the offset the caller's fd shares with its dups; None when /proc cannot reopen it."""
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        return None


def _next_data(fd: int, offset: int, size: int) -> int:
    """The first offset >= offset holding data (SEEK_DATA); size when only a hole follows.

    A file system without SEEK_DATA (EINVAL...) has data everywhere, as lseek(2) allows.
    """
    try:
        return min(os.lseek(fd, offset, os.SEEK_DATA), size)
    except OSError as e:
        if e.errno == errno.ENXIO:
            return size
        if e.errno in _SEEK_DATA_UNSUPPORTED:
            return offset
        raise


def _next_hole(fd: int, offset: int, size: int) -> int:
    """The end of the data that starts at offset (SEEK_HOLE), at most size."""
    try:
        return max(offset + 1, min(os.lseek(fd, offset, os.SEEK_HOLE), size))
    except OSError as e:
        if e.errno == errno.ENXIO or e.errno in _SEEK_DATA_UNSUPPORTED:
            return size
        raise


def _copy_file_range(src: int, dst: int, offset: int, count: int) -> int:
    return os.copy_file_range(src, dst, count, offset, offset)


def _sendfile(src: int, dst: int, offset: int, count: int) -> int:
    os.lseek(dst, offset, os.SEEK_SET)
    return os.sendfile(dst, src, offset, count)


def _pread_pwrite(src: int, dst: int, offset: int, count: int) -> int:
    data = os.pread(src, count, offset)
    done = 0
    while done < len(data):
        done += os.pwrite(dst, data[done:], offset + done)
    return len(data)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]

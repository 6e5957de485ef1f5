"""Durable writes every stage uses: all of a buffer to a file descriptor, a directory's entries synced,
a small file replaced atomically; and a directory tree removed however deep it is.

The crash-safe order for replacing a whole file is rename(2)'s contract (POSIX): write a temporary
file in the target's directory, fsync it, rename it over the target, fsync the directory; a reader,
or a host that lost power, then sees the old file or the whole new one.  The store's copies of
binaries (store/install.py, after perf's ``build_id_cache__add``) and the session log's segments
follow that order with their own temporary files; small files (a session's gap file, a BPF
compile-cache entry) use :func:`replace_file`.
"""

from __future__ import annotations

import os
import secrets
import subprocess

__all__ = ["fsync_dir", "remove_tree", "replace_file", "write_all"]


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """os.write until every byte of data is written (a write may take fewer).

    Raises:
        OSError: a write failed, or accepted no bytes (EIO).
    """
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(5, "write accepted no bytes")
        view = view[n:]


def fsync_dir(directory: str | os.PathLike | int) -> None:
    """fsync a directory, given by path or as an open descriptor of it, so that the entries created,
    renamed or removed in it persist.

    Raises:
        OSError: it cannot be opened or synced.
    """
    if isinstance(directory, int):
        os.fsync(directory)
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(directory: str | os.PathLike | int, name: str, data: bytes, mode: int) -> None:
    """Replace directory/name with data, atomically and durably: a new temporary file
    (``.NAME.PID.RANDOM.tmp``: hidden, one per call; O_EXCL, O_NOFOLLOW, mode less the umask), written
    and fsynced, renamed over name, and the directory fsynced.  On failure the temporary file is removed and name is as it was
    (or, when only the directory's fsync failed, replaced but not yet durable).

    Args:
        directory: a path, or an open descriptor of the directory (every call then relative to it).
        name: a file name in directory (no slash).
        data: the whole new content.
        mode: the new file's permission bits.
    Raises:
        OSError: a step failed (ENOSPC, EACCES, ...).
        ValueError: name is not a plain file name.
    """
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"not a file name: {name!r}")
    own_fd = not isinstance(directory, int)
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) if own_fd else directory
    tmp = f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    made = False
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                     dir_fd=dir_fd)
        made = True
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        os.fsync(dir_fd)
    except BaseException:
        try:
            if made:
                os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass                      # renamed already
        raise
    finally:
        if own_fd:
            os.close(dir_fd)


def remove_tree(path: str | os.PathLike) -> None:
    """Remove path and everything under it, on its file system only (``rm -rf --one-file-system``);
    what cannot be removed stays, silently, as with ``shutil.rmtree(ignore_errors=True)``.

    Not shutil.rmtree, which recurses once per directory level (Python 3.11) and raises RecursionError
    past about a thousand: a store or an imported cache mirrors the path of each file it holds (perf's
    layout), and a user can map a file at a path 2,047 directories deep (PATH_MAX).  coreutils' rm walks
    any depth, symlinks removed and never followed.
    """
    subprocess.run(["rm", "-rf", "--one-file-system", "--", os.fspath(path)], check=False,
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

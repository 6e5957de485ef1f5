"""Copying a file's bytes into a store file: a reflink where the file system shares extents, else the data
extents one chunk at a time, holes kept.

perf *hard-links* ``elf`` and ``debug`` to the original when both are on one file system, and copies
otherwise (tools/perf/util/copyfile.c ``copyfile()``).  A hard link is not a snapshot (an in-place rewrite
of the original changes it), so the store always copies: a reflink (``FICLONE``) where the file system
shares extents, else ``copy_file_range``/``sendfile``/``pread``.  Holes stay holes: data is copied extent
by extent (``SEEK_DATA``/``SEEK_HOLE``) and the copy is cut to the source's size with ``ftruncate``, so a
sparse file takes the room of its data, not of its size.  Where the bytes go (a temporary file, renamed
into place) is :mod:`buildidd.store.install`'s concern.
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Callable

COPY_CHUNK_BYTES = 1 << 20
"""Bytes per copy step when not reflinking; the caller's ``copied(n)`` is called after each."""

FICLONE = 0x40049409
"""ioctl FICLONE = _IOW(0x94, 9, int): share the source's extents (include/uapi/linux/fs.h)."""

_SEEK_DATA_UNSUPPORTED = frozenset({errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS, errno.ESPIPE})

#: errnos meaning "this way of copying does not work here, try the next".
_REFLINK_FALLBACK = frozenset({errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.EBADF,
                               errno.ENOSYS, errno.EPERM, errno.ETXTBSY})
_COPY_FALLBACK = frozenset({errno.EOPNOTSUPP, errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EBADF})


def copy_data(src: int, dst: int, size: int, copied: Callable[[int], None]) -> tuple[bool, int]:
    """Copy size bytes from offset 0 of src to dst (both fds; their offsets are not used by the data copy).

    Order: FICLONE (whole file, shares extents: btrfs, XFS, bcachefs); ``copy_file_range`` (in-kernel; may
    itself share extents or do a server-side copy on NFS); ``sendfile``; ``pread``/``pwrite``.  A way that
    fails with an errno meaning "not here" (EXDEV, EOPNOTSUPP, EINVAL, ...) is dropped for the rest of this
    file.  ``copied(n)`` is called after each chunk of n bytes (at most :data:`COPY_CHUNK_BYTES`) copied as
    data, never for a reflink.

    Returns:
        (reflinked, reached): whether FICLONE shared the extents, and the offset the copy reached; reached
        is below size when the source ended early (it shrank while being copied).

    Raises:
        OSError: ENOSPC, EIO and every other errno that is not a "try the next way" one.
    """
    if size > 0:
        try:
            fcntl.ioctl(dst, FICLONE, src)
            return True, size
        except OSError as e:
            if e.errno not in _REFLINK_FALLBACK:
                raise
    os.ftruncate(dst, size)  # the holes: a sparse source gives a sparse copy
    probe = _own_description(src)
    try:
        return False, _copy_extents(src, dst, probe, size, copied)
    finally:
        if probe is not None:
            os.close(probe)


def _copy_extents(src: int, dst: int, probe: int | None, size: int, copied: Callable[[int], None]) -> int:
    """Copy the data extents of src (found with SEEK_DATA/SEEK_HOLE on probe, when given) to dst; the offset
    reached (size, or less when src ended early)."""
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
            return offset
        offset += n
        copied(n)
    return size


# --- the ways of copying, tried in order by copy_data ---------------------------------------------------------


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

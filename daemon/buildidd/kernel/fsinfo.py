"""File-system facts the kernel reports for an open file: the statfs(2) type.

Used by resolve.procfs (FUSE and network file systems are slow or never read)
and kernel.pinned (the pin root must lie on bpffs).
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["fs_type", "path_fs_type"]

_libc = ctypes.CDLL(None, use_errno=True)
_STATFS_BYTES = 120                  # sizeof(struct statfs) on 64-bit; f_type (long) first


def fs_type(fd: int) -> int:
    """statfs f_type (include/uapi/linux/magic.h) of the file system holding fd (fstatfs(2);
    works on O_PATH fds), as an unsigned 32-bit value.

    Raises:
        OSError: fstatfs failed.
    """
    buf = ctypes.create_string_buffer(_STATFS_BYTES)
    if _libc.fstatfs(fd, buf) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def path_fs_type(path: str) -> int:
    """:func:`fs_type` of path itself (opened O_PATH, the last component not followed).

    Raises:
        OSError: path cannot be opened (ENOENT, ELOOP ...) or fstatfs failed.
    """
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return fs_type(fd)
    finally:
        os.close(fd)

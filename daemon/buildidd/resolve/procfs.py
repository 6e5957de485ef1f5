"""/proc access: open the exact mapped file, and scan /proc/*/maps.

The routes to a mapped file, best first (perf calls the analogous list
DSO_BINARY_TYPE__*):

* ``/proc/PID/map_files/START-END``: the very inode of the mapping, even when
  deleted, replaced or memfd-backed, for as long as the mapping exists (root).
* ``/proc/PID/root/PATH``: the path in the process's mount namespace and root.
* ``PATH`` in the daemon's own namespace.

Whatever the route, the caller accepts a file only when :func:`identity_of`
agrees with the identity the kernel read at mmap time.
"""

from __future__ import annotations

import enum
import fcntl
import os
import struct
from dataclasses import dataclass
from typing import Iterator

from buildidd.kernel.events import Identity

#: FS_IOC_GETVERSION = _IOR('v', 1, long): the inode generation (include/uapi/linux/fs.h).
FS_IOC_GETVERSION = 0x80087601

#: Bytes of one /proc/PID/maps file read at most; a process with more maps is cut there.
MAPS_READ_MAX = 16 << 20


class Source(enum.Enum):
    """Where a build-id was read from (the record's ``build_id_source``)."""

    MAP_FILES = "map_files"   #: /proc/PID/map_files/START-END: the mapping's own inode
    PROC_ROOT = "proc_root"   #: /proc/PID/root + path, identity checked
    PATH = "path"             #: path in the daemon's namespace, identity checked
    NONE = "none"             #: no file with the right identity could be opened


def identity_of(fd: int, want_generation: bool = True) -> Identity:
    """Identity of the open file fd, in the form the kernel side reports it.

    Args:
        fd: an open file descriptor.
        want_generation: also ask FS_IOC_GETVERSION (0 where unsupported).
    Raises:
        OSError: fstat failed.
    """
    st = os.fstat(fd)
    gen = 0
    if want_generation:
        try:
            buf = fcntl.ioctl(fd, FS_IOC_GETVERSION, b"\0" * 8)
            gen = struct.unpack("<q", buf)[0] & 0xFFFFFFFF
        except OSError:
            gen = 0
    return Identity(st.st_dev, st.st_ino, gen, st.st_size, st.st_mtime_ns)


def mismatch(want: Identity, got: Identity) -> str | None:
    """Why got is not the file want describes, or None when they agree.

    The generation is compared only when both sides know one (non-zero): some
    file systems (tmpfs, overlayfs) have none or do not answer the ioctl.
    Two anonymous devices (major 0) are taken as equal: btrfs reports a
    subvolume's anon_dev to stat(2) but the super block's to the kernel side
    (fs/btrfs/inode.c btrfs_getattr); inode, size and mtime still must agree.
    """
    if want.ino != got.ino:
        return "other_inode"
    if want.dev != got.dev and (os.major(want.dev) != 0 or os.major(got.dev) != 0):
        return "other_inode"
    if want.generation and got.generation and want.generation != got.generation:
        return "other_generation"
    if want.size != got.size or want.mtime_ns != got.mtime_ns:
        return "modified"
    return None


def open_map_file(pid: int, start: int, end: int) -> int:
    """Open /proc/PID/map_files/START-END read-only.

    Args:
        start, end: the VMA's exact vm_start and vm_end (bytes).
    Raises:
        OSError: ENOENT when no such mapping or process exists, EPERM/EACCES without privilege.
    """
    return os.open(f"/proc/{pid}/map_files/{start:x}-{end:x}", os.O_RDONLY | os.O_CLOEXEC)


def open_in_root(pid: int, path: str) -> int:
    """Open path as process pid sees it (/proc/PID/root/PATH). Raises OSError."""
    return os.open(f"/proc/{pid}/root/{path.lstrip('/')}", os.O_RDONLY | os.O_CLOEXEC)


def open_path(path: str) -> int:
    """Open path in the daemon's own mount namespace. Raises OSError."""
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


@dataclass(frozen=True, slots=True)
class MapsEntry:
    """One line of /proc/PID/maps (fs/proc/task_mmu.c show_map_vma).

    Attributes:
        start, end: vm_start, vm_end (bytes); offset: file offset (bytes);
        perms: e.g. "r-xp"; dev: user-space st_dev; ino: inode number;
        path: the pathname column, with a trailing " (deleted)" removed;
        deleted: the kernel marked the file deleted.
    """

    start: int
    end: int
    perms: str
    offset: int
    dev: int
    ino: int
    path: str
    deleted: bool

    @property
    def prot(self) -> int:
        """PROT_* bits from perms."""
        return (4 if self.perms[2] == "x" else 0) | (2 if self.perms[1] == "w" else 0) | \
            (1 if self.perms[0] == "r" else 0)


def parse_maps_line(line: str) -> MapsEntry | None:
    """Parse one /proc/PID/maps line; None for a line that is not well formed."""
    parts = line.split(None, 5)
    if len(parts) < 5:
        return None
    try:
        lo, hi = parts[0].split("-")
        major, minor = parts[3].split(":")
        path = parts[5].rstrip("\n") if len(parts) == 6 else ""
        deleted = path.endswith(" (deleted)")
        if deleted:
            path = path[: -len(" (deleted)")]
        return MapsEntry(int(lo, 16), int(hi, 16), parts[1], int(parts[2], 16),
                         os.makedev(int(major, 16), int(minor, 16)), int(parts[4]), path, deleted)
    except ValueError:
        return None


def read_maps(pid: int) -> list[MapsEntry]:
    """Every mapping of pid. Raises OSError (ENOENT/ESRCH when the process is gone)."""
    fd = os.open(f"/proc/{pid}/maps", os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks, total = [], 0
        while total < MAPS_READ_MAX:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    finally:
        os.close(fd)
    text = b"".join(chunks).decode("utf-8", "surrogateescape")
    out = []
    for line in text.splitlines():
        entry = parse_maps_line(line)
        if entry is not None:
            out.append(entry)
    return out


def exec_file_mappings(pid: int) -> list[MapsEntry]:
    """The executable file-backed mappings of pid (perms with x, an inode).  Raises OSError."""
    return [m for m in read_maps(pid) if m.perms[2] == "x" and m.ino != 0]


def find_vma_range(pid: int, addr: int) -> tuple[int, int] | None:
    """(vm_start, vm_end) of pid's mapping that contains addr, or None.  Raises OSError."""
    for m in read_maps(pid):
        if m.start <= addr < m.end:
            return m.start, m.end
    return None


def pids() -> Iterator[int]:
    """The tgids of every process now in /proc (threads are not listed at top level)."""
    for name in os.listdir("/proc"):
        if name.isdigit():
            yield int(name)


def read_comm(pid: int) -> str:
    """/proc/PID/comm without the newline; "" when the process is gone."""
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f.read(64).rstrip(b"\n").decode("utf-8", "replace")
    except OSError:
        return ""

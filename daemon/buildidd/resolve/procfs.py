"""/proc access: open the exact mapped file, and scan /proc/*/maps.

The routes to a mapped file, best first (perf calls the analogous list
DSO_BINARY_TYPE__*):

* ``/proc/PID/map_files/START-END``: the very inode of the mapping, even when
  deleted, replaced or memfd-backed, for as long as the mapping exists (root).
* ``/proc/PID/root/PATH``: the path in the process's mount namespace and root.
* ``PATH`` in the daemon's own namespace.

Whatever the route, a file is opened for reading only when it is the regular
file the kernel saw at mmap time (:func:`open_identified`): the route is first
opened with O_PATH, which runs no file system's or driver's open method (a
FIFO or a device put at the path is never opened), its statfs type, mode and
identity are checked on that descriptor, and only then is that same inode
reopened through /proc/self/fd/N with O_RDONLY|O_NONBLOCK|O_NOCTTY|O_CLOEXEC.
Symbolic links: ``map_files/START-END`` and ``/proc/PID/root`` are magic links
that must be followed (they name the mapped inode and the process's root
directly, with no walk of a name the user chose); the user's PATH is walked
with openat2 RESOLVE_NO_MAGICLINKS (inside the process's root:
RESOLVE_IN_ROOT, so an absolute symlink stays in that root), and its last
component is never followed (O_NOFOLLOW: a symlink there is ``not_regular``).
These calls can still block on a slow or hostile file system (FUSE, NFS):
they run on resolve.workers' threads, never on the recording thread.
"""

from __future__ import annotations

import ctypes
import enum
import errno
import fcntl
import os
import stat
import struct
import time
from dataclasses import dataclass
from typing import Iterator

from buildidd.errors import FileRefusedError
from buildidd.kernel.fsinfo import fs_type
from buildidd.kernel.events import Identity
from buildidd.resolve.reasons import MissReason

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
    KERNEL = "kernel"         #: the BPF side read it from the page cache at the event (bpf/pagecache.h)


def identity_of(fd: int, want_generation: bool = True, named_at_event: bool = True) -> Identity:
    """Identity of the open file fd, in the form the kernel side reports it.

    Args:
        fd: an open file descriptor.
        want_generation: also ask FS_IOC_GETVERSION (0 where unsupported).
        named_at_event: as :func:`stat_identity`'s.
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
    return stat_identity(st, gen, named_at_event)


def stat_identity(st: os.stat_result, generation: int = 0, named_at_event: bool = True) -> Identity:
    """The Identity of an fstat(2) result, with the given inode generation (0: unknown).

    ctime is left out (0: not compared by :func:`mismatch`) when the file had
    a name at the event (named_at_event: the event's nlink was not 0) and has
    none now (st_nlink 0): unlinking it, or renaming another file over its
    path (a package upgrade), moved its ctime while its bytes stayed those that
    were mapped.  Size, mtime, inode and generation are still compared.  A
    file that keeps a name, or had none already at the event (a memfd, an
    O_TMPFILE, a file unlinked before its mmap: the event's ctime is after
    its unlink), is compared on ctime too (a write whose mtime was set back).
    """
    dropped = named_at_event and st.st_nlink == 0
    return Identity(st.st_dev, st.st_ino, generation, st.st_size, st.st_mtime_ns,
                    0 if dropped else st.st_ctime_ns)


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
    if want.ctime_ns and got.ctime_ns and want.ctime_ns != got.ctime_ns:
        return "modified"
    return None


#: CLOCK_REALTIME_COARSE (include/uapi/linux/time.h); the time module does not name it.
CLOCK_REALTIME_COARSE = 5


def coarse_tick_ns() -> int:
    """One tick of the coarse clock that stamps inode times (clock_getres(CLOCK_REALTIME_COARSE)), ns."""
    return round(time.clock_getres(CLOCK_REALTIME_COARSE) * 1e9) or 1


def changed_near(want: Identity, wall_ns: int, tick_ns: int, nlink: int = 1) -> bool:
    """True when want's ctime is not older than one coarse tick before wall_ns (ns since the epoch).

    Inode times come from the coarse clock: a rewrite in place within the
    tick of the last change leaves ctime (and mtime) as they were
    (current_time() is ktime_get_coarse_real_ts64, fs/inode.c).  A file changed within a
    tick before the mapping may thus have been rewritten after it with no
    trace in its identity, so its bytes read now cannot be trusted to be
    the ones mapped.  An unknown ctime (0) is not judged, nor one more than a
    tick after wall_ns: the kernel reads ctime at the event, so that is a
    clock step or an event time that is not the kernel's.

    A file that had no name left at the event (nlink 0, the kernel's
    inode.i_nlink read with the identity) is judged on mtime instead: the
    unlink, or the rename of a new file over its path, that took its name
    moved ctime without touching its bytes (an exec's mapping is reported at
    the execve's return, which a package upgrade may precede).
    """
    changed = want.ctime_ns if nlink else want.mtime_ns
    return bool(changed) and wall_ns - tick_ns <= changed <= wall_ns + tick_ns


#: statfs f_type of FUSE (include/uapi/linux/magic.h FUSE_SUPER_MAGIC): a
#: process serves its files, possibly the mapping user's own; never read.
FUSE_SUPER_MAGIC = 0x65735546

#: statfs f_type of network and cluster file systems (include/uapi/linux/magic.h,
#: fs/smb/client/cifsglob.h, fs/ceph/super.h): read, but only on a worker
#: under Config.resolve_deadline_s (a server may be slow or gone).
NETWORK_FS_TYPES = {0x6969: "nfs", 0xFF534D42: "cifs", 0xFE534D42: "smb2", 0x517B: "smb",
                    0x01021997: "9p", 0x00C36400: "ceph", 0x5346414F: "afs", 0x6B414653: "afs",
                    0x73757245: "coda", 0x0BD00BD0: "lustre", 0x20030528: "orangefs",
                    0x01161970: "gfs2", 0x7461636F: "ocfs2"}

#: Flags of every open of a user-controlled file for reading: O_NONBLOCK (a
#: FIFO or a device does not block the open), O_NOCTTY (a tty never becomes
#: ours).  The file was checked on an O_PATH descriptor first (open_identified).
O_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_OPENAT2 = 437                   # x86_64 and the generic table (include/uapi/asm-generic/unistd.h)
_RESOLVE_NO_MAGICLINKS = 0x02        # include/uapi/linux/openat2.h
_RESOLVE_IN_ROOT = 0x10
_AT_FDCWD = -100


def _openat2(dirfd: int, path: str, flags: int, resolve: int) -> int:
    """openat2(2) with struct open_how {flags, mode 0, resolve}; an fd. Raises OSError."""
    how = struct.pack("=QQQ", flags, 0, resolve)
    fd = _libc.syscall(_SYS_OPENAT2, dirfd, os.fsencode(path), how, len(how))
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), path)
    return fd


def open_route(source: "Source", pid: int, path: str, vma: tuple[int, int] = (0, 0)) -> int:
    """An O_PATH descriptor of one route to a mapped file (no open method of the file runs).

    Args:
        source: MAP_FILES (/proc/PID/map_files/START-END, vma = (vm_start,
            vm_end) in bytes; the magic link is followed: it is the mapped
            inode), PROC_ROOT (path inside /proc/PID/root, RESOLVE_IN_ROOT) or
            PATH (path in the daemon's namespace); both path routes use
            RESOLVE_NO_MAGICLINKS and O_NOFOLLOW on the last component.
        pid: the mapping process (tgid).
    Raises:
        OSError: ENOENT (no such mapping, process or file), EACCES/EPERM, ELOOP ...
    """
    flags = os.O_PATH | os.O_CLOEXEC
    if source is Source.MAP_FILES:
        return os.open(f"/proc/{pid}/map_files/{vma[0]:x}-{vma[1]:x}", flags)
    if "\0" in path:
        raise OSError(errno.ENOENT, "path holds a NUL byte", path)
    flags |= os.O_NOFOLLOW
    if source is Source.PATH:
        return _openat2(_AT_FDCWD, path, flags, _RESOLVE_NO_MAGICLINKS)
    root = os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return _openat2(root, path.lstrip("/") or ".", flags, _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS)
    finally:
        os.close(root)


def open_identified(pfd: int, want: Identity, named_at_event: bool = True) -> int:
    """Reopen the O_PATH descriptor pfd for reading when it is the regular file want describes.

    The checks run on pfd, before any open for reading: fstat (a regular
    file; ino, dev, size, mtime and ctime equal want's by :func:`mismatch`,
    ctime as :func:`stat_identity` says with named_at_event: False when the
    event's nlink was 0), then
    fstatfs (on FUSE: not read; the answer is final for that identity).  The reopen goes through the magic link
    /proc/self/fd/PFD, so it reaches that same inode whatever the path names
    now, with :data:`O_READ_FLAGS`; the generation is compared on the result
    (FS_IOC_GETVERSION does not work on O_PATH descriptors).  pfd stays open
    (the caller closes it).

    Returns:
        A read-only fd of the file (the caller closes it).
    Raises:
        FileRefusedError: reason ``slow_fs``, ``not_regular``, or the mismatch
            (``other_inode``, ``other_generation``, ``modified``).
        OSError: a call failed (ENOENT, EACCES, EIO ...).
    """
    st = os.fstat(pfd)
    if not stat.S_ISREG(st.st_mode):
        raise FileRefusedError(MissReason.NOT_REGULAR, f"mode {stat.filemode(st.st_mode)}")
    why = mismatch(want, stat_identity(st, 0, named_at_event))
    if why is not None:
        raise FileRefusedError(why, "another file than the one mapped")
    if fs_type(pfd) == FUSE_SUPER_MAGIC:
        raise FileRefusedError(MissReason.SLOW_FS, "on a FUSE file system")
    fd = os.open(f"/proc/self/fd/{pfd}", O_READ_FLAGS)
    try:
        why = mismatch(want, identity_of(fd, want.generation != 0, named_at_event))
        if why is not None:
            raise FileRefusedError(why, "another file than the one mapped")
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_map_file(pid: int, start: int, end: int) -> int:
    """Open /proc/PID/map_files/START-END for reading (:data:`O_READ_FLAGS`; the magic link is followed).

    For callers that check the result themselves; the enricher uses
    :func:`open_route` and :func:`open_identified`.
    Args:
        start, end: the VMA's exact vm_start and vm_end (bytes).
    Raises:
        OSError: ENOENT when no such mapping or process exists, EPERM/EACCES without privilege.
    """
    return os.open(f"/proc/{pid}/map_files/{start:x}-{end:x}", O_READ_FLAGS)


def open_path(path: str) -> int:
    """Open path in the daemon's namespace for reading: :data:`O_READ_FLAGS` | O_NOFOLLOW.

    A FIFO or device at path is opened without blocking but opened all the
    same: callers that must not open one use :func:`open_route` and
    :func:`open_identified`.  Raises OSError (ELOOP: a symlink at the last component).
    """
    return os.open(path, O_READ_FLAGS | os.O_NOFOLLOW)


def open_scanned(pid: int, start: int, end: int) -> tuple[int, Identity]:
    """Open the mapping [start, end) of pid through map_files for reading: (fd, its Identity).

    For the /proc/PID/maps scans, where the kernel's view of the identity is
    not known beforehand: the checks of :func:`open_identified` except the
    identity comparison (map_files names the mapped inode itself).
    Raises:
        FileRefusedError: ``slow_fs`` or ``not_regular``.
        OSError: the mapping or process is gone, or a call failed.
    """
    pfd = open_route(Source.MAP_FILES, pid, "", (start, end))
    try:
        if fs_type(pfd) == FUSE_SUPER_MAGIC:
            raise FileRefusedError(MissReason.SLOW_FS, "on a FUSE file system")
        if not stat.S_ISREG(os.fstat(pfd).st_mode):
            raise FileRefusedError(MissReason.NOT_REGULAR, "not a regular file")
        fd = os.open(f"/proc/self/fd/{pfd}", O_READ_FLAGS)
    finally:
        os.close(pfd)
    try:
        return fd, identity_of(fd)
    except BaseException:
        os.close(fd)
        raise


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


def read_uid(pid: int) -> int:
    """The process's real uid (the first field of /proc/PID/status ``Uid:``, as cred->uid in the
    kernel's records); -1 when the process is gone or the line is not there."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f.read(1 << 14).split(b"\n"):
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return -1

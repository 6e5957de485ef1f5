"""A fanotify notification group for ``FAN_OPEN_EXEC`` (fanotify(7), Linux 5.0+) and its marks.

One ``FAN_MARK_FILESYSTEM`` mark per super block of the local file systems
(:data:`PINNABLE_FS`, found in /proc/self/mountinfo, or through
/proc/PID/exe for one met in another mount namespace), and evictable ignore
marks (``FAN_MARK_IGNORED_MASK | FAN_MARK_EVICTABLE``, Linux 5.19) on
inodes whose execs need no event.  Reading an event makes the kernel open
the file that was executed and hand over the descriptor: only file systems
whose bytes the kernel serves itself are marked (reading a FUSE file's event
would call its server).  Used by :mod:`buildidd.resolve.execpins`.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct

from buildidd.kernel.fsinfo import fs_type

__all__ = ["FAN_Q_OVERFLOW", "FanotifyGroup", "PINNABLE_FS", "pinnable_mounts"]

# include/uapi/linux/fanotify.h
FAN_CLASS_NOTIF = 0x0
FAN_CLOEXEC = 0x1
FAN_NONBLOCK = 0x2
FAN_OPEN_EXEC = 0x1000
FAN_Q_OVERFLOW = 0x4000
FAN_MARK_ADD = 0x1
FAN_MARK_IGNORED_MASK = 0x20
FAN_MARK_FILESYSTEM = 0x100
FAN_MARK_EVICTABLE = 0x200
FANOTIFY_METADATA_VERSION = 3
#: struct fanotify_event_metadata: event_len u32, vers u8, reserved u8, metadata_len u16,
#: mask u64 (aligned), fd s32, pid s32.
_META = struct.Struct("=IBBHQii")
_AT_FDCWD = -100
_READ_BYTES = 64 * _META.size

#: File system types (/proc/self/mountinfo's fstype) marked for exec pins, with their statfs
#: f_type (include/uapi/linux/magic.h): local file systems whose bytes the kernel serves itself.
PINNABLE_FS = {"ext2": 0xEF53, "ext3": 0xEF53, "ext4": 0xEF53, "xfs": 0x58465342, "btrfs": 0x9123683E,
               "tmpfs": 0x01021994, "ramfs": 0x858458F6, "squashfs": 0x73717368, "erofs": 0xE0F5E1E2,
               "f2fs": 0xF2F52010, "overlay": 0x794C7630, "vfat": 0x4D44, "iso9660": 0x9660}
_PINNABLE_MAGIC = frozenset(PINNABLE_FS.values())
#: A file system first met through another mount namespace's process (mark_exe_of) may be one a user
#: mounted in their own user namespace: an overlay there may have a FUSE layer below it, so overlays
#: are marked only from this namespace's mount table.
_FOREIGN_MAGIC = _PINNABLE_MAGIC - {PINNABLE_FS["overlay"]}
#: Super blocks marked (and refused) at most: file systems come and go, their numbers are reused.
MARKED_MAX = 4096

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fanotify_init.argtypes = [ctypes.c_uint, ctypes.c_uint]
_libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p]


def _check(rc: int, what: str) -> int:
    if rc < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return rc


def _unescape_mountinfo(field: str) -> str:
    """A mountinfo path field with its octal escapes (``\\040`` for a space, proc_pid_mountinfo(5)) undone."""
    if "\\" not in field:
        return field
    out, i = bytearray(), 0
    raw = field.encode("utf-8", "surrogateescape")
    while i < len(raw):
        if raw[i] == 0x5C and i + 4 <= len(raw) and raw[i + 1:i + 4].isdigit():
            out.append(int(raw[i + 1:i + 4], 8) & 0xFF)
            i += 4
        else:
            out.append(raw[i])
            i += 1
    return out.decode("utf-8", "surrogateescape")


def pinnable_mounts(mountinfo: str) -> dict[str, str]:
    """{"MAJOR:MINOR": mount point} of the file systems to mark, one mount point per super block.

    Args:
        mountinfo: the text of /proc/self/mountinfo (proc_pid_mountinfo(5)): ID, parent ID,
            MAJOR:MINOR, root, mount point, options, optional fields, ``-``, fstype, source, options.
    """
    out: dict[str, str] = {}
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        try:
            sep = fields.index("-", 6)
        except ValueError:
            continue
        if len(fields) < sep + 2 or fields[sep + 1] not in PINNABLE_FS:
            continue
        out.setdefault(fields[2], _unescape_mountinfo(fields[4]))
    return out


class FanotifyGroup:
    """A fanotify notification group for FAN_OPEN_EXEC and its marks: one per pinnable super block,
    and evictable ignore marks on inodes (see the module docstring).

    Raises (from the constructor):
        OSError: fanotify_init failed (no CAP_SYS_ADMIN, a kernel without fanotify).
    """

    def __init__(self, mountinfo: str = "/proc/self/mountinfo"):
        self.fd = _check(_libc.fanotify_init(FAN_CLASS_NOTIF | FAN_CLOEXEC | FAN_NONBLOCK,
                                             os.O_RDONLY | os.O_LARGEFILE | os.O_CLOEXEC), "fanotify_init")
        self.mountinfo = mountinfo
        self.marked: set[int] = set()           # st_dev of marked super blocks
        self.unmarkable: set[int] = set()       # st_dev whose marking failed (a kernel-internal mount: memfd)
        self.evictable = True                   # FAN_MARK_EVICTABLE accepted (Linux 5.19+)
        self.stats = {"mark_errors": 0, "ignore_marks": 0, "ignore_mark_errors": 0}
        self.last_error: str | None = None

    def close(self) -> None:
        """Close the group (its marks go with it)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def mark_mounts(self) -> int:
        """Mark each pinnable super block of the mount table not marked yet; returns how many were.

        A mount point that cannot be marked (gone, covered, refused) is counted (``mark_errors``).
        """
        try:
            with open(self.mountinfo, encoding="utf-8", errors="surrogateescape") as f:
                text = f.read()
        except OSError as e:
            self.last_error = f"{self.mountinfo}: {e}"
            return 0
        added = 0
        for majmin, mnt in pinnable_mounts(text).items():
            major, _, minor = majmin.partition(":")
            try:
                dev = os.makedev(int(major), int(minor))
            except ValueError:
                continue
            if dev not in self.marked and self._mark_checked(mnt, dev, _PINNABLE_MAGIC):
                added += 1
        return added

    def mark_exe_of(self, pid: int, dev: int) -> bool:
        """Mark the file system of /proc/PID/exe when dev (its st_dev) is not marked yet and it is
        pinnable (a file system met in another mount namespace).

        The magic link is followed by the kernel (no path a user names is walked); its statfs
        type is read on an O_PATH descriptor first, which opens nothing.  True when newly marked.
        """
        if dev in self.marked or dev in self.unmarkable or self.fd < 0:
            return False
        if self._mark_checked(f"/proc/{pid}/exe", dev, _FOREIGN_MAGIC):
            return True
        if len(self.unmarkable) < MARKED_MAX:
            self.unmarkable.add(dev)
        return False

    def _mark_checked(self, path: str, dev: int, allowed: frozenset[int]) -> bool:
        """Mark the super block of the file path names, when its statfs type is in allowed and its
        st_dev is dev.  The check and the mark are made on one O_PATH descriptor (the mark through
        /proc/self/fd/N), so a mount put over path, or an exec, in between changes neither."""
        if len(self.marked) >= MARKED_MAX:
            return False
        try:
            pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            if fs_type(pfd) not in allowed or os.fstat(pfd).st_dev != dev:
                return False
            return self._mark_fs(f"/proc/self/fd/{pfd}".encode(), dev)
        except OSError:
            return False
        finally:
            os.close(pfd)

    def _mark_fs(self, path: bytes, dev: int) -> bool:
        rc = _libc.fanotify_mark(self.fd, FAN_MARK_ADD | FAN_MARK_FILESYSTEM, FAN_OPEN_EXEC, _AT_FDCWD, path)
        if rc < 0:
            e = ctypes.get_errno()
            self.stats["mark_errors"] += 1
            self.last_error = f"fanotify_mark {os.fsdecode(path)}: {os.strerror(e)}"
            return False
        self.marked.add(dev)
        return True

    def ignore(self, fd: int) -> None:
        """Set an evictable ignore mark for FAN_OPEN_EXEC on fd's inode: its execs make no event
        until it is modified or evicted.  Failures are counted (``ignore_mark_errors``)."""
        if self.fd < 0 or not self.evictable:
            return
        rc = _libc.fanotify_mark(self.fd, FAN_MARK_ADD | FAN_MARK_IGNORED_MASK | FAN_MARK_EVICTABLE,
                                 FAN_OPEN_EXEC, fd, None)
        if rc < 0:
            if ctypes.get_errno() == errno.EINVAL:
                self.evictable = False      # before 5.19: no evictable marks; a plain one would pin inodes
            self.stats["ignore_mark_errors"] += 1
            return
        self.stats["ignore_marks"] += 1

    def events(self):
        """The queued events, read without blocking: (mask, fd, pid) each; fd is -1 (FAN_NOFD) for
        an overflow.  The caller owns every fd >= 0.

        Raises:
            OSError: read failed (EMFILE/ENFILE making an event's fd: that event is lost).
            ValueError: a metadata version or length this reader does not know.
        """
        while True:
            try:
                buf = os.read(self.fd, _READ_BYTES)
            except BlockingIOError:
                return
            if not buf:
                return
            off = 0
            while off + _META.size <= len(buf):
                event_len, vers, _r, _mlen, mask, fd, pid = _META.unpack_from(buf, off)
                if vers != FANOTIFY_METADATA_VERSION or event_len < _META.size:
                    raise ValueError(f"fanotify metadata version {vers}, length {event_len}")
                off += event_len
                yield mask, fd, pid

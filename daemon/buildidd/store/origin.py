"""Where a stored file came from: its owner, path and privacy, kept in ``origin.json`` next to it.

A build-id is a claim a file makes, not a proof: anyone can link a binary
with ``-Wl,--build-id=0x<the build-id of /usr/bin/tac>``.  So each copy in
the store records the facts of its source at the moment it was copied (the
source's ``fstat`` and its path), in a small JSON file beside it::

    ROOT/<path>/<bid>/origin.json            the entry's main copy
    ROOT/<path>/<bid>/alt/<sha256>/elf       another content claiming <bid>
    ROOT/<path>/<bid>/alt/<sha256>/origin.json

*Trusted*: the source was owned by root (``st_uid`` 0), not writable by
other users (no ``o+w``; no ``g+w`` unless its group is root's), and its path
lies under one of :data:`SYSTEM_DIRS`, where package managers install.  Only
root can make a file owned by root, so an unprivileged user cannot forge
this, whatever mount namespace their path comes from.

*Private*: the source was not readable by every user: its mode lacks
``o+r``, or a directory on its path lacks ``o+x`` (each component is checked
with ``lstat``; one that cannot be checked counts as private), or it is a
memfd (``/memfd:NAME``, which has no path at all).  A private entry is kept,
but its directory is mode 0o700 and readers do not archive or serve it unless
the operator says so (``store_share_private``).  What made it private is
recorded with it (:func:`private_cause`): the first directory on the path
without ``o+x`` (``/root``, mode 0700), the file itself when its own mode
lacks ``o+r``, or the memfd; so an archive can say which directory to open up.

The same rules hold for a file without a GNU build-id, kept under its htlhash
(``"key": "htlhash"``): the htlhash is a claim too (it covers only the file's
first and last 4 KiB and its length).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path

ORIGIN_NAME = "origin.json"
"""The sidecar of every copy the store made from a mapped file."""

ALT_DIR = "alt"
"""``<entry>/alt/<sha256>/``: other contents claiming the entry's build-id."""

SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/bin", "/sbin", "/opt", "/boot")
"""Where the system's packages install files; a root-owned file elsewhere is not trusted."""

MEMFD_PREFIX = "/memfd:"
"""How the kernel names a memfd (``memfd_create``) in /proc/PID/maps and /proc/PID/fd."""

KEY_GNU, KEY_HTLHASH = "gnu", "htlhash"
KEYS = (KEY_GNU, KEY_HTLHASH)
"""What names an entry (:attr:`Origin.key`): a GNU build-id, or the htlhash of a file without one."""

ORIGIN_MAX_BYTES = 64 << 10
"""An ``origin.json`` longer than this is not read (the store writes < 1 KiB)."""

HASH_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class Origin:
    """The facts of a copy's source when it was copied.

    Attributes:
        uid, gid: the source's owner (``st_uid``, ``st_gid``).
        mode: its permission bits (``S_IMODE(st_mode)``).
        path: its path as the mapping named it (the kernel's d_path).
        dev, ino: its ``st_dev``, ``st_ino`` (to tell whether a process still maps it).
        size_bytes: its ``st_size``.
        mtime_ns: its ``st_mtime_ns``.
        ctime_ns: its ``st_ctime_ns`` (a chmod or chown changes it; 0 in older entries).
        trusted: root-owned, not writable by others, under :data:`SYSTEM_DIRS`.
        private: not readable by every user at its source, or a memfd.
        private_by: what made it private (:func:`private_cause`): the first directory on its path without
            ``o+x``, the path itself when the file's own mode lacks ``o+r``, the memfd's name; "" when not
            private or in an entry stored before this was recorded.
        private_by_mode: that directory's or file's permission bits; -1 when it could not be checked
            (``lstat`` failed, or not a directory), or for a memfd.
        sha256: the copy's content hash, lower-case hex ("" until computed).
        has_debug: the copy has a ``.debug_info`` or ``.symtab`` section.
        time_ns: ns since the epoch when it was stored.
        key: what the entry's name (``.build-id/xx/rest``) is: ``gnu``, the GNU build-id the copy
            carries, or ``htlhash``, the copy's :func:`buildidd.resolve.fileid.file_id` (OpenTelemetry's
            ``process.executable.build_id.htlhash``) for a file without a GNU build-id (:data:`KEYS`).
        file_id: the copy's htlhash, 32 lower-case hex digits ("" when not computed: an older entry).
        go_build_id: the copy's Go build ID (``.note.go.buildid``), "" when it has none.
        charged_uid: the real uid of the task whose mapping or exec caused the copy (Request.uid);
            -1 when not known (a /proc scan, an entry stored before this was recorded).
    """

    uid: int
    gid: int
    mode: int
    path: str
    dev: int = 0
    ino: int = 0
    size_bytes: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0
    trusted: bool = False
    private: bool = True
    private_by: str = ""
    private_by_mode: int = -1
    sha256: str = ""
    has_debug: bool = False
    time_ns: int = 0
    key: str = "gnu"
    file_id: str = ""
    go_build_id: str = ""
    charged_uid: int = -1

    @property
    def payer(self) -> int:
        """The uid the copy's disk bytes are charged to (the quota's per-user shares and eviction, see
        store.eviction): root for a source root owns (a system file is no user's flood, and no user's
        copies may evict it as their own), else the user whose task mapped or exec'd it, so that a user
        who maps another user's readable files pays for their copies; the source's owner when that
        user is not known."""
        return self.uid if self.uid == 0 or self.charged_uid < 0 else self.charged_uid

    def same_file(self, st: os.stat_result) -> bool:
        """Whether st names the same unchanged source (dev, inode, size, mtime)."""
        return (self.dev, self.ino, self.size_bytes, self.mtime_ns) == (
            st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def rank(self) -> int:
        """Order of preference among copies of one build-id: trusted first, then public."""
        return (0 if self.trusted else 2) + (1 if self.private else 0)

    def to_json(self) -> bytes:
        """The ``origin.json`` text: every field, keys sorted, one line.  The fields are scalars, so a
        shallow dict gives what ``dataclasses.asdict`` (a deep copy per call) would."""
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)}, sort_keys=True).encode() + b"\n"

    def replace(self, **changes) -> Origin:
        """A copy with changes (field names; TypeError for another name)."""
        return dataclasses.replace(self, **changes)


def under_system_dir(path: str) -> bool:
    """Whether path lies under one of :data:`SYSTEM_DIRS` (component-wise, no ``..``)."""
    if not path.startswith("/") or "/../" in path + "/" or "/./" in path + "/":
        return False
    return any(path == d or path.startswith(d + "/") for d in SYSTEM_DIRS)


def is_memfd(path: str) -> bool:
    return path.startswith(MEMFD_PREFIX)


def path_private(path: str) -> bool:
    """Whether a directory on path's way keeps other users out (no ``o+x``), or cannot be checked.

    Each proper prefix of path (``/``, ``/a``, ``/a/b`` for ``/a/b/c``) is
    ``lstat``-ed; a symlink, a non-directory, or an error counts as private.
    The kernel's d_path holds no symlinks, so a true path passes.
    """
    return closing_dir(path) is not None


def closing_dir(path: str) -> tuple[str, int] | None:
    """The first directory on path's way that keeps other users out, as ``(directory, mode)``; None if none.

    mode is the directory's permission bits (``S_IMODE(st_mode)``), or -1 when it could not be
    checked (an ``lstat`` error, a symlink or a non-directory: each counts as closing).  A memfd or a
    relative path is closed by itself: ``(path, -1)``.  ``" (deleted)"`` at the end is ignored.
    """
    if not path.startswith("/") or is_memfd(path):
        return path, -1
    if path.endswith(" (deleted)"):
        path = path[: -len(" (deleted)")]
    parts = [p for p in path.split("/") if p]
    prefix = "/"
    for part in [""] + parts[:-1]:
        prefix = os.path.join(prefix, part) if part else prefix
        try:
            st = os.lstat(prefix)
        except OSError:
            return prefix, -1
        if not stat.S_ISDIR(st.st_mode):
            return prefix, -1
        if not st.st_mode & stat.S_IXOTH:
            return prefix, stat.S_IMODE(st.st_mode)
    return None


def private_cause(path: str, mode: int, *, memfd: bool = False) -> tuple[str, int] | None:
    """What makes a source at path with permission bits mode private, as ``(where, mode)``; None if public.

    where is the memfd's name (mode -1), else the first directory on the path without ``o+x``
    (:func:`closing_dir`), else the path itself when mode lacks ``o+r``.  The outermost cause is
    named first: opening up ``/root`` is what an operator would do before chmod-ing each file.
    """
    if memfd or is_memfd(path):
        return path, -1
    closing = closing_dir(path)
    if closing is not None:
        return closing
    if not mode & stat.S_IROTH:
        return path, mode
    return None


def dir_closed(store_root: Path, store_dir: Path) -> bool:
    """Whether the source directory a store directory stands for (``/`` + store_dir below store_root) keeps
    its names from other users: not a directory, no ``o+r`` or no ``o+x``, or not checkable here (lstat).

    The store gives such a directory, when it makes it for a private entry, the private mode: the names
    in a private directory stay as closed to the control group as they were to other users.
    """
    try:
        st = os.lstat("/" + str(store_dir.relative_to(store_root)))
    except (OSError, ValueError):
        return True
    return not (stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_IROTH and st.st_mode & stat.S_IXOTH)


def origin_of(st: os.stat_result, path: str, *, fd_name: str = "") -> Origin:
    """The facts of a source from its fstat and path (the caller's thread does the path's lstat calls).

    Args:
        st: ``os.fstat`` of the open source.
        path: the path the mapping names (the store entry's name).
        fd_name: ``readlink /proc/self/fd/N`` of the source, when known (shows a memfd
            whatever path the caller was given).
    """
    memfd = is_memfd(path) or is_memfd(fd_name)
    mode = stat.S_IMODE(st.st_mode)
    writable_by_others = bool(mode & stat.S_IWOTH) or (bool(mode & stat.S_IWGRP) and st.st_gid != 0)
    trusted = st.st_uid == 0 and not writable_by_others and not memfd and under_system_dir(path)
    cause = private_cause(fd_name if is_memfd(fd_name) else path, mode, memfd=memfd)
    return Origin(uid=st.st_uid, gid=st.st_gid, mode=mode, path=path, dev=st.st_dev, ino=st.st_ino,
                  size_bytes=st.st_size, mtime_ns=st.st_mtime_ns, ctime_ns=st.st_ctime_ns, trusted=trusted,
                  private=cause is not None, private_by=cause[0] if cause else "",
                  private_by_mode=cause[1] if cause else -1,
                  time_ns=time.time_ns())


def origin_of_fd(fd: int, path: str) -> Origin:
    """:func:`origin_of` for an open fd (fstat, and its /proc/self/fd name). Raises OSError."""
    try:
        fd_name = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        fd_name = ""
    return origin_of(os.fstat(fd), path, fd_name=fd_name)


def read_origin(directory: Path) -> Origin | None:
    """The ``origin.json`` in directory; ``None`` when absent or unreadable (an entry perf or an older buildidd made)."""
    found = read_origin_stat(directory)
    return found[1] if found is not None else None


def read_origin_stat(directory: str | os.PathLike) -> tuple[os.stat_result, Origin] | None:
    """:func:`read_origin`, with the ``fstat`` of the file it read (its inode and mtime: the
    entry's stamp, Store.origin_stamp, as of that content)."""
    try:
        fd = os.open(os.path.join(directory, ORIGIN_NAME), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        data = os.read(fd, ORIGIN_MAX_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    origin = parse_origin(data)
    return (st, origin) if origin is not None else None


def parse_origin(data: bytes) -> Origin | None:
    """An ``origin.json``'s bytes as an :class:`Origin`; ``None`` when larger than ORIGIN_MAX_BYTES
    or not an origin (fields it does not know are ignored, so newer files stay readable)."""
    if len(data) > ORIGIN_MAX_BYTES:
        return None
    try:
        raw = json.loads(data)
        known = {k: raw[k] for k in Origin.__dataclass_fields__ if k in raw}
        return Origin(**known)
    except (ValueError, TypeError):
        return None


def sha256_fd(fd: int, size: int) -> str:
    """sha256 of the first size bytes of fd (positioned reads; holes read as zeros). Raises OSError."""
    h = hashlib.sha256()
    offset = 0
    while offset < size:
        chunk = os.pread(fd, min(HASH_CHUNK_BYTES, size - offset), offset)
        if not chunk:
            break
        h.update(chunk)
        offset += len(chunk)
    return h.hexdigest()

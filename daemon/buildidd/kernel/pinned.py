"""Loaded BPF programs kept across daemon restarts: pinned in bpffs, keyed by what was compiled.

On this kind of machine the loader's child spends ~2.3 s compiling (BCC,
clang) and ~2.2 s in the kernel's verifier (the page-cache reader), which a
restart under systemd would pay again for the very same program.
:func:`load_pinned` pins every program and map the loader handed over under
``ROOT/<source>-<key>`` (bpffs, root only), and on the next start with the
same key takes them back (BPF_OBJ_GET) and attaches them afresh: no compile,
no verifier.

The key is a SHA-256 over the BPF source and every header beside it, the
cflags (they carry this kernel's BTF offsets), the attach lists, the kernel
release and the boot id: any change loads afresh (and unpins the old copy).

Only the process holding the flock of a program's lock directory
(``ROOT/lock-<source>``, one per BPF source, so that one daemon can load its
programs side by side) uses that program's pins: a second daemon loads its
own copy, since two consumers must never share rings.
Before attaching, what a previous run left is reset: ring buffers skipped to
their producer position (its records never reach this session), hash maps
emptied, array maps zeroed, program arrays refilled.  Pinned programs of a
stopped or killed daemon stay loaded but do not run (nothing attaches them);
their maps keep their memory (the rings: Config.ring_bytes) until the
next start or ``rm -r ROOT``.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import shutil
import stat
import struct
import threading
import time
from typing import Callable

from buildidd.errors import ProbeError
from buildidd.kernel.attach import attach
from buildidd.kernel.bpfsys import MapRef, MapType, bpf, map_info
from buildidd.kernel.fsinfo import path_fs_type
from buildidd.kernel.loader import LoadedProgram, LoadSpec, load

log = logging.getLogger(__name__)

__all__ = ["load_pinned"]

#: Where bpffs is mounted when it is not (the only place this module mounts it).
BPF_MOUNT = "/sys/fs/bpf"
#: statfs f_type of bpffs (include/uapi/linux/magic.h BPF_FS_MAGIC).
BPF_FS_MAGIC = 0xCAFE4A11

BPF_OBJ_PIN = 6
BPF_OBJ_GET = 7
#: Array maps with more slots than this are not reused (zeroing them would cost more than a load).
MAX_ARRAY_RESET = 1 << 16


class _ObjAttr(ctypes.Structure):
    """union bpf_attr for BPF_OBJ_PIN / BPF_OBJ_GET (include/uapi/linux/bpf.h)."""
    _fields_ = [("pathname", ctypes.c_uint64), ("bpf_fd", ctypes.c_uint32), ("file_flags", ctypes.c_uint32)]


_libc = ctypes.CDLL(None, use_errno=True)
_MOUNT_LOCK = threading.Lock()


def spec_key(spec: LoadSpec) -> str:
    """Hex SHA-256 naming one compiled program on this boot: the source and the headers in its
    directory, cflags, attach lists, kernel release and /proc/sys/kernel/random/boot_id."""
    h = spec.digest()
    h.update(os.uname().release.encode())
    with open("/proc/sys/kernel/random/boot_id", "rb") as f:
        h.update(f.read())
    return h.hexdigest()[:32]


def load_pinned(spec: LoadSpec, root: str,
                fresh: Callable[[LoadSpec], LoadedProgram] = load) -> LoadedProgram:
    """spec loaded: from the pins under root when this boot already compiled it, else by
    fresh and then pinned.  Falls back to fresh alone (said in the log) when root cannot be used
    or another process holds its lock.

    Args:
        spec: what to load.
        root: the pin root, a directory directly under a bpffs mount (Config.bpf_pin_root).
        fresh: how to load without pins (:func:`buildidd.kernel.loader.load`, or the compile
            cache's kernel.progcache.load_compiled).
    Returns:
        The LoadedProgram; ``reused`` True when it came from the pins (compile_s 0, attach_s
        the time to take and attach them); its ``lock_fd`` holds the lock until close().
    Raises:
        ProbeError: as loader.load.
    """
    try:
        with _MOUNT_LOCK:              # two loads at once (capture.bpfstart) must not mount twice
            _ensure_bpffs(root)
        key = spec_key(spec)
        lock = _lock(root, spec.name)
    except (OSError, ProbeError) as e:
        log.info("BPF pins not used (%s): loading afresh", e)
        return fresh(spec)
    if lock is None:
        return fresh(spec)
    try:
        return _load_locked(spec, root, key, lock, fresh)
    except BaseException:
        os.close(lock)
        raise


def _load_locked(spec: LoadSpec, root: str, key: str, lock: int,
                 fresh: Callable[[LoadSpec], LoadedProgram]) -> LoadedProgram:
    name = spec.name
    pin_dir = os.path.join(root, f"{name}-{key}")
    if os.path.isdir(pin_dir):
        t0 = time.monotonic()
        try:
            loaded = _reuse(pin_dir, spec)
            loaded.attach_s = loaded.load_s = time.monotonic() - t0
            loaded.reused, loaded.lock_fd = True, lock
            return loaded
        except Exception as e:  # noqa: BLE001 - any fault in the pins: load afresh instead
            log.warning("pinned BPF program %s not reusable (%s): loading afresh", pin_dir, e)
            shutil.rmtree(pin_dir, ignore_errors=True)
    loaded = fresh(spec)
    loaded.lock_fd = lock
    try:
        if spec_key(spec) == key:        # not the source of an upgrade made during the compile
            _pin(loaded, root, name, pin_dir)
    except OSError as e:
        log.warning("cannot pin the BPF program under %s: %s", root, e)
    return loaded


def _lock(root: str, name: str) -> int | None:
    """flock (LOCK_EX) of the directory ``root/lock-name`` (made when absent; in bpffs it lives
    exactly as long as the pins, whatever happens to /run).  None when another open file holds
    it: another daemon, or another load of the same source in this one.

    Raises:
        OSError: the lock directory cannot be made or opened, or is not a directory of ours.
    """
    path = os.path.join(root, f"lock-{name}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    if os.fstat(fd).st_uid != os.geteuid():
        os.close(fd)
        raise OSError(errno.EPERM, f"{path} is not this user's")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)           # another daemon uses the pins: this one loads its own copy
        return None
    return fd


def _ensure_bpffs(root: str) -> None:
    """Check root is a 0700 directory of this user's directly under a bpffs mount, making it if
    absent; bpffs is mounted (mode 0700, as systemd does) only at :data:`BPF_MOUNT` when nothing
    is there.

    Raises:
        OSError: no bpffs at root's parent, root's parent is not the mount's root, or root is not
            this user's 0700 directory (/sys/fs/bpf may be world-writable: a directory a user
            made there first could hold a link to another pinned object standing in for ours).
    """
    root = root.rstrip("/")
    parent = os.path.dirname(root)
    if path_fs_type(parent) != BPF_FS_MAGIC:
        if parent != BPF_MOUNT:
            raise OSError(errno.ENOTDIR, f"{parent} is not a bpffs mount")
        if _libc.mount(b"bpf", parent.encode(), b"bpf", ctypes.c_ulong(0), b"mode=0700") != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot mount bpffs at {parent}: {os.strerror(err)}")
    if path_fs_type(os.path.dirname(parent)) == BPF_FS_MAGIC:
        raise OSError(errno.EINVAL, f"{root}: its parent is not the root of a bpffs mount")
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise OSError(errno.EPERM, f"{root} is not a directory of this user's, mode 0700 "
                                   f"(uid {st.st_uid}, mode {stat.filemode(st.st_mode)})")


def _obj(cmd: int, path: str, fd: int = 0) -> int:
    p = ctypes.create_string_buffer(path.encode())
    return bpf(cmd, _ObjAttr(pathname=ctypes.addressof(p), bpf_fd=fd))


def _pin(loaded: LoadedProgram, root: str, name: str, pin_dir: str) -> None:
    """Pin loaded's programs and maps in a new directory, renamed to pin_dir when complete; older
    keys of the same source are unpinned."""
    tmp = f"{pin_dir}_tmp{os.getpid()}"          # bpffs refuses names with a dot
    shutil.rmtree(tmp, ignore_errors=True)          # a crashed start's, with the same pid
    os.mkdir(tmp, 0o700)
    try:
        for kind, table in (("prog", loaded.progs), ("map", {n: m.fd for n, m in loaded.maps.items()})):
            for obj, fd in table.items():
                _obj(BPF_OBJ_PIN, os.path.join(tmp, f"{kind}_{obj}"), fd)
        os.rename(tmp, pin_dir)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for other in os.listdir(root):
        if other.startswith(f"{name}-") and os.path.join(root, other) != pin_dir:
            shutil.rmtree(os.path.join(root, other), ignore_errors=True)


def _reuse(pin_dir: str, spec: LoadSpec) -> LoadedProgram:
    loaded = LoadedProgram()
    try:
        for entry in sorted(os.listdir(pin_dir)):
            kind, _, obj = entry.partition("_")
            fd = _obj(BPF_OBJ_GET, os.path.join(pin_dir, entry))
            if kind != "map":
                loaded.progs[obj] = fd
                continue
            try:
                loaded.maps[obj] = MapRef(fd, map_info(fd))
            except BaseException:
                os.close(fd)
                raise
        for ref in loaded.maps.values():
            _reset(ref)
        attach(loaded, spec)
    except BaseException:
        loaded.close()
        raise
    return loaded


def _reset(ref: MapRef) -> None:
    """Return one map to its state after a fresh load (see the module docstring).

    Raises:
        ProbeError: a map type this does not know how to reset (the pins are then not used).
    """
    kind = ref.info.type
    if kind == MapType.RINGBUF:
        page = mmap.PAGESIZE
        with mmap.mmap(ref.fd, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0) as cons, \
                mmap.mmap(ref.fd, page, mmap.MAP_SHARED, mmap.PROT_READ, offset=page) as prod:
            cons[0:8] = prod[0:8]
    elif kind in (MapType.HASH, MapType.PERCPU_HASH, MapType.LRU_HASH, MapType.LRU_PERCPU_HASH):
        for key in list(ref.keys()):
            try:
                ref.delete(key)
            except KeyError:
                pass
    elif kind in (MapType.ARRAY, MapType.PERCPU_ARRAY) and ref.info.max_entries <= MAX_ARRAY_RESET:
        zero = bytes(ref.info.value_size)
        for i in range(ref.info.max_entries):
            ref.update(struct.pack("<I", i), zero)
    elif kind != MapType.PROG_ARRAY:
        raise ProbeError(f"map {ref.info.name!r} of type {kind} cannot be reset")

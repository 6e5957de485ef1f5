"""BPF map operations through the bpf(2) system call, without BCC.

The recording process holds map file descriptors it received from the loader's
child (:mod:`buildidd.kernel.loader`) and must not import BCC (which maps
libLLVM and libclang for good).  This module is the little of libbpf it needs:
look up, update, delete and iterate map elements, and ask the kernel what a map
is (type, key and value sizes, max_entries).

Every layout here is the kernel's UAPI, include/uapi/linux/bpf.h: ``union
bpf_attr`` (the ``map_fd``/``key``/``value``/``flags`` member for the element
commands, ``info.bpf_fd``/``info_len``/``info`` for BPF_OBJ_GET_INFO_BY_FD) and
``struct bpf_map_info``.  Per-CPU maps read and write ``round_up(value_size, 8)``
bytes per possible CPU (kernel/bpf/syscall.c, bpf_map_value_size).
"""

from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass
from enum import IntEnum
from typing import Callable, Iterator

from buildidd.errors import ProbeError

#: __NR_bpf per machine (arch/x86/entry/syscalls/syscall_64.tbl: 321;
#: include/uapi/asm-generic/unistd.h: 280 on arm64 and riscv64).
SYSCALL_NR = {"x86_64": 321, "aarch64": 280, "riscv64": 280}

# enum bpf_cmd (include/uapi/linux/bpf.h)
BPF_MAP_LOOKUP_ELEM = 1
BPF_MAP_UPDATE_ELEM = 2
BPF_MAP_DELETE_ELEM = 3
BPF_MAP_GET_NEXT_KEY = 4
BPF_OBJ_GET_INFO_BY_FD = 15

# Update flags (include/uapi/linux/bpf.h)
BPF_ANY = 0
BPF_NOEXIST = 1
BPF_EXIST = 2


class MapType(IntEnum):
    """enum bpf_map_type (include/uapi/linux/bpf.h), the values buildidd meets."""

    HASH = 1
    ARRAY = 2
    PROG_ARRAY = 3
    PERF_EVENT_ARRAY = 4
    PERCPU_HASH = 5
    PERCPU_ARRAY = 6
    STACK_TRACE = 7
    CGROUP_ARRAY = 8
    LRU_HASH = 9
    LRU_PERCPU_HASH = 10
    LPM_TRIE = 11
    ARRAY_OF_MAPS = 12
    HASH_OF_MAPS = 13
    RINGBUF = 27


#: Map types whose values are one slot per possible CPU.
PERCPU_TYPES = frozenset({MapType.PERCPU_HASH, MapType.PERCPU_ARRAY, MapType.LRU_PERCPU_HASH})


class _ElemAttr(ctypes.Structure):
    """union bpf_attr, the anonymous struct used by BPF_MAP_*_ELEM commands."""

    _fields_ = [("map_fd", ctypes.c_uint32), ("_pad", ctypes.c_uint32),
                ("key", ctypes.c_uint64), ("value", ctypes.c_uint64),  # value or next_key
                ("flags", ctypes.c_uint64)]


class _InfoAttr(ctypes.Structure):
    """union bpf_attr, the ``info`` struct used by BPF_OBJ_GET_INFO_BY_FD."""

    _fields_ = [("bpf_fd", ctypes.c_uint32), ("info_len", ctypes.c_uint32), ("info", ctypes.c_uint64)]


class _MapInfo(ctypes.Structure):
    """struct bpf_map_info (include/uapi/linux/bpf.h, as of Linux 6.x; the kernel
    fills at most info_len bytes and zero-fills what it does not know)."""

    _fields_ = [("type", ctypes.c_uint32), ("id", ctypes.c_uint32),
                ("key_size", ctypes.c_uint32), ("value_size", ctypes.c_uint32),
                ("max_entries", ctypes.c_uint32), ("map_flags", ctypes.c_uint32),
                ("name", ctypes.c_char * 16), ("ifindex", ctypes.c_uint32),
                ("btf_vmlinux_value_type_id", ctypes.c_uint32),
                ("netns_dev", ctypes.c_uint64), ("netns_ino", ctypes.c_uint64),
                ("btf_id", ctypes.c_uint32), ("btf_key_type_id", ctypes.c_uint32),
                ("btf_value_type_id", ctypes.c_uint32), ("btf_vmlinux_id", ctypes.c_uint32),
                ("map_extra", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_NR_BPF = SYSCALL_NR.get(os.uname().machine)


def bpf(cmd: int, attr: ctypes.Structure) -> int:
    """The bpf(2) system call: ``bpf(cmd, &attr, sizeof(attr))``.

    Returns:
        The call's non-negative result.
    Raises:
        ProbeError: this machine's bpf syscall number is not known.
        OSError: the kernel refused (errno as returned).
    """
    if _NR_BPF is None:
        raise ProbeError(f"bpf(2) syscall number unknown on {os.uname().machine}")
    r = _libc.syscall(ctypes.c_long(_NR_BPF), ctypes.c_int(cmd), ctypes.byref(attr),
                      ctypes.c_uint(ctypes.sizeof(attr)))
    if r < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return r


BPF_LINK_CREATE = 28
BPF_ITER_CREATE = 33
#: enum bpf_attach_type BPF_TRACE_ITER (include/uapi/linux/bpf.h)
BPF_TRACE_ITER = 28
#: Bytes asked of an iterator per read(2) (a record straddling two reads is the caller's to join).
ITER_READ_BYTES = 1 << 16


class _LinkCreateAttr(ctypes.Structure):
    """union bpf_attr for BPF_LINK_CREATE of an iterator (link_create: prog_fd, target_fd,
    attach_type, flags, iter_info, iter_info_len); the rest of the union stays zero."""
    _fields_ = [("prog_fd", ctypes.c_uint32), ("target_fd", ctypes.c_uint32),
                ("attach_type", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("iter_info", ctypes.c_uint64), ("iter_info_len", ctypes.c_uint32),
                ("_pad", ctypes.c_uint32 * 9)]


class _IterCreateAttr(ctypes.Structure):
    """union bpf_attr for BPF_ITER_CREATE (iter_create: link_fd, flags)."""
    _fields_ = [("link_fd", ctypes.c_uint32), ("flags", ctypes.c_uint32)]


def iter_chunks(prog_fd: int) -> Iterator[bytes]:
    """Run a BPF iterator program over every object of its target; what it wrote, read by read.

    A link (BPF_LINK_CREATE, attach type BPF_TRACE_ITER, no target
    parameters: every task for task and task_vma) and an iterator
    (BPF_ITER_CREATE) are made; each read(2) of ITER_READ_BYTES runs the
    program on the objects whose output (bpf_seq_write) fills it, and is
    yielded as it comes, so the caller holds one chunk at a time however
    many objects exist.  Both fds are closed when the generator ends or is
    closed.

    Args:
        prog_fd: a loaded BPF_PROG_TYPE_TRACING program for a bpf_iter target.
    Raises:
        OSError: the kernel refused the link or the iterator, or a read failed.
    """
    link = bpf(BPF_LINK_CREATE, _LinkCreateAttr(prog_fd=prog_fd, attach_type=BPF_TRACE_ITER))
    try:
        it = bpf(BPF_ITER_CREATE, _IterCreateAttr(link_fd=link))
        try:
            while True:
                chunk = os.read(it, ITER_READ_BYTES)
                if not chunk:
                    return
                yield chunk
        finally:
            os.close(it)
    finally:
        os.close(link)


def possible_cpus(path: str = "/sys/devices/system/cpu/possible") -> int:
    """How many CPUs the kernel may bring up (num_possible_cpus()): the number of
    CPUs in the list at path (e.g. ``0-1`` or ``0-3,6``).

    Raises:
        ProbeError: the file is unreadable or malformed.
    """
    try:
        with open(path) as f:
            text = f.read(4096).strip()
        count = 0
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            count += (int(hi) if hi else int(lo)) - int(lo) + 1
    except (OSError, ValueError) as e:
        raise ProbeError(f"cannot read the possible CPUs from {path}: {e}") from e
    if count < 1:
        raise ProbeError(f"{path} lists no CPU: {text!r}")
    return count


@dataclass(frozen=True)
class MapInfo:
    """What the kernel says a map is (struct bpf_map_info).

    Attributes:
        type: enum bpf_map_type value (a :class:`MapType` when known).
        id: the kernel's map id (as bpftool prints).
        key_size, value_size: bytes; value_size is one CPU's share in per-CPU maps.
        max_entries: entries, or bytes for a ring buffer.
        name: the kernel's name (at most 15 characters; BCC truncates longer table names).
    """

    type: int
    id: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int
    name: str


def map_info(fd: int) -> MapInfo:
    """BPF_OBJ_GET_INFO_BY_FD on a map fd.

    Raises:
        OSError: fd is not a BPF map (EINVAL) or not open (EBADF).
    """
    info = _MapInfo()
    attr = _InfoAttr(bpf_fd=fd, info_len=ctypes.sizeof(info), info=ctypes.addressof(info))
    bpf(BPF_OBJ_GET_INFO_BY_FD, attr)
    try:
        kind: int = MapType(info.type)
    except ValueError:
        kind = info.type
    return MapInfo(kind, info.id, info.key_size, info.value_size, info.max_entries, info.map_flags,
                   info.name.decode(errors="replace"))


def _buffer(data, size: int, what: str):
    """A ctypes char array holding the bytes of data (bytes, bytearray, ctypes object)."""
    raw = bytes(memoryview(data).cast("B"))
    if len(raw) != size:
        raise ValueError(f"{what} is {len(raw)} bytes; the map's is {size}")
    return ctypes.create_string_buffer(raw, size)


class MapRef:
    """One BPF map, by file descriptor (not owned: closing it is the caller's business).

    Keys and values are bytes-like objects (bytes, or a ctypes Structure/int of the
    right size: ``bytes(ctypes.c_int(0))`` works, and so does passing the ctypes
    object itself).  Values come back as bytes; a per-CPU map's value is a list
    of bytes, one per possible CPU, each value_size long.

    Args:
        fd: the map's file descriptor.
        info: its :class:`MapInfo` (asked from the kernel when None).

    Raises:
        OSError: fd is not a BPF map.
    """

    def __init__(self, fd: int, info: MapInfo | None = None):
        self.fd = fd
        self.info = info or map_info(fd)
        self.percpu = self.info.type in PERCPU_TYPES
        self.ncpus = possible_cpus() if self.percpu else 1
        #: bytes the kernel reads or writes for one value (all CPUs' in a per-CPU map).
        self.value_bytes = ((self.info.value_size + 7) & ~7) * self.ncpus if self.percpu \
            else self.info.value_size

    def _attr(self, key, value=None, flags: int = 0) -> _ElemAttr:
        return _ElemAttr(map_fd=self.fd, key=ctypes.addressof(key) if key is not None else 0,
                         value=ctypes.addressof(value) if value is not None else 0, flags=flags)

    def lookup_raw(self, key) -> bytes | None:
        """The value at key as the kernel returns it (value_bytes long), or None when absent.

        Raises:
            OSError: any other refusal (e.g. a ring buffer, which has no elements).
        """
        k = _buffer(key, self.info.key_size, "key")
        v = ctypes.create_string_buffer(self.value_bytes)
        try:
            bpf(BPF_MAP_LOOKUP_ELEM, self._attr(k, v))
        except OSError as e:
            if e.errno == errno.ENOENT:
                return None
            raise
        return v.raw

    def lookup(self, key) -> bytes | list[bytes] | None:
        """The value at key (a list of per-CPU values for a per-CPU map), or None when absent.

        Raises:
            OSError: the kernel refused for another reason than an absent key.
        """
        raw = self.lookup_raw(key)
        if raw is None or not self.percpu:
            return raw
        stride = (self.info.value_size + 7) & ~7
        return [raw[i * stride:i * stride + self.info.value_size] for i in range(self.ncpus)]

    def update(self, key, value, flags: int = BPF_ANY) -> None:
        """Set the value at key.  For a per-CPU map, value is either one value for
        every CPU or a sequence of ncpus values.

        Args:
            flags: BPF_ANY, BPF_NOEXIST or BPF_EXIST.
        Raises:
            OSError: E2BIG (map full), EEXIST/ENOENT (flags), EINVAL (bad flags or value).
            ValueError: key or value of the wrong size.
        """
        k, v = self._update_buffers(key, value)
        bpf(BPF_MAP_UPDATE_ELEM, self._attr(k, v, flags))

    def prepared_update(self, key, value) -> Callable[[], None]:
        """A call that sets key to value (as update(), BPF_ANY), both fixed now: the buffers and
        the bpf_attr are made once, for an update repeated on a hot path (one bpf(2) each call).

        Raises (from the call): OSError as update().
        """
        k, v = self._update_buffers(key, value)
        attr = self._attr(k, v, BPF_ANY)

        def run() -> None:
            bpf(BPF_MAP_UPDATE_ELEM, attr)
        run.buffers = (k, v)        # the attr points into them: kept alive with the call
        return run

    def _update_buffers(self, key, value):
        """(key, value) ctypes buffers for BPF_MAP_UPDATE_ELEM (see update())."""
        k = _buffer(key, self.info.key_size, "key")
        if self.percpu:
            values = list(value) if isinstance(value, (list, tuple)) else [value] * self.ncpus
            if len(values) != self.ncpus:
                raise ValueError(f"{len(values)} per-CPU values for {self.ncpus} possible CPUs")
            stride = (self.info.value_size + 7) & ~7
            raw = b"".join(_buffer(x, self.info.value_size, "value").raw.ljust(stride, b"\0")
                           for x in values)
            return k, ctypes.create_string_buffer(raw, self.value_bytes)
        return k, _buffer(value, self.info.value_size, "value")

    def delete(self, key) -> None:
        """Remove key.

        Raises:
            KeyError: key is absent.
            OSError: the kernel refused (EINVAL on an array map, whose elements always exist).
        """
        k = _buffer(key, self.info.key_size, "key")
        try:
            bpf(BPF_MAP_DELETE_ELEM, self._attr(k))
        except OSError as e:
            if e.errno == errno.ENOENT:
                raise KeyError(bytes(k.raw)) from e
            raise

    def next_key(self, key=None) -> bytes | None:
        """The key after key (the first key when key is None); None past the last.

        Raises:
            OSError: the kernel refused.
        """
        k = _buffer(key, self.info.key_size, "key") if key is not None else None
        nxt = ctypes.create_string_buffer(self.info.key_size)
        try:
            bpf(BPF_MAP_GET_NEXT_KEY, self._attr(k, nxt))
        except OSError as e:
            if e.errno == errno.ENOENT:
                return None
            raise
        return nxt.raw

    def keys(self) -> Iterator[bytes]:
        """Every key, at most max_entries of them (a hash map changing under the walk
        may restart it from the first key; the bound keeps the walk finite)."""
        key = None
        for _ in range(self.info.max_entries):
            key = self.next_key(key)
            if key is None:
                return
            yield key

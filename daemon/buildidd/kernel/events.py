"""The ctypes mirror of bpf/events.h, and decoding of raw ring-buffer events.

This is the only Python definition of the kernel→user wire format;
tests/kernel/test_events.py compiles bpf/events.h with gcc and checks that every size
and offset here agrees with the C compiler's.
"""

from __future__ import annotations

import ctypes
import enum
import os
import struct
from dataclasses import dataclass
from typing import NamedTuple

from buildidd import memo

COMM_LEN = 16
PATH_MAX = 4096


def bpf_dir() -> str:
    """The directory holding buildidd.bpf.c and events.h (package data ``buildidd.bpf``, found
    through importlib.resources: from a source checkout and an installed wheel alike).

    Raises:
        ProbeError: the sources are not installed as plain files.
    """
    from importlib.resources import files
    from buildidd.errors import ProbeError
    root = files("buildidd.bpf")
    path = os.fspath(root) if isinstance(root, os.PathLike) else None
    if path is None or not os.path.isfile(os.path.join(path, "buildidd.bpf.c")):
        raise ProbeError(f"the BPF sources (package buildidd.bpf) are not installed as files: {root}")
    return path


BPF_DIR = bpf_dir()


class EventType(enum.IntEnum):
    """event_header.type (enum buildidd_event_type)."""

    MAP = 1
    EXEC = 2
    FORK = 3
    EXIT = 4
    COMM = 5


class MapOrigin(enum.IntEnum):
    """map_event.origin (enum buildidd_map_origin): how the mapping came to be."""

    MMAP = 1
    MPROTECT = 2
    EXEC_MAIN = 3
    EXEC_INTERP = 4
    SYNTHESIZED = 5


class DropCause(enum.IntEnum):
    """Indexes of the BPF "drops" counters (enum buildidd_drop_cause; one u64 each, all CPUs')."""

    RINGBUF_FULL = 0
    PENDING_FULL = 1
    NO_VMA = 2
    READ_FAILED = 3


N_DROP_CAUSES = 4


class PcStatus(enum.IntEnum):
    """enum pagecache_status of bpf/events.h: the outcome of one page-cache build-id read (bpf/pagecache.h)."""

    NONE = 0            #: not tried
    OK = 1              #: build-id read
    NOT_CACHED = 2      #: page ``page`` not in the page cache
    NOT_ELF = 3         #: no ELF magic
    NO_NOTE = 4         #: sound ELF without a GNU build-id note in a PT_NOTE segment
    NOTE_TOO_LARGE = 5  #: the GNU build-id note has more than 64 bytes
    RACED = 6           #: the folio of page ``page`` changed during the read
    MALFORMED = 7       #: headers or notes out of the file or inconsistent
    UNSUPPORTED = 8     #: big-endian, PN_XNUM, or beyond the walk's caps
    FAULT = 9           #: a kernel read failed, or the bases are unknown (kernel path off)


PC_BUILD_ID_MAX = 64    #: the longest build-id the kernel side takes, bytes
PATH_TRUNCATED, PATH_UNREACHABLE, FILE_BACKING = 0x2, 0x4, 0x8
BID_MEMO = 0x10         #: map_event.bid came from the kernel's build-id memo (bpf/buildid_memo.h)
BID_NEW = 0x20          #: the memo met this file first at this mapping; the record forced a wake-up
#: id_flags bits that mean the path was not read whole (the record's "path_truncated").
PATH_CUT = PATH_TRUNCATED | PATH_UNREACHABLE


class EventHeader(ctypes.Structure):
    """struct event_header of bpf/events.h (see the field comments there)."""
    _fields_ = [
        ("type", ctypes.c_uint32),
        ("pid", ctypes.c_uint32),       # tgid
        ("tid", ctypes.c_uint32),
        ("uid", ctypes.c_uint32),       # the task's real uid (the user charged)
        ("time_ns", ctypes.c_uint64),   # ns since boot (CLOCK_BOOTTIME)
        ("comm", ctypes.c_char * COMM_LEN),
    ]


class FileId(ctypes.Structure):
    """struct file_id of bpf/events.h (see the field comments there)."""
    _fields_ = [
        ("ino", ctypes.c_uint64),
        ("size", ctypes.c_uint64),       # bytes
        ("mtime_sec", ctypes.c_int64),
        ("mtime_nsec", ctypes.c_uint32),
        ("dev", ctypes.c_uint32),        # kernel dev_t: MAJOR << 20 | MINOR
        ("generation", ctypes.c_uint32),
        ("ctime_nsec", ctypes.c_uint32),
        ("ctime_sec", ctypes.c_int64),
        ("nlink", ctypes.c_uint32),
        ("_pad", ctypes.c_uint32),
    ]


class PagecacheBuildId(ctypes.Structure):
    """struct pagecache_build_id of bpf/events.h (see the field comments there)."""
    _fields_ = [
        ("status", ctypes.c_uint32),     # PcStatus
        ("size", ctypes.c_uint32),       # bytes of build_id used
        ("page", ctypes.c_uint64),       # file page index (NOT_CACHED, RACED)
        ("build_id", ctypes.c_uint8 * PC_BUILD_ID_MAX),
    ]


class MapEvent(ctypes.Structure):
    """struct map_event of bpf/events.h (see the field comments there)."""
    _fields_ = [
        ("hdr", EventHeader),
        ("start", ctypes.c_uint64),
        ("len", ctypes.c_uint64),
        ("pgoff", ctypes.c_uint64),      # bytes
        ("prot", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("origin", ctypes.c_uint32),
        ("id_flags", ctypes.c_uint32),
        ("file", FileId),
        ("bid", PagecacheBuildId),
        ("path_len", ctypes.c_uint16),
        ("_pad1", ctypes.c_uint8 * 6),
        ("path", ctypes.c_char * PATH_MAX),
    ]


class ExecEvent(ctypes.Structure):
    """struct exec_event of bpf/events.h (see the field comments there)."""
    _fields_ = [
        ("hdr", EventHeader),
        ("old_tid", ctypes.c_uint32),    # the tid before exec (tracepoint's old_pid)
        ("id_flags", ctypes.c_uint32),
        ("file", FileId),
        ("filename_len", ctypes.c_uint16),
        ("path_len", ctypes.c_uint16),
        ("_pad1", ctypes.c_uint8 * 4),
        ("names", ctypes.c_char * (2 * PATH_MAX)),   # filename, then path
    ]


class TaskFork(ctypes.Structure):
    """struct task_fork of bpf/events.h: a FORK event's parent."""
    _fields_ = [
        ("ppid", ctypes.c_uint32),       # tgid
        ("ptid", ctypes.c_uint32),
    ]


class TaskExit(ctypes.Structure):
    """struct task_exit of bpf/events.h: an EXIT event's status."""
    _fields_ = [
        ("exit_code", ctypes.c_uint32),  # task_struct.exit_code
        ("_pad", ctypes.c_uint32),
    ]


class _TaskBody(ctypes.Union):
    """The anonymous union of struct task_event (by hdr.type)."""
    _fields_ = [("fork", TaskFork), ("exit", TaskExit)]


class TaskEvent(ctypes.Structure):
    """struct task_event of bpf/events.h: ev.fork (FORK), ev.exit (EXIT), nothing (COMM)."""
    _anonymous_ = ("_body",)
    _fields_ = [
        ("hdr", EventHeader),
        ("_body", _TaskBody),
    ]


class DropTime(ctypes.Structure):
    """struct drop_time of bpf/events.h (see the field comments there)."""
    _fields_ = [("first_ns", ctypes.c_uint64), ("last_ns", ctypes.c_uint64)]


#: Every wire struct, by its C name, for the layout test.
WIRE_STRUCTS: dict[str, type[ctypes.Structure]] = {
    "event_header": EventHeader,
    "file_id": FileId,
    "pagecache_build_id": PagecacheBuildId,
    "map_event": MapEvent,
    "exec_event": ExecEvent,
    "task_fork": TaskFork,
    "task_exit": TaskExit,
    "task_event": TaskEvent,
    "drop_time": DropTime,
}


# --- decoding ---------------------------------------------------------------
# Decoding uses struct.Struct formats derived from the ctypes mirror above
# (offsets checked by _check_formats at import), because unpack_from on bytes
# is several times cheaper per event than ctypes.from_buffer_copy.
_HDR = struct.Struct("<IIIIQ16s")
_FILE = struct.Struct("<QQqIIIIqII")
_BID = struct.Struct("<IIQ")                  # pagecache_build_id.status, size, page; then build_id
_MAP_BODY = struct.Struct("<QQQIIII")
_MAP_TAIL = struct.Struct("<H6x")
_EXEC_BODY = struct.Struct("<II")
_EXEC_HEAD = struct.Struct("<IIIIQ16sII")     # event_header, old_tid, id_flags: exec_head()
_EXEC_LENS = struct.Struct("<HH4x")           # exec_event.filename_len, path_len

_MAP_BODY_OFF = MapEvent.start.offset
_MAP_FILE_OFF = MapEvent.file.offset
_MAP_BID_OFF = MapEvent.bid.offset
_MAP_BID_BYTES_OFF = _MAP_BID_OFF + PagecacheBuildId.build_id.offset
_MAP_PLEN_OFF = MapEvent.path_len.offset
_MAP_PATH_OFF = MapEvent.path.offset
_EXEC_BODY_OFF = ExecEvent.old_tid.offset
_EXEC_FILE_OFF = ExecEvent.file.offset
_EXEC_FLEN_OFF = ExecEvent.filename_len.offset
_EXEC_NAMES_OFF = ExecEvent.names.offset
_TASK_BODY_OFF = TaskEvent.fork.offset
_FILE_KEY = struct.Struct("<QQqIIIIq")
#: A fork/exit/comm event in one unpack: header fields, then the union's two
#: words (fork: ppid, ptid; exit: exit_code, 0; comm: 0, 0).
TASK_EVENT = struct.Struct("<IIIIQ16sII")


def _check_formats() -> None:
    assert _HDR.size == ctypes.sizeof(EventHeader)
    assert _FILE.size == ctypes.sizeof(FileId)
    assert _MAP_FILE_OFF == _MAP_BODY_OFF + _MAP_BODY.size
    assert _MAP_BID_OFF == _MAP_FILE_OFF + _FILE.size
    assert _MAP_PLEN_OFF == _MAP_BID_OFF + ctypes.sizeof(PagecacheBuildId)
    assert _BID.size == PagecacheBuildId.build_id.offset
    assert _MAP_PATH_OFF == _MAP_PLEN_OFF + _MAP_TAIL.size
    assert _EXEC_FILE_OFF == _EXEC_BODY_OFF + _EXEC_BODY.size
    assert _EXEC_NAMES_OFF == _EXEC_FLEN_OFF + _EXEC_LENS.size
    assert _TASK_BODY_OFF == _HDR.size
    assert _FILE_KEY.size == FileId.nlink.offset
    assert TASK_EVENT.size == ctypes.sizeof(TaskEvent)
    assert TaskEvent.exit.offset + TaskExit.exit_code.offset == _TASK_BODY_OFF
    assert TaskFork.ptid.offset == 4
    assert _EXEC_HEAD.size == _EXEC_FILE_OFF


_check_formats()
TASK_FORK_PPID_OFF = _TASK_BODY_OFF + TaskFork.ppid.offset    #: offset of task_event.fork.ppid in a raw record


class ExecHead(NamedTuple):
    """An EXEC record without its identity (see exec_head).

    Attributes:
        pid: tgid; tid: the task's pid after exec; time_ns: ns since boot;
        comm: the raw 16 bytes of event_header.comm (NUL-padded);
        old_tid: exec_event.old_tid (the tid before exec);
        filename: linux_binprm.filename as passed to execve (raw bytes);
        path: the path of the ELF that runs (linux_binprm.file), raw bytes;
        path_cut: True when that path was not read whole (id_flags PATH_CUT); uid: event_header.uid.
    """

    pid: int
    tid: int
    time_ns: int
    comm: bytes
    old_tid: int
    filename: bytes
    path: bytes
    path_cut: bool
    uid: int = 0


def _exec_names(buf: bytes) -> tuple[bytes, bytes]:
    """exec_event's filename and path (raw bytes) of a raw EXEC record; DecodeError if it is short."""
    if len(buf) < _EXEC_NAMES_OFF:
        raise DecodeError(f"exec record of {len(buf)} bytes")
    flen, plen = _EXEC_LENS.unpack_from(buf, _EXEC_FLEN_OFF)
    end = _EXEC_NAMES_OFF + flen + plen
    if len(buf) < end:
        raise DecodeError(f"exec record of {len(buf)} bytes, its names end at {end}")
    return buf[_EXEC_NAMES_OFF:_EXEC_NAMES_OFF + flen], buf[_EXEC_NAMES_OFF + flen:end]


def exec_head(buf: bytes) -> ExecHead:
    """The ExecHead of a raw EXEC record, its identity left raw.

    Cheaper than decode() when the identity is only needed as a key
    (exec_file_key).  Raises DecodeError as decode() does for a short record.
    """
    filename, path = _exec_names(buf)
    _t, pid, tid, uid, time_ns, comm, old_tid, idf = _EXEC_HEAD.unpack_from(buf)
    return ExecHead(pid, tid, time_ns, comm, old_tid, filename, path, bool(idf & PATH_CUT), uid)


class TaskRecord(NamedTuple):
    """A FORK, EXIT or COMM record (struct task_event), see decode_task.

    Attributes:
        type: EventType.FORK, EXIT or COMM; pid: tgid; tid; time_ns: ns since boot.
        comm: the raw 16 bytes of event_header.comm (NUL-padded).
        ppid, ptid: task_event.fork (FORK; else 0).
        exit_code: task_event.exit.exit_code (EXIT; else 0).
    """

    type: int
    pid: int
    tid: int
    time_ns: int
    comm: bytes
    ppid: int = 0
    ptid: int = 0
    exit_code: int = 0


def decode_task(buf: bytes) -> TaskRecord:
    """Decode one FORK, EXIT or COMM ring-buffer record.

    Raises:
        DecodeError: shorter than struct task_event, or another type.
    """
    if len(buf) < TASK_EVENT.size:
        raise DecodeError(f"task record of {len(buf)} bytes")
    etype, pid, tid, _p, time_ns, comm, w0, w1 = TASK_EVENT.unpack_from(buf)
    if etype == EventType.FORK:
        return TaskRecord(etype, pid, tid, time_ns, comm, ppid=w0, ptid=w1)
    if etype == EventType.EXIT:
        return TaskRecord(etype, pid, tid, time_ns, comm, exit_code=w0)
    if etype == EventType.COMM:
        return TaskRecord(etype, pid, tid, time_ns, comm)
    raise DecodeError(f"event type {etype} is not a task event")


def exec_file_key(buf: bytes) -> bytes:
    """The identity key (see file_key) of a raw EXEC record's executable."""
    return buf[_EXEC_FILE_OFF:_EXEC_FILE_OFF + _FILE_KEY.size]


def file_key(ident: "Identity") -> bytes:
    """The raw struct file_id bytes (without nlink) the kernel sends for ident: a cheap dict key."""
    return _FILE_KEY.pack(ident.ino, ident.size, ident.mtime_ns // 1_000_000_000,
                          ident.mtime_ns % 1_000_000_000, st_dev_to_kdev(ident.dev), ident.generation,
                          ident.ctime_ns % 1_000_000_000, ident.ctime_ns // 1_000_000_000)


#: PcStatus values whose kernel answer is the whole answer (a build-id, or a verdict on the bytes).
KERNEL_FINAL = frozenset({PcStatus.OK, PcStatus.NOT_ELF, PcStatus.NOTE_TOO_LARGE, PcStatus.MALFORMED})


def answer_key(ident_key: bytes, ev: "RawEvent") -> bytes:
    """The fast table's key of a mapping (_fastpath.c answer_key): its identity key (file_key), then,
    when ev.pc_status is in KERNEL_FINAL, that status as one byte and the kernel's build-id."""
    return ident_key + bytes((ev.pc_status,)) + ev.pc_build_id if ev.pc_status in KERNEL_FINAL else ident_key


def st_dev_to_kdev(dev: int) -> int:
    """User-space st_dev → kernel dev_t (MAJOR << 20 | MINOR, include/linux/kdev_t.h)."""
    return (os.major(dev) << 20) | os.minor(dev)


@dataclass(frozen=True, slots=True)
class Identity:
    """The identity of a file as the kernel's inode reported it.

    Attributes:
        dev: user-space st_dev (os.makedev of the kernel's MAJOR << 20 | MINOR).
        ino: inode number (inode.i_ino).
        generation: inode.i_generation; 0 where the file system has none.
        size: bytes (inode.i_size).
        mtime_ns: ns since the epoch (inode.i_mtime_sec * 10**9 + i_mtime_nsec).
        ctime_ns: ns since the epoch (inode.i_ctime_sec/_nsec, st_ctime_ns); 0: unknown, not compared.
    """

    dev: int
    ino: int
    generation: int
    size: int
    mtime_ns: int
    ctime_ns: int = 0


def kdev_to_st_dev(kdev: int) -> int:
    """Kernel dev_t (MAJOR << 20 | MINOR, include/linux/kdev_t.h) → user-space st_dev."""
    return os.makedev(kdev >> 20, kdev & 0xFFFFF)


@dataclass(slots=True)
class RawEvent:
    """One decoded kernel event.

    Attributes:
        type: EventType.
        pid: tgid; tid: task pid; time_ns: ns since boot; comm: text
            (surrogateescape for bytes that are not UTF-8).
        start, length, pgoff: bytes (MAP only); prot, flags: PROT_*/MAP_*.
        origin: MapOrigin (MAP) or None.
        identity: Identity of the mapped or executed file (MAP, EXEC) or None.
        nlink: inode.i_nlink (0: the file was deleted) for MAP/EXEC.
        id_flags: PATH_TRUNCATED / PATH_UNREACHABLE / FILE_BACKING bits.
        path: the file's path in the task's mount namespace, read for this
            event (MAP; EXEC: the path of the ELF that runs), text with
            surrogateescape for bytes that are not UTF-8 (os.fsdecode's form).
        old_tid: EXEC only: exec_event.old_tid, the tid before exec.
        pc_status, pc_build_id, pc_page: MAP only: map_event.bid, the kernel's
            page-cache read: PcStatus (NONE for EXEC and user-space records),
            the build-id bytes (OK, else b""), the page not cached or raced.
        uid: event_header.uid, the task's real uid (cred->uid): the user charged (-1: not known).
    """

    type: int
    pid: int
    tid: int
    time_ns: int
    comm: str
    start: int = 0
    length: int = 0
    pgoff: int = 0
    prot: int = 0
    flags: int = 0
    origin: int | None = None
    identity: Identity | None = None
    nlink: int = 1
    id_flags: int = 0
    path: str = ""
    old_tid: int = 0
    pc_status: int = 0
    pc_build_id: bytes = b""
    pc_page: int = 0
    uid: int = -1


def _comm_text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


#: Raw 16-byte event_header.comm -> text (memo.py: bounded LRU "comm_text").
_COMM_TEXT = memo.shared("comm_text", 4096, _comm_text, max_bytes=512 << 10, cost=memo.text_cost)


def _identity(buf: bytes, off: int) -> tuple[Identity, int]:
    ino, size, msec, mnsec, kdev, gen, cnsec, csec, nlink, _pad = _FILE.unpack_from(buf, off)
    return Identity(kdev_to_st_dev(kdev), ino, gen, size, msec * 1_000_000_000 + mnsec,
                    csec * 1_000_000_000 + cnsec), nlink


class DecodeError(ValueError):
    """A ring-buffer record is shorter than its type requires or has an unknown type."""


def decode(buf: bytes) -> RawEvent:
    """Decode one MAP or EXEC ring-buffer record (bytes as submitted by the BPF side).

    Fork, exit and comm records: decode_task (or TASK_EVENT, flat).

    Raises:
        DecodeError: truncated record, or a type other than MAP and EXEC.
    """
    if len(buf) < _HDR.size:
        raise DecodeError(f"record of {len(buf)} bytes is shorter than its header")
    etype, pid, tid, uid, time_ns, comm = _HDR.unpack_from(buf, 0)
    if etype == EventType.MAP:
        if len(buf) < _MAP_PATH_OFF:
            raise DecodeError(f"map record of {len(buf)} bytes")
        start, length, pgoff, prot, flags, origin, id_flags = _MAP_BODY.unpack_from(buf, _MAP_BODY_OFF)
        ident, nlink = _identity(buf, _MAP_FILE_OFF)
        (plen,) = _MAP_TAIL.unpack_from(buf, _MAP_PLEN_OFF)
        path = buf[_MAP_PATH_OFF:_MAP_PATH_OFF + plen].decode("utf-8", "surrogateescape")
        pcs, bsize, page = _BID.unpack_from(buf, _MAP_BID_OFF)
        raw_bid = buf[_MAP_BID_BYTES_OFF:_MAP_BID_BYTES_OFF + bsize] if pcs == PcStatus.OK else b""
        if pcs == PcStatus.OK and not 0 < bsize <= PC_BUILD_ID_MAX:
            raise DecodeError(f"map record with a kernel build-id of {bsize} bytes")
        return RawEvent(etype, pid, tid, time_ns, _COMM_TEXT(comm), start, length, pgoff, prot, flags,
                        origin, ident, nlink, id_flags, path, 0, pcs, raw_bid, page, uid)
    if etype == EventType.EXEC:
        _filename, raw_path = _exec_names(buf)
        old_tid, id_flags = _EXEC_BODY.unpack_from(buf, _EXEC_BODY_OFF)
        ident, nlink = _identity(buf, _EXEC_FILE_OFF)
        path = raw_path.decode("utf-8", "surrogateescape")
        return RawEvent(etype, pid, tid, time_ns, _COMM_TEXT(comm), identity=ident, nlink=nlink,
                        id_flags=id_flags, path=path, old_tid=old_tid, uid=uid)
    raise DecodeError(f"event type {etype} is not decoded here (fork/exit/comm: unpack with TASK_EVENT)")

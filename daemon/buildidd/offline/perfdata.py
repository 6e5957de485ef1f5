"""Export a session's mapping history as a perf.data file (``buildidd export --perf``).

No maintained Python library writes perf.data, so this is a writer with
``struct``, checked in tests by perf itself (``perf buildid-list -i``,
``perf script --show-mmap-events``, Debian linux-perf 6.1).  All integers
little-endian (x86_64, the recording host's order).

File layout (tools/perf/util/header.h ``struct perf_file_header``, written by
header.c ``perf_session__do_write_header``, the order ``perf record`` uses)::

    0     perf_file_header (104 bytes): magic "PERFILE2", size 104,
          attr_size 144, attrs {offset, size}, data {offset, size},
          event_types {0, 0}, adds_features (256-bit bitmap)
    104   ids: one u64 event id of the one attr
    112   perf_file_attr: perf_event_attr (PERF_ATTR_SIZE_VER7, 128 bytes)
          + ids {offset, size} (perf_file_section)
    256   data: the records, sorted by time (see below)
    ...   feature index: one perf_file_section per set feature bit, in bit
          order, at data.offset + data.size (header.c ``perf_header__adds_write``)
    ...   the features: HEADER_BUILD_ID (2), HEADER_HOSTNAME (3), HEADER_OSRELEASE (4)

The attr (include/uapi/linux/perf_event.h ``struct perf_event_attr``) is a
dummy software event (PERF_TYPE_SOFTWARE, PERF_COUNT_SW_DUMMY) with
``sample_type = PERF_SAMPLE_TID | PERF_SAMPLE_TIME`` and the bits mmap, comm,
task, sample_id_all, mmap2, comm_exec, build_id, use_clockid with
``clockid = CLOCK_BOOTTIME`` (the session's clock).

Records (perf_event.h ``enum perf_event_type``), each ``struct
perf_event_header {u32 type; u16 misc; u16 size}`` then the body, then the
``sample_id`` trailer of sample_id_all (``{u32 pid, tid}`` for TID, ``{u64
time}`` for TIME):

* PERF_RECORD_MMAP2 (10): ``u32 pid, tid; u64 addr, len, pgoff; union {u32
  maj, min; u64 ino, ino_generation} | {u8 build_id_size, res; u16 res; u8
  build_id[20]}; u32 prot, flags; char filename[]`` (NUL-terminated, padded to
  8 bytes).  misc: PERF_RECORD_MISC_USER (2), plus
  PERF_RECORD_MISC_MMAP_BUILD_ID (1 << 14) when the build-id fits in 20 bytes
  (else maj/min/ino/ino_generation from the session's dev/ino).
* PERF_RECORD_COMM (3): ``u32 pid, tid; char comm[]`` (padded to 8);
  PERF_RECORD_MISC_COMM_EXEC (1 << 13) for an exec.  A process first seen
  by a mapping (running before the session) gets one before it.
* PERF_RECORD_FORK (7) / PERF_RECORD_EXIT (4): ``u32 pid, ppid, tid, ptid;
  u64 time``.

HEADER_BUILD_ID (header.c ``write_build_id`` / ``perf_header__read_build_ids``):
a sequence of ``struct perf_record_header_build_id {perf_event_header header;
s32 pid; u8 build_id[20]; u8 size; u8 res; u16 res}`` (36 bytes) + filename,
NUL-terminated and padded to NAME_ALIGN (64); header.misc = cpumode
(PERF_RECORD_MISC_KERNEL 1 for ``[kernel.kallsyms]``, USER 2) |
PERF_RECORD_MISC_BUILD_ID_SIZE (1 << 15, so ``size`` is read); pid -1
(HOST_KERNEL_ID).  HEADER_HOSTNAME/OSRELEASE: ``struct perf_header_string {u32
len; char str[len]}``, len = NUL-terminated string padded to 64.

Limits of the format: a build-id over 20 bytes does not fit (the mapping is
written with its dev/ino instead, and the build-id entry is left out,
counted in :class:`ExportStats`).  perf files a header entry under the
machine its ``pid`` names and, in that machine, under the DSO's name alone
(header.c ``__event_process_build_id``: ``machine__findnew_dso(machine,
filename)``), so a second build-id for one path (a binary replaced between
two runs) would overwrite the first.  The first build-id of each path goes
to the host machine (pid -1, as perf record writes it); each further one is
filed under the pid of a process that mapped it, which perf reads as a guest
machine's DSO: ``perf buildid-list`` then lists every build-id, and samples
of the host never resolve through it (each MMAP2 record carries its own
build-id for that).
"""

from __future__ import annotations

import contextlib
import heapq
import os
import struct
from dataclasses import dataclass, field

from buildidd.errors import AnalysisError
from buildidd.offline.perfabi import (ATTR_FLAG_BUILD_ID, ATTR_FLAG_COMM, ATTR_FLAG_COMM_EXEC, ATTR_FLAG_MMAP,
                                      ATTR_FLAG_MMAP2, ATTR_FLAG_SAMPLE_ID_ALL, ATTR_FLAG_TASK, ATTR_FLAG_USE_CLOCKID,
                                      BUILD_ID_ENTRY, BUILD_ID_SIZE, CLOCK_BOOTTIME, COMM_HEAD, EVENT_HEADER,
                                      FILE_HEADER, HEADER_BUILD_ID, HEADER_HOSTNAME, HEADER_OSRELEASE, HEADER_STRING,
                                      HOST_KERNEL_ID, MMAP2_BODY, MMAP2_BUILD_ID, MMAP2_ID, NAME_ALIGN,
                                      PERF_ATTR_SIZE_VER7, PERF_COUNT_SW_DUMMY, PERF_EVENT_ATTR, PERF_MAGIC,
                                      PERF_RECORD_COMM, PERF_RECORD_EXIT, PERF_RECORD_FORK,
                                      PERF_RECORD_MISC_BUILD_ID_SIZE, PERF_RECORD_MISC_COMM_EXEC,
                                      PERF_RECORD_MISC_KERNEL, PERF_RECORD_MISC_MMAP_BUILD_ID, PERF_RECORD_MISC_USER,
                                      PERF_RECORD_MMAP2, PERF_SAMPLE_TID, PERF_SAMPLE_TIME, PERF_TYPE_SOFTWARE,
                                      SAMPLE_ID_TID_TIME, SECTION, TASK_BODY, TASK_COMM_LEN, set_feature)
from buildidd.offline.resolutions import LateResolutions
from buildidd.sessionlog import read_session
from buildidd.store import KALLSYMS_DSO

ATTR_SIZE = PERF_ATTR_SIZE_VER7
#: Records held to sort by time before they are written: a record that arrives
#: later than this many others is written out of order (perf sorts on reading).
SORT_WINDOW = 1 << 16
#: Longest path written (bytes, before the NUL): a record's size is a u16.
MAX_NAME_BYTES = 4095
_ID = 1                                                  # the attr's one event id
_U64 = struct.Struct("<Q")
#: Layout written: the header, the one event id (a u64), then the one perf_file_attr.
_IDS_AT = FILE_HEADER.size
_ATTRS_AT = _IDS_AT + _U64.size


@dataclass
class ExportStats:
    """What :func:`export_perf` wrote.

    Attributes:
        records: data records written, by name (``mmap2``, ``comm``, ``fork``, ``exit``).
        build_ids: (build-id hex, path) pairs in HEADER_BUILD_ID, kernel included.
        build_ids_too_long: distinct build-ids over 20 bytes that perf.data cannot hold.
        out_of_order: records written before one with an earlier time (beyond :data:`SORT_WINDOW`).
        skipped: session records ignored as malformed.
        size_bytes: size of the file.
        resolved_late: records (mmap, exec) recorded with the error ``timeout`` given the build-id of
            the session's later ``resolution`` record (:mod:`buildidd.offline.resolutions`).
    """

    records: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("mmap2", "comm", "fork", "exit"), 0))
    build_ids: list[tuple[str, str]] = field(default_factory=list)
    build_ids_too_long: int = 0
    out_of_order: int = 0
    skipped: int = 0
    size_bytes: int = 0
    resolved_late: int = 0


def _pad(data: bytes, align: int) -> bytes:
    """data + NUL, zero-padded to a multiple of align."""
    n = len(data) + 1
    return data + b"\0" * (n + (-n % align) - len(data))


def _name(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")[:MAX_NAME_BYTES]


def _record(rtype: int, misc: int, body: bytes, pid: int, tid: int, time_ns: int) -> bytes:
    trailer = SAMPLE_ID_TID_TIME.pack(pid & 0xFFFFFFFF, tid & 0xFFFFFFFF, time_ns)
    return EVENT_HEADER.pack(rtype, misc, EVENT_HEADER.size + len(body) + len(trailer)) + body + trailer


def attr_bytes() -> bytes:
    """The dummy event's perf_event_attr (128 bytes, layout of perf_event.h, PERF_ATTR_SIZE_VER7)."""
    flags = (ATTR_FLAG_MMAP | ATTR_FLAG_COMM | ATTR_FLAG_TASK | ATTR_FLAG_SAMPLE_ID_ALL | ATTR_FLAG_MMAP2
             | ATTR_FLAG_COMM_EXEC | ATTR_FLAG_USE_CLOCKID | ATTR_FLAG_BUILD_ID)
    attr = PERF_EVENT_ATTR.Fields(*[0] * len(PERF_EVENT_ATTR.names))._replace(
        type=PERF_TYPE_SOFTWARE, size=ATTR_SIZE, config=PERF_COUNT_SW_DUMMY, sample_period=1,
        sample_type=PERF_SAMPLE_TID | PERF_SAMPLE_TIME, flags=flags, clockid=CLOCK_BOOTTIME)
    return PERF_EVENT_ATTR.pack_fields(attr)


def mmap2_record(r: dict) -> tuple[bytes, bool]:
    """A session mmap record as PERF_RECORD_MMAP2; also whether its build-id was too long to carry.

    Raises:
        KeyError, TypeError, ValueError, struct.error: a malformed record.
    """
    bid = r.get("build_id")
    misc = PERF_RECORD_MISC_USER
    too_long = False
    raw = bytes.fromhex(bid) if isinstance(bid, str) else b""
    if raw and len(raw) <= BUILD_ID_SIZE:
        union = MMAP2_BUILD_ID.pack(len(raw), 0, 0, raw)
        misc |= PERF_RECORD_MISC_MMAP_BUILD_ID
    else:
        too_long = len(raw) > BUILD_ID_SIZE
        dev = int(r.get("dev") or 0)
        union = MMAP2_ID.pack(os.major(dev), os.minor(dev), int(r.get("ino") or 0),
                              int(r.get("ino_generation") or 0))
    pid, tid = int(r["pid"]), int(r["tid"])
    body = MMAP2_BODY.pack(pid, tid, int(r["start"]), int(r["len"]), int(r["pgoff"]), union,
                           int(r.get("prot") or 0), int(r.get("flags") or 0))
    return _record(PERF_RECORD_MMAP2, misc, body + _pad(_name(str(r["path"])), 8), pid, tid,
                   int(r["time_ns"])), too_long


def comm_record(pid: int, tid: int, comm: str, time_ns: int, exec_: bool) -> bytes:
    """PERF_RECORD_COMM (misc COMM_EXEC for an exec)."""
    misc = PERF_RECORD_MISC_USER | (PERF_RECORD_MISC_COMM_EXEC if exec_ else 0)
    return _record(PERF_RECORD_COMM, misc, COMM_HEAD.pack(pid, tid) + _pad(_name(comm)[:TASK_COMM_LEN - 1], 8),
                   pid, tid, time_ns)


def task_record(rtype: int, ids: tuple[int, int, int, int], time_ns: int) -> bytes:
    """PERF_RECORD_FORK or _EXIT; ids = (pid, ppid, tid, ptid)."""
    pid, ppid, tid, ptid = ids
    return _record(rtype, PERF_RECORD_MISC_USER, TASK_BODY.pack(pid, ppid, tid, ptid, time_ns), pid, tid, time_ns)


def build_id_entry(build_id_hex: str, path: str, kernel: bool, machine_pid: int = HOST_KERNEL_ID) -> bytes:
    """One HEADER_BUILD_ID entry (36-byte perf_record_header_build_id + filename padded to 64).

    machine_pid: the entry's ``pid``: -1 (HOST_KERNEL_ID) for the host machine.
    """
    raw = bytes.fromhex(build_id_hex)
    name = _pad(_name(path), NAME_ALIGN)
    misc = (PERF_RECORD_MISC_KERNEL if kernel else PERF_RECORD_MISC_USER) | PERF_RECORD_MISC_BUILD_ID_SIZE
    return BUILD_ID_ENTRY.pack(0, misc, BUILD_ID_ENTRY.size + len(name), machine_pid, raw, len(raw), 0, 0) + name


def header_string(text: str) -> bytes:
    """A perf_header_string: u32 len, then the string NUL-terminated and padded to 64."""
    data = _pad(_name(text), NAME_ALIGN)
    return HEADER_STRING.pack(len(data)) + data


class _Converter:
    """Session records → perf records (bytes, with their time), and the build-id list."""

    def __init__(self, stats: ExportStats):
        self.stats = stats
        self.session: dict = {}
        self.seen_pids: set[int] = set()
        self.parents: dict[int, tuple[int, int]] = {}        # pid -> (ppid, ptid) of its fork
        self.bids: dict[tuple[str, str], int] = {}          # (build-id, path) -> first pid mapping it
        self.too_long: set[str] = set()

    def convert(self, r: dict) -> list[bytes]:
        kind = r.get("type")
        if kind == "session":
            self.session = r
            return []
        if kind not in ("mmap", "exec", "fork", "exit", "comm"):
            return []
        pid, tid, t = int(r["pid"]), int(r["tid"]), int(r["time_ns"])
        out = []
        if kind == "mmap":
            if pid not in self.seen_pids:
                out.append(self._count("comm", comm_record(pid, pid, str(r.get("comm") or ""), t, False)))
            rec, too_long = mmap2_record(r)
            out.append(self._count("mmap2", rec))
            bid = r.get("build_id")
            if too_long:
                self.too_long.add(bid)
            elif isinstance(bid, str) and bid:
                self.bids.setdefault((bid, str(r["path"])), pid)
        elif kind in ("exec", "comm"):
            out.append(self._count("comm", comm_record(pid, tid, str(r.get("comm") or ""), t, kind == "exec")))
        elif kind == "fork":
            ppid, ptid = int(r["ppid"]), int(r["ptid"])
            self.parents[tid] = (ppid, ptid)
            out.append(self._count("fork", task_record(PERF_RECORD_FORK, (pid, ppid, tid, ptid), t)))
        else:
            ppid, ptid = self.parents.pop(tid, (pid, tid))
            out.append(self._count("exit", task_record(PERF_RECORD_EXIT, (pid, ppid, tid, ptid), t)))
        self.seen_pids.add(pid)
        return [(t, rec) for rec in out]

    def _count(self, name: str, rec: bytes) -> bytes:
        self.stats.records[name] += 1
        return rec

    def build_id_section(self) -> bytes:
        entries = []
        kbid = self.session.get("kernel_build_id")
        if isinstance(kbid, str) and kbid:
            entries.append(build_id_entry(kbid, KALLSYMS_DSO, True))
            self.stats.build_ids.append((kbid, KALLSYMS_DSO))
        entries += user_build_id_entries((bid, path, pid) for (bid, path), pid in self.bids.items())
        self.stats.build_ids += list(self.bids)
        self.stats.build_ids_too_long = len(self.too_long)
        return b"".join(entries)


def user_build_id_entries(items) -> list[bytes]:
    """HEADER_BUILD_ID entries of user-space DSOs from (build-id hex, path, pid) triples, one per
    distinct (build-id, path): the first build-id of a path filed under the host machine (pid -1),
    each further one under the pid of a process that mapped it (see the module doc)."""
    machines: dict[str, set[int]] = {}   # path -> machine pids it is filed under
    entries = []
    for bid, path, pid in items:
        used = machines.setdefault(path, set())
        machine = HOST_KERNEL_ID if not used else pid
        while machine in used:
            machine += 1
        used.add(machine)
        entries.append(build_id_entry(bid, path, False, machine))
    return entries


def export_perf(session_dir: str | os.PathLike, out_path: str | os.PathLike) -> ExportStats:
    """Write a session's mapping history as a perf.data file at out_path.

    The session is read twice, streaming: its ``resolution`` records first (a
    mapping recorded with the error ``timeout`` is written with the build-id of
    its later resolution), then the records, sorted by time through a
    window of :data:`SORT_WINDOW` records (memory stays bounded; perf sorts
    again on reading).  The file is written to ``out_path + ".tmp"`` and
    renamed into place.

    Raises:
        AnalysisError: the output cannot be written (message names the path).
        SessionLogError: the session cannot be read.
    """
    stats = ExportStats()
    conv = _Converter(stats)
    late = LateResolutions.scan(session_dir)
    tmp = f"{os.fspath(out_path)}.tmp"
    data_offset = _ATTRS_AT + ATTR_SIZE + SECTION.size
    try:
        with open(tmp, "wb") as f:
            f.write(b"\0" * data_offset)
            heap: list[tuple[int, int, bytes]] = []
            last_t = -1
            seq = 0
            for r in read_session(session_dir):
                try:
                    recs = conv.convert(late.complete(r))
                except (KeyError, TypeError, ValueError, OverflowError, struct.error):
                    stats.skipped += 1
                    continue
                for t, rec in recs:
                    heapq.heappush(heap, (t, seq, rec))
                    seq += 1
                    if len(heap) > SORT_WINDOW:
                        last_t = _emit(f, heapq.heappop(heap), last_t, stats)
            while heap:
                last_t = _emit(f, heapq.heappop(heap), last_t, stats)
            data_size = f.tell() - data_offset
            features = [(HEADER_BUILD_ID, conv.build_id_section()),
                        (HEADER_HOSTNAME, header_string(str(conv.session.get("host") or ""))),
                        (HEADER_OSRELEASE, header_string(str(conv.session.get("kernel_release") or "")))]
            _write_features(f, features)
            stats.size_bytes = f.tell()
            stats.resolved_late = late.completed
            f.seek(0)
            f.write(_file_header(data_offset, data_size, [n for n, _ in features]))
            f.write(_U64.pack(_ID))
            f.write(attr_bytes() + SECTION.pack(_IDS_AT, _U64.size))
        os.rename(tmp, out_path)
    except OSError as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise AnalysisError(f"{out_path}: cannot write perf.data: {e.strerror}") from e
    return stats


def _emit(f, item: tuple[int, int, bytes], last_t: int, stats: ExportStats) -> int:
    t, _seq, rec = item
    if t < last_t:
        stats.out_of_order += 1
    f.write(rec)
    return max(t, last_t)


def _write_features(f, features: list[tuple[int, bytes]]) -> None:
    """The feature index (one perf_file_section per feature, bit order) and the features after it."""
    index_at = f.tell()
    offset = index_at + SECTION.size * len(features)
    index = []
    for _bit, payload in features:
        index.append(SECTION.pack(offset, len(payload)))
        offset += len(payload)
    f.write(b"".join(index))
    for _bit, payload in features:
        f.write(payload)


def _file_header(data_offset: int, data_size: int, feature_bits: list[int]) -> bytes:
    bitmap = (0, 0, 0, 0)
    for bit in feature_bits:
        bitmap = set_feature(bitmap, bit)
    return FILE_HEADER.pack_fields(FILE_HEADER.Fields(
        magic=PERF_MAGIC, size=FILE_HEADER.size, attr_size=ATTR_SIZE + SECTION.size, attrs_offset=_ATTRS_AT,
        attrs_size=ATTR_SIZE + SECTION.size, data_offset=data_offset, data_size=data_size, event_types_offset=0,
        event_types_size=0, adds_features=bitmap))

"""The session log's records and their JSON form.

One JSON object per line, with a ``"type"``:

``session``  first record: host, kernel, boot id, clocks, daemon version,
             kernel_build_id_path ({"enabled": bool, "reason": text or null}:
             whether the BPF side reads build-ids from the page cache).
``mmap``     an executable file mapping: time_ns, pid, tid, comm, start, len,
             pgoff, prot, flags, origin, deleted, path (read by the kernel for
             this very event: the name this process used), dev, ino,
             ino_generation, size, mtime_ns, build_id, build_id_source, error,
             and kernel_status when the kernel's page-cache read of the
             build-id at the event gave no answer (KERNEL_STATUS_JSON).
             build_id_source "kernel": that read gave the build-id (or the
             verdict not_elf / malformed_elf), nothing was read in user space.
``exec``     execve() succeeded: filename (as passed to execve), path (the
             ELF the kernel ran: for a #! script, its interpreter), and that
             ELF's identity and build-id as mmap.
``fork``     pid/tid created by ppid/ptid.
``exit``     a process ended (exit_code as in task_struct.exit_code).
``comm``     a task's comm changed.
``file_id``  the htlhash (``file_id``) of a file whose mappings were recorded without one (the
             kernel read their build-id): identity fields, build_id, file_id (FILE_ID_LINE).
``lost``     the kernel side dropped events: counts per cause and the gap's
             time range; mappings recovered by a rescan follow with
             origin "recovered".
``end``      last record of a cleanly closed session: totals.

Units: ``time_ns`` is ns since boot (CLOCK_BOOTTIME; the session record gives the
offset to wall-clock time), ``start``/``len``/``pgoff``/``size`` are bytes,
``mtime_ns`` is ns since the epoch, ``dev`` is the user-space st_dev.

Names (``path``, ``filename``, ``comm``) are the kernel's bytes.  JSON text
must be Unicode without lone surrogates (RFC 8259), so a name that is not
valid UTF-8 is written with each invalid byte replaced by U+FFFD, and its
exact bytes follow in ``path_bytes``/``filename_bytes``/``comm_bytes``
(base64) only then.  ``"path_truncated":true`` follows a path the kernel
could not read whole (longer than 4095 bytes or about 1000 components, or a
read failed): what is given is its end.
Mapping, exec, fork, exit and comm records are bytes templates around pre-encoded
fragments: they are the hot path, where a json.dumps per record would be its largest cost.
The templates below are the one definition of those lines: the recorder's C
fast path (_fastpath.c) is given them at import and fills them the way
``%`` does here (tests/test_fastpath.py compares the two byte for byte).
"""

from __future__ import annotations

import base64
import json

from buildidd import memo
from buildidd.resolve.enrich import Resolution
from buildidd.kernel.events import PATH_CUT, EventType, ExecHead, MapOrigin, PcStatus, RawEvent, TaskRecord
from buildidd.sessionlog.segments import MAX_LINE_BYTES

#: map_event.origin → the record's "origin"; plus the two user-space origins.
ORIGIN_NAMES = {
    MapOrigin.MMAP: "mmap",
    MapOrigin.MPROTECT: "mprotect",
    MapOrigin.EXEC_MAIN: "exec",
    MapOrigin.EXEC_INTERP: "interp",
    MapOrigin.SYNTHESIZED: "synthesized",
}
SYNTHESIZED = "synthesized"   #: mapped before start: the task_vma iterator, else /proc/PID/maps (perf's synthesized MMAP2)
RECOVERED = "recovered"       #: found in /proc/PID/maps by the rescan after a loss

# -- JSON of the names records repeat: memoized (memo.shared, bounded LRU) ----


def name_json(raw: bytes, key: str) -> bytes:
    """A name's JSON value for field ``key``: the JSON string of raw as UTF-8, and when
    raw is not valid UTF-8, ``,"<key>_bytes":"<base64 of raw>"`` after it.

    Invalid bytes become U+FFFD (never lone surrogates: RFC 8259 JSON).  The
    output is ASCII (json.dumps escapes the rest).  The C fast path writes
    these bytes as given (memos below), so both paths agree byte for byte.
    """
    text = raw.decode("utf-8", "replace")
    out = json.dumps(text).encode("ascii")
    if text.encode("utf-8") != raw:
        out += b',"%s_bytes":"%s"' % (key.encode(), base64.b64encode(raw))
    return out


def _comm_json(raw: bytes) -> bytes:
    return name_json(raw.split(b"\0", 1)[0], "comm")


def _filename_json(raw: bytes) -> bytes:
    return name_json(raw, "filename")


def _path_json(raw: bytes) -> bytes:
    return name_json(raw, "path")


def raw_name(text: str) -> bytes:
    """The kernel's bytes of a name decoded with surrogateescape (kernel.events, os.fsdecode)."""
    return text.encode("utf-8", "surrogateescape")


#: Bytes the memos below keep at most (memo.text_cost of each entry: its key's and value's
#: lengths and a constant).  A user chooses the paths and file names they map and exec (up to
#: PATH_MAX each, and as many as they like): without a byte budget, 65,536 paths of 4 KiB
#: held twice (raw and JSON) are 512 MiB.  A path evicted is only encoded again.
COMM_JSON_MAX_BYTES = 1 << 20
FILENAME_JSON_MAX_BYTES = 1 << 20
PATH_JSON_MAX_BYTES = 4 << 20

#: Raw 16-byte task comm (NUL-padded) -> its JSON value (bytes), as the
#: records below write "comm" (name_json).  Also read by the C fast path (memo.py).
COMM_JSON = memo.shared("comm_json", 65536, _comm_json, max_bytes=COMM_JSON_MAX_BYTES, cost=memo.text_cost)
#: Raw exec filename (linux_binprm.filename bytes) -> its JSON value (bytes),
#: as exec_prefix() writes "filename".  Also read by the C fast path.
FILENAME_JSON = memo.shared("exec_filename_json", 4096, _filename_json, max_bytes=FILENAME_JSON_MAX_BYTES,
                            cost=memo.text_cost)
#: Raw path bytes -> its JSON value (bytes), as mapping and exec records write
#: "path".  Also read by the C fast path.
PATH_JSON = memo.shared("path_json", 65536, _path_json, max_bytes=PATH_JSON_MAX_BYTES, cost=memo.text_cost)
#: What follows a path's JSON value: by whether it was read whole.
PATH_CUT_JSON = (b"", b',"path_truncated":true')


#: A mapping record: time_ns, pid, tid, uid (the task's real uid), comm (COMM_JSON), start, len, pgoff,
#: prot, flags, origin, deleted (true/false), path (PATH_JSON), PATH_CUT_JSON,
#: then res_tail().  Only %d (unsigned decimal) and %s (bytes): the C fast
#: path supports those two.
MMAP_LINE = (b'{"type":"mmap","time_ns":%d,"pid":%d,"tid":%d,"uid":%d,"comm":%s,"start":%d,"len":%d,'
             b'"pgoff":%d,"prot":%d,"flags":%d,"origin":"%s","deleted":%s,"path":%s%s,%s%s}')

#: What follows a mapping record's build-id fields, by map_event.bid.status
#: (kernel.events.PcStatus): nothing when the kernel read the build-id (OK) or
#: did not try (NONE: records made in user space, e.g. synthesized), else
#: ``"kernel_status"``, the reason its page-cache read gave no answer: not_cached,
#: not_elf, no_note, note_too_large, raced, malformed, unsupported, fault
#: (the kernel path is off: see the session record's kernel_build_id_path).
KERNEL_STATUS_JSON: tuple[bytes, ...] = tuple(
    b"" if st in (PcStatus.NONE, PcStatus.OK) else b',"kernel_status":"%s"' % st.name.lower().encode()
    for st in PcStatus)


def mmap_line(ev: RawEvent, origin: str, res: Resolution) -> bytes:
    """The JSON line of a mapping record: ev's own path (read for this event), res's identity and build-id."""
    return MMAP_LINE % (ev.time_ns, ev.pid, ev.tid, ev.uid, COMM_JSON(raw_name(ev.comm).ljust(16, b"\0")),
                        ev.start, ev.length, ev.pgoff, ev.prot, ev.flags, origin.encode(),
                        b"true" if ev.nlink == 0 else b"false", PATH_JSON(raw_name(ev.path)),
                        PATH_CUT_JSON[bool(ev.id_flags & PATH_CUT)], res_tail(res),
                        KERNEL_STATUS_JSON[ev.pc_status if ev.pc_status < len(KERNEL_STATUS_JSON) else 0])


#: An exec record's line up to its identity and build-id fields: time_ns, pid,
#: tid, uid (the exec'ing task's real uid), comm (COMM_JSON), old_tid (exec_event.old_tid), filename (FILENAME_JSON),
#: path of the ELF that ran (PATH_JSON), PATH_CUT_JSON.
EXEC_PREFIX = (b'{"type":"exec","time_ns":%d,"pid":%d,"tid":%d,"uid":%d,"comm":%s,"old_tid":%d,"filename":%s,'
               b'"path":%s%s,')


def exec_prefix(head: ExecHead) -> bytes:
    """An exec record's line up to its identity and build-id fields (see exec_line)."""
    return EXEC_PREFIX % (head.time_ns, head.pid, head.tid, head.uid, COMM_JSON(head.comm), head.old_tid,
                          FILENAME_JSON(head.filename), PATH_JSON(head.path), PATH_CUT_JSON[head.path_cut])


def res_tail(res: Resolution) -> bytes:
    """The identity and build-id fields of a Resolution, encoded."""
    return res.json_tail.encode("utf-8", "surrogateescape")


#: A ``file_id`` record: the htlhash of a file whose build-id the kernel read at its mapping (the
#: mapping and exec records then carry none), computed once per file identity by the worker that
#: hands the file to the store: time_ns (ns since boot, when it was written), the identity fields
#: (dev, ino, ino_generation, size, mtime_ns, as on mmap records), build_id (hex, or null for a
#: kernel verdict without one), file_id (32 hex digits), go_build_id (only when known).  Offline
#: readers give file_id (and go_build_id) to every mmap/exec record of that identity
#: (offline.resolutions).
FILE_ID_LINE = (b'{"type":"file_id","time_ns":%d,"dev":%d,"ino":%d,"ino_generation":%d,"size":%d,"mtime_ns":%d,'
                b'"build_id":%s,"file_id":"%s"%s}')


def file_id_line(time_ns: int, key) -> bytes:
    """The JSON line of a ``file_id`` record for key (a resolve.filekeys.FileKey) at time_ns (ns since boot)."""
    ident = key.identity
    bid = b'"%s"' % key.build_id.encode() if key.build_id else b"null"
    go = b',"go_build_id":%s' % json.dumps(key.go_build_id).encode() if key.go_build_id else b""
    return FILE_ID_LINE % (time_ns, ident.dev, ident.ino, ident.generation, ident.size, ident.mtime_ns, bid,
                           key.file_id.encode(), go)


#: An exec record: exec_prefix(), then res_tail() of the executable's Resolution.
EXEC_LINE = b'%s%s}'


def exec_line(prefix: bytes, res: Resolution) -> bytes:
    """The JSON line of an exec record: exec_prefix() (filename as passed to execve), the executable's build-id."""
    return EXEC_LINE % (prefix, res_tail(res))


#: fork, exit and comm records: time_ns, pid, tid, comm (JSON), then ppid, ptid
#: (fork: task_event.fork) or exit_code (exit: task_event.exit.exit_code).
FORK_LINE = b'{"type":"fork","time_ns":%d,"pid":%d,"tid":%d,"comm":%s,"ppid":%d,"ptid":%d}'
EXIT_LINE = b'{"type":"exit","time_ns":%d,"pid":%d,"tid":%d,"comm":%s,"exit_code":%d}'
COMM_LINE = b'{"type":"comm","time_ns":%d,"pid":%d,"tid":%d,"comm":%s}'


def task_line(rec: TaskRecord) -> bytes:
    """The JSON line of a fork, exit or comm record (kernel.events.decode_task)."""
    comm = COMM_JSON(rec.comm)
    if rec.type == EventType.FORK:
        return FORK_LINE % (rec.time_ns, rec.pid, rec.tid, comm, rec.ppid, rec.ptid)
    if rec.type == EventType.EXIT:
        return EXIT_LINE % (rec.time_ns, rec.pid, rec.tid, comm, rec.exit_code)
    return COMM_LINE % (rec.time_ns, rec.pid, rec.tid, comm)


def dict_line(record: dict) -> bytes:
    """A rare record (session, lost, end) as compact JSON.

    Raises:
        ValueError: the line would be longer than segments.MAX_LINE_BYTES, which the reader skips
            as torn (the end record is bounded below it: capture.report.end_line).
    """
    line = json.dumps(record, separators=(",", ":"), sort_keys=False).encode()
    if len(line) > MAX_LINE_BYTES:
        raise ValueError(f"a {record.get('type')} record of {len(line)} bytes is over {MAX_LINE_BYTES}")
    return line

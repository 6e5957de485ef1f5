"""The session log's records and their JSON form.

One JSON object per line, with a ``"type"``:

``session``  first record: host, kernel, boot id, clocks, daemon version.
``mmap``     an executable file mapping: time_ns, pid, tid, comm, start, len,
             pgoff, prot, flags, origin, deleted, dev, ino, ino_generation, size,
             mtime_ns, path, build_id, build_id_source, error.
``exec``     execve() succeeded: the file executed (identity and build-id as mmap).
``fork``     pid/tid created by ppid/ptid.
``exit``     a process ended (exit_code as in task_struct.exit_code).
``comm``     a task's comm changed.
``lost``     the kernel side dropped events: counts per cause and the gap's
             time range; mappings recovered by a rescan follow with
             origin "recovered".
``end``      last record of a cleanly closed session: totals.

Units: ``time_ns`` is ns since boot (CLOCK_BOOTTIME; the session record gives the
offset to wall-clock time), ``start``/``len``/``pgoff``/``size`` are bytes,
``mtime_ns`` is ns since the epoch, ``dev`` is the user-space st_dev.
Mapping, exec, fork, exit and comm records are bytes templates around pre-encoded
fragments: they are the hot path, and json.dumps costs several µs per record.
The templates below are the one definition of those lines: the recorder's C
fast path (_fastpath.c) is given them at import and fills them the way
``%`` does here (tests/test_fastpath.py compares the two byte for byte).
"""

from __future__ import annotations

import json

from buildidd import memo
from buildidd.resolve.enrich import Resolution
from buildidd.kernel.events import EventType, ExecHead, MapOrigin, RawEvent, TaskRecord

#: map_event.origin → the record's "origin"; plus the two user-space origins.
ORIGIN_NAMES = {
    MapOrigin.MMAP: "mmap",
    MapOrigin.MPROTECT: "mprotect",
    MapOrigin.EXEC_MAIN: "exec",
    MapOrigin.EXEC_INTERP: "interp",
}
SYNTHESIZED = "synthesized"   #: found in /proc/PID/maps at start (perf's synthesized MMAP2)
RECOVERED = "recovered"       #: found in /proc/PID/maps by the rescan after a loss

# -- JSON of the strings records repeat: memoized (memo.shared, bounded LRU) ----

_JSON_STR = memo.shared("json_str", 65536, json.dumps)


def json_str(text: str) -> str:
    """JSON encoding of a short, often repeated string (paths, comms), memoized (LRU "json_str")."""
    return _JSON_STR(text)


def _comm_json(raw: bytes) -> bytes:
    return json_str(raw.split(b"\0", 1)[0].decode("utf-8", "replace")).encode("utf-8", "surrogateescape")


def _filename_json(raw: bytes) -> bytes:
    return json_str(raw.decode("utf-8", "surrogateescape")).encode("utf-8", "surrogateescape")


#: Raw 16-byte task comm (NUL-padded) -> its JSON string (bytes), as the
#: records below write "comm".  Also read by the C fast path (memo.py).
COMM_JSON = memo.shared("comm_json", 65536, _comm_json)
#: Raw exec filename (linux_binprm.filename bytes) -> its JSON string (bytes),
#: as exec_prefix() writes "filename".  Also read by the C fast path.
FILENAME_JSON = memo.shared("exec_filename_json", 4096, _filename_json)

#: A mapping record: time_ns, pid, tid, comm (JSON), start, len, pgoff, prot,
#: flags, origin, deleted (true/false), then mmap_tail().  Only %d (unsigned
#: decimal) and %s (bytes): the C fast path supports those two.
MMAP_LINE = (b'{"type":"mmap","time_ns":%d,"pid":%d,"tid":%d,"comm":%s,"start":%d,"len":%d,'
             b'"pgoff":%d,"prot":%d,"flags":%d,"origin":"%s","deleted":%s,%s}')


def mmap_tail(path: str, res: Resolution) -> bytes:
    """The path, identity and build-id fields of a mapping record, encoded once per identity."""
    return f'"path":{json_str(path)},'.encode("utf-8", "surrogateescape") + res_tail(res)


def mmap_line(ev: RawEvent, origin: str, path: str, res: Resolution) -> bytes:
    """The JSON line of a mapping record."""
    return MMAP_LINE % (ev.time_ns, ev.pid, ev.tid, json_str(ev.comm).encode("utf-8", "surrogateescape"),
                        ev.start, ev.length, ev.pgoff, ev.prot, ev.flags, origin.encode(),
                        b"true" if ev.nlink == 0 else b"false", mmap_tail(path, res))


#: An exec record's line up to its identity and build-id fields: time_ns, pid,
#: tid, comm (JSON), old_tid (exec_event.old_tid), filename (JSON).
EXEC_PREFIX = b'{"type":"exec","time_ns":%d,"pid":%d,"tid":%d,"comm":%s,"old_tid":%d,"filename":%s,'


def exec_prefix(head: ExecHead) -> bytes:
    """An exec record's line up to its identity and build-id fields (see exec_line)."""
    return EXEC_PREFIX % (head.time_ns, head.pid, head.tid, json_str(head.comm).encode("utf-8", "surrogateescape"),
                          head.old_tid, json_str(head.filename).encode("utf-8", "surrogateescape"))


def res_tail(res: Resolution) -> bytes:
    """The identity and build-id fields of a Resolution, encoded."""
    return res.json_tail.encode("utf-8", "surrogateescape")


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
    """A rare record (session, lost, end) as compact JSON."""
    return json.dumps(record, separators=(",", ":"), sort_keys=False).encode()

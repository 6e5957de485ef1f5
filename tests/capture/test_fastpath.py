"""The C fast path (_fastpath.c) records exactly what the Python path records.

Raw records are built from the ctypes mirror of bpf/events.h and fed to two
Recorders, one with the fast path and one with every record through
_slow_record; the session-log lines must be byte-identical and the counters
equal.  The ring reader is checked on a ring laid out as the kernel lays it out.
"""

import os
import random
import struct

import pytest

from buildidd import clock
from buildidd.capture import _fastpath
from buildidd.config import Config
from buildidd.memo import Memo
from buildidd.capture.recorder import Recorder
from buildidd.capture.tables import HeldExec, Tables
from tests.capture.ringmem import MemRings
from buildidd.kernel.events import (KERNEL_FINAL, EventType, ExecEvent, MapEvent, TaskEvent, answer_key, decode,
                                     file_key, st_dev_to_kdev)
from buildidd.resolve.procfs import identity_of

from conftest import gcc, readelf_build_id

COMMS = [b"bash", b"", b'q"uote', b"back\\slash", b"\xff\xfeinvalid", b"sixteen-bytes-xx", b"tab\tnl\n",
         b"\xc3\xa9t\xc3\xa9"]


class NoBudgets:
    """kernel.budget.UidBudgets without its maps: nothing is ever held back."""

    def report(self):
        return []

    def totals(self):
        return {"records": 0, "bytes": 0, "by_uid": {}}


class FakeTracer:
    """Stands in for the BPF side: hands step() prepared records."""

    known_full = 0
    fill = 0.0

    def __init__(self):
        self.batch: list[bytes] = []
        self.rings = MemRings(1)
        self.budgets = NoBudgets()

    def drain(self):
        out, self.batch = self.batch, []
        return out

    def take(self):
        """Rings.take: the batch laid into a ring in memory and taken in place, as from BPF."""
        self.rings.feed(self.drain())
        return self.rings.take()

    def reset_wakeups(self):
        """Tracer.reset_wakeups: no BPF side here, nothing to wake."""

    def mark_known(self, ident, kdev):
        pass

    def forget(self, ident, kdev):
        pass


def _memos(comm, filename):
    """Memos that answer every comm and every filename with fixed JSON (run()'s own tables)."""
    return Memo("comm", 16, lambda raw: comm), Memo("filename", 16, lambda raw: filename)


class ExecsSeen:
    """Stands for the exec pins: keeps what the recorder tells ExecPins.recorded."""

    def __init__(self):
        self.execs = []

    def recorded(self, execs, until_ns):
        self.execs += execs

    def close(self):
        pass


def _recorder(tmp_path, name, fast):
    rec = Recorder(Config(session_root=str(tmp_path / name), store_root=""))
    rec.tracer = rec.rings = FakeTracer()
    rec.pins = ExecsSeen()
    rec.recovery.next_check = float("inf")
    if not fast:
        rec._run_fast = None
    return rec


def _file_id(fid, ident, nlink):
    fid.ino, fid.size = ident.ino, ident.size
    fid.mtime_sec, fid.mtime_nsec = divmod(ident.mtime_ns, 1_000_000_000)
    fid.dev, fid.generation, fid.nlink = st_dev_to_kdev(ident.dev), ident.generation, nlink
    fid.ctime_sec, fid.ctime_nsec = divmod(ident.ctime_ns, 1_000_000_000)


def _hdr(ev, etype, pid, tid, time_ns, comm):
    ev.hdr.type, ev.hdr.pid, ev.hdr.tid, ev.hdr.time_ns, ev.hdr.comm = etype, pid, tid, time_ns, comm


#: map_event.bid values drawn by map_raw: (status, build-id): none tried, a kernel
#: build-id (two of them), not cached, the kernel path off, not ELF, no note.
KERNEL_ANSWERS = [(0, b""), (1, bytes(range(20))), (1, b"\xab" * 16), (2, b""), (9, b""), (3, b""), (4, b"")]


def map_raw(rng, ident, *, pid, tid, time_ns, comm, path=b"", origin=None, nlink=1, id_flags=0, pc=None):
    ev = MapEvent()
    ev.bid.status, bid = pc if pc is not None else rng.choice(KERNEL_ANSWERS)
    ev.bid.size, ev.bid.page = len(bid), rng.randrange(4)
    ev.bid.build_id[:len(bid)] = bid
    _hdr(ev, EventType.MAP, pid, tid, time_ns, comm)
    ev.start = rng.choice([0x7F0000000000 + rng.randrange(1 << 30) * 4096, (1 << 64) - 4096])
    ev.len = rng.choice([4096, 1 << 21, (1 << 64) - 1])
    ev.pgoff = rng.randrange(1 << 40)
    ev.prot, ev.flags = rng.choice([5, 7, 4]), rng.choice([2, 1, 0x812])
    ev.origin = origin if origin is not None else rng.choice([0, 1, 2, 3, 4, 5, 99])
    _file_id(ev.file, ident, nlink)
    ev.id_flags = id_flags
    ev.path_len = len(path)
    ev.path = path
    return bytes(ev)[:MapEvent.path.offset + len(path)]


def task_raw(etype, *, pid, tid, time_ns, comm, a, b):
    ev = TaskEvent()
    _hdr(ev, etype, pid, tid, time_ns, comm)
    ev.fork.ppid, ev.fork.ptid = a, b       # the union's two words, whatever the type
    return bytes(ev)


def exec_raw(ident, *, pid, tid, time_ns, comm, filename, path=b"/bin/elf", id_flags=0):
    ev = ExecEvent()
    _hdr(ev, EventType.EXEC, pid, tid, time_ns, comm)
    ev.old_tid = tid
    ev.id_flags = id_flags
    _file_id(ev.file, ident, 1)
    ev.filename_len, ev.path_len = len(filename), len(path)
    ev.names = filename + path
    return bytes(ev)[:ExecEvent.names.offset + len(filename) + len(path)]


@pytest.fixture
def elfs(tmp_path):
    """Identities of three files: with a build-id, without one, and one that no longer exists."""
    src = "int main(void) { return 0; }\n"
    with_id = gcc(src, tmp_path / "with_id", "-Wl,--build-id=sha1")
    without = gcc(src, tmp_path / "without_id", "-Wl,--build-id=none")
    assert readelf_build_id(with_id) and readelf_build_id(without) is None
    out = {}
    for p in (with_id, without):
        fd = os.open(p, os.O_RDONLY)
        try:
            out[str(p).encode()] = identity_of(fd)
        finally:
            os.close(fd)
    gone = gcc(src, tmp_path / "gone")
    fd = os.open(gone, os.O_RDONLY)
    out[str(gone).encode()] = identity_of(fd)
    os.close(fd)
    os.unlink(gone)
    return out


def _workload(rng, elfs, n):
    """Batches of raw records, every record type, well-formed and not; and how many need Python."""
    me = os.getpid()
    paths = list(elfs)
    t = clock.boot_ns() + 10**8      # after the files were made: their ctime is older than a tick
    batches = [[map_raw(rng, elfs[p], pid=me, tid=me, time_ns=t, comm=b"first", path=p, origin=1)
                for p in paths]]
    batch = []
    gone = paths[-1]
    seen = set()

    def needs(raw):
        """Whether this mapping record needs Python: the first of its answer key, or no final answer."""
        ev = decode(raw)
        key = answer_key(file_key(ev.identity), ev)
        if ev.pc_status not in KERNEL_FINAL and ev.identity == elfs[gone]:
            return True
        new = key not in seen
        seen.add(key)
        return new

    n_python = sum(map(needs, batches[0]))
    for _ in range(n):
        t += rng.randrange(1, 10**6)
        pid = rng.choice([me, 1, 4242, (1 << 32) - 1])
        tid = rng.choice([pid, pid + 1])
        comm = rng.choice(COMMS)
        p = rng.choice(paths)
        kind = rng.random()
        if kind < 0.70:
            batch.append(map_raw(rng, elfs[p], pid=pid, tid=tid, time_ns=t, comm=comm,
                                 nlink=rng.choice([1, 1, 0]), path=rng.choice([p, p, b"", p + b"\xff\n"]),
                                 id_flags=rng.choice([0, 0, 2, 4, 8])))
            n_python += needs(batch[-1])        # no final answer: never on the fast path
        elif kind < 0.85:
            etype = rng.choice([EventType.FORK, EventType.EXIT, EventType.COMM])
            batch.append(task_raw(etype, pid=pid, tid=tid, time_ns=t, comm=comm,
                                  a=rng.randrange(1 << 32), b=rng.randrange(1 << 32)))
        elif kind < 0.88:       # an exec, then the mapping of its executable from that tid
            name = p + rng.choice([b"", b"", b"\xff", b'"q\\'])   # execve's filename: any bytes
            batch.append(exec_raw(elfs[p], pid=me, tid=me, time_ns=t, comm=comm, filename=name,
                                  path=rng.choice([p, b"/usr/bin/\xfe\"q"]), id_flags=rng.choice([0, 2])))
            batch.append(map_raw(rng, elfs[p], pid=me, tid=me, time_ns=t + 1, comm=comm, origin=3))
            n_python += needs(batch[-1])            # held in C; a mapping with no final answer is Python's
        elif kind < 0.885:      # two execs from one tid before a mapping: the second is Python's
            batch.append(exec_raw(elfs[p], pid=me, tid=me, time_ns=t, comm=comm, filename=p))
            batch.append(exec_raw(elfs[p], pid=me, tid=me, time_ns=t + 1, comm=comm, filename=p))
            batch.append(map_raw(rng, elfs[p], pid=me, tid=me, time_ns=t + 2, comm=comm, origin=3))
            n_python += 1 + needs(batch[-1])
        elif kind < 0.91:       # another name of the file (a hard link, a rename): its own path
            batch.append(map_raw(rng, elfs[p], pid=pid, tid=tid, time_ns=t, comm=comm,
                                 path=p + rng.choice([b".link", b"\xff", b"\xed\xa0\x80"])))
            n_python += needs(batch[-1])
        elif kind < 0.93:       # malformed: short, unknown type, short task record
            batch.append(rng.choice([b"\x01\x00\x00\x00" + bytes(30), b"\x09" + bytes(60),
                                     b"\x03\x00\x00\x00" + bytes(30), b"\x01"]))
            n_python += 1
        else:
            batch.append(map_raw(rng, elfs[p], pid=pid, tid=tid, time_ns=t, comm=comm, origin=1))
            n_python += needs(batch[-1])
        if rng.random() < 0.01:
            batches.append(batch)
            batch = []
    batches.append(batch)
    return batches, n_python


def test_fast_path_lines_and_counters_equal_the_python_path(tmp_path, elfs):
    rng = random.Random(5)
    batches, n_python = _workload(rng, elfs, 20000)
    fast, slow = _recorder(tmp_path, "fast", True), _recorder(tmp_path, "slow", False)
    slow_calls = 0
    orig = fast.slow.record

    def counting(raw):
        nonlocal slow_calls
        slow_calls += 1
        orig(raw)

    fast.slow.record = counting
    for batch in batches:
        for rec in (fast, slow):
            rec.tracer.batch = list(batch)
            rec.step()
    assert fast.tables.lines == slow.tables.lines
    assert fast.summary() == slow.summary()
    assert fast.tables.live == slow.tables.live
    # Each exec record and exec mapping confirms its pin, from either path: (pid, uid, kdev, ino, time_ns).
    assert fast.pins.execs == slow.pins.execs and len(fast.pins.execs) > 300
    assert fast.tables.live_entries == slow.tables.live_entries == sum(map(len, fast.tables.live.values()))
    # The fast path did the work: only the records that need Python reached it.
    assert slow_calls == n_python
    assert n_python < sum(map(len, batches)) * 0.4
    s = fast.summary()
    assert s["events"]["mmap"] > 10000 and s["events"]["fork"] > 500 and s["events"]["exec"] > 300
    assert s["decode_errors"] > 50
    assert s["build_ids_resolved"] > 3000 and s["build_ids_missing"]["no_build_id"] > 3000
    assert any(b'"deleted":true' in line for line in fast.tables.lines)
    assert any(b'"comm":"q\\"uote"' in line for line in fast.tables.lines)
    # Names that are not UTF-8: U+FFFD in the text, the exact bytes in base64, no lone surrogates.
    assert any(b'"comm":"\\ufffd\\ufffdinvalid","comm_bytes":"//5pbnZhbGlk"' in line for line in fast.tables.lines)
    assert any(b'\\ufffd","path_bytes":"' in line for line in fast.tables.lines)
    assert any(b'"path_truncated":true' in line for line in fast.tables.lines)
    assert any(b'"filename_bytes":"' in line and b'"path":"/usr/bin/\\ufffd\\"q","path_bytes":"' in line
               for line in fast.tables.lines)
    for line in fast.tables.lines:
        assert b"\\ud" not in line.lower()


def test_fast_path_stops_at_what_it_cannot_record(tmp_path, elfs):
    rng = random.Random(1)
    rec = _recorder(tmp_path, "r", True)
    p = next(iter(elfs))
    now = clock.boot_ns()
    none = (0, b"")         # no kernel answer: the identity's user-space answer
    known = map_raw(rng, elfs[p], pid=1, tid=1, time_ns=now, comm=b"c", path=p, origin=1, pc=none)
    rec.tracer.batch = [known]
    rec.step()
    plain = map_raw(rng, elfs[p], pid=1, tid=1, time_ns=now, comm=b"c", origin=1, pc=none)
    fork = task_raw(EventType.FORK, pid=2, tid=2, time_ns=3, comm=b"c", a=1, b=1)
    renamed = map_raw(rng, elfs[p], pid=1, tid=1, time_ns=now, comm=b"c", path=p + b".new", origin=1, pc=none)
    raws = [plain, fork, known, renamed, plain, b"\x09" + bytes(60)]
    comm_json, filename_json = _memos(b'"x"', b'"p"')
    t = Tables(missing={}, fast=rec.tables.fast, comm_json=comm_json, filename_json=filename_json,
               origins=(b"mmap",) * 5)
    assert _fastpath.run(raws, 0, t)[:4] == (5, 4, 4, 1)          # another path is its own: stops at the unknown type
    lines = t.lines
    assert len(lines) == 5 and b'"path":"' + p + b'.new"' in lines[3]
    t.held = {1: HeldExec((None, 0, b"another file".ljust(len(file_key(elfs[p]))), b"{"))}
    assert _fastpath.run([plain], 0, t)[0] == 0   # its tid holds another exec
    ex = exec_raw(elfs[p], pid=1, tid=1, time_ns=4, comm=b"c", filename=b"/x")
    assert _fastpath.run([ex, ex], 0, t)[0] == 0   # tid 1 holds an exec
    t.held = held = {}
    assert _fastpath.run([ex, ex], 0, t)[0] == 1   # held; the second is Python's
    assert held[1][0] is ex and held[1][2] == file_key(elfs[p])
    assert held[1][3].endswith(b'"filename":"p","path":"/bin/elf",')
    t.held = {}
    assert _fastpath.run([ex[:-1]], 0, t)[0] == 0   # filename past the end
    unknown = map_raw(rng, elfs[p].__class__(1, 2, 3, 4, 5), pid=1, tid=1, time_ns=2, comm=b"c", pc=none)
    assert _fastpath.run([unknown], 0, t)[0] == 0
    assert file_key(elfs[p]) in rec.tables.fast


def _ring(records, size=4096, busy_at=None, discard=()):
    """A ring buffer laid out as kernel/bpf/ringbuf.c lays it out, in two bytearrays."""
    page = 4096
    cons = bytearray(page)
    data = bytearray(page + 2 * size)
    pos = 0
    for k, rec in enumerate(records):
        length = len(rec) | (1 << 31 if k == busy_at else 0) | (1 << 30 if k in discard else 0)
        frame = struct.pack("<II", length, 0) + rec
        for j, byte in enumerate(frame):        # the data area is mapped twice in a row
            off = (pos + j) % size
            data[page + off] = data[page + size + off] = byte
        pos += (len(rec) + 8 + 7) & ~7
    struct.pack_into("<Q", data, 0, pos)
    return cons, data, page, size - 1


def test_read_ring_reads_records_in_order_and_advances_the_consumer():
    recs = [bytes([k]) * (20 + k) for k in range(6)]
    cons, data, page, mask = _ring(recs, discard={2})
    out = []
    end = struct.unpack_from("<Q", data)[0]
    assert _fastpath.read_ring(cons, data, page, mask, out) == (5, end)
    assert out == [r for k, r in enumerate(recs) if k != 2]
    assert struct.unpack_from("<Q", cons)[0] == end
    assert _fastpath.read_ring(cons, data, page, mask, out) == (0, 0)


def test_read_ring_stops_at_a_record_being_written_and_wraps():
    recs = [bytes([k]) * 1000 for k in range(6)]       # 6 x 1008 bytes
    cons, data, page, mask = _ring(recs, size=8192, busy_at=4)
    out = []
    assert _fastpath.read_ring(cons, data, page, mask, out) == (4, 4 * 1008)
    assert struct.unpack_from("<Q", cons)[0] == 4 * 1008
    # Records 2 and 3 (bytes 3024..6048 of a 4096-byte ring): record 2 wraps,
    # and is read whole from the second mapping of the data area.
    recs = [bytes([k]) * 1500 for k in range(4)]
    cons, data, page, mask = _ring(recs, size=4096)
    struct.pack_into("<Q", cons, 0, 2 * 1512)
    out = []
    assert _fastpath.read_ring(cons, data, page, mask, out) == (2, 2 * 1512)
    assert out == recs[2:]


def test_read_ring_rejects_a_record_longer_than_the_ring():
    cons, data, page, mask = _ring([b"x" * 100])
    struct.pack_into("<I", data, page, 1 << 20)
    with pytest.raises(ValueError):
        _fastpath.read_ring(cons, data, page, mask, [])
    with pytest.raises(ValueError):
        _fastpath.read_ring(cons, data[:100], page, mask, [])


def test_sort_by_time_merges_runs_stably():
    def rec(t, tag):
        return bytes(16) + struct.pack("<Q", t) + tag

    raws = [rec(5, b"a"), rec(1, b"b"), rec(5, b"c"), rec(0, b"d"), rec(1, b"e"), b"short"]
    _fastpath.sort_by_time(raws)
    assert [r[24:] for r in raws] == [b"d", b"", b"b", b"e", b"a", b"c"]   # "short": time 0, last
    # Rings' runs (each ascending, with ties across and within them), and random input.
    rng = random.Random(3)
    for nruns in (1, 2, 3, 8, 500):
        raws = []
        for k in range(nruns):
            t = 0
            for j in range(rng.randrange(0, 300)):
                t += rng.choice([0, 0, 1, 5])
                raws.append(rec(t, b"%d.%d" % (k, j)))
        want = sorted(raws, key=lambda r: r[16:24][::-1])      # Python's sort: stable
        _fastpath.sort_by_time(raws)
        assert raws == want
    with pytest.raises(TypeError):
        _fastpath.sort_by_time([b"x", "not bytes"])


def test_configure_rejects_a_template_it_cannot_fill():
    from buildidd.sessionlog.records import (COMM_LINE, EXEC_LINE, EXEC_PREFIX, EXIT_LINE, FORK_LINE,
                                             KERNEL_STATUS_JSON as KS, MMAP_LINE)

    with pytest.raises(ValueError):
        _fastpath.configure(MMAP_LINE, FORK_LINE, EXIT_LINE, b'{"comm":%s}', EXEC_LINE, EXEC_PREFIX, KS)
    with pytest.raises(ValueError):
        _fastpath.configure(MMAP_LINE + b"%x", FORK_LINE, EXIT_LINE, COMM_LINE, EXEC_LINE, EXEC_PREFIX, KS)
    with pytest.raises(ValueError):
        _fastpath.configure(MMAP_LINE, FORK_LINE, EXIT_LINE, COMM_LINE, b"%s%d", EXEC_PREFIX, KS)
    with pytest.raises(ValueError):
        _fastpath.configure(MMAP_LINE, FORK_LINE, EXIT_LINE, COMM_LINE, EXEC_LINE, EXEC_PREFIX + b"%s", KS)
    with pytest.raises(ValueError):
        _fastpath.configure(MMAP_LINE, FORK_LINE, EXIT_LINE, COMM_LINE, EXEC_LINE, EXEC_PREFIX, ())
    with pytest.raises(TypeError):
        _fastpath.configure(MMAP_LINE, FORK_LINE, EXIT_LINE, COMM_LINE, EXEC_LINE, EXEC_PREFIX, ("fault",))
    # A rejected set leaves the templates in use untouched.
    comm_json, filename_json = _memos(b'"x"', b'"p"')
    t = Tables(missing={}, comm_json=comm_json, filename_json=filename_json, origins=(b"mmap",))
    comm = task_raw(EventType.COMM, pid=7, tid=8, time_ns=9, comm=b"x", a=0, b=0)
    assert _fastpath.run([comm], 0, t)[0] == 1
    assert t.lines == [COMM_LINE % (9, 7, 8, b'"x"')]

"""kernel.pinned: the loaded program kept in bpffs and taken back at the next start, reset, attached afresh."""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import shutil
import struct
import subprocess

import pytest

from conftest import recorded_exec, session_records

RING_BYTES = 2 << 20


@pytest.fixture
def pin_root(bpf):
    from buildidd.kernel.pinned import _ensure_bpffs
    root = f"/sys/fs/bpf/buildidd-test-{os.getpid()}"
    _ensure_bpffs(root)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _positions(fd: int) -> tuple[int, int]:
    """(consumer_pos, producer_pos) of a BPF ring buffer (pages 0 and 1 of its mmap)."""
    page = mmap.PAGESIZE
    with mmap.mmap(fd, 2 * page, mmap.MAP_SHARED, mmap.PROT_READ) as m:
        return struct.unpack_from("<Q", m, 0)[0], struct.unpack_from("<Q", m, page)[0]


def test_second_load_is_taken_from_the_pins_and_reset(pin_root):
    from buildidd.kernel.tracer import Tracer
    first = Tracer(ring_bytes=RING_BYTES, pin_root=pin_root)
    try:
        assert not first.prog.reused and first.compile_s > 0
        assert sorted(os.listdir(pin_root))[1:] == ["lock-buildidd_bpf"]     # one pin dir and its lock
        # Leave state behind: unread events in the rings, a hash entry, an array value.
        for _ in range(20):
            subprocess.run(["/bin/true"], check=True)
        assert any(_positions(fd)[1] > _positions(fd)[0] for fd, _ in first.ring_maps)
        first.prog.maps["bid_memo"].update(ctypes.c_uint64(12345), bytes(
            first.prog.maps["bid_memo"].info.value_size))
        first.prog.maps["pagecache_bases"].update(ctypes.c_int(0), b"\x07" * 16)
        first.prog.detach()                                   # nothing writes to the rings now
        left = [_positions(fd)[1] for fd, _ in first.ring_maps]
    finally:
        first.close()
    second = Tracer(ring_bytes=RING_BYTES, pin_root=pin_root)
    try:
        assert second.prog.reused and second.compile_s == 0
        assert not {k for k in second.prog.links if k.startswith("tracepoint:")}
        assert {k for k in second.prog.links if k.startswith("raw_tracepoint:")} == {
            "raw_tracepoint:sched_process_exec", "raw_tracepoint:sched_process_fork",
            "raw_tracepoint:sched_process_exit", "raw_tracepoint:task_rename", "raw_tracepoint:sys_exit"}
        assert list(second.prog.maps["bid_memo"].keys()) == []
        assert second.prog.maps["pagecache_bases"].lookup(ctypes.c_int(0)) == bytes(16)
        before = [_positions(fd) for fd, _ in second.ring_maps]
        # The previous run's records are skipped: each ring's consumer starts at or past where the
        # first run's producer stopped (the host may have written more since the second attached).
        assert all(c >= p for (c, _), p in zip(before, left)), (before, left)
        for _ in range(5):
            subprocess.run(["/bin/true"], check=True)
        after = [_positions(fd) for fd, _ in second.ring_maps]
        assert sum(p for _, p in after) > sum(p for _, p in before)   # attached afresh: events flow
    finally:
        second.close()


def test_a_second_daemon_loads_its_own_copy_while_the_pins_are_in_use(pin_root):
    from buildidd.kernel.tracer import Tracer
    first = Tracer(ring_bytes=RING_BYTES, pin_root=pin_root)     # holds the lock until closed
    try:
        pins = sorted(os.listdir(pin_root))
        other = Tracer(ring_bytes=RING_BYTES, pin_root=pin_root)
        try:
            assert not other.prog.reused and other.prog.lock_fd == -1
            assert sorted(os.listdir(pin_root)) == pins
            ids = lambda t: {t.prog.maps["events0"].info.id}     # noqa: E731
            assert ids(first) != ids(other)                       # no shared ring
        finally:
            other.close()
    finally:
        first.close()
    fd = os.open(os.path.join(pin_root, "lock-buildidd_bpf"), os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)         # the program's lock, released by close()
    finally:
        os.close(fd)


def test_daemon_restart_reuses_the_program_and_records(recorder, pin_root):
    rec = recorder(bpf_pin_root=pin_root)
    assert session_records(rec.session_dir)[0]["bpf_reused"] is False     # a new pin root: compiled
    rec.close()
    rec = recorder(bpf_pin_root=pin_root)
    session = session_records(rec.session_dir)[0]
    assert session["bpf_reused"] is True and session["bpf_compile_s"] == 0
    seen = recorded_exec(rec, ["/bin/true"])
    assert seen and seen[0]["build_id"] and seen[0]["build_id_source"] == "kernel", seen


def test_a_pin_root_another_user_made_first_is_not_used(bpf, attacker):
    """/sys/fs/bpf is world-writable: a directory the attacker made at the pin root is never trusted."""
    from buildidd.kernel.tracer import Tracer
    uid, gid, _name = attacker
    root = f"/sys/fs/bpf/buildidd-test-hostile-{os.getpid()}"
    os.mkdir(root, 0o700)
    os.chown(root, uid, gid)
    try:
        t = Tracer(ring_bytes=RING_BYTES, pin_root=root)
        try:
            assert not t.prog.reused and t.prog.lock_fd == -1   # loaded afresh, pins not used
            assert os.listdir(root) == []                    # nothing made where the attacker could reach it
        finally:
            t.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_an_incomplete_pin_dir_is_replaced_by_a_fresh_load(pin_root):
    from buildidd.kernel.tracer import Tracer
    Tracer(ring_bytes=RING_BYTES, pin_root=pin_root).close()
    (pin_dir,) = [d for d in os.listdir(pin_root) if not d.startswith("lock-")]
    os.unlink(os.path.join(pin_root, pin_dir, "prog_exec_vmas"))     # the tail-called program's pin
    t = Tracer(ring_bytes=RING_BYTES, pin_root=pin_root)
    try:
        assert not t.prog.reused and t.prog.lock_fd >= 0
        assert "prog_exec_vmas" in os.listdir(os.path.join(pin_root, pin_dir))      # pinned again
    finally:
        t.close()

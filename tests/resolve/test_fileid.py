"""Go build IDs and file_id keys of files without a GNU build-id (resolve.fileid, via the Enricher)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import threading

from buildidd.kernel.events import EventType, MapOrigin, RawEvent
from buildidd.resolve.enrich import Enricher
from buildidd.resolve.fileid import file_id, read_go_build_id
from buildidd.resolve.procfs import identity_of
from buildidd.resolve.workers import PoolPolicy, WorkerPool

from conftest import gcc, readelf_build_id


def _fd_call(path, fn):
    fd = os.open(path, os.O_RDONLY)
    try:
        return fn(fd)
    finally:
        os.close(fd)


def _resolve(path):
    ident = _fd_call(path, identity_of)
    ev = RawEvent(EventType.MAP, 999999999, 999999999, 1, "t", 0x1000, 0x1000, 0, 5, 2, MapOrigin.MMAP, ident, 1, 0,
                  str(path))
    return Enricher().resolve(ev)


def _otel_file_id(data: bytes) -> str:
    """The OpenTelemetry profiler's FileID from its definition: head, tail, big-endian size; 128 bits."""
    edge = min(len(data), 4096)
    return hashlib.sha256(data[:edge] + data[len(data) - edge:] + len(data).to_bytes(8, "big")).hexdigest()[:32]


def test_go_binary_gets_its_go_build_id_and_a_file_id(tmp_path):
    assert shutil.which("go"), "go (golang-go) is installed by scripts/setup"
    (tmp_path / "m.go").write_text("package main\n\nfunc main() {}\n")
    env = {**os.environ, "HOME": str(tmp_path), "GOCACHE": str(tmp_path / "cache"), "GOPATH": str(tmp_path / "gp"),
           "GO111MODULE": "off", "GOFLAGS": ""}
    subprocess.run(["go", "build", "-o", str(tmp_path / "m"), str(tmp_path / "m.go")], check=True, env=env,
                   cwd=tmp_path)
    want = subprocess.run(["go", "tool", "buildid", str(tmp_path / "m")], check=True, env=env,
                          capture_output=True, text=True).stdout.strip()
    assert readelf_build_id(tmp_path / "m") is None and want.count("/") >= 1
    assert _fd_call(tmp_path / "m", read_go_build_id) == want
    res = _resolve(tmp_path / "m")
    assert res.build_id is None and res.error == "no_build_id" and res.go_build_id == want
    assert res.file_id == _otel_file_id((tmp_path / "m").read_bytes())
    assert f'"go_build_id":"{want}"' in res.json_tail and f'"file_id":"{res.file_id}"' in res.json_tail


def test_hand_made_go_note_section_is_found_through_the_section_headers(tmp_path):
    exe = gcc("int main(void) { return 0; }\n", tmp_path / "a", "-Wl,--build-id=none")
    desc = b"abc/def-123_x"
    note = (4).to_bytes(4, "little") + len(desc).to_bytes(4, "little") + (4).to_bytes(4, "little") + b"Go\0\0"
    note += desc + b"\0" * (-len(desc) % 4)
    (tmp_path / "note").write_bytes(note)
    subprocess.run(["objcopy", "--add-section", f".note.go.buildid={tmp_path / 'note'}", str(exe),
                    str(tmp_path / "b")], check=True)
    assert _fd_call(tmp_path / "b", read_go_build_id) == desc.decode()
    assert _fd_call(exe, read_go_build_id) is None
    # A descriptor that is not printable text is not a Go build ID.
    (tmp_path / "note").write_bytes(note.replace(b"abc", b"a\nc"))
    subprocess.run(["objcopy", "--add-section", f".note.go.buildid={tmp_path / 'note'}", str(exe),
                    str(tmp_path / "c")], check=True)
    assert _fd_call(tmp_path / "c", read_go_build_id) is None


def test_file_id_of_a_file_without_build_id(tmp_path):
    exe = gcc("int main(void) { return 0; }\n", tmp_path / "a", "-Wl,--build-id=none")
    data = exe.read_bytes()
    assert len(data) > 8192 and readelf_build_id(exe) is None
    res = _resolve(exe)
    assert res.error == "no_build_id" and res.go_build_id is None and res.file_id == _otel_file_id(data)
    shutil.copy(exe, tmp_path / "copy")
    assert _fd_call(tmp_path / "copy", file_id) == res.file_id          # a content key: copies agree
    changed = bytearray(data)
    changed[-10] ^= 1
    (tmp_path / "tail").write_bytes(changed)
    assert _fd_call(tmp_path / "tail", file_id) not in (res.file_id, None)
    (tmp_path / "small").write_bytes(b"not elf at all\n")
    small = _resolve(tmp_path / "small")
    assert small.error == "not_elf" and small.file_id == _otel_file_id(b"not elf at all\n")
    # A file with a GNU build-id gets its htlhash too (OpenTelemetry recommends it on every mapping), no Go key.
    w = gcc("int main(void) { return 0; }\n", tmp_path / "w", "-Wl,--build-id=sha1")
    withid = _resolve(w)
    assert withid.build_id and withid.go_build_id is None
    assert withid.file_id == _otel_file_id(w.read_bytes()) and f'"file_id":"{withid.file_id}"' in withid.json_tail


def test_go_reader_is_bounded_on_hostile_headers(tmp_path):
    exe = gcc("int main(void) { return 0; }\n", tmp_path / "a", "-Wl,--build-id=none")
    data = bytearray(exe.read_bytes())
    for off, value in ((32, (1 << 64) - 8), (40, (1 << 63)), (56, 0xFFFF)):   # e_phoff, e_shoff, e_phnum
        bad = bytearray(data)
        width = 2 if off == 56 else 8
        bad[off:off + width] = value.to_bytes(width, "little")
        (tmp_path / "bad").write_bytes(bad)
        assert _fd_call(tmp_path / "bad", read_go_build_id) is None


def test_worker_pool_hands_a_late_job_back_and_counts_it():
    told = []                   # on_late: how the recorder's quiet wait learns of a late answer
    pool = WorkerPool(PoolPolicy(workers=1, max_threads=2, queue_max=2, stuck_after_s=0.0),
                      on_late=lambda: told.append(pool.has_late()))
    gate = threading.Event()
    slow = pool.submit(lambda _: gate.wait(30) and "late answer", None)
    assert not pool.wait(slow, 0.01) and slow.late
    # The stuck worker does not hold up the next job: a second thread takes it.
    assert pool.can_run_now()
    quick = pool.submit(lambda x: x * 2, 21)
    assert pool.wait(quick, 10) and quick.result == 42
    assert pool.status()["stuck"] == 1 and pool.status()["threads"] == 2
    # Both threads busy or stuck, queue bounded: extra jobs are refused and counted.
    blockers = [pool.submit(lambda _: gate.wait(30), None) for _ in range(4)]
    assert None in blockers and pool.status()["queue_dropped"] >= 1
    assert pool.take_late() == [] and not pool.has_late()
    gate.set()
    assert pool.wait(quick, 1)
    for _ in range(500):
        if told:
            break
        threading.Event().wait(0.01)
    assert told == [True]       # called once, for the late job only, after it was queued
    late = pool.take_late()
    assert late == [slow] and slow.result == "late answer"
    assert pool.status()["late_completed"] == 1 and pool.status()["timed_out"] == 1


#: Run in a Python of its own: in the suite's process, threads earlier tests left (a proxy's accept loop,
#: a recorder's) and the garbage collector's finalizers can hand the GIL over inside the window below.
_POOL_NEVER_WAITS = """
import gc, sys, threading, time
from buildidd.resolve.workers import PoolPolicy, WorkerPool

pool = WorkerPool(PoolPolicy(workers=2, max_threads=4, queue_max=8, stuck_after_s=0.0))
try:
    deadline = time.monotonic() + 30
    while pool.status()["threads"] != 2 or pool._idle != 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    before = {t.ident for t in threading.enumerate()}
    release = threading.Event()
    busy = [pool.submit(lambda _: release.wait(30), None) for _ in range(2)]
    while any(j.started == 0 for j in busy):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    gc.collect()
    gc.disable()
    sys.setswitchinterval(5.0)      # no other thread gets the GIL while this one does not block
    job = pool.submit(lambda x: x * 2, 21)     # both workers busy: a third is started
    ran_yet = job.started != 0
    threads = pool.status()["threads"]
    # threading.Thread.start() would have waited until the thread ran and registered
    # itself; a _thread worker names itself when it first runs, which it cannot have yet.
    named = {t.name for t in threading.enumerate()}
    sys.setswitchinterval(0.005)
    gc.enable()
    assert threads == 3 and not ran_yet and "buildidd-resolve-3" not in named, (threads, ran_yet, named)
    assert pool.wait(job, 30.0) and job.result == 42
    assert {t.name for t in threading.enumerate() if t.ident not in before} >= {"buildidd-resolve-3"}
    release.set()
finally:
    pool.close()
print("ok")
"""


def test_worker_pool_keeps_its_workers_and_submit_never_waits_for_a_new_thread():
    """submit() returns before a worker it starts has run: the recording thread must not wait for one."""
    import sys
    r = subprocess.run([sys.executable, "-c", _POOL_NEVER_WAITS], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout == "ok\n", r.stdout + r.stderr


def test_enricher_pools_follow_the_configured_offload():
    """The recorder builds its Enricher with Offload.from_config, and its hand-over queue from the same
    Offload (capture.wiring): the kept workers are started at once."""
    from buildidd.config import Config
    from buildidd.resolve.enrich import Offload
    from buildidd.resolve.filekeys import FileKeys
    from buildidd.resolve.handover import HandOverJob
    from buildidd.resolve.handoverqueue import HandOverQueue

    off = Offload.from_config(Config(resolve_workers=3, resolve_deadline_s=0.5))
    assert off.deadline_s == 0.5 and off.pool.workers == 3 and off.pool.max_threads == 24
    assert off.pool.stuck_after_s == 0.5
    e = Enricher(offload=off)
    q = HandOverQueue(HandOverJob(lambda *a: None, FileKeys(), None, None, None), off.pool, off.handover_uid_share)
    try:
        assert e.pool.status()["threads"] == 3
        assert q.live.status()["threads"] == 1 and q.bulk.status()["threads"] == 1
        assert q.live.policy.max_threads == 6 and q.live.policy.uid_share == off.handover_uid_share
    finally:
        q.close()
        e.close()

"""Processes running at start-up are synthesized by the BPF task_vma iterator (kernel.synth).

Oracles: /proc/PID/maps (the kernel's own listing of the same VMAs) and
readelf -n on the mapped files; a library whose pages were dropped from the
page cache is read by user space through map_files instead (nothing else may
read it meanwhile: another recorder starting on the host would, as it
synthesizes every mapped file's build-id; the test then evicts it and tries again).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from buildidd.kernel import synth
from buildidd.kernel.events import EventType, MapEvent
from buildidd.resolve import procfs
from conftest import gcc, readelf_build_id, session_records
from perfcompare import other_tracers

HOLD_SRC = r"""
#include <fcntl.h>
#include <stdio.h>
#include <sys/mman.h>
#include <unistd.h>
int main(int argc, char **argv)
{
	int fd = open(argv[1], O_RDONLY);
	if (fd < 0 || mmap(NULL, 8192, PROT_READ | PROT_EXEC, MAP_PRIVATE, fd, 0) == MAP_FAILED)
		return 1;
	close(fd);
	puts("mapped");
	fflush(stdout);
	for (;;) pause();
}
"""


def _wait_mapped(pid: int, path: str) -> None:
    deadline = time.monotonic() + 10
    while not any(m.path == path for m in procfs.exec_file_mappings(pid)):
        assert time.monotonic() < deadline, f"pid {pid} never mapped {path}"
        time.sleep(0.01)


def _synthesized(rec, expected: dict) -> tuple[list[dict], dict[str, set]]:
    """rec's synthesized mmap records, checked against expected (pid: its /proc/PID/maps mappings), and
    {path: {(build-id, build_id_source)}} of those of the expected pids."""
    records = [r for r in session_records(rec.session_dir) if r["type"] == "mmap"]
    synthesized = [r for r in records if r["origin"] == "synthesized"]
    assert not any(r["pid"] == os.getpid() for r in synthesized), "the daemon synthesized itself"
    assert rec.stats.synthesized == len(synthesized)
    for pid, maps in expected.items():
        ours = sorted((r["start"], r["start"] + r["len"], r["pgoff"], r["path"])
                      for r in synthesized if r["pid"] == pid)
        assert ours == sorted((m.start, m.end, m.offset, m.path) for m in maps), pid
    by_path = {}
    for r in synthesized:
        if r["pid"] in expected:
            by_path.setdefault(r["path"], set()).add((r["build_id"], r["build_id_source"]))
    return synthesized, by_path


def _wait_no_other_tracer(bound_s: float = 120.0) -> None:
    """Wait (a hang bound) until no other recorder runs on the host: one that is running rescans the
    processes' mappings after a loss, and one starting synthesizes them, reading the cold library."""
    deadline = time.monotonic() + bound_s
    while other_tracers() and time.monotonic() < deadline:
        time.sleep(0.2)


def _resident_pages(path) -> int:
    out = subprocess.run(["fincore", "--noheadings", "--raw", "-o", "PAGES", str(path)],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def _drop_page_cache(path) -> None:
    """Evict path's pages.  DONTNEED skips pages still in another CPU's LRU batch (they hold a
    reference until it drains), so try again, then drop every clean page (drop_caches)."""
    for attempt in range(40):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        if _resident_pages(path) == 0:
            return
        if attempt == 30:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1")
        time.sleep(0.02)
    assert _resident_pages(path) == 0, f"{path} stays in the page cache"


def test_running_processes_are_synthesized_as_proc_maps_lists_them(recorder, workloads, tmp_path):
    idle = [subprocess.Popen([str(workloads["idle"])]) for _ in range(12)]
    # A library mapped but never touched, then evicted: the kernel cannot read its note.
    cold = tmp_path / "libcold.so"
    shutil.copy(workloads["lib5"], cold)
    hold = gcc(HOLD_SRC, tmp_path / "hold")
    holder = subprocess.Popen([str(hold), str(cold)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"mapped\n"
        for p in idle:
            _wait_mapped(p.pid, str(workloads["lib3"]))
        for attempt in range(1, 4):
            _wait_no_other_tracer()
            _drop_page_cache(cold)
            expected = {p.pid: procfs.exec_file_mappings(p.pid) for p in idle + [holder]}
            assert _resident_pages(cold) == 0
            rec = recorder()
            synthesized, by_path = _synthesized(rec, expected)
            # Another recorder starting on this host meanwhile (a bench beside the suite) reads the cold
            # library back into the page cache as it synthesizes the holder: then evict it and start again.
            if {src for _, src in by_path[str(cold)]} != {"kernel"} or attempt == 3 or not other_tracers():
                break
            print(f"\nattempt {attempt}: {str(cold)!r} read back into the page cache by {other_tracers()}")
            rec.close()              # its workers read nothing more meanwhile (closed again at teardown)
        for path, got in by_path.items():
            assert {bid for bid, _ in got} == {readelf_build_id(path)}, path
        assert by_path[str(workloads["lib0"])] == {(readelf_build_id(workloads["lib0"]), "kernel")}
        assert by_path[str(workloads["idle"])] == {(readelf_build_id(workloads["idle"]), "kernel")}
        # Evicted: user space read it through map_files, under the identity check.
        assert by_path[str(cold)] == {(readelf_build_id(cold), "map_files")}
        print(f"\nsynthesized {len(synthesized)} mappings of {len({r['pid'] for r in synthesized})} "
              f"processes; READY {rec.ready_s:.3f} s")
    finally:
        for p in idle + [holder]:
            p.kill()
            p.wait()


def test_a_refused_iterator_falls_back_to_the_proc_scan(recorder, workloads):
    idle = subprocess.Popen([str(workloads["idle"])])
    try:
        _wait_mapped(idle.pid, str(workloads["lib3"]))
        rec = recorder()
        progs = rec.tracer.prog.progs
        real = progs[synth.ITERATOR]
        # A program of another type in its place: BPF_LINK_CREATE with BPF_TRACE_ITER is refused.
        progs[synth.ITERATOR] = progs["on_sched_process_fork"]
        try:
            # As if the iterator had failed before idle's mappings: they are not live yet.
            rec.tables.drop_live(idle.pid)
            before = rec.stats.synthesized
            rec.recovery.synthesize(rec.tracer, rec._record_raws, rec.log.flush, rec.last_errors, 0.2)
            assert rec.stats.synthesized > before
            # ... and as if it had failed after them: what is live is not recorded again.
            idle_records = lambda: [r for r in session_records(rec.session_dir)   # noqa: E731
                                    if r["type"] == "mmap" and r["pid"] == idle.pid]
            again = len(idle_records())
            rec.recovery.synthesize(rec.tracer, rec._record_raws, rec.log.flush, rec.last_errors, 0.2)
            assert len(idle_records()) == again
        finally:
            progs[synth.ITERATOR] = real
        assert any("task_vma iterator" in e["error"] for e in rec.last_errors)
        scanned = [r for r in session_records(rec.session_dir)
                   if r["type"] == "mmap" and r["pid"] == idle.pid and r["build_id_source"] == "map_files"]
        assert {r["path"] for r in scanned} >= {str(workloads["lib0"]), str(workloads["idle"])}
        assert len({r["start"] for r in scanned}) == len(scanned)           # none twice
    finally:
        idle.kill()
        idle.wait()


def _record(path: bytes, pid: int = 7) -> bytes:
    ev = MapEvent()
    ev.hdr.type = EventType.MAP
    ev.hdr.pid = ev.hdr.tid = pid
    ev.path_len = len(path)
    ev.path = path
    return bytes(ev)[:MapEvent.path.offset + len(path)]


def test_split_records_cuts_the_stream_and_stops_at_garbage():
    a, b = _record(b"/usr/lib/libc.so.6"), _record(b"/x" * 100, pid=9)
    recs, left = synth.split_records(a + b)
    assert recs == [a, b] and left == 0
    recs, left = synth.split_records(a + b[:-3])              # cut inside a path
    assert recs == [a] and left == len(b) - 3
    garbage = bytearray(b)
    garbage[0] = EventType.EXEC
    recs, left = synth.split_records(a + bytes(garbage))      # not a map event
    assert recs == [a] and left == len(b)
    huge = bytearray(b)
    huge[MapEvent.path_len.offset:MapEvent.path_len.offset + 2] = (60000).to_bytes(2, "little")
    recs, left = synth.split_records(bytes(huge) + a)         # path_len out of range
    assert recs == [] and left == len(huge) + len(a)
    assert synth.split_records(b"") == ([], 0)


def test_synthesis_stream_is_cut_a_chunk_at_a_time_and_completes_records_across_chunks(monkeypatch):
    recs = [_record(f"/usr/lib/x86_64-linux-gnu/lib{i}.so".encode() * (i % 5 + 1), pid=i + 1) for i in range(300)]
    stream = b"".join(recs)
    # Chunks of 1000 bytes: most records straddle two reads.
    monkeypatch.setattr(synth, "iter_chunks", lambda fd: iter(stream[i:i + 1000] for i in range(0, len(stream), 1000)))
    got = []
    res = synth.synthesize(-1, lambda records: got.append(records))
    assert [r for chunk in got for r in chunk] == recs and res.records == 300 and res.malformed == 0
    assert max(len(chunk) for chunk in got) < 20          # never the whole stream at once
    # A corrupt record: reading stops there, what came before is kept, the rest counted.
    bad = bytearray(recs[1])
    bad[0] = EventType.EXEC
    stream2 = recs[0] + bytes(bad) + b"".join(recs[2:])
    monkeypatch.setattr(synth, "iter_chunks", lambda fd: iter(stream2[i:i + 1000] for i in range(0, len(stream2), 1000)))
    got = []
    res = synth.synthesize(-1, lambda records: got.append(records))
    assert [r for chunk in got for r in chunk] == [recs[0]] and res.records == 1 and res.malformed > 0


@pytest.mark.parametrize("n", [0, 1, 5])
def test_split_records_takes_what_fits(n):
    recs = [_record(f"/lib/l{i}.so".encode(), pid=i + 1) for i in range(n)]
    assert synth.split_records(b"".join(recs)) == (recs, 0)

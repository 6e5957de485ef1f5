"""The kernel's build-id memo (bpf/buildid_memo.h): repeated mappings of an unchanged
file are answered without a page-cache walk, and never with the bytes of before.

Each test runs a real process that maps a gcc-built library executable, with the
real BPF program recording, and checks the recorded build-ids against readelf."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from conftest import Background, gcc, readelf_build_id, session_records

LIB = "int f(void) { return 1; }\n"

#: argv: path, rounds, pause_s.  Maps path executable and unmaps it, rounds times.
MAP_REPEATEDLY = """
import mmap, os, sys, time
path, rounds, pause = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
fd = os.open(path, os.O_RDONLY)
for _ in range(rounds):
    mmap.mmap(fd, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_EXEC, flags=mmap.MAP_PRIVATE).close()
    time.sleep(pause)
"""

#: argv: path, old build-id hex, new build-id hex.  Holds path open for writing with a shared
#: writable mapping, dirties it, maps path executable 30 times, then writes the new build-id
#: through the already dirty mapping (no page fault, so no i_ctime update) and maps it once more.
#: Prints "ctime_moved 0|1" (whether that last store moved i_ctime).
WRITER = """
import mmap, os, sys, time
path, old, new = sys.argv[1], bytes.fromhex(sys.argv[2]), bytes.fromhex(sys.argv[3])
rw = os.open(path, os.O_RDWR)
size = os.fstat(rw).st_size
w = mmap.mmap(rw, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
at = w.find(old)
assert at > 0 and w.find(old, at + 1) < 0
w[at] = w[at]                    # the write fault: i_ctime moves now, the page is dirty
time.sleep(0.1)
ro = os.open(path, os.O_RDONLY)
def map_exec():
    mmap.mmap(ro, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_EXEC, flags=mmap.MAP_PRIVATE).close()
for _ in range(30):
    map_exec()
    time.sleep(0.005)
before = os.fstat(rw).st_ctime_ns
w[at:at + len(new)] = new        # through the writable, dirty PTE
after = os.fstat(rw).st_ctime_ns
map_exec()
print("ctime_moved", int(before != after), flush=True)
"""


def _lib(tmp_path, name, fill):
    lib = gcc(LIB, tmp_path / name, "-shared", "-fPIC", f"-Wl,--build-id=0x{fill * 20}")
    time.sleep(0.05)    # older than a coarse clock tick
    return lib


def _records_of(rec, pid, path):
    return [r for r in session_records(rec.session_dir)
            if r["type"] == "mmap" and r["pid"] == pid and r["path"] == str(path)]


def _run(argv) -> tuple[int, str]:
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0
    return p.pid, out


def test_repeated_mappings_come_from_the_memo_and_a_rewrite_is_read_again(recorder, tmp_path):
    lib = _lib(tmp_path, "memo.so", "a1")
    other = _lib(tmp_path, "other.so", "b2")
    assert lib.stat().st_size == other.stat().st_size
    bid1, bid2 = readelf_build_id(lib), readelf_build_id(other)
    rec = recorder()
    before = rec.tracer.memo_stats()
    bg = Background(rec)
    try:
        pid1, _ = _run([sys.executable, "-c", MAP_REPEATEDLY, str(lib), "60", "0.005"])
        mid = rec.tracer.memo_stats()
        # Rewrite in place (same inode), well after the memo was confirmed.
        with open(lib, "r+b") as f:
            f.write(other.read_bytes())
        assert readelf_build_id(lib) == bid2
        pid2, _ = _run([sys.executable, "-c", MAP_REPEATEDLY, str(lib), "20", "0.005"])
        time.sleep(0.3)
    finally:
        bg.stop()
    after = rec.tracer.memo_stats()
    rec.close()
    print("memo before", before, "after the first process", mid, "at the end", after)
    assert mid["hits"] - before["hits"] >= 30, (before, mid)
    assert mid["confirms"] > before["confirms"]
    first_run, second_run = _records_of(rec, pid1, lib), _records_of(rec, pid2, lib)
    assert len(first_run) == 60 and len(second_run) == 20
    assert {(r["build_id"], r["build_id_source"]) for r in first_run} == {(bid1, "kernel")}
    assert {(r["build_id"], r["build_id_source"]) for r in second_run} == {(bid2, "kernel")}, second_run


def test_a_file_open_for_writing_is_read_at_every_mapping(recorder, tmp_path):
    lib = _lib(tmp_path, "written.so", "c3")
    bid1 = readelf_build_id(lib)
    bid2 = "d4" * 20
    rec = recorder()
    # Confirm a memo entry for the file first: without the writer guard it would answer below.
    bg = Background(rec)
    try:
        subprocess.run([sys.executable, "-c", MAP_REPEATEDLY, str(lib), "30", "0.005"], check=True)
        before = rec.tracer.memo_stats()
        pid, out = _run([sys.executable, "-c", WRITER, str(lib), bid1, bid2])
        time.sleep(0.3)
    finally:
        bg.stop()
    after = rec.tracer.memo_stats()
    rec.close()
    print(out.strip(), "memo before", before, "after", after)
    assert readelf_build_id(lib) == bid2
    recs = sorted(_records_of(rec, pid, lib), key=lambda r: r["time_ns"])
    assert len(recs) == 31
    assert all(r["build_id_source"] == "kernel" for r in recs), recs
    assert [r["build_id"] for r in recs] == [bid1] * 30 + [bid2]
    assert after["writer_skips"] - before["writer_skips"] >= 31

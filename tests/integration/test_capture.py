"""Real BPF, real processes: every executable mapping is recorded with the build-id readelf reports."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time

import pytest

from conftest import gcc, readelf_build_id, session_records
from perfcompare import TracerWatch

LIB_SRC = "int lib_answer(void) { return 42; }\n"
MAIN_SRC = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <unistd.h>
int main(int argc, char **argv) {
    if (argc > 1) {
        void *h = dlopen(argv[1], RTLD_NOW);
        if (!h) { fprintf(stderr, "%s\n", dlerror()); return 1; }
        int (*f)(void) = (int (*)(void))dlsym(h, "lib_answer");
        if (!f || f() != 42) return 2;
    }
    return 0;
}
"""


def _step_until(rec, pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rec.step()
        rec.log.flush()
        if pred():
            return True
        time.sleep(0.02)
    return False


def _mmaps(rec, **match):
    out = []
    for r in session_records(rec.session_dir):
        if r.get("type") == "mmap" and all(r.get(k) == v for k, v in match.items()):
            out.append(r)
    return out


@pytest.fixture(scope="module")
def binaries(tmp_path_factory):
    d = tmp_path_factory.mktemp("bins")
    out = {}
    for style in ("sha1", "md5", "none"):
        out[f"exe_{style}"] = gcc(MAIN_SRC, d / f"exe_{style}", f"-Wl,--build-id={style}", "-ldl")
    out["lib_sha1"] = gcc(LIB_SRC, d / "libanswer.so", "-shared", "-fPIC", "-Wl,--build-id=sha1")
    out["lib_hex"] = gcc(LIB_SRC, d / "libhex.so", "-shared", "-fPIC", "-Wl,--build-id=0x0123456789abcdef")
    return out


def test_gcc_binaries_and_dlopen_have_readelf_build_ids(recorder, binaries):
    rec = recorder()
    procs = []
    for style in ("sha1", "md5", "none"):
        exe = binaries[f"exe_{style}"]
        lib = binaries["lib_sha1"] if style != "md5" else binaries["lib_hex"]
        p = subprocess.run([str(exe), str(lib)], check=True)
        procs.append(p)
    want = {str(p): readelf_build_id(p) for p in binaries.values()}
    assert want[str(binaries["exe_none"])] is None
    assert len(want[str(binaries["exe_md5"])]) == 32 and len(want[str(binaries["exe_sha1"])]) == 40

    def complete():
        got = {r["path"] for r in _mmaps(rec)}
        return all(p in got for p in want)

    assert _step_until(rec, complete), "not every binary was recorded"
    for path, bid in want.items():
        recs = _mmaps(rec, path=path)
        assert recs, path
        for r in recs:
            assert r["build_id"] == bid, (path, r)
            st = os.stat(path)
            assert (r["dev"], r["ino"], r["size"], r["mtime_ns"]) == (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            if bid is None:
                assert r["error"] == "no_build_id"
            else:
                assert r["error"] is None and r["build_id_source"] in ("kernel", "map_files", "proc_root", "path")
    # The main executables come from execve (origin exec), the libraries from dlopen's mmap.
    assert {r["origin"] for r in _mmaps(rec, path=str(binaries["exe_sha1"]))} == {"exec"}
    assert {r["origin"] for r in _mmaps(rec, path=str(binaries["lib_sha1"]))} == {"mmap"}
    # Every process also has its ELF interpreter, with the build-id readelf gives for it.
    interp = [r for r in _mmaps(rec) if r["origin"] == "interp" and r["comm"].startswith("exe_")]
    assert len({r["pid"] for r in interp}) == 3
    for r in interp:
        assert r["build_id"] == readelf_build_id(r["path"])
    execs = [r for r in session_records(rec.session_dir) if r.get("type") == "exec"
             and r["filename"] in want]
    assert {r["filename"] for r in execs} == {str(binaries[f"exe_{s}"]) for s in ("sha1", "md5", "none")}
    for r in execs:
        assert r["build_id"] == want[r["filename"]]


def test_kernel_identity_matches_stat_for_mmap_and_mprotect(recorder, tmp_path, binaries):
    """mmap(PROT_EXEC) and mprotect(+PROT_EXEC) of a file: dev/ino/size/mtime as os.stat gives them."""
    rec = recorder()
    target = tmp_path / "blob.bin"
    target.write_bytes(os.urandom(3 * mmap.PAGESIZE))
    code = f"""
import ctypes, mmap, os
fd = os.open({str(target)!r}, os.O_RDONLY)
m = mmap.mmap(fd, 2 * mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_EXEC, flags=mmap.MAP_PRIVATE, offset=mmap.PAGESIZE)
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
addr = libc.mmap(None, mmap.PAGESIZE, mmap.PROT_READ, mmap.MAP_PRIVATE, fd, 0)
assert libc.mprotect(ctypes.c_void_p(addr), mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_EXEC) == 0
print(hex(addr))
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    mprot_addr = int(out.strip(), 16)
    st = os.stat(target)
    assert _step_until(rec, lambda: len(_mmaps(rec, path=str(target))) >= 2)
    recs = _mmaps(rec, path=str(target))
    by_origin = {r["origin"]: r for r in recs}
    assert set(by_origin) == {"mmap", "mprotect"}
    for r in recs:
        assert (r["dev"], r["ino"], r["size"], r["mtime_ns"]) == (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        assert r["build_id"] is None and r["error"] == "not_elf"
        assert r["prot"] & mmap.PROT_EXEC
    assert by_origin["mmap"]["pgoff"] == mmap.PAGESIZE and by_origin["mmap"]["len"] == 2 * mmap.PAGESIZE
    assert by_origin["mprotect"]["start"] == mprot_addr and by_origin["mprotect"]["pgoff"] == 0


def test_mprotect_exec_of_anonymous_memory_is_neither_recorded_nor_a_loss(recorder, tmp_path, binaries):
    """A JIT's mprotect(PROT_EXEC) of anonymous memory: no file mapping, nothing dropped.

    raw_syscalls:sys_exit sees every mprotect(PROT_EXEC); only a VMA that
    cannot be found is a loss (no_vma), not one without a file.
    """
    rec = recorder()
    watch = TracerWatch().start()       # a full ring is a busy host's loss, not this test's: judged when quiet
    code = """
import ctypes, mmap
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
for _ in range(200):
    addr = libc.mmap(None, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert libc.mprotect(ctypes.c_void_p(addr), mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_EXEC) == 0
    assert libc.mprotect(ctypes.c_void_p(addr), mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC) == 0
"""
    p = subprocess.run([sys.executable, "-c", code], check=True)
    # A file mapping after it, from the same kind of process: once it is recorded, so is all before.
    exe = str(binaries["exe_sha1"])
    subprocess.run([exe], check=False)
    assert _step_until(rec, lambda: any(r.get("path") == exe for r in _mmaps(rec)))
    rec.recovery.next_check = 0
    rec.step()
    beside = watch.stop()
    lost = rec.summary()["lost"]
    lost_records = [r for r in session_records(rec.session_dir) if r["type"] == "lost"]
    if beside:                          # another tracer's storms fill every tracer's rings
        assert set(lost) <= {"ringbuf_full"}, lost
        assert all(set(r["counts"]) <= {"ringbuf_full"} for r in lost_records), lost_records
    else:
        assert lost == {} and not lost_records, (lost, lost_records)
    assert p.returncode == 0


def test_other_syscalls_with_a_mapped_file_in_their_arguments_record_nothing(recorder, tmp_path):
    """chmod, capget and lgetxattr have the native numbers of i386's old_mmap, mprotect and mmap2
    (90, 125, 192): a native task's call, even one shaped like mprotect(file page, len,
    PROT_EXEC) that returns 0, is not a mapping."""
    rec = recorder()
    target = tmp_path / "names.bin"
    target.write_bytes(str(target).encode() + b"\0" + bytes(4 * mmap.PAGESIZE))
    code = f"""
import ctypes, mmap, os
fd = os.open({str(target)!r}, os.O_RDONLY)
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
addr = libc.mmap(None, mmap.PAGESIZE, mmap.PROT_READ, mmap.MAP_PRIVATE, fd, 0)
libc.syscall.restype = ctypes.c_long
for _ in range(50):
    # chmod(path in the file's mapping, 0o644); dx (the third argument) holds PROT_EXEC.
    assert libc.syscall(90, ctypes.c_void_p(addr), 0o644, mmap.PROT_EXEC) == 0
    libc.syscall(125, ctypes.c_void_p(addr), ctypes.c_void_p(addr), mmap.PROT_EXEC)
print("done")
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "done"
    exe = gcc("int main(void) { return 0; }\n", tmp_path / "marker")
    subprocess.run([str(exe)], check=True)
    assert _step_until(rec, lambda: any(r.get("path") == str(exe) for r in _mmaps(rec)))
    assert _mmaps(rec, path=str(target)) == []


def test_executable_segments_after_a_gap_are_recorded(recorder, tmp_path):
    """Segments aligned to 2 MiB leave gaps between the VMAs; the exec walk must cross them."""
    exe = gcc("#include <unistd.h>\nint main(void) { pause(); return 0; }\n", tmp_path / "gapped",
              "-Wl,-z,max-page-size=0x200000", "-Wl,-z,separate-code", "-Wl,--build-id=sha1")
    rec = recorder()
    p = subprocess.Popen([str(exe)])
    try:
        assert _step_until(rec, lambda: _mmaps(rec, path=str(exe)))
        maps = open(f"/proc/{p.pid}/maps").read().splitlines()
        want = [line for line in maps if str(exe) in line and line.split()[1][2] == "x"]
        assert len(want) == 1
        start = int(want[0].split("-")[0], 16)
        recs = _mmaps(rec, path=str(exe), origin="exec")
        assert [r["start"] for r in recs] == [start], (recs, maps)
        assert recs[0]["pgoff"] == int(want[0].split()[2], 16) and recs[0]["build_id"] == readelf_build_id(exe)
    finally:
        p.kill()
        p.wait()


THREADED_MAPPER_SRC = r"""
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
static int fd, rounds;
static void *mapper(void *arg) {
    (void)arg;
    for (int i = 0; i < rounds; i++) {
        void *x = mmap(NULL, 4096, PROT_READ | PROT_EXEC, MAP_PRIVATE, fd, 0);
        void *d = mmap(NULL, 4096, PROT_READ, MAP_PRIVATE, fd, 0);
        void *a = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (x == MAP_FAILED || d == MAP_FAILED || a == MAP_FAILED) exit(3);
        if (i % 7 == 0) sched_yield();
        munmap(x, 4096); munmap(d, 4096); munmap(a, 4096);
    }
    printf("%ld\n", (long)syscall(SYS_gettid));
    return NULL;
}
int main(int argc, char **argv) {
    int n = atoi(argv[2]);
    pthread_t t[16];
    rounds = atoi(argv[3]);
    fd = open(argv[1], O_RDONLY);
    if (fd < 0) return 2;
    for (int i = 0; i < n; i++) pthread_create(&t[i], NULL, mapper, NULL);
    for (int i = 0; i < n; i++) pthread_join(t[i], NULL);
    return 0;
}
"""


def test_each_exec_mmap_is_recorded_once_and_no_other_among_threads_racing_on_both_cpus(recorder, tmp_path):
    """sys_exit_mmap skips the VMA lookup when the call's saved registers show no PROT_EXEC:
    with threads mapping executable, read-only and anonymous memory at once (contending on
    mmap_lock, migrating and yielding), exactly the executable ones are recorded, every one."""
    target = tmp_path / "racy.bin"
    target.write_bytes(b"\x7f" * 4096)
    exe = gcc(THREADED_MAPPER_SRC, tmp_path / "mapper", "-pthread")
    rec = recorder(ring_bytes=16 << 20)  # drained after the run: the rings hold all 18,000 events
    threads, rounds = 6, 3000
    out = subprocess.run([str(exe), str(target), str(threads), str(rounds)], check=True,
                         capture_output=True, text=True).stdout
    tids = {int(x) for x in out.split()}
    assert len(tids) == threads
    assert _step_until(rec, lambda: len(_mmaps(rec, path=str(target))) >= threads * rounds)
    time.sleep(0.2)
    rec.step()
    rec.log.flush()
    recs = _mmaps(rec, path=str(target))
    per_tid = {}
    for r in recs:
        per_tid[r["tid"]] = per_tid.get(r["tid"], 0) + 1
        assert r["prot"] & mmap.PROT_EXEC and r["origin"] == "mmap", r
    assert per_tid == {t: rounds for t in tids}
    assert rec.tracer.drops().total == 0


def test_read_implies_exec_personality_makes_a_read_only_mmap_executable_and_recorded(recorder, tmp_path):
    """Under READ_IMPLIES_EXEC, do_mmap adds PROT_EXEC to PROT_READ: the kernel maps it
    executable (perf records it), so must we, though the mmap asked for PROT_READ only."""
    target = tmp_path / "rie.bin"
    target.write_bytes(b"\x7f" * 4096)
    code = f"""
import ctypes, mmap, os
libc = ctypes.CDLL(None, use_errno=True)
fd = os.open({str(target)!r}, os.O_RDONLY)
plain = mmap.mmap(fd, mmap.PAGESIZE, prot=mmap.PROT_READ, flags=mmap.MAP_PRIVATE)
assert libc.personality(0x0400000) >= 0          # READ_IMPLIES_EXEC
implied = mmap.mmap(fd, mmap.PAGESIZE, prot=mmap.PROT_READ, flags=mmap.MAP_PRIVATE)
print("\\n".join(l for l in open("/proc/self/maps").read().splitlines() if l.endswith({str(target)!r})))
"""
    rec = recorder()
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    lines = out.strip().splitlines()
    assert sorted(line.split()[1] for line in lines) == ["r--p", "r-xp"], lines   # the kernel made one executable
    addr = int(next(line for line in lines if line.split()[1] == "r-xp").split("-")[0], 16)
    assert _step_until(rec, lambda: _mmaps(rec, path=str(target)))
    time.sleep(0.2)
    rec.step()
    rec.log.flush()
    recs = _mmaps(rec, path=str(target))
    assert [r["start"] for r in recs] == [addr], recs   # not the plain PROT_READ one
    assert recs[0]["prot"] & mmap.PROT_EXEC


def test_comm_is_recorded_for_prctl_but_not_again_for_execve(recorder, tmp_path):
    """execve renames the task inside the exec (task_rename with in_execve set); the exec
    record carries that comm, so only real renames (prctl PR_SET_NAME) are comm records."""
    rec = recorder()
    code = "import ctypes; ctypes.CDLL(None).prctl(15, b'renamed-here', 0, 0, 0)"
    p = subprocess.run([sys.executable, "-c", code], check=True)
    del p

    def recs():
        return [r for r in session_records(rec.session_dir) if r.get("type") in ("exec", "comm")]
    assert _step_until(rec, lambda: any(r["type"] == "comm" and r["comm"] == "renamed-here" for r in recs()))
    mine = [r for r in recs() if r["type"] == "comm" and r["comm"] == "renamed-here"]
    pid = mine[0]["pid"]
    by_pid = [r for r in recs() if r["pid"] == pid]
    assert [r["type"] for r in by_pid] == ["exec", "comm"], by_pid
    assert by_pid[0]["comm"] == os.path.basename(sys.executable)[:15]


def test_shared_anonymous_executable_mapping_is_recorded(recorder):
    """MAP_SHARED|MAP_ANONYMOUS with PROT_EXEC is backed by a shmem file (vm_file set, shown as
    "/dev/zero (deleted)"): perf reports it, so it is recorded, with why it has no build-id."""
    code = """
import mmap
m = mmap.mmap(-1, 2 * mmap.PAGESIZE, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS,
              prot=mmap.PROT_READ | mmap.PROT_EXEC)
print("\\n".join(l for l in open("/proc/self/maps").read().splitlines() if "/dev/zero" in l))
"""
    rec = recorder()
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].split()[1] == "r-xs", lines
    start = int(lines[0].split("-")[0], 16)
    assert _step_until(rec, lambda: [r for r in _mmaps(rec, start=start) if r["path"].startswith("/dev/zero")])
    r = [r for r in _mmaps(rec, start=start) if r["path"].startswith("/dev/zero")][0]
    assert r["len"] == 2 * mmap.PAGESIZE and r["deleted"] and r["build_id"] is None and r["error"]

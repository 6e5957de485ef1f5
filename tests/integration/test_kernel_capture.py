"""Names and ABIs read by the kernel at the event: each record's own path, long and
non-UTF-8 names, overlayfs, and i386 (compat) processes checked against perf."""

from __future__ import annotations

import base64
import ctypes
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from perfcompare import PerfRecorder, compare

from buildidd.kernel.pagecache import PAGE_SIZE
from conftest import Background, gcc, need, readelf_build_id, session_records
from kernel.test_pagecache import move_notes_past

LIB = "int f(void) { return 1; }\n"

#: Maps each argument (a path, relative to the cwd given) executable, then waits for stdin to close.
MAPPER = """
import mmap, os, sys
keep = []
for p in sys.argv[1:]:
    fd = os.open(os.fsencode(p) if p != "-" else p, os.O_RDONLY)
    keep.append(mmap.mmap(fd, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_EXEC, flags=mmap.MAP_PRIVATE))
print("ready", flush=True)
sys.stdin.read()
"""


def _map_files(rec, paths, ino, cwd=None):
    """Run a process that maps every path executable; its recorded mmap records of inode ino."""
    p = subprocess.Popen([sys.executable, "-c", MAPPER, *paths], cwd=cwd, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline() == b"ready\n"
        deadline = time.monotonic() + 10
        while True:
            rec.step()
            recs = [r for r in session_records(rec.session_dir)
                    if r["type"] == "mmap" and r["pid"] == p.pid and r["ino"] == ino]
            if len(recs) >= len(paths) or time.monotonic() > deadline:
                return recs
            time.sleep(0.05)
    finally:
        p.stdin.close()
        p.wait()


def _lib(tmp_path, name="lib.so"):
    return gcc(LIB, tmp_path / name, "-shared", "-fPIC", "-Wl,--build-id=sha1")


def test_hard_links_each_event_has_its_own_name(recorder, tmp_path):
    lib = _lib(tmp_path)
    links = [tmp_path / f"link{i}.so" for i in range(3)]
    for link in links:
        os.link(lib, link)
    rec = recorder()
    # The same inode three times, under three names, in one process and then in another.
    for order in (links, links[::-1]):
        recs = _map_files(rec, [str(p) for p in order], os.stat(lib).st_ino)
        assert [r["path"] for r in recs] == [str(p) for p in order]
        assert {r["ino"] for r in recs} == {os.stat(lib).st_ino}
        assert {r["build_id"] for r in recs} == {readelf_build_id(lib)}


@pytest.mark.parametrize("kfuncs", [True, False], ids=["kld-loads", "probe-reads"])
def test_identity_path_and_build_id_with_and_without_kfuncs(recorder, tmp_path, monkeypatch, kfuncs):
    """KLD (bpf/kfuncs.h) reads the fields through bpf_rdonly_cast pointers; on a kernel without
    that kfunc (here: a name BTF lacks) the same source is compiled with -DNO_KFUNCS and reads
    them with bpf_probe_read_kernel.  Both give what stat(2) and readelf -n give."""
    from buildidd.kernel.btf import Btf
    from buildidd.kernel.compiled import KFUNCS
    if not kfuncs:       # a kernel whose BTF has no such function (bpf_rdonly_cast is Linux 6.2+)
        found = Btf.type_ids
        monkeypatch.setattr(Btf, "type_ids", lambda self, kind, name: [] if name in KFUNCS else found(self, kind, name))
    lib = _lib(tmp_path)
    st = os.stat(lib)
    rec = recorder()
    recs = _map_files(rec, [str(lib)], st.st_ino)
    assert len(recs) == 1, recs
    r = recs[0]
    assert (r["path"], r["ino"], r["dev"], r["size"], r["mtime_ns"]) == (
        str(lib), st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns)
    assert r["build_id"] == readelf_build_id(lib) and r["build_id_source"] == "kernel"
    assert ("-DNO_KFUNCS" in rec.tracer.spec.cflags) is (not kfuncs)


def test_a_60_component_path_is_whole_and_a_longer_one_says_truncated(recorder, tmp_path):
    deep = tmp_path.joinpath(*[f"c{i:02d}" for i in range(60)])
    deep.mkdir(parents=True)
    lib = _lib(deep)
    assert len(lib.parts) > 60
    # Over PATH_MAX: 24 components of 200 bytes below tmp_path, made and reached by relative paths.
    parts = [f"{i:02d}" + "x" * 198 for i in range(24)]
    _make_long_dirs(tmp_path, parts)
    mid = os.path.join(tmp_path, *parts[:12])
    long_rel = os.path.join(*parts[12:], "lib.so")
    subprocess.run(["cp", str(lib), long_rel], cwd=mid, check=True)
    full = os.path.join(mid, long_rel)
    assert len(full.encode()) > 4096
    rec = recorder()
    recs = _map_files(rec, [str(lib)], os.stat(lib).st_ino)
    assert len(recs) == 1 and recs[0]["path"] == str(lib) and "path_truncated" not in recs[0]
    recs = _map_files(rec, [long_rel], os.stat(long_rel, dir_fd=os.open(mid, os.O_DIRECTORY)).st_ino, cwd=mid)
    assert len(recs) == 1
    r = recs[0]
    assert r["path_truncated"] is True
    assert full.endswith(r["path"]) and len(r["path"].encode()) > 3000
    assert r["build_id"] == readelf_build_id(lib)


def test_a_path_of_1500_components_is_whole(recorder, tmp_path):
    # The walk is a bpf_loop (bpf/callbacks.h): its bound no longer costs verification, and a path
    # within PATH_MAX has at most 2047 components.  1500 one-byte components: ~3,000 bytes.
    parts = ["d"] * 1500
    _make_long_dirs(tmp_path, parts)
    try:
        mid = os.path.join(tmp_path, *parts[:750])
        rel = os.path.join(*parts[750:], "lib.so")
        lib = _lib(tmp_path)
        subprocess.run(["cp", str(lib), rel], cwd=mid, check=True)
        full = os.path.join(mid, rel)
        assert 3000 < len(full.encode()) < 4096
        rec = recorder()
        recs = _map_files(rec, [rel], os.stat(rel, dir_fd=os.open(mid, os.O_DIRECTORY)).st_ino, cwd=mid)
        assert len(recs) == 1
        r = recs[0]
        assert r["path"] == full
        assert "path_truncated" not in r and "path_unreachable" not in r
        assert r["build_id"] == readelf_build_id(lib)
    finally:
        _remove_long_dirs(tmp_path, parts)


def _remove_long_dirs(root, parts):
    """Remove what _make_long_dirs made (and the files in it), deepest first, without recursion:
    pytest's own clean-up of old temporary directories recurses once per level."""
    fds = [os.open(root, os.O_DIRECTORY)]
    try:
        for part in parts:
            try:
                fds.append(os.open(part, os.O_DIRECTORY, dir_fd=fds[-1]))
            except FileNotFoundError:
                break
        for depth in range(len(fds) - 1, 0, -1):
            for name in os.listdir(fds[depth]):
                os.unlink(name, dir_fd=fds[depth])
            os.close(fds.pop())
            os.rmdir(parts[depth - 1], dir_fd=fds[-1])
    finally:
        for fd in fds:
            os.close(fd)


def _make_long_dirs(root, parts):
    """mkdir each component of parts below root, one level at a time (no path is ever over PATH_MAX)."""
    fd = os.open(root, os.O_DIRECTORY)
    try:
        for part in parts:
            os.mkdir(part, dir_fd=fd)
            nxt = os.open(part, os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
    finally:
        os.close(fd)


def test_a_name_that_is_not_utf8_is_valid_json_with_its_exact_bytes(recorder, tmp_path):
    lib = _lib(tmp_path)
    want = readelf_build_id(lib)
    raw = bytes(tmp_path) + b'/bad\xff\xfe"q\nname\xed\xa0\x80.so'
    os.rename(lib, raw)
    rec = recorder()
    p = subprocess.Popen([sys.executable, "-c", MAPPER, os.fsdecode(raw)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline() == b"ready\n"
        time.sleep(0.2)
        rec.step()
    finally:
        p.stdin.close()
        p.wait()
    rec.close()
    recs = [r for r in session_records(rec.session_dir) if r["type"] == "mmap" and r["pid"] == p.pid
            and r.get("path_bytes")]
    assert len(recs) == 1
    r = recs[0]
    assert base64.b64decode(r["path_bytes"]) == raw
    assert r["path"] == raw.decode("utf-8", "replace") and "\ufffd" in r["path"]
    assert r["build_id"] == want
    # Every line is strict JSON: no lone surrogate escapes, no raw control characters.
    for seg in sorted(rec.session_dir.glob("*.jsonl*")):
        if seg.suffix == ".jsonl":
            for line in seg.read_bytes().splitlines():
                assert b"\\ud8" not in line.lower() and b"\\udc" not in line.lower()
                json.loads(line)


def test_overlayfs_path_and_identity_are_the_merged_file(recorder, tmp_path):
    lower, upper, work, merged = (tmp_path / n for n in ("lower", "upper", "work", "merged"))
    for d in (lower, upper, work, merged):
        d.mkdir()
    lib = _lib(lower)
    libc = ctypes.CDLL(None, use_errno=True)
    opts = f"lowerdir={lower},upperdir={upper},workdir={work}".encode()
    if libc.mount(b"overlay", bytes(merged), b"overlay", 0, opts) != 0:
        need(False, f"overlay mount: {os.strerror(ctypes.get_errno())}")
    try:
        st = os.stat(merged / "lib.so")
        rec = recorder()
        recs = _map_files(rec, [str(merged / "lib.so")], st.st_ino)
        assert len(recs) == 1
        r = recs[0]
        assert r["path"] == str(merged / "lib.so")
        assert (r["dev"], r["ino"]) == (st.st_dev, st.st_ino)
        assert (r["dev"], r["ino"]) != (os.stat(lib).st_dev, os.stat(lib).st_ino)
        assert r["build_id"] == readelf_build_id(lib)
    finally:
        libc.umount2(bytes(merged), 2)


PROG32 = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <unistd.h>
int main(int argc, char **argv) {
    void *h = dlopen(argv[1], RTLD_NOW);
    if (!h) { fprintf(stderr, "%s\n", dlerror()); return 1; }
    return ((int (*)(void))dlsym(h, "f"))() == 1 ? 0 : 2;
}
"""


def test_32bit_programs_match_perf(recorder, tmp_path):
    need(shutil.which("perf") is not None, "perf (linux-perf) not installed")
    lib = gcc(LIB, tmp_path / "lib32.so", "-m32", "-shared", "-fPIC", "-Wl,--build-id=sha1")
    exe = gcc(PROG32, tmp_path / "prog32", "-m32", "-Wl,--build-id=md5", "-ldl")
    perf = PerfRecorder(tmp_path / "perf.data")
    rec = recorder()
    bg = Background(rec)
    pids = set()
    try:
        for _ in range(5):
            p = subprocess.Popen([str(exe), str(lib)])
            assert p.wait() == 0
            pids.add(p.pid)
        time.sleep(0.3)
    finally:
        perf_maps = perf.stop()
        bg.stop()
    rec.close()
    records = session_records(rec.session_dir)
    c = compare(perf_maps, records, pids=pids)
    print("perf comparison (i386):", c.as_dict())
    assert c.matched == c.perf_with_build_id >= 5 * 4, c.examples
    assert (c.wrong, c.path_differs, c.extent_differs, c.missing, c.no_build_id) == (0, 0, 0, 0, 0)
    for pid in pids:
        mine = [r for r in records if r["type"] == "mmap" and r["pid"] == pid]
        origins = {r["origin"] for r in mine}
        assert {"exec", "interp", "mmap"} <= origins, origins
        paths = {r["path"] for r in mine}
        assert str(exe) in paths and str(lib) in paths
        assert any("/i386-linux-gnu/" in p or "/lib32/" in p for p in paths), paths   # the 32-bit libc
        ex = [r for r in records if r["type"] == "exec" and r["pid"] == pid]
        assert ex and ex[0]["path"] == str(exe) and ex[0]["build_id"] == readelf_build_id(exe)


#: Execs argv[1] from a fresh memfd argv[2] times (fork + fexecve; the memfd closed in the parent at
#: once, the child exits at once): no path, no /proc/PID/map_files left to read it from afterwards.
MEMFD_EXEC = r"""
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <fcntl.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
extern char **environ;
int main(int argc, char **argv) {
    int src = open(argv[1], O_RDONLY);
    struct stat st;
    if (src < 0 || fstat(src, &st)) return 1;
    char *buf = malloc(st.st_size);
    if (read(src, buf, st.st_size) != st.st_size) return 1;
    for (int i = 0; i < atoi(argv[2]); i++) {
        int fd = memfd_create("bidd_memfd", 0);
        if (fd < 0 || write(fd, buf, st.st_size) != st.st_size) return 1;
        pid_t pid = fork();
        if (pid == 0) {
            char *a[] = {"bidd_memfd", NULL};
            fexecve(fd, a, environ);
            _exit(127);
        }
        close(fd);
        int status;
        if (waitpid(pid, &status, 0) != pid || status != 0) return 2;
        printf("%d\n", pid);
    }
    return 0;
}
"""


def test_memfd_exec_storm_has_the_build_id_read_by_the_kernel(recorder, tmp_path):
    need(shutil.which("perf") is not None, "perf (linux-perf) not installed")
    short = gcc("int main(void) { return 0; }\n", tmp_path / "short", "-Wl,--build-id=sha1")
    want = readelf_build_id(short)
    launcher = gcc(MEMFD_EXEC, tmp_path / "memfd_exec")
    n = 100
    perf = PerfRecorder(tmp_path / "perf.data")
    rec = recorder()
    bg = Background(rec)
    try:
        out = subprocess.run([str(launcher), str(short), str(n)], check=True, capture_output=True, text=True)
        time.sleep(0.3)
    finally:
        perf_maps = perf.stop()
        bg.stop()
    rec.close()
    pids = {int(x) for x in out.stdout.split()}
    assert len(pids) == n
    records = session_records(rec.session_dir)
    c = compare(perf_maps, records, pids=pids)
    print("perf comparison (memfd exec storm):", c.as_dict())
    assert c.perf_with_build_id >= 3 * n        # the memfd, ld.so, libc of each child
    assert c.matched == c.perf_with_build_id, c.examples
    assert (c.wrong, c.path_differs, c.extent_differs, c.missing, c.no_build_id) == (0, 0, 0, 0, 0)
    for pid in pids:
        ex = [r for r in records if r["type"] == "exec" and r["pid"] == pid]
        assert len(ex) == 1 and ex[0]["build_id"] == want, ex
        mine = [r for r in records if r["type"] == "mmap" and r["pid"] == pid and "memfd:bidd_memfd" in r["path"]]
        assert mine and all(r["build_id"] == want and r["build_id_source"] == "kernel" for r in mine), mine


#: dlopens argv[1], then rewrites its bytes in place (same inode) with argv[2]'s, and exits at once
#: (_exit: a truncation also drops the private copies of the library's relocated pages, and its
#: destructors would run on unrelocated ones).
OVERWRITE = """
import ctypes, os, sys
ctypes.CDLL(sys.argv[1])
data = open(sys.argv[2], "rb").read()
fd = os.open(sys.argv[1], os.O_WRONLY | (os.O_TRUNC if sys.argv[3] == "truncate" else 0))
os.write(fd, data)
os.close(fd)
os._exit(0)
"""


@pytest.mark.parametrize("how", ["in_place", "truncate"])
def test_library_overwritten_right_after_dlopen_has_the_mapped_build_id(recorder, tmp_path, how):
    need(shutil.which("perf") is not None, "perf (linux-perf) not installed")
    first = gcc(LIB, tmp_path / "first.so", "-shared", "-fPIC", "-Wl,--build-id=0x" + "11" * 20)
    second = gcc(LIB, tmp_path / "second.so", "-shared", "-fPIC", "-Wl,--build-id=0x" + "22" * 20)
    assert first.stat().st_size == second.stat().st_size
    bid1, bid2 = readelf_build_id(first), readelf_build_id(second)
    target = tmp_path / "lib.so"
    perf = PerfRecorder(tmp_path / "perf.data")
    rec = recorder()
    bg = Background(rec)
    pids = set()
    try:
        for _ in range(3):
            shutil.copyfile(first, target)
            ino = os.stat(target).st_ino
            p = subprocess.Popen([sys.executable, "-c", OVERWRITE, str(target), str(second), how])
            assert p.wait() == 0
            pids.add(p.pid)
            assert os.stat(target).st_ino == ino and readelf_build_id(target) == bid2
        time.sleep(0.3)
    finally:
        perf_maps = perf.stop()
        bg.stop()
    rec.close()
    records = session_records(rec.session_dir)
    c = compare(perf_maps, records, pids=pids)
    print(f"perf comparison (overwritten {how}):", c.as_dict())
    assert c.matched == c.perf_with_build_id > 0, c.examples
    assert (c.wrong, c.path_differs, c.extent_differs, c.missing, c.no_build_id) == (0, 0, 0, 0, 0)
    assert not any(p.build_id == bid2 for p in perf_maps if p.pid in pids)
    for pid in pids:
        mine = [r for r in records if r["type"] == "mmap" and r["pid"] == pid and r["path"] == str(target)]
        assert mine, pid
        assert {(r["build_id"], r["build_id_source"]) for r in mine} == {(bid1, "kernel")}, mine


#: For each path: drop its page cache (POSIX_FADV_DONTNEED), then map it executable without reading a byte.
MAP_EVICTED = """
import mmap, os, sys
keep = []
for p in sys.argv[1:]:
    fd = os.open(p, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    keep.append(mmap.mmap(fd, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_EXEC, flags=mmap.MAP_PRIVATE))
print("ready", flush=True)
sys.stdin.read()
"""


def test_page_cache_dropped_before_the_mmap_we_still_have_the_build_id(recorder, tmp_path):
    need(shutil.which("perf") is not None, "perf (linux-perf) not installed")
    libs = [gcc(LIB, tmp_path / f"ev{i}.so", "-shared", "-fPIC", f"-Wl,--build-id=0x{i + 1:040x}") for i in range(10)]
    want = {str(lib): readelf_build_id(lib) for lib in libs}
    os.sync()           # dirty pages are not dropped
    time.sleep(0.1)     # ctime older than a coarse clock tick: user space may read these files
    perf = PerfRecorder(tmp_path / "perf.data")
    rec = recorder()
    bg = Background(rec)
    try:
        p = subprocess.Popen([sys.executable, "-c", MAP_EVICTED, *want], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            assert p.stdout.readline() == b"ready\n"
            time.sleep(0.5)
        finally:
            p.stdin.close()
            p.wait()
    finally:
        perf_maps = perf.stop()
        bg.stop()
    rec.close()
    records = session_records(rec.session_dir)
    c = compare([m for m in perf_maps if m.path in want], records, pids={p.pid})
    print("perf comparison (evicted):", c.as_dict())
    print(f"we have, perf has not: {c.resolved_where_perf_had_none}; "
          f"perf has, we have not: {c.no_build_id + c.missing}")
    assert c.perf_with_build_id + c.perf_without_build_id == len(libs)
    assert c.no_build_id + c.missing == 0, c.examples
    assert (c.wrong, c.path_differs, c.extent_differs) == (0, 0, 0), c.examples
    assert c.matched == c.perf_with_build_id
    assert c.resolved_where_perf_had_none == c.perf_without_build_id > 0
    mine = [r for r in records if r["type"] == "mmap" and r["pid"] == p.pid and r["path"] in want]
    assert len(mine) == len(libs)
    for r in mine:
        assert r["build_id"] == want[r["path"]], r
    evicted = [r for r in mine if r.get("kernel_status") == "not_cached"]
    assert evicted and all(r["build_id_source"] != "kernel" for r in evicted)


def test_a_note_past_the_first_page_is_read_by_the_kernel(recorder, tmp_path):
    lib = _lib(tmp_path)
    late = tmp_path / "late.so"
    move_notes_past(lib, late, 64 * PAGE_SIZE + 100)
    want = readelf_build_id(late)
    assert want == readelf_build_id(lib)
    fd = os.open(late, os.O_RDONLY)
    try:
        while os.read(fd, 1 << 20):     # every page cached: the note's page too
            pass
    finally:
        os.close(fd)
    rec = recorder()
    recs = _map_files(rec, [str(late)], os.stat(late).st_ino)
    assert len(recs) == 1
    assert (recs[0]["build_id"], recs[0]["build_id_source"]) == (want, "kernel"), recs[0]

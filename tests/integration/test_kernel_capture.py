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

from perfcompare import PerfRecorder, compare

from conftest import Background, gcc, need, readelf_build_id, session_records

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

"""Identity across mount namespaces (a container's private mount) and memfd-backed mappings."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

from conftest import gcc, need, readelf_build_id, session_records

SLEEPER = "#include <unistd.h>\nint main(void) { for (;;) pause(); }\n"


def _wait_records(rec, pred, timeout=10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rec.step()
        recs = [r for r in session_records(rec.session_dir) if pred(r)]
        if recs:
            return recs
        time.sleep(0.05)
    return []


def test_binary_visible_only_in_a_private_mount_namespace(recorder, tmp_path):
    need(shutil.which("unshare") is not None, "unshare (util-linux) missing")
    exe = gcc(SLEEPER, tmp_path / "nsapp", "-Wl,--build-id=sha1")
    want = readelf_build_id(exe)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    rec = recorder(kernel_build_id=False)     # the user-space fallback under test
    # A new mount namespace with a tmpfs at mnt: the daemon's namespace sees an empty dir.
    script = f"mount -t tmpfs none {mnt} && cp {exe} {mnt}/nsapp && sleep 0.05 && exec {mnt}/nsapp"
    p = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", script])
    try:
        recs = _wait_records(rec, lambda r: r["type"] == "mmap" and r["path"] == f"{mnt}/nsapp")
        assert recs, "no mapping recorded for the namespaced binary"
        assert not (mnt / "nsapp").exists()          # not visible from here
        for r in recs:
            assert r["build_id"] == want and r["build_id_source"] in ("map_files", "proc_root"), (r["error"], r)
    finally:
        p.kill()
        p.wait()


def test_memfd_elf_and_jit_memfd(recorder, tmp_path):
    exe = gcc("int f(void){return 1;}\n", tmp_path / "libm.so", "-shared", "-fPIC", "-Wl,--build-id=md5")
    want = readelf_build_id(exe)
    rec = recorder(kernel_build_id=False)     # the user-space fallback under test
    code = f"""
import mmap, os, sys, time
elf = os.memfd_create("bidd-elf")
os.write(elf, open({str(exe)!r}, "rb").read())
jit = os.memfd_create("bidd-jit")
os.write(jit, b"\\xc3" * mmap.PAGESIZE)
time.sleep(0.05)       # written a clock tick before they are mapped: else changed_at_map
a = mmap.mmap(elf, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_EXEC, flags=mmap.MAP_PRIVATE)
b = mmap.mmap(jit, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_EXEC, flags=mmap.MAP_SHARED)
print("ready", flush=True)
sys.stdin.read()
"""
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        elf = _wait_records(rec, lambda r: r["type"] == "mmap" and "bidd-elf" in r["path"])
        jit = _wait_records(rec, lambda r: r["type"] == "mmap" and "bidd-jit" in r["path"])
        assert elf and jit
        assert elf[0]["build_id"] == want and elf[0]["build_id_source"] == "map_files"
        assert jit[0]["build_id"] is None and jit[0]["error"] == "not_elf"
        assert elf[0]["deleted"] and jit[0]["deleted"]      # memfd inodes have no link
    finally:
        p.stdin.close()
        p.wait()

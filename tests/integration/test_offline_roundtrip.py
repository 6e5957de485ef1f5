"""The offline round trip: record with the daemon, replace one binary and delete another, archive, import into
empty directories, then symbolize with perf, gdb and debuginfod-find (against ``buildidd serve``) from the import."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

from buildidd.store import Store

from conftest import ServeProcess, gcc, need, readelf_build_id, upgrade_by_rename, wait_exec
from perfcompare import perf_record_lock

BUILDIDD = [sys.executable, "-m", "buildidd.cli"]

SPINNER = """
volatile int version = VERSION;
static volatile unsigned long sink;
__attribute__((noinline)) void bidd_roundtrip_spin(void) { for (unsigned long i = 0; i < 1000000; i++) sink += i; }
int main(void) { for (;;) bidd_roundtrip_spin(); }
"""
SYMBOL = "bidd_roundtrip_spin"


def _run(cmd, **kw):
    env = {k: v for k, v in os.environ.items() if k != "DEBUGINFOD_URLS"}
    r = subprocess.run(cmd, capture_output=True, text=True, env={**env, **kw.pop("env", {})}, **kw)
    assert r.returncode == 0, f"{cmd}: {r.stderr}"
    return r.stdout


def test_record_replace_delete_archive_import_then_perf_gdb_and_debuginfod_find(recorder, tmp_path,
                                                                               public_tmp_factory):
    need(shutil.which("perf") is not None, "perf missing")
    need(shutil.which("gdb") is not None, "gdb missing")
    v1 = gcc(SPINNER, tmp_path / "v1", "-DVERSION=1", "-g")
    v2 = gcc(SPINNER, tmp_path / "v2", "-DVERSION=2", "-g")
    old, new = readelf_build_id(v1), readelf_build_id(v2)
    assert old != new
    store_root = tmp_path / "store"
    rec = recorder(store_root=str(store_root), snapshot_rate_bytes_per_s=0)
    host = public_tmp_factory("buildidd-roundtrip-host-")     # world-readable: archived and served (not private)
    app_a, app_b = host / "app_a", host / "app_b"
    upgrade_by_rename(v1, app_a)
    upgrade_by_rename(gcc(SPINNER, tmp_path / "v3", "-DVERSION=3", "-g"), app_b)     # app_b: a third build-id
    deleted = readelf_build_id(app_b)
    deleted_bytes = app_b.read_bytes()
    pa, pb = subprocess.Popen([str(app_a)]), subprocess.Popen([str(app_b)])
    data = tmp_path / "perf.data"
    try:
        wait_exec(pa, app_a)
        wait_exec(pb, app_b)
        with perf_record_lock():
            _run(["perf", "record", "-N", "-q", "-e", "cpu-clock", "-o", str(data), "-p", str(pa.pid),
                  "--", "sleep", "0.5"], cwd=tmp_path)
        upgrade_by_rename(v2, app_a)           # upgraded: a new build-id at the same path
        os.unlink(app_b)              # removed
        store = Store(store_root)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (store.contains(old) and store.contains(deleted)):
            rec.step()
            time.sleep(0.05)
    finally:
        for p in (pa, pb):
            p.kill()
            p.wait()
    rec.close()
    assert store.contains(old) and store.contains(deleted)

    # Archive on the "host", import on the "analysis machine" into empty directories.
    archive = tmp_path / "session.tar.zst"
    _run([*BUILDIDD, "archive", str(rec.session_dir), "-o", str(archive), "--store-root", str(store_root)])
    analysis = tmp_path / "analysis"
    debug_dir, sessions = analysis / "debug", analysis / "sessions"
    _run([*BUILDIDD, "import", str(archive), "--debug-dir", str(debug_dir), "--session-root", str(sessions)])
    assert (sessions / rec.session_dir.name).is_dir()
    link = debug_dir / ".build-id" / old[:2] / old[2:]
    assert (link / "elf").read_bytes() == v1.read_bytes()                        # cmp with the original
    assert (debug_dir / ".build-id" / deleted[:2] / deleted[2:] / "elf").read_bytes() == deleted_bytes

    # perf: the profile names the replaced binary's original build-id, and is symbolized from the import.
    # (``perf buildid-cache -l`` is no oracle here: it lists only entries whose path still holds that build-id.)
    listed = _run(["perf", "--buildid-dir", str(debug_dir), "buildid-list", "-i", str(data)], cwd=tmp_path)
    assert f"{old} {app_a}" in listed, listed

    def report(buildid_dir):
        buildid_dir.mkdir(exist_ok=True)
        return _run(["perf", "--buildid-dir", str(buildid_dir), "report", "-i", str(data), "--stdio",
                     "--sort", "dso,sym"], cwd=tmp_path)
    assert SYMBOL not in report(tmp_path / "empty")       # the control: the file at the path is another build
    assert SYMBOL in report(debug_dir)

    # gdb: a stripped copy of the original finds its symbols by build-id in the imported tree.
    stripped = tmp_path / "app_a.stripped"
    subprocess.run(["objcopy", "--strip-all", str(v1), str(stripped)], check=True)
    out = _run(["gdb", "-nx", "-batch", "-ex", f"set debug-file-directory {debug_dir}", "-ex", f"file {stripped}",
                "-ex", f"info address {SYMBOL}"])
    assert "is a function at address" in out, out

    # debuginfod-find against buildidd serve of the imported tree: the original bytes of both.
    serve = ServeProcess(debug_dir, tmp_path / "serve.log")
    try:
        for bid, original in ((old, v1.read_bytes()), (deleted, deleted_bytes)):
            cache = tempfile.mkdtemp(dir=tmp_path, prefix="client-cache-")
            path = _run(["debuginfod-find", "executable", bid],
                        env={"DEBUGINFOD_URLS": serve.url, "DEBUGINFOD_CACHE_PATH": cache}).strip()
            with open(path, "rb") as f:
                assert f.read() == original
    finally:
        serve.stop()

"""Snapshots of replaced and deleted binaries into the store; retention and quota with live sessions."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from buildidd.capture.housekeeping import Housekeeping, RetentionPolicy
from buildidd.sessionlog import SessionWriter
from buildidd.store import CopyJob, Snapshotter, Store

from conftest import gcc, need, readelf_build_id, session_records, upgrade_by_rename, wait_exec
from perfcompare import perf_record_lock

SPINNER = """
volatile int version = VERSION;
static volatile unsigned long sink;
static __attribute__((noinline)) void bidd_spin_target(void) { for (unsigned long i = 0; i < 1000000; i++) sink += i; }
int main(void) { for (;;) bidd_spin_target(); }
"""
SYMBOL = "bidd_spin_target"


def _perf(*args, cwd):
    env = {k: v for k, v in os.environ.items() if k != "DEBUGINFOD_URLS"}
    r = subprocess.run(["perf", *args], capture_output=True, text=True, env=env, cwd=cwd)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_replaced_and_deleted_binaries_are_in_the_store_under_old_build_ids(recorder, tmp_path):
    need(shutil.which("perf") is not None, "perf missing")
    v1 = gcc(SPINNER, tmp_path / "v1", "-DVERSION=1", "-Wl,--build-id=sha1")
    v2 = gcc(SPINNER, tmp_path / "v2", "-DVERSION=2", "-Wl,--build-id=sha1")
    old, new = readelf_build_id(v1), readelf_build_id(v2)
    assert old != new
    store_root = tmp_path / "store"
    rec = recorder(store_root=str(store_root), snapshot_rate_bytes_per_s=0)
    app_a, app_b = tmp_path / "bin" / "app_a", tmp_path / "bin" / "app_b"
    app_a.parent.mkdir()
    upgrade_by_rename(v1, app_a)
    upgrade_by_rename(v1, app_b)
    pa, pb = subprocess.Popen([str(app_a)]), subprocess.Popen([str(app_b)])
    try:
        wait_exec(pa, app_a)
        wait_exec(pb, app_b)
        # A profile of both, taken without perf's own cache (-N): symbolizing it
        # later needs the very binaries that ran.
        data = tmp_path / "perf.data"
        with perf_record_lock():
            _perf("record", "-N", "-q", "-e", "cpu-clock", "-o", str(data), "-p", f"{pa.pid},{pb.pid}",
                  "--", "sleep", "0.5", cwd=tmp_path)
        upgrade_by_rename(v2, app_a)          # a package upgrade renames the new build over the path
        os.unlink(app_b)             # ... or removes the file
        deadline = time.monotonic() + 20
        store = Store(store_root)
        while time.monotonic() < deadline and not store.contains(old):
            rec.step()
            time.sleep(0.05)
    finally:
        pa.kill()
        pb.kill()
        pa.wait()
        pb.wait()
    rec.close()
    assert store.contains(old)
    copy = store.path_of(old)
    assert copy.read_bytes() == v1.read_bytes()            # byte-identical to the original
    assert readelf_build_id(copy) == old
    assert not store.contains(new)                          # nothing mapped the new build
    assert rec.snapshotter.stats["urgent"] >= 1
    # perf, with the store as its build-id directory, symbolizes the profile of
    # both (the control: with an empty one it cannot, the files are gone or different).
    def report(buildid_dir):
        buildid_dir.mkdir(exist_ok=True)
        return _perf("--buildid-dir", str(buildid_dir), "report", "-i", str(data), "--stdio",
                     "--sort", "comm,dso,sym", cwd=tmp_path)
    assert SYMBOL not in report(tmp_path / "empty")
    with_store = report(store_root)
    for comm in ("app_a", "app_b"):
        assert any(comm in line and SYMBOL in line for line in with_store.splitlines()), with_store
    # The kernel's symbols were snapshotted at session start, as perf lays them out.
    head = session_records(rec.session_dir)[0]
    if head.get("kernel_build_id"):
        assert (store_root / "[kernel.kallsyms]" / head["kernel_build_id"] / "kallsyms").exists()


def _session(root, name, build_ids, age_s):
    d = root / name
    w = SessionWriter(d, compress=True)
    w.write({"type": "session", "kernel_build_id": None})
    for b in build_ids:
        w.write({"type": "mmap", "build_id": b, "path": "/x"})
    w.close()
    t = time.time() - age_s
    for f in [d, *d.iterdir()]:
        os.utime(f, (t, t))
    return d


def test_retention_and_quota_never_delete_what_a_retained_session_references(tmp_path):
    libs = []
    for i in range(4):
        lib = gcc(f"int f{i}(void) {{ return {i}; }}\n" + "static char pad[65536] = {1};\nchar *p(void){return pad;}\n",
                  tmp_path / f"lib{i}.so", "-shared", "-fPIC", "-Wl,--build-id=sha1")
        libs.append((lib, readelf_build_id(lib)))
    store = Store(tmp_path / "store")
    for lib, bid in libs:
        fd = os.open(lib, os.O_RDONLY)
        try:
            store.add_from_fd(fd, str(lib), bid)
        finally:
            os.close(fd)
    store.quota_bytes = 1                                 # always over quota (no copy would fit now)
    sessions = tmp_path / "sessions"
    sessions.mkdir()
    old = _session(sessions, "20200101T000000Z-1", [libs[0][1]], age_s=90 * 86400)   # expired
    kept = _session(sessions, "20260101T000000Z-2", [libs[1][1]], age_s=3600)
    current = sessions / "20261122T000000Z-3"
    current.mkdir()
    snap = Snapshotter(store, housekeeping=Housekeeping(store, RetentionPolicy(
        session_root=sessions, current_session=current, max_age_s=30 * 86400, max_total_bytes=None)))
    snap.submit(CopyJob(libs[2][1], str(libs[2][0]), None), None)     # referenced by the current session
    snap.housekeeping()
    assert not old.exists() and kept.exists() and current.exists()
    assert store.contains(libs[1][1])                     # a retained session references it
    assert store.contains(libs[2][1])                     # the current session references it
    assert not store.contains(libs[0][1])                 # only the expired session did
    assert not store.contains(libs[3][1])                 # nothing did
    assert store.over_quota                               # still over: protected entries stay


def test_a_sighting_of_a_build_id_stored_trusted_opens_no_file(recorder, public_tmp_factory, workloads):
    """A restart sees every running DSO again: a build-id the store holds from a trusted, public
    copy is only touched (SettledView.settled), the hand-over opens nothing; a new one is copied."""
    from buildidd.store.settledview import SettledView
    from conftest import store_add

    d = public_tmp_factory()
    # Trusted: root-owned, not writable by others, under a system directory (store/origin.py).
    with open("/proc/self/maps") as f:
        known = next(Path(line.split()[-1]) for line in f if "/libm.so" in line and line.split()[-1].startswith("/usr/"))
    new = d / "libnew.so"
    shutil.copy(workloads["lib7"], new)
    os.chmod(new, 0o755)
    store_root = d / "store"
    known_bid = store_add(Store(store_root), known)
    assert SettledView(Store(store_root)).settled(known_bid)
    new_bid = readelf_build_id(new)
    assert not SettledView(Store(store_root)).settled(new_bid)
    rec = recorder(store_root=str(store_root), snapshot_rate_bytes_per_s=0)
    for lib in (known, new):
        subprocess.run([str(workloads["mmap_storm"]), str(lib), "3"], check=True, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        rec.step()
        if (Store(store_root).contains(new_bid) and rec.handovers.status()["handovers_settled"] >= 1
                and rec.snapshotter.status()["already_present"] >= 1):    # queued behind the bulk
            break
        time.sleep(0.05)
    status = rec.status()["resolve"]
    assert status["handovers_settled"] == 1, status
    assert Store(store_root).contains(new_bid)
    assert rec.snapshotter.status()["stored"] >= 1 and rec.snapshotter.status()["already_present"] >= 1
    records = [r for r in session_records(rec.session_dir) if r["type"] == "mmap" and r["path"] in (str(known), str(new))]
    assert {r["build_id"] for r in records} == {known_bid, new_bid}

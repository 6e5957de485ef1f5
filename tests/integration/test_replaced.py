"""Binaries replaced (rename over) or deleted while, or after, a process mapped them."""

from __future__ import annotations

import json
import os
import subprocess
import time

from conftest import gcc, readelf_build_id, session_records, upgrade_by_rename, wait_exec

SLEEPER = "#include <unistd.h>\nvolatile int version = VERSION;\nint main(void) { for (;;) pause(); }\n"
QUICK = "volatile int version = VERSION;\nint main(void) { return version - VERSION; }\n"


def _build(tmp_path, name, src, version):
    out = gcc(src, tmp_path / f"{name}.v{version}", f"-DVERSION={version}", "-Wl,--build-id=sha1")
    return out, readelf_build_id(out)


#: Files are run this long after they were written: user space cannot prove that a file written within
#: a clock tick of its mapping was mapped with today's bytes (error changed_at_map, tests/resolve).
TICK_S = 0.05


def _start(path):
    return wait_exec(subprocess.Popen([str(path)]), path)


def _exec_maps(records, pid):
    return [r for r in records if r["type"] == "mmap" and r["pid"] == pid and r["origin"] in ("exec", "synthesized")
            and r["path"].endswith(("/app_a", "/app_b", "/app_c", "/app_d"))]


def test_replaced_and_deleted_while_running_keep_the_old_build_id(recorder, tmp_path):
    v1, old_bid = _build(tmp_path, "sleeper", SLEEPER, 1)
    v2, new_bid = _build(tmp_path, "sleeper", SLEEPER, 2)
    assert old_bid and new_bid and old_bid != new_bid
    app_a, app_b = tmp_path / "app_a", tmp_path / "app_b"
    upgrade_by_rename(v1, app_a)
    upgrade_by_rename(v1, app_b)
    # c and d run before the daemon starts: they are found by synthesis.
    app_c, app_d = tmp_path / "app_c", tmp_path / "app_d"
    upgrade_by_rename(v1, app_c)
    upgrade_by_rename(v1, app_d)
    time.sleep(TICK_S)
    pc, pd = _start(app_c), _start(app_d)
    upgrade_by_rename(v2, app_c)
    os.unlink(app_d)
    procs = [pc, pd]
    try:
        rec = recorder(kernel_build_id=False)     # the user-space fallback under test
        # a and b exec while recording; the daemon reads their events only after
        # the files were replaced and deleted.
        pa, pb = _start(app_a), _start(app_b)
        procs += [pa, pb]
        upgrade_by_rename(v2, app_a)
        os.unlink(app_b)
        for _ in range(5):
            rec.step()
            time.sleep(0.02)
        records = session_records(rec.session_dir)
        for p, origin in ((pa, "exec"), (pb, "exec"), (pc, "synthesized"), (pd, "synthesized")):
            maps = _exec_maps(records, p.pid)
            assert maps, (p.args, origin)
            for r in maps:
                assert r["origin"] == origin
                assert r["build_id"] == old_bid, (r["error"], r["build_id_source"], origin, json.dumps(r))
                assert r["build_id_source"] == "map_files", r
        assert all(r["deleted"] for r in _exec_maps(records, pd.pid))
        assert readelf_build_id(app_a) == new_bid  # the path now names the new build
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_gone_process_with_replaced_file_gets_a_reason_not_a_guess(recorder, tmp_path):
    v1, old_bid = _build(tmp_path, "quick", QUICK, 1)
    v2, new_bid = _build(tmp_path, "quick", QUICK, 2)
    replaced, deleted = tmp_path / "gone_replaced", tmp_path / "gone_deleted"
    upgrade_by_rename(v1, replaced)
    upgrade_by_rename(v1, deleted)
    time.sleep(TICK_S)
    rec = recorder(kernel_build_id=False)     # the user-space fallback under test
    subprocess.run([str(replaced)], check=True)
    subprocess.run([str(deleted)], check=True)
    upgrade_by_rename(v2, replaced)       # the processes are gone; the paths name other files now
    os.unlink(deleted)
    for _ in range(5):
        rec.step()
        time.sleep(0.02)
    records = session_records(rec.session_dir)
    by_path = {}
    for r in records:
        if r["type"] == "mmap" and r["origin"] == "exec" and r["path"] in (str(replaced), str(deleted)):
            by_path.setdefault(r["path"], []).append(r)
    assert set(by_path) == {str(replaced), str(deleted)}
    for r in by_path[str(replaced)]:
        assert r["build_id"] is None and r["error"] == "file_replaced", r
    for r in by_path[str(deleted)]:
        assert r["build_id"] is None and r["error"] == "file_vanished", r
    summary = rec.summary()
    assert summary["build_ids_missing"].get("file_replaced", 0) >= 1
    assert summary["build_ids_missing"].get("file_vanished", 0) >= 1

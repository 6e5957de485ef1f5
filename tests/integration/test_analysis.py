"""resolve, buildid-list and export --perf on a session recorded by the real daemon (root + BPF)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import gcc, need, readelf_build_id, session_records, upgrade_by_rename

from buildidd.offline.replay import Replay
from buildidd.store import Store

BUILDIDD = [sys.executable, "-m", "buildidd.cli"]
APP_SRC = r"""
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>
__attribute__((noinline)) int buildidd_target_fn(int x) { return x * VERSION + 1; }
int main(int argc, char **argv) {
    printf("%d %p %p\n", getpid(), (void *)buildidd_target_fn, (void *)getppid);
    fflush(stdout);
    pid_t c = fork();
    if (c == 0) {
        printf("%d\n", getpid());
        fflush(stdout);
        usleep(20000);
        if (argc > 1) execl(argv[1], argv[1], (char *)NULL);
        _exit(0);
    }
    waitpid(c, NULL, 0);
    return buildidd_target_fn(argc) > 0 ? 0 : 1;
}
"""


def _run(app: Path, *args: str) -> tuple[int, int, int, int]:
    """Run app; its pid, the address of buildidd_target_fn and of libc's getppid, the child's pid."""
    out = subprocess.run([str(app), *args], check=True, capture_output=True, text=True).stdout.split()
    return int(out[0]), int(out[1], 16), int(out[2], 16), int(out[3])


def _step_until(rec, pred, timeout=20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rec.step()
        if pred():
            return True
        time.sleep(0.05)
    return False


def _cli(*args: str, stdin: str | None = None, ok: bool = True) -> str:
    r = subprocess.run([*BUILDIDD, *args], input=stdin, capture_output=True, text=True, timeout=120)
    if ok:
        assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    d = tmp_path_factory.mktemp("apps")
    v1 = gcc(APP_SRC, d / "app.v1", "-DVERSION=1", "-Wl,--build-id=sha1")
    v2 = gcc(APP_SRC, d / "app.v2", "-DVERSION=2", "-Wl,--build-id=sha1")
    assert readelf_build_id(v1) != readelf_build_id(v2)
    return v1, v2


@pytest.fixture
def recorded(recorder, tmp_path, builds):
    """app v1 runs (its child exits), is replaced by v2 at the same path, v2 runs (its child execs
    /bin/true); the store snapshots both."""
    v1, v2 = builds
    bid1, bid2 = readelf_build_id(v1), readelf_build_id(v2)
    store_root = tmp_path / "store"
    rec = recorder(store_root=str(store_root), snapshot_rate_bytes_per_s=0)
    store = Store(store_root)
    app = tmp_path / "bin" / "app"
    app.parent.mkdir()
    upgrade_by_rename(v1, app)
    run1 = _run(app)
    assert _step_until(rec, lambda: store.contains(bid1)), "v1 was not snapshotted"
    upgrade_by_rename(v2, app)
    run2 = _run(app, "/bin/true")
    assert _step_until(rec, lambda: store.contains(bid2)), "v2 was not snapshotted"
    rec.close()
    return {"session": rec.session_dir, "store": store_root, "app": str(app), "bid1": bid1, "bid2": bid2,
            "run1": run1, "run2": run2, "records": session_records(rec.session_dir)}


def test_resolve_across_fork_exec_and_a_replaced_binary(recorded):
    r = recorded
    (pid1, fn1, libc1, child1), (pid2, fn2, _libc2, child2) = r["run1"], r["run2"]
    replay = Replay.load(r["session"])
    a = replay.resolve(pid1, fn1 + 1)
    assert (a.mapping.dso.path, a.mapping.dso.build_id) == (r["app"], r["bid1"]) and a.exited_ns is not None
    a = replay.resolve(pid2, fn2 + 1)
    assert (a.mapping.dso.path, a.mapping.dso.build_id) == (r["app"], r["bid2"])
    # The child of run 1 never mapped anything: its maps are its parent's, at the fork.
    a = replay.resolve(child1, fn1)
    assert a.mapping.dso.build_id == r["bid1"] and a.via == (child1,) and a.mapping.pid == pid1
    a = replay.resolve(child1, libc1)
    assert "libc" in a.mapping.dso.path and a.mapping.dso.build_id == readelf_build_id(a.mapping.dso.path)
    # The child of run 2 exec'd /bin/true: before that it had app v2, after it a new address space.
    exec_ns = next(x["time_ns"] for x in r["records"] if x["type"] == "exec" and x["pid"] == child2)
    assert replay.resolve(child2, fn2, exec_ns - 1).mapping.dso.build_id == r["bid2"]
    after = replay.resolve(child2, fn2)
    assert after.mapping is None or after.mapping.dso.path != r["app"]
    assert replay.resolve(pid1, 0x1000).reason == "not_mapped"


def test_resolve_cli_symbolizes_from_the_store_and_reads_stdin(recorded):
    r = recorded
    (pid1, fn1, _l, child1), (pid2, fn2, _l2, _c2) = r["run1"], r["run2"]
    roots = ["--store-root", str(r["store"])]
    out = _cli("resolve", str(r["session"]), str(pid2), f"{fn2 + 4:x}", "--symbolize", *roots)
    assert re.search(rf"{r['app']} {r['bid2']} \+0x[0-9a-f]+ buildidd_target_fn\+0x4 ", out), out
    assert str(Store(r["store"]).path_of(r["bid2"])) in out
    lines = f"{pid1} {fn1:#x}\n{child1} {fn1:x}\n{pid1} 0x1000\n"
    import json
    answers = [json.loads(x) for x in _cli("resolve", str(r["session"]), "--symbolize", "--json", *roots,
                                          stdin=lines).splitlines()]
    assert [a.get("build_id") for a in answers] == [r["bid1"], r["bid1"], None]
    assert answers[0]["symbol"]["name"] == answers[1]["symbol"]["name"] == "buildidd_target_fn"
    assert answers[1]["via"] == [child1] and answers[2]["reason"] == "not_mapped"


def test_buildid_list_and_export_perf_agree_with_the_session(recorded, tmp_path):
    need(shutil.which("perf") is not None, "perf missing")
    r = recorded
    maps = [x for x in r["records"] if x["type"] == "mmap"]
    want = {(x["build_id"], x["path"]) for x in maps if x["build_id"] and len(x["build_id"]) <= 40}
    kernel = r["records"][0].get("kernel_build_id")
    if kernel:
        want.add((kernel, "[kernel.kallsyms]"))
    listed = {tuple(line.split(None, 1)) for line in _cli("buildid-list", str(r["session"])).splitlines()}
    assert {(r["bid1"], r["app"]), (r["bid2"], r["app"])} <= listed
    assert listed == want | {(x["build_id"], x["path"]) for x in maps if x["build_id"]}
    mine = {tuple(line.split(None, 1)) for line in
            _cli("buildid-list", str(r["session"]), "--pid", str(r["run1"][0])).splitlines()}
    assert (r["bid1"], r["app"]) in mine and (r["bid2"], r["app"]) not in mine

    data = tmp_path / "out.data"
    _cli("export", "--perf", str(r["session"]), "-o", str(data))
    perf_list = subprocess.run(["perf", "buildid-list", "-i", str(data)], capture_output=True, text=True,
                               check=True).stdout
    assert {tuple(line.split(None, 1)) for line in perf_list.splitlines()} == want
    script = subprocess.run(["perf", "script", "-i", str(data), "--show-mmap-events"], capture_output=True,
                            text=True, check=True).stdout
    pid2 = r["run2"][0]
    for x in maps:
        if x["pid"] == pid2 and x["path"] == r["app"]:
            line = (f"PERF_RECORD_MMAP2 {pid2}/{x['tid']}: [{x['start']:#x}({x['len']:#x}) @ "
                    f"{x['pgoff']:#x} <{x['build_id']}>]: r-xp {r['app']}")
            assert line in script, line

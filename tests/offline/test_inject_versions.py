"""inject names the versions of one path apart, read back by the real perf without a daemon: a per-process
``perf record`` of a program upgraded by rename while it ran (its function at the same address in both
versions), beside a file someone named like one of the versions (``prog@<v1's prefix>``); the session is
written from the profile's own MMAP2 records with the build-id of the file each process ran."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import gcc, need, readelf_build_id
from perfcompare import perf_record_lock
from offline.test_replay import mmap, write_session

BUILDIDD = [sys.executable, "-m", "buildidd.cli"]
SPIN = r"""
#include <stdlib.h>
#include <time.h>
static volatile unsigned long sink;
__attribute__((noinline)) void FN(void) { for (unsigned long i = 0; i < 200000; i++) sink += i; }
int main(int argc, char **argv) {
    struct timespec a, b;
    double s = argc > 1 ? atof(argv[1]) : 0.4;
    clock_gettime(CLOCK_MONOTONIC, &a);
    do { FN(); clock_gettime(CLOCK_MONOTONIC, &b); } while (b.tv_sec - a.tv_sec + (b.tv_nsec - a.tv_nsec) / 1e9 < s);
    return 0;
}
"""
MMAP2 = re.compile(r"PERF_RECORD_MMAP2 (\d+)/\d+: \[(0x[0-9a-f]+)\((0x[0-9a-f]+)\) @ (0x[0-9a-f]+|0) .*?\]: "
                   r"r-xp (\S+)$")


def _run(cmd) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{cmd}: {r.stderr[-2000:]}"
    return r


@pytest.fixture(scope="module")
def upgraded(tmp_path_factory):
    """The profile, its session, the build-ids, and a build-id cache holding all three binaries."""
    need(shutil.which("perf") is not None, "perf missing")
    d = tmp_path_factory.mktemp("inject-versions")
    old, new = gcc(SPIN, d / "old", "-DFN=work_old", "-g"), gcc(SPIN, d / "new", "-DFN=work_new", "-g")
    bids = {"old": readelf_build_id(old), "new": readelf_build_id(new)}
    prog = d / "prog"
    squatter = d / f"prog@{bids['old'][:8]}"          # a file named like old's version
    bids["squatter"] = readelf_build_id(gcc(SPIN, squatter, "-DFN=squat_it", "-g"))
    shutil.copyfile(old, prog)
    prog.chmod(0o755)
    data = d / "perf.data"
    script = f"{prog} & sleep 0.1; cp {new} {prog}.new; mv {prog}.new {prog}; {prog} & {squatter}; wait"
    with perf_record_lock():
        _run(["perf", "record", "-q", "-N", "--no-buildid", "-e", "cpu-clock", "-o", str(data), "--", "sh", "-c",
              script])
    # The session: each of the three programs' mappings with the build-id of the file that process ran.
    shown = _run(["perf", "script", "-i", str(data), "--show-mmap-events"]).stdout
    recs, seen = [], []
    for m in filter(None, map(MMAP2.search, shown.splitlines())):
        pid, start, length, pgoff, path = int(m[1]), int(m[2], 16), int(m[3], 16), int(m[4], 16), m[5]
        if path == str(prog):
            seen.append(pid)
            bid = bids["old" if len(seen) == 1 else "new"]
        elif path == str(squatter):
            bid = bids["squatter"]
        else:
            continue
        r = mmap(1, pid, start, length, path, bid, pgoff=pgoff)
        r.update(dev=None, ino=None, ino_generation=None)
        recs.append(r)
    assert len(seen) == 2 and len(recs) == 3, shown[-3000:]
    cache = d / "cache"
    for b in (old, new, squatter):
        _run(["perf", "--buildid-dir", str(cache), "buildid-cache", "-a", str(b)])
    return {"dir": d, "data": data, "session": write_session(d / "session", recs), "bids": bids, "prog": str(prog),
            "cache": str(cache), "squatter": str(squatter)}


def test_versions_named_apart_and_perf_reads_them(upgraded):
    u = upgraded
    out = u["dir"] / "injected.data"
    err = _run([*BUILDIDD, "inject", str(u["data"]), str(u["session"]), "-o", str(out)]).stderr
    old_name = f"{u['prog']}@{u['bids']['old'][:9]}"          # 8 digits are taken by the squatter
    new_name = f"{u['prog']}@{u['bids']['new'][:8]}"
    assert "1 paths held several build-ids: 2 versions named PATH@BIDPREFIX" in err, err
    assert f"{old_name}  {u['bids']['old']}" in err and f"{new_name}  {u['bids']['new']}" in err, err
    listed = set(_run(["perf", "buildid-list", "-i", str(out)]).stdout.splitlines())
    assert {f"{u['bids']['old']} {old_name}", f"{u['bids']['new']} {new_name}",
            f"{u['bids']['squatter']} {u['squatter']}"} <= listed, listed
    report = _run(["perf", "--buildid-dir", u["cache"], "report", "-i", str(out), "--stdio"]).stdout
    rows = {(m[1], m[2]): float(m[0]) for m in re.findall(r"^\s+([\d.]+)%\s+\S+\s+(\S+)\s+\[\.\]\s+(\S+)", report, re.M)}
    print("perf report, default view:", sorted(rows.items(), key=lambda kv: -kv[1])[:5])
    for name, fn in ((old_name, "work_old"), (new_name, "work_new"), (u["squatter"], "squat_it")):
        assert rows.get((Path(name).name, fn), 0) >= 10, (name, fn, report[:2000])
    # perf alone: one DSO 'prog', the old version's samples under the new version's symbol.
    alone = _run(["perf", "--buildid-dir", u["cache"], "report", "-i", str(u["data"]), "--stdio"]).stdout
    assert not re.search(r"\bwork_old\b", alone), alone[:2000]

"""Completeness against the kernel's own MMAP2 build-ids (perf record --buildid-mmap)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import perfcompare
from perfcompare import PerfRecorder, compare

from conftest import Background, need, session_records

WORKLOAD_COMMS = {"bidd_child", "bidd_storm", "bidd_dlopen", "bidd_mmap"}


def workload_pids(records, bin_dir) -> set[int]:
    """The pids that exec'd a program of bin_dir (this test session's build of the workloads)."""
    prefix = f"{bin_dir}{os.sep}"
    return {r["pid"] for r in records if r["type"] == "exec" and r["path"].startswith(prefix)}


def test_every_mapping_perf_saw_with_a_build_id_has_the_same_build_id(recorder, workloads, tmp_path):
    need(shutil.which("perf") is not None, "perf (linux-perf) not installed")
    perf = PerfRecorder(tmp_path / "perf.data")
    rec = recorder()
    bg = Background(rec)
    try:
        w = workloads
        subprocess.run([str(w["storm"]), "300", str(w["child"])], check=True)
        libs = [str(w[f"lib{i}"]) for i in range(8)]
        subprocess.run([str(w["dlopen_storm"]), "3", *libs], check=True)
        subprocess.run([str(w["mmap_storm"]), libs[0], "200"], check=True, stdout=subprocess.DEVNULL)
        subprocess.run([str(w["mmap_storm"]), libs[1], "200"], check=True, stdout=subprocess.DEVNULL,
                       env={**os.environ, "MPROTECT": "1"})
        time.sleep(0.3)
    finally:
        perf_maps = perf.stop()
        bg.stop()
    rec.close()
    records = session_records(rec.session_dir)
    # Only this test's processes: the bench (or another test) may run the same workloads meanwhile.
    ours = workload_pids(records, workloads["child"].parent)
    c = compare(perf_maps, records, comms=WORKLOAD_COMMS, pids=ours)
    print("perf comparison:", c.as_dict())
    # The storm alone: 300 children x (exe, ld.so, libc) exec mappings.
    assert c.perf_with_build_id + c.perf_without_build_id >= 300 * 3 + 8 * 3 + 400
    # Place by place: same pid, start, len, pgoff, path and build-id; perf's own misses apart.
    assert c.wrong == 0, c.examples
    assert c.path_differs == 0, c.examples
    assert c.extent_differs == 0, c.examples
    assert c.missing == 0, c.examples
    assert c.no_build_id == 0, c.examples
    assert c.matched == c.perf_with_build_id and c.match_rate == 1.0
    print(f"build-ids we have that perf does not: {c.resolved_where_perf_had_none} "
          f"of perf's {c.perf_without_build_id} records without one")
    assert c.resolved_where_perf_had_none == c.perf_without_build_id
    lost = [r for r in records if r["type"] == "lost"]
    assert not lost, lost
    # The build-id is read by the kernel at the mapping, not by user space afterwards.
    with_bid = [r for r in records if r["type"] == "mmap" and r.get("origin") != "synthesized" and r["build_id"]
                and r["pid"] in ours]
    from_kernel = sum(r["build_id_source"] == "kernel" for r in with_bid)
    share = from_kernel / len(with_bid)
    print(f"build-ids read by the kernel: {from_kernel} of {len(with_bid)} mapping records ({share:.1%})")
    assert share >= 0.9
    # Every child of the storm: its exec record, its executable and its interpreter.
    kids = {r["pid"] for r in records if r["type"] == "exec" and r["filename"] == str(workloads["child"])
            and r["pid"] in ours}
    assert len(kids) == 300
    by_pid = {}
    for r in records:
        if r["type"] == "mmap" and r["pid"] in kids:
            by_pid.setdefault(r["pid"], set()).add(r["origin"])
    assert all({"exec", "interp", "mmap"} <= by_pid.get(pid, set()) for pid in kids)


def test_perf_records_take_turns_on_the_host_and_why(tmp_path):
    """perf_record_lock: while a PerfRecorder (--buildid-mmap) runs, another holder waits; and the reason, shown
    on this kernel: a per-process perf record beside it (without the lock) gets MMAP2 records flagged as
    carrying a build-id over their maj/min/ino (inject.flag_without_build_id), which perf 6.1 cannot read.
    If the second half fails, the kernel restores the flag (kernel/events/core.c perf_event_mmap_output)
    and the lock is no longer needed."""
    from buildidd.offline.inject import flag_without_build_id
    from buildidd.offline.perfabi import PERF_RECORD_MMAP2
    from buildidd.offline.perffile import PerfFile

    need(shutil.which("perf") is not None, "perf (linux-perf) not installed")
    try_lock = [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import perfcompare\n"
                "with perfcompare.perf_record_lock(timeout_s=float(sys.argv[2])): print('held')",
                str(Path(perfcompare.__file__).parent)]
    perf = PerfRecorder(tmp_path / "yardstick.data")
    try:
        r = subprocess.run([*try_lock, "0.5"], capture_output=True, text=True, timeout=30)
        assert r.returncode != 0 and "TimeoutError" in r.stderr, (r.stdout, r.stderr)
        plain = tmp_path / "plain.data"
        subprocess.run(["perf", "record", "-q", "-N", "-B", "-e", "cpu-clock", "-o", str(plain), "--", "true"],
                       check=True, capture_output=True, timeout=60)
    finally:
        assert perfcompare.finish_all() == 1          # what a failed test's teardown does (conftest)
    assert perf.proc.returncode is not None
    r = subprocess.run([*try_lock, "10"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout == "held\n", r.stderr
    with open(plain, "rb") as f:
        pf = PerfFile.open(plain, f)
        mmap2 = [(misc, bytes(rec)) for _, rtype, misc, rec in pf.records(f) if rtype == PERF_RECORD_MMAP2]
    flagged = [m for m in mmap2 if flag_without_build_id(PERF_RECORD_MMAP2, m[0], memoryview(m[1]))]
    print(f"\nper-process perf beside --buildid-mmap: {len(flagged)} of {len(mmap2)} MMAP2 records flagged "
          "over dev/inode")
    assert mmap2 and flagged

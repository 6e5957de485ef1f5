"""Issue 44's recording goal at small scale (scripts/bench_fleet.py at full scale), against a real ``weed mini``;
the other goals are asserted by the fleet scenario's smoke case (tests/integration/test_bench_scenarios.py).

Three ``buildidd run`` daemons on this machine, each with its own store, sessions and push service
(``buildidd push --service``) under its own host name, see the same programs (a 20 MiB one among
them); the bucket is stopped for 20 s while programs run and segments close; then the last host
disappears and its session's binaries are fetched from the bucket with debuginfod-find and gdb, its
session pulled, injected and resolved elsewhere.  The hosts start from one image: a store of the
machine's running binaries, snapshotted and pushed once before (bench_fleet.seed_store), so what
is measured is what the hosts add.  The figures are printed (pytest -s shows them).
"""

from __future__ import annotations

import os

import pytest

import bench_fleet
from conftest import need


@pytest.fixture
def bench_bucket(weed):
    bench_fleet.s3(weed.endpoint).create_bucket(Bucket=bench_fleet.BUCKET)
    return weed


def test_recording_is_unaffected_by_push_reachable_slow_or_down(bench_bucket, tmp_path):
    need(os.geteuid() == 0, "buildidd run needs root")
    rec = bench_fleet.recording(bench_bucket, tmp_path, reps=1, exec_n=300)
    print("\n".join(bench_fleet.fmt({"recording": rec})))
    for mode in ("reachable", "slow", "down"):
        assert rec[mode]["losses"] == 0, (mode, rec)
        assert rec[mode]["wall_ratio"] < 2.0, (mode, rec)

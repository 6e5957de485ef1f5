"""Issue 44's recording goal at small scale (scripts/bench_fleet.py at full scale), against a real ``weed mini``;
the other goals are asserted by the fleet scenario's smoke case (tests/integration/test_bench_scenarios.py).

An exec storm under one ``buildidd run`` daemon on a warm store, in four modes (bench_fleet.recording):
no push; a ``buildidd push --service`` uploading the whole store to a new prefix during the storm, the
bucket reachable; the same through a slow proxy; the bucket down.  Nothing is lost in any mode and the
storm's time stays within twice its time without push: a bound on a hang or a stall, not the paired
ratio (that is the bench's, on a quiet host).  The figures are printed (pytest -s shows them).
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

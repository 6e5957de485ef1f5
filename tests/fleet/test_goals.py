"""Issue 44's goals at small scale (scripts/bench_fleet.py at full scale), against a real ``weed mini``.

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
import time

import pytest

import bench_fleet
from conftest import need


@pytest.fixture
def bench_bucket(weed):
    bench_fleet.s3(weed.endpoint).create_bucket(Bucket=bench_fleet.BUCKET)
    return weed


def test_fleet_goals_three_hosts_an_outage_and_a_host_gone(bench_bucket, tmp_path):
    need(os.geteuid() == 0, "buildidd run needs root")
    t0 = time.monotonic()
    res = bench_fleet.fleet(bench_bucket, tmp_path / "fleet", n_hosts=3, n_progs=4, big_mb=20, outage_s=20,
                            retry_max_s=4.0)
    took_s = time.monotonic() - t0
    print("\n".join(bench_fleet.fmt(res)))
    lat, out, gone, dd = res["latency"], res["outage"], res["gone"], res["dedup"]
    assert lat["in_bucket"] == lat["programs"] == 5
    assert lat["p99_s"] <= 10.0, lat
    # the outage: nothing lost, the backlog drained (backoff at most 4 s here)
    assert out["programs"] >= 5 and out["segments"] >= 3, out
    assert out["drain_s"] is not None and out["drain_s"] <= 60, out
    assert not out["programs_missing"] and not out["segments_lost"], out
    assert any((b.get("entries") or b.get("segments")) for b in out["backlog_at_end"].values()), out
    # the gone host: every build-id its session names, from the bucket, but the private and untrusted ones
    # and those its store never held (the manifest names them, reason not_in_store: counted apart)
    assert gone["excluded_private_untrusted"] >= 2, gone
    assert gone["fetched"] == gone["wanted"] and gone["fetched"] >= 5 and not gone["not_fetched"], gone
    assert gone["gdb_ok"] and gone["pull_rc"] == 0 and gone["resolve_ok"], gone
    assert isinstance(gone["inject_matched"], int) and gone["inject_matched"] >= 1, gone
    # each binary about once over three hosts, on the wire (requests, lost races and segments included)
    assert dd["steady"]["wire_bytes"] / dd["steady"]["unique_bytes"] <= 1.05, dd
    assert dd["wire_bytes"] / dd["unique_bytes"] <= 1.05, dd
    print(f"  the whole run: {took_s:.0f} s")         # its phases are bounded by their own waits


def test_recording_is_unaffected_by_push_reachable_slow_or_down(bench_bucket, tmp_path):
    need(os.geteuid() == 0, "buildidd run needs root")
    rec = bench_fleet.recording(bench_bucket, tmp_path, reps=1, exec_n=300)
    print("\n".join(bench_fleet.fmt({"recording": rec})))
    for mode in ("reachable", "slow", "down"):
        assert rec[mode]["losses"] == 0, (mode, rec)
        assert rec[mode]["wall_ratio"] < 2.0, (mode, rec)

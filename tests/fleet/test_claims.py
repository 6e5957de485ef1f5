"""Claims (fleet.claims) against a real S3 server: hosts that push the same large binary at the same moment
send its bytes once; a host that finds another's live claim leaves the entry queued and finds the object
on its next pass; a stale claim, or one this host left, is taken over."""

from __future__ import annotations

import json
import threading
import time

from fleet.test_push import PREFIX, keys, s3, sysdir  # noqa: F401  (sysdir: a fixture)
from fleet.world import Host, build


def _big_hosts(tmp_path, weed, sysdir, n: int):
    """n hosts whose stores hold the same trusted 6 MiB binary (5 MiB parts: a multipart upload)."""
    big = build(sysdir, "claimed", "-s", pad_bytes=6 << 20)
    hosts = [Host(tmp_path / f"h{i}", f"host-{i}", weed.endpoint) for i in range(n)]
    bids = {h.add("claimed", big) for h in hosts}
    (bid,) = bids
    return hosts, big, bid


def _claim(weed, bid: str, host: str, age_s: float) -> None:
    s3(weed).put_object(Bucket="fleet-test", Key=f"{PREFIX}/claims/{bid}", Body=b"{}",
                        Metadata={"host": host, "claimed-ns": str(time.time_ns() - int(age_s * 1e9))})


def test_three_hosts_at_once_send_a_large_binary_once(tmp_path, weed, sysdir):
    hosts, big, bid = _big_hosts(tmp_path, weed, sysdir, 3)
    pushers = [h.pusher() for h in hosts]
    barrier, reports = threading.Barrier(3), {}

    def one(p):
        barrier.wait()
        reports[p.keys.host] = p.run_pass()

    threads = [threading.Thread(target=one, args=(p,)) for p in pushers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    size = big.stat().st_size
    sent = sum(p.bucket.sent_bytes for p in pushers)
    outcomes = [r.counts for r in reports.values()]
    assert sum(c["uploaded"] for c in outcomes) == 1, outcomes
    # once on the wire, plus the claims' small bodies; a host that lost the race holds it queued or found it
    assert size <= sent <= size + 4096, (sent, size, outcomes)
    assert all(c["uploaded"] + c["present"] + c["claimed_elsewhere"] == 1 for c in outcomes), outcomes
    held = keys(weed, PREFIX + "/")
    assert held[f"{PREFIX}/buildid/{bid}/executable"] == size, held
    assert not [k for k in held if "/claims/" in k], held          # the winner released its claim
    for p in pushers:                                                # the losers find it on their next pass
        r = p.run_pass()
        assert not r.failed and not any(r.backlog.values()), (p.keys.host, r.counts, r.backlog)
    assert sum(p.bucket.sent_bytes for p in pushers) <= size + 4096 + 3 * 8192   # manifests not in it: no session


def test_a_live_claim_defers_a_stale_one_is_taken_over(tmp_path, weed, sysdir):
    (h,), big, bid = _big_hosts(tmp_path, weed, sysdir, 1)
    exe = f"{PREFIX}/buildid/{bid}/executable"
    _claim(weed, bid, "host-other", age_s=5)
    p = h.pusher()
    r = p.run_pass()
    assert r.counts["claimed_elsewhere"] == 1 and r.counts["uploaded"] == 0, r.counts
    assert r.backlog["entries"] == 1 and p.bucket.sent_bytes < 4096, (r.backlog, p.bucket.sent_bytes)
    assert exe not in keys(weed, PREFIX + "/")
    assert json.loads(json.dumps(p.status()))["backlog"]["entries"] == 1
    # quick passes look at it again (the entry is in the pass's retry set)
    r = p.run_pass(full=False)
    assert r.counts["claimed_elsewhere"] == 1, r.counts
    # the claimer died: once its claim is older than the lease it is taken over
    _claim(weed, bid, "host-other", age_s=h.cfg.push_claim_lease_s + 60)
    r = p.run_pass(full=False)
    assert r.counts["uploaded"] == 1 and not any(r.backlog.values()), (r.counts, r.backlog)
    assert s3(weed).head_object(Bucket="fleet-test", Key=exe)["ContentLength"] == big.stat().st_size
    assert f"{PREFIX}/claims/{bid}" not in keys(weed, PREFIX + "/")


def test_this_hosts_own_claim_is_taken_over_at_once(tmp_path, weed, sysdir):
    (h,), _big, bid = _big_hosts(tmp_path, weed, sysdir, 1)
    _claim(weed, bid, h.name, age_s=1)            # left by a pass of this host that failed mid-upload
    r = h.pusher().run_pass()
    assert r.counts["uploaded"] == 1 and r.counts["claimed_elsewhere"] == 0, r.counts

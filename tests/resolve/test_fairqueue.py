"""Queues shared by users: budgets per uid with a reserve, round robin across uids, bounded counts;
and a fair WorkerPool (the hand-over pools) with real threads."""

from __future__ import annotations

import threading

import pytest

from buildidd.resolve.fairqueue import (GENERAL, OTHER_UIDS, QUEUE_FULL, RESERVE, UID_BUDGET, Budget, FairQueue,
                                        UidCounts)
from buildidd.resolve.workers import PoolPolicy, WorkerPool


def test_a_uid_holds_its_share_of_each_part_and_root_none():
    b = Budget(100, 0.2, 0.25)                     # general 80 (20 per uid), reserve 20 (5 per uid)
    assert b.caps == (80, 20) and b.uid_caps == (20, 5)
    assert [b.take(1000, False) for _ in range(21)][-2:] == [GENERAL, UID_BUDGET]
    assert [b.take(1000, True) for _ in range(6)] == [RESERVE] * 5 + [UID_BUDGET]
    assert b.held(1000) == 25 and b.top(1) == {"1000": 25}
    assert all(b.take(0, False) == GENERAL for _ in range(60))          # root: no share, only the total
    assert b.take(0, False) == QUEUE_FULL and b.take(1001, False) == QUEUE_FULL
    assert b.take(1001, True) == RESERVE                               # an urgent job of another uid: the reserve
    b.release(1000, GENERAL)
    assert b.take(1001, False) == GENERAL and b.used == [80, 6] and b.total == 86
    for _ in range(5):
        b.release(1000, RESERVE)
    with pytest.raises(ValueError):
        b.release(1000, RESERVE)
    with pytest.raises(ValueError):
        Budget(10, 1.0, 0.5)


def test_one_uids_backlog_delays_anothers_job_by_one_job_whatever_its_level():
    q: FairQueue[str] = FairQueue(levels=3)
    for i in range(1000):
        q.push(1000, 0, f"flood{i}")               # the flood's jobs at the most urgent level
    q.push(0, 2, "root-bulk")                      # root's at the least urgent
    q.push(1001, 1, "bystander-live")
    q.push(0, 0, "root-urgent")
    order = [q.pop()[1] for _ in range(6)]
    # Each uid's own by level first; uids in turn.
    assert order == ["flood0", "root-urgent", "bystander-live", "flood1", "root-bulk", "flood2"]
    assert len(q) == 997 and q.uids() == 1
    assert [item for _, item in q.drain()][:2] == ["flood3", "flood4"] and q.pop() is None


def test_uid_counts_name_a_bounded_number_of_uids():
    c = UidCounts(max_uids=3)
    for uid in range(10):
        c.add(uid, uid + 1)
    assert len(c.counts) == 3 and c.total == sum(range(1, 11)) and c.get(9) == 0
    assert c.top(2) == {"2": 3, "1": 2, OTHER_UIDS: c.total - 5}


def test_a_fair_pool_serves_another_uids_job_next_and_refuses_the_flood_beyond_its_share():
    """One worker busy, uid 1000 queues 30 jobs (20 fit its share of 40), then root one: root's runs
    right after the flood's first, and only uid 1000's jobs are refused, counted under its uid."""
    pool = WorkerPool(PoolPolicy(workers=1, max_threads=1, queue_max=40, uid_share=0.5), name="buildidd-test-fair")
    gate, ran = threading.Event(), []
    try:
        assert not isinstance(pool.submit_charged(lambda _: gate.wait(10), None, 1000), str)
        while pool.status()["idle"]:                 # the worker holds the first job
            threading.Event().wait(0.01)
        got = [pool.submit_charged(ran.append, f"flood{i}", 1000) for i in range(30)]
        assert got.count(UID_BUDGET) == 10
        root = pool.submit_charged(ran.append, "root", 0)
        st = pool.status()
        assert st["queued_by_uid"] == {"1000": 20, "0": 1} and st["refused_by_uid"] == {"1000": 10}
        gate.set()
        assert pool.wait(root, 10) and pool.drain(10)
        assert ran[:2] == ["flood0", "root"] and len(ran) == 21
    finally:
        gate.set()
        pool.close()
    plain = WorkerPool(PoolPolicy(workers=1), name="buildidd-test-plain")
    try:
        with pytest.raises(ValueError):
            plain.submit_charged(print, None, 0)
    finally:
        plain.close()

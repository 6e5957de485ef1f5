"""The coverage ledger is bounded in bytes and charged per uid: one uid's flood costs only its own entries.

Memory is measured with tracemalloc (what the ledger's objects hold, not an
estimate); the report's order and bounds are checked on the JSON it makes.
"""

from __future__ import annotations

import json
import os
import tracemalloc

from buildidd.store.coverage import (EARLY_MAX, HELD, OTHER_UIDS, PATH_MAX_CHARS, UID_BUCKETS_MAX, Coverage)
from buildidd.store.gapreport import MISSING_LISTED_BYTES

X, Y = 1000, 1001                                   # the flooding user, another user
DEEP = "/tmp/" + "/".join(["d" * 250] * 15)        # a directory ~3,760 characters deep


def _bid() -> str:
    return os.urandom(20).hex()


def _gap(cov: Coverage, path: str, uid: int, reason: str = "process_gone") -> str:
    bid = _bid()
    cov.named(bid, path, uid)
    cov.outcome(bid, reason, path)
    return bid


def _never(_bid: str) -> bool:
    return False


def test_a_flood_of_fresh_build_ids_from_a_deep_path_stays_in_its_uids_share():
    """200,000 fresh build-ids with 3,700-character paths from uid X: the ledger stays within its budget
    (estimated and measured), stops growing once X's share is spent, and root's and uid Y's gaps, named
    before and after the flood, are all named and listed before X's."""
    assert len(DEEP) >= 3700
    budget = 8 << 20
    cov = Coverage(max_bytes=budget, uid_share=0.25)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        early = [_gap(cov, f"/usr/bin/root-{i}", 0) for i in range(10)] + \
                [_gap(cov, f"/home/y/prog-{i}", Y) for i in range(10)]
        at_50k = 0
        for i in range(200_000):
            bid = _bid()
            path = f"{DEEP}/f{i}"
            cov.named(bid, path, X)
            cov.outcome(bid, "unreachable", path)      # the snapshotter's outcome: no uid
            if i == 50_000:
                at_50k = tracemalloc.get_traced_memory()[0]
        late = [_gap(cov, f"/usr/sbin/root-late-{i}", 0, "queue_full") for i in range(10)] + \
               [_gap(cov, f"/home/y/late-{i}", Y, "queue_full") for i in range(10)]
        grown = tracemalloc.get_traced_memory()[0] - before
        after_50k = tracemalloc.get_traced_memory()[0] - at_50k
    finally:
        tracemalloc.stop()
    print(f"\nledger: {cov.bytes} bytes estimated, {grown} measured (tracemalloc), budget {budget}; "
          f"{cov.untracked} untracked; growth after the first 50,000: {after_50k} bytes")
    assert cov.bytes <= budget
    assert grown <= budget and grown <= cov.bytes * 1.25, (grown, cov.bytes)
    assert after_50k < 256 << 10                  # X's share was spent: the flood costs nothing more
    led = cov.ledger()
    x = next(u for u in led["top_uids"] if u["uid"] == X)
    assert x["bytes"] <= cov.uid_share_bytes and x["untracked"] > 190_000
    assert x["untracked"] + x["entries"] == 200_000          # each refused build-id counted once
    for bid in early + late:
        assert cov.state(bid) in ("process_gone", "queue_full"), bid
    r = cov.report(_never, final=True)
    listed = [m["build_id"] for m in r["missing"]]
    assert set(early + late) <= set(listed)
    assert [m["uid"] for m in r["missing"][:20]] == [0] * 20      # root's first
    uids = [m["uid"] for m in r["missing"]]
    assert uids.index(X) > max(i for i, u in enumerate(uids) if u == Y)   # the flooder's last
    assert r["by_uid"][str(X)]["untracked"] == x["untracked"]
    assert r["by_uid"]["0"]["gaps"] == {"process_gone": 10, "queue_full": 10}
    assert len(json.dumps(r["missing"], separators=(",", ":"))) <= MISSING_LISTED_BYTES
    cut = [m for m in r["missing"] if m["uid"] == X]
    # X's paths kept their end (the file's name), marked cut
    assert cut and all(m["path_cut"] and len(m["path"]) == PATH_MAX_CHARS and "/f" in m["path"][-8:] for m in cut)


def test_a_uid_over_its_share_never_evicts_root_or_another_uid():
    cov = Coverage(max_bytes=1 << 20, uid_share=0.25)
    mine = {_gap(cov, f"/usr/lib/lib{i}.so", 0, HELD) for i in range(100)}
    theirs = {_gap(cov, f"/home/y/lib{i}.so", Y, "failed") for i in range(100)}
    for i in range(20_000):
        cov.named(_bid(), f"/home/x/f{i}", X)
    assert all(cov.state(b) == HELD for b in mine) and all(cov.state(b) == "failed" for b in theirs)
    # root may still add: X took its share only
    more = [_gap(cov, f"/usr/lib/more{i}.so", 0, "gone") for i in range(100)]
    assert all(cov.state(b) == "gone" for b in more)
    led = {u["uid"]: u for u in cov.ledger(top=10)["top_uids"]}
    assert led[X]["bytes"] <= cov.uid_share_bytes < led[X]["bytes"] + 512 and led[X]["untracked"] > 0
    assert led[0]["untracked"] == 0 and led[Y]["untracked"] == 0


def test_many_flooding_uids_fill_the_total_and_no_more_and_evict_nothing():
    """Five uids each at their share: the ledger stops at its total; root's entries stay; new ones of
    root are then counted untracked (root's), never made by evicting."""
    cov = Coverage(max_bytes=1 << 20, uid_share=0.25)
    root = [_gap(cov, f"/usr/bin/r{i}", 0) for i in range(50)]
    for uid in range(2000, 2005):
        for i in range(5_000):
            cov.named(_bid(), f"/home/u{uid}/{'p' * 300}{i}", uid)
    assert cov.bytes <= cov.max_bytes
    assert all(cov.state(b) == "process_gone" for b in root)
    late = _bid()
    cov.named(late, "/usr/bin/late", 0)
    assert cov.bytes <= cov.max_bytes
    r = cov.report(_never, final=True)
    assert r["by_uid"]["0"]["named"] + r["by_uid"]["0"]["untracked"] == 51


def test_uids_beyond_the_bucket_cap_share_one_bucket():
    cov = Coverage(max_bytes=8 << 20)
    for uid in range(100_000, 100_000 + UID_BUCKETS_MAX + 50):
        cov.named(_bid(), "/p", uid)
    assert len(cov._buckets) <= UID_BUCKETS_MAX
    assert any(u["uid"] == OTHER_UIDS for u in cov.ledger(top=UID_BUCKETS_MAX)["top_uids"])
    r = cov.report(_never, final=True)
    assert len(r["by_uid"]) == 16 and r["uids_omitted"]["uids"] >= UID_BUCKETS_MAX - 16


def test_an_outcome_before_the_naming_waits_for_it_and_is_charged_to_the_namer():
    """A hand-over can finish before the recording thread names its build-id: the outcome (no uid)
    waits, and the naming charges the entry, with that outcome, to the uid that mapped it."""
    cov = Coverage()
    bid = _bid()
    cov.outcome(bid, "queue_full", "/home/y/p")
    assert cov.state(bid) == "queue_full" and cov.uid_of(bid) is None
    cov.named(bid, "/home/y/p", Y)
    assert cov.state(bid) == "queue_full" and cov.uid_of(bid) == Y
    assert cov.ledger()["early"] == 0
    for _ in range(EARLY_MAX + 10):                      # bounded: the oldest go, counted
        cov.outcome(_bid(), "failed", "/x")
    led = cov.ledger()
    assert led["early"] == EARLY_MAX and led["early_dropped"] == 10
    # an outcome that knows its uid is charged at once
    other = _bid()
    cov.outcome(other, "unreachable", "/home/x/q", X)
    assert cov.uid_of(other) == X and cov.state(other) == "unreachable"


def test_paths_are_stored_once_and_a_held_build_id_stays_held():
    cov = Coverage()
    a, b = _bid(), _bid()
    cov.named(a, "/usr/lib/libfoo.so.1", 0)
    grown = cov.bytes
    cov.named(b, "/usr/lib/libfoo.so.1", 0)              # same path: only the entry is charged
    assert cov.bytes - grown < grown and cov.ledger()["paths"] == 1
    cov.outcome(a, HELD)
    cov.outcome(a, "failed", "/elsewhere")
    assert cov.state(a) == HELD


def test_the_report_lists_within_its_byte_bound_whatever_the_paths():
    """Paths of bytes that JSON escapes six-fold (undecodable bytes as surrogates, control characters):
    the inline list stays within MISSING_LISTED_BYTES; every gap goes to all_gaps, in the same order."""
    cov = Coverage(max_bytes=4 << 20, uid_share=1.0)
    ugly = "/" + "\udcff\x01" * 2000
    for i in range(2000):
        _gap(cov, f"{ugly}{i}", i % 40)
    everything: list = []
    r = cov.report(_never, final=True, all_gaps=everything)
    assert len(json.dumps(r["missing"])) <= MISSING_LISTED_BYTES
    assert len(everything) == r["gaps_total"] == 2000 - r["untracked"]
    assert everything[:len(r["missing"])] == r["missing"]
    assert len(json.dumps(r)) <= 64 << 10

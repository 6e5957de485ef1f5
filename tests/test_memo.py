"""memo.LruCache's byte budget: what it counts is what its entries hold, and a flood of fresh paths
keeps it within its budget (measured with tracemalloc)."""

from __future__ import annotations

import pytest

from buildidd import memo
from buildidd.memo import LruCache, Memo, text_bytes, text_cost
from buildidd.sessionlog import records
from tests.memflood import FLOOD_N, deep_path, retained_bytes


def test_bytes_follow_put_replace_pop_and_clear_and_evict_least_recent_first():
    c = LruCache("t", 100, max_bytes=3 * text_cost("k0", "x" * 100), cost=text_cost)
    for i in range(3):
        c.put(f"k{i}", "x" * 100)
    assert c.bytes == 3 * text_cost("k0", "x" * 100) and c.evictions == 0
    c.get("k0")                                   # k1 is now the least recent
    c.put("k3", "x" * 100)
    assert list(c.entries) == ["k2", "k0", "k3"] and c.evictions == 1
    c.put("k3", "y")                              # replaced: its old cost is given back
    assert c.bytes == 2 * text_cost("k0", "x" * 100) + text_cost("k3", "y")
    assert c.pop("k2") == "x" * 100 and c.pop("k2") is None
    assert c.bytes == text_cost("k0", "x" * 100) + text_cost("k3", "y")
    c.put("big", "z" * 10_000)                   # alone over the budget: not kept, nor the rest
    assert len(c) == 0 and c.bytes == 0
    c.put("k4", "x")
    c.clear()
    assert c.bytes == 0 and c.stats()["bytes"] == 0 and c.stats()["max_bytes"] == c.max_bytes


def test_a_cache_without_a_cost_counts_no_bytes_and_the_budget_needs_one():
    c = LruCache("t", 2)
    c.put("a", "b" * 1000)
    assert c.stats()["bytes"] is None and c.bytes == 0
    with pytest.raises(ValueError):
        LruCache("t", 2, max_bytes=10)
    with pytest.raises(ValueError):
        LruCache("t", 2, max_bytes=0, cost=text_cost)


def test_text_that_is_not_ascii_is_counted_at_its_widest():
    assert text_bytes("abc") == 3 and text_bytes(b"\xff\xfe") == 2 and text_bytes(None) == 0
    assert text_bytes("\U0001f600" * 10) == 40
    assert text_bytes("/tmp/\udcff") == 24          # a surrogate-escaped byte: CPython's 2- or 4-byte form


def test_the_path_json_memo_stays_within_its_budget_under_a_flood_of_deep_paths():
    """records.PATH_JSON (the C fast path fills it on a miss, as here) with FLOOD_N fresh paths of
    3,700 characters: its count and what tracemalloc sees both stay within PATH_JSON_MAX_BYTES."""
    m = records.PATH_JSON
    m.clear()
    try:
        def flood():
            for i in range(FLOOD_N):
                m.fill(deep_path(i).encode())
        held = retained_bytes(flood)
        assert m.bytes <= records.PATH_JSON_MAX_BYTES
        assert held <= records.PATH_JSON_MAX_BYTES, held
        assert m.evictions >= FLOOD_N - len(m) and len(m) > 100      # recent paths are still answered
        assert m(deep_path(FLOOD_N - 1).encode()) == records._path_json(deep_path(FLOOD_N - 1).encode())
    finally:
        m.clear()


def test_each_shared_memo_has_a_byte_budget():
    stats = memo.shared_stats()
    assert {"path_json", "exec_filename_json", "comm_json", "comm_text"} <= set(stats)
    for name, got in stats.items():
        assert got["max_bytes"] is not None and got["bytes"] <= got["max_bytes"], name


def test_a_costed_memo_evicts_within_budget_with_non_ascii_keys():
    """Paths that are not valid UTF-8 decode with surrogates (kernel.events): each costs its widest."""
    m = Memo("t", 1 << 20, lambda k: k * 2, max_bytes=1 << 20, cost=text_cost)

    def flood():
        for i in range(FLOOD_N // 4):
            m(deep_path(i)[-1000:] + "\udcff")
    held = retained_bytes(flood)
    assert m.bytes <= 1 << 20 and held <= 1 << 20, held
    assert len(m) > 20 and m.evictions > 0

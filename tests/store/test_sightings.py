"""The snapshotter's memories of a session's sightings (store/sightings.py) and its queue stay within
their byte budgets under a flood of fresh build-ids at deep paths, measured with tracemalloc."""

from __future__ import annotations

import time

from buildidd.kernel.events import Identity
from buildidd.store import SnapshotPolicy, Snapshotter, Store
from buildidd.store.copyqueue import CopyJob
from buildidd.store.origin import Origin
from buildidd.resolve.resolution import Sighting
from buildidd.store.sightings import Settled, SettledMemory, Sightings, SourceFile
from tests.memflood import FLOOD_N, deep_path, retained_bytes


def _ident(i: int) -> Identity:
    return Identity(2049, 3_000_000 + i, 1, 5 * 1024, 1_700_000_000_000_000_000 + i, 1_700_000_000_000_000_000 + i)


def test_sightings_stay_within_their_budget_and_say_when_full():
    s = Sightings(max_entries=1 << 20, max_bytes=2 << 20)
    kept = 0

    def flood():
        nonlocal kept
        for i in range(FLOOD_N):
            kept += s.add(Sighting(f"{i:040x}", deep_path(i), 2049, i))
    held = retained_bytes(flood)
    assert s.bytes <= 2 << 20 and held <= 2 << 20, held
    assert kept == len(s) == len(s.build_ids) and 100 < kept < FLOOD_N
    assert Sighting(f"{0:040x}", deep_path(0), 2049, 0) in s
    assert Sighting(f"{FLOOD_N - 1:040x}", deep_path(FLOOD_N - 1), 2049, FLOOD_N - 1) not in s
    # The same build-id at another path costs its path only.
    before = s.bytes
    s.max_bytes = 1 << 30
    assert s.add(Sighting(f"{0:040x}", "/usr/lib/x", 1, 1)) and s.bytes - before < 300


def test_settled_answers_are_dropped_whole_beyond_their_budget():
    m = SettledMemory(max_entries=1 << 20, max_bytes=1 << 20)

    def flood():
        for i in range(FLOOD_N):
            path = deep_path(i)
            origin = Origin(path=path, uid=1000, gid=1000, mode=0o755, dev=2049, ino=i, size_bytes=5120,
                            mtime_ns=i, trusted=False, private=False)
            m.put(f"{i:040x}", Settled(time.monotonic(), (i,), 0.0, SourceFile(path, 2049, i, 5120, i, i), origin))
    held = retained_bytes(flood)
    assert m.bytes <= 1 << 20 and held <= 1 << 20, held
    assert m.get(f"{FLOOD_N - 1:040x}") is not None and m.get(f"{0:040x}") is None


def test_the_snapshot_queue_and_its_memory_of_sightings_stay_within_budget(tmp_path):
    """Without its worker the queue only fills: a user's jobs beyond their share of max_queue_bytes
    are refused (``uid_budget``, counted ``dropped``), and root's job still finds room; sightings
    beyond max_seen_bytes are counted ``seen_full``."""
    policy = SnapshotPolicy(max_queue_bytes=2 << 20, max_seen_bytes=2 << 20)
    snap = Snapshotter(Store(tmp_path / "store"), policy)

    def flood():
        for i in range(FLOOD_N):
            snap.submit(CopyJob(f"{i:040x}", deep_path(i), _ident(i), uid=1000), None)
    held = retained_bytes(flood)
    mem = snap.memory()
    assert mem["queue"]["bytes"] <= mem["queue"]["uid_max_bytes"] < 2 << 20 and mem["seen"]["bytes"] <= 2 << 20
    # With the ledger's own (store/coverage.py: every refused job is a named gap there).
    assert held <= (4 << 20) + snap.coverage.max_bytes + (1 << 20), held
    assert snap.stats["dropped"] == FLOOD_N - snap.queued() and snap.queued() > 50
    snap.submit(CopyJob("ab" * 20, deep_path(0), _ident(0), uid=0), None)
    assert snap.memory()["queue"]["entries"] == FLOOD_N - snap.stats["dropped"] + 1
    assert snap.status()["memory"] == snap.memory()

"""The recorder's per-file tables stay within their byte budgets when one user maps fresh files
with deep paths: every record through the real fast and slow paths (raw records as the BPF side
writes them), measured with tracemalloc."""

from __future__ import annotations

import os
import random

from buildidd import clock
from buildidd.capture import report, slowpath, tables as tables_mod
from buildidd.capture.tables import Tables
from buildidd.kernel.events import EventType
from buildidd.kernel.events import Identity
from buildidd.sessionlog import records
from tests.capture.test_fastpath import _recorder, map_raw, task_raw
from tests.memflood import FLOOD_N, deep_path, retained_bytes

#: Processes the flood's mappings come from (the live mappings' bound in all is then the one that binds).
PIDS = 64
#: Records per step: 200 of ~4 KiB fit the 1 MiB ring of MemRings.
BATCH = 200


def _ident(i: int) -> Identity:
    return Identity(2049, 2_000_000 + i, 1, 5 * 1024, 1_700_000_000_000_000_000 + i, 1_700_000_000_000_000_000 + i)


def _flood(rng: random.Random, n: int, t0: int):
    """Batches of mappings of n fresh files (each its own identity, build-id the kernel read, and
    deep path), from PIDS processes."""
    batch = []
    for i in range(n):
        pid = 500_000 + i % PIDS
        batch.append(map_raw(rng, _ident(i), pid=pid, tid=pid, time_ns=t0 + i, comm=b"flood",
                             path=deep_path(i).encode(), origin=0, nlink=0,
                             pc=(1, i.to_bytes(8, "little") + b"\x5a" * 12)))
        if len(batch) == BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def test_a_flood_of_fresh_deep_files_keeps_the_recorders_tables_within_budget(tmp_path):
    """FLOOD_N + 25,000 fresh files: the first 20,000 traced (every table fills: what they hold is
    measured against the sum of their budgets), the next FLOOD_N untraced (tracemalloc slows the
    Python path five-fold), the last 5,000 traced again: what they leave fits the caches' budgets."""
    rec = _recorder(tmp_path, "flood", True)
    records.PATH_JSON.clear()
    rng = random.Random(42)
    files = _flood(rng, FLOOD_N + 25_000, clock.boot_ns())

    def record(n_batches: int):
        for _ in range(n_batches):
            rec.tracer.batch = next(files)
            rec.step()
            rec.tables.drop_oldest_lines(0)      # written (no session log here): not what is measured
    t = rec.tables
    bound = (slowpath.KERNEL_FAST_MAX_BYTES + records.PATH_JSON_MAX_BYTES
             + tables_mod.LIVE_ENTRIES_MAX * tables_mod.LIVE_ENTRY_BYTES + (1 << 20))
    held = retained_bytes(lambda: record(20_000 // BATCH))
    assert t.live_entries == sum(map(len, t.live.values())) == tables_mod.LIVE_ENTRIES_MAX
    assert held <= bound, (held, bound)
    record(FLOOD_N // BATCH)
    # What these 5,000 left (each kernel answer and path memo replaced by theirs: freeing the
    # untraced old ones is not seen) is what the two caches hold; unbounded, it would be ~23 MiB.
    more = retained_bytes(lambda: record(5_000 // BATCH))
    assert more <= slowpath.KERNEL_FAST_MAX_BYTES + records.PATH_JSON_MAX_BYTES + (1 << 20), more
    assert rec.summary()["events"]["mmap"] == FLOOD_N + 25_000
    assert rec.slow.kernel_fast.bytes <= slowpath.KERNEL_FAST_MAX_BYTES
    assert records.PATH_JSON.bytes <= records.PATH_JSON_MAX_BYTES
    assert len(t.fast) == len(rec.slow.kernel_fast) < FLOOD_N // 10
    caches = report.caches(rec)
    assert caches["kernel_fast"]["bytes"] <= caches["kernel_fast"]["max_bytes"]
    assert caches["path_json"]["bytes"] <= caches["path_json"]["max_bytes"]
    assert caches["live_mappings"]["entries"] == tables_mod.LIVE_ENTRIES_MAX
    # An exit gives its process's live mappings back, in C as in Python.
    rec.tracer.batch = [task_raw(EventType.EXIT, pid=500_000, tid=500_000, time_ns=clock.boot_ns(), comm=b"flood",
                                 a=0, b=0)]
    rec.step()
    assert t.live_entries == sum(map(len, t.live.values())) < tables_mod.LIVE_ENTRIES_MAX
    records.PATH_JSON.clear()


def test_live_mappings_are_bounded_in_all_and_counted_in_python_and_c(tmp_path):
    t = Tables(missing={}, live_max_entries=10)
    for pid in range(4):
        for start in range(4):
            t.add_live(pid, start, b"k")
    assert t.live_entries == 10 == sum(map(len, t.live.values()))
    t.add_live(0, 0, b"k")                  # already there: not counted twice
    assert t.live_entries == 10
    t.drop_live(0)
    assert t.live_entries == 6
    assert t.trim_live(1) == 1 and t.live_entries == sum(map(len, t.live.values())) == 2
    # The C fast path keeps the same count against the same bound.
    fast, slow = _recorder(tmp_path, "fast", True), _recorder(tmp_path, "slow", False)
    rng = random.Random(1)
    batch = list(next(_flood(rng, 300, clock.boot_ns())))
    batch += [map_raw(rng, _ident(i), pid=os.getpid(), tid=os.getpid(), time_ns=clock.boot_ns(), comm=b"x",
                      path=b"/again", origin=0, pc=(1, i.to_bytes(8, "little") + b"\x5a" * 12)) for i in range(300)]
    for rec in (fast, slow):
        rec.tables.live_max_entries = 200
        rec.tracer.batch = list(batch)
        rec.step()
    assert fast.tables.live == slow.tables.live
    assert fast.tables.live_entries == slow.tables.live_entries == 200

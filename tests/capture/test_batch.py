"""_fastpath.take: a step's records read in place from ring memory (rings laid out as the kernel's)."""

from __future__ import annotations

import random
import struct

import pytest

from buildidd.capture import _fastpath
from tests.capture.ringmem import BUSY_BIT, DISCARD_BIT, MemRing


def _rec(time_ns: int, tag: int, size: int = 40) -> bytes:
    """A record with event_header.time_ns at bytes 16..24 and a tag after it."""
    return struct.pack("<IIIIQI", 9, tag, tag, 0, time_ns, tag).ljust(size, b"\xab")


def _read_ring_then_sort(rings: list[MemRing]) -> list[bytes]:
    """What Rings.drain did before take(): read_ring per ring, then sort_by_time."""
    out: list[bytes] = []
    for r in rings:
        cons, data, page, mask = r.view()
        _fastpath.read_ring(cons, data, page, mask, out)
    _fastpath.sort_by_time(out)
    return out


def _pair(seed: int) -> tuple[list[MemRing], list[MemRing]]:
    """Two identical sets of two rings holding interleaved, partly equal times, some wrapping."""
    rng = random.Random(seed)
    sets = ([MemRing(1 << 12), MemRing(1 << 12)], [MemRing(1 << 12), MemRing(1 << 12)])
    for rings in sets:                  # move the positions near the end: later records wrap
        for r in rings:
            r.prod = (1 << 12) - 64
            struct.pack_into("<Q", r.cons, 0, r.prod)
            struct.pack_into("<Q", r.data, 0, r.prod)
    t = [1000, 1000]
    for i in range(40):
        k = rng.randrange(2)
        t[k] += rng.choice((0, 1, 5))
        size = rng.choice((24, 40, 72, 130))
        for rings in sets:
            rings[k].put(_rec(t[k], i, size))
    return sets


@pytest.mark.parametrize("seed", range(5))
def test_take_gives_what_read_ring_and_sort_gave(seed):
    mine, theirs = _pair(seed)
    batch = _fastpath.take(tuple(r.view() for r in mine))
    assert list(batch) == _read_ring_then_sort(theirs)
    assert len(batch) == 40 and 0 < batch.fill < 1
    before = [r.consumer() for r in mine]
    batch.release()
    assert [r.consumer() for r in mine] == [r.prod for r in mine] != before
    assert len(batch) == 0
    batch.release()                     # idempotent
    assert len(_fastpath.take(tuple(r.view() for r in mine))) == 0


def test_records_stay_in_the_ring_until_release():
    ring = MemRing(1 << 12)
    ring.put(_rec(5, 1))
    batch = _fastpath.take((ring.view(),))
    assert ring.consumer() == 0          # the kernel may not reuse the space yet
    again = _fastpath.take((ring.view(),))
    assert list(again) == list(batch)    # a second take sees the same records
    again.release()
    batch.release()
    assert ring.consumer() == ring.prod


def test_busy_stops_a_ring_and_discarded_records_are_skipped():
    ring = MemRing(1 << 12)
    ring.put(_rec(1, 1))
    ring.put(_rec(2, 2), DISCARD_BIT)
    ring.put(_rec(3, 3))
    busy_at = ring.prod
    ring.put(_rec(4, 4), BUSY_BIT)
    ring.put(_rec(5, 5))
    batch = _fastpath.take((ring.view(),))
    assert [struct.unpack_from("<I", r, 24)[0] for r in batch] == [1, 3]
    batch.release()
    assert ring.consumer() == busy_at


def test_run_reads_a_batch_in_place_and_copies_only_what_python_records():
    ring = MemRing(1 << 12)
    ring.put(_rec(1, 1))                 # type 9: not the fast path's
    batch = _fastpath.take((ring.view(),))
    item = batch[0]
    assert isinstance(item, bytes) and item == _rec(1, 1)
    with pytest.raises(IndexError):
        batch[1]
    batch.release()


def test_bad_rings_are_refused_and_nothing_is_consumed():
    ring = MemRing(1 << 12)
    ring.put(_rec(1, 1))
    cons, data, page, mask = ring.view()
    with pytest.raises(ValueError):
        _fastpath.take(((cons, data[:page + 100], page, mask),))
    struct.pack_into("<I", ring.data, page, 1 << 20)        # a record larger than the ring
    with pytest.raises(ValueError):
        _fastpath.take((ring.view(),))
    assert ring.consumer() == 0
    with pytest.raises(TypeError):
        _fastpath.take([ring.view()])


def _rings_out_of_order(n: int, size: int = 1 << 17, at: int = 0) -> tuple[list[MemRing], dict[int, tuple[int, int]]]:
    """Two rings holding n records from position at (near the end of the area: the batch wraps),
    some discarded ones between them, whose times fall back now and then within a ring (a program
    preempted between its clock read and its reserve), so the merge orders some of a ring's
    records before earlier ones of the same ring.  Returns the rings and tag -> (ring, position)."""
    rng = random.Random(n)
    rings = [MemRing(size), MemRing(size)]
    for r in rings:
        r.prod = at
        struct.pack_into("<Q", r.cons, 0, at)
        struct.pack_into("<Q", r.data, 0, at)
    where: dict[int, tuple[int, int]] = {}
    t = [10_000, 10_000]
    for tag in range(n):
        k = rng.randrange(2)
        t[k] += rng.choice((1, 2, 3)) if rng.random() > 0.05 else -rng.randrange(50)
        if rng.random() < 0.03:
            rings[k].put(b"\0" * 40, DISCARD_BIT)
        where[tag] = (k, rings[k].put(_rec(t[k], tag)))
    return rings, where


def _tag(record: bytes) -> int:
    return struct.unpack_from("<I", record, 24)[0]


@pytest.mark.parametrize("at", [0, (1 << 17) - 40_000, (5 << 17) - 4000, (1 << 40) + 123 * 8])
def test_release_to_gives_back_only_the_space_no_later_record_needs(at):
    n, stride = 3000, 1024
    rings, where = _rings_out_of_order(n, at=at)
    batch = _fastpath.take(tuple(r.view() for r in rings))
    copies = list(batch)
    tags = [_tag(r) for r in copies]
    ends = [r.prod for r in rings]
    for k in (0, 1):                    # the merge put some of a ring's records before earlier ones
        in_merge = [where[g][1] for g in tags if where[g][0] == k]
        assert in_merge != sorted(in_merge)
    for i in (0, 500, 1023, 1024, 1500, 2047, 2048, 2999, n, n + 2000):
        batch.release_to(i)
        q = min(i, n) // stride * stride
        for k, ring in enumerate(rings):
            needed = [where[g][1] for g in tags[q:] if where[g][0] == k]
            assert ring.consumer() == (at if q == 0 else min(needed) if needed else ends[k])
        # The kernel may now reuse what was given back: fill it, and the records still to be
        # recorded must be intact.
        for ring in rings:
            while True:
                try:
                    ring.put(b"\xee" * 40)
                except ValueError:
                    break
        assert [batch[j] for j in range(q, n)] == copies[q:]
    batch.release()
    assert [r.consumer() for r in rings] == ends


def test_a_ring_with_few_records_keeps_the_lowest_one_still_needed():
    """Ring 1's first record in ring order comes late in the merge, its second early: the
    checkpoints hold the lowest position from each on, not the span's own."""
    r0, r1 = MemRing(1 << 18), MemRing(1 << 18)
    for j in range(3000):
        r0.put(_rec(100 + j, j))
    late = r1.put(_rec(100 + 2500, 90_000))        # merged into the third span
    r1.put(_rec(100 + 1500, 90_001))                # merged into the second
    batch = _fastpath.take((r0.view(), r1.view()))
    for i in (1024, 2048):
        batch.release_to(i)
        assert r1.consumer() == late
    batch.release()
    assert r1.consumer() == r1.prod


@pytest.mark.parametrize("n", [1024, 2048])
def test_a_busy_record_ends_what_a_whole_batch_gives_back(n):
    rings = [MemRing(1 << 17), MemRing(1 << 17)]
    for j in range(n):
        rings[j % 2].put(_rec(1000 + j, j))
    busy_at = rings[0].put(_rec(1, 99_999), BUSY_BIT)
    rings[0].put(_rec(1, 99_998))
    batch = _fastpath.take(tuple(r.view() for r in rings))
    assert len(batch) == n
    batch.release_to(n)
    assert [r.consumer() for r in rings] == [busy_at, rings[1].prod]
    batch.release()
    batch.release_to(n)                 # a released batch: nothing
    assert rings[0].consumer() == busy_at


def test_a_small_batch_holds_its_space_until_release():
    rings, _where = _rings_out_of_order(100)
    batch = _fastpath.take(tuple(r.view() for r in rings))
    batch.release_to(100)
    assert [r.consumer() for r in rings] == [0, 0]
    batch.release()
    assert [r.consumer() for r in rings] == [r.prod for r in rings]


def test_run_gives_the_kernel_space_back_as_it_goes():
    """run() over one ring of fork records: what the memo's fill() sees of consumer_pos while run()
    is at record i shows the space of the records before i's checkpoint given back already."""
    from buildidd.capture.tables import Tables
    from buildidd.kernel.events import EventType, TaskEvent
    from buildidd.memo import Memo

    ring = MemRing(1 << 19)
    positions = []
    for i in range(5000):
        ev = TaskEvent()
        ev.hdr.type, ev.hdr.pid, ev.hdr.tid, ev.hdr.time_ns = EventType.FORK, 7, 7, 1000 + i
        ev.hdr.comm = b"c%d" % (i // 500)       # a new comm every 500: the memo fills
        positions.append(ring.put(bytes(ev)))
    seen = []

    def fill_comm(raw):
        seen.append(ring.consumer())
        return b'"c"'

    t = Tables(missing={}, comm_json=Memo("comm", 64, fill_comm),
               filename_json=Memo("filename", 16, lambda raw: b'"f"'), origins=(b"mmap",))
    batch = _fastpath.take((ring.view(),))
    assert _fastpath.run(batch, 0, t).next == 5000
    # fill() ran at records 0, 500, ..., 4500: by then the checkpoints at or below each were given back
    assert seen == [positions[i // 1024 * 1024] for i in range(0, 5000, 500)]
    assert ring.consumer() == positions[4096]    # run() ends at the last checkpoint; release() does the rest
    batch.release()
    assert ring.consumer() == ring.prod


def test_run_keeps_the_record_it_stops_at():
    """run() stops at record 1023 (a type it does not know), just before a checkpoint: its space is
    not given back, since Python copies it next (batch[1023])."""
    from buildidd.capture.tables import Tables
    from buildidd.kernel.events import EventType, TaskEvent
    from buildidd.memo import Memo

    ring = MemRing(1 << 19)
    positions = []
    for i in range(3000):
        ev = TaskEvent()
        ev.hdr.type, ev.hdr.pid, ev.hdr.tid, ev.hdr.time_ns = EventType.FORK, 7, 7, 1000 + i
        if i == 1023:
            ev.hdr.type = 0xDEAD
        positions.append(ring.put(bytes(ev)))
    t = Tables(missing={}, comm_json=Memo("comm", 64, lambda raw: b'"c"'),
               filename_json=Memo("filename", 16, lambda raw: b'"f"'), origins=(b"mmap",))
    batch = _fastpath.take((ring.view(),))
    assert _fastpath.run(batch, 0, t).next == 1023
    assert ring.consumer() == 0
    assert _fastpath.run(batch, 1024, t).next == 3000
    assert ring.consumer() == positions[2048]
    batch.release()

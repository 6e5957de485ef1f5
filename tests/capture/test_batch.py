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

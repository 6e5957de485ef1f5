"""Snapshotter.settled remembers a trusted, public entry only while the entry stays what it was."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from buildidd.store import Snapshotter, Store
from conftest import store_add


def _libm() -> Path:
    with open("/proc/self/maps") as f:
        return next(Path(line.split()[-1]) for line in f
                    if "/libm.so" in line and line.split()[-1].startswith("/usr/"))


def test_a_remembered_answer_follows_removal_and_an_untrusted_copy(public_tmp_factory):
    d = public_tmp_factory()
    store = Store(d / "store")
    bid = store_add(store, _libm())
    snap = Snapshotter(store)
    assert snap.settled(bid) and snap.settled(bid)          # the second from memory
    stamp = store.origin_stamp(bid)
    assert stamp is not None and snap._settled[bid][1] == stamp
    store.remove(bid)                                        # an eviction
    assert store.origin_stamp(bid) is None and not snap.settled(bid)
    copy = d / "libm-copy.so"                                # the same bytes where any user could have put them
    shutil.copy(_libm(), copy)
    os.chmod(copy, 0o755)
    assert store_add(store, copy) == bid
    assert not store.origin(bid).trusted and not snap.settled(bid)


def test_a_settled_entry_is_touched_once_per_period(public_tmp_factory):
    d = public_tmp_factory()
    store = Store(d / "store")
    bid = store_add(store, _libm())
    snap = Snapshotter(store)
    assert snap.settled(bid)
    entry = store.linkname(bid).resolve()
    os.utime(entry, (1, 1))
    snap._touch_settled(bid)
    assert entry.stat().st_mtime > 1                         # touched: recent for the quota
    os.utime(entry, (1, 1))
    snap._touch_settled(bid)
    assert entry.stat().st_mtime == 1                        # not again within SETTLED_TTL_S

"""Per-pid state of processes whose exit was lost stays bounded."""

from __future__ import annotations

import os

from buildidd.capture import follow
from buildidd.capture.follow import FollowFilter
from buildidd.capture.tables import Tables
from buildidd.kernel.events import TASK_EVENT, TASK_FORK_PPID_OFF, EventType


def _fork(pid: int, ppid: int) -> bytes:
    raw = bytearray(TASK_EVENT.size)
    raw[0] = EventType.FORK
    raw[4:8] = pid.to_bytes(4, "little")
    raw[TASK_FORK_PPID_OFF:TASK_FORK_PPID_OFF + 4] = ppid.to_bytes(4, "little")
    return bytes(raw)


def test_live_mappings_of_lost_exits_are_trimmed_oldest_first():
    t = Tables(missing={})
    for pid in range(10):
        t.add_live(pid, 0x1000, b"k")
    assert t.trim_live(4) == 6 and sorted(t.live) == [6, 7, 8, 9]
    assert t.trim_live(4) == 0


def test_follow_set_prunes_gone_pids_then_drops(monkeypatch):
    monkeypatch.setattr(follow, "TRACKED_MAX", 4)
    me = os.getpid()
    gone = [4_000_000 + i for i in range(3)]     # above pid_max: no /proc entry
    f = FollowFilter({me, *gone})
    assert len(f.filter([_fork(5_000_000, me)])) == 1
    assert f.tracked == {me, 5_000_000} and f.dropped == 0       # the gone pids were pruned
    # Full of live processes: the fork is not followed, and counted.
    f.tracked.update({1, os.getppid()})
    f.tracked.discard(5_000_000)
    assert len(f.tracked) == 3
    f.tracked.add(me)
    monkeypatch.setattr(follow, "TRACKED_MAX", 3)
    assert len(f.filter([_fork(5_000_001, me)])) == 1      # the parent's fork record is kept
    assert f.dropped == 1 and 5_000_001 not in f.tracked

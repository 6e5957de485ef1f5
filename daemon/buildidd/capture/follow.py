"""Follow mode (``buildidd record``): only the records of a process tree.

The one place follow mode filters: the recorder then records all it is given.
"""

from __future__ import annotations

import os

from buildidd.capture import _fastpath
from buildidd.kernel.events import TASK_EVENT, TASK_FORK_PPID_OFF, EventType

#: Records of untracked pids held back at most (one step's worth).
DEFERRED_MAX = 65536
#: Pids followed at most: a fork beyond it, once pids without a /proc entry
#: (their exit was lost) are pruned, is not followed and is counted (dropped).
TRACKED_MAX = 65536


class FollowFilter:
    """Keeps the records of tracked processes and of the processes they fork.

    Args:
        tracked: the pids (tgids) followed; grows with their forks and loses
            a pid at its exit (the set is shared with the recorder's rescan).
    """

    def __init__(self, tracked: set[int]):
        self.tracked = tracked
        self.dropped = 0
        self._deferred: list[bytes] = []

    def _track(self, pid: int) -> None:
        tracked = self.tracked
        if len(tracked) >= TRACKED_MAX:
            # /proc/PID: the kernel's, not a path a user controls.
            tracked.difference_update([p for p in tracked if not os.path.exists(f"/proc/{p}")])
        if len(tracked) < TRACKED_MAX:
            tracked.add(pid)
        else:
            self.dropped += 1

    def filter(self, raws: list[bytes]) -> list[bytes]:
        """The records of tracked processes (and forks from them) among raws, in time order.

        A record of an untracked pid is held back for one step: its parent's
        FORK may sit in another CPU's ring that was read just before the
        parent's CPU committed it.  Held twice, it is dropped.
        """
        prev = self._deferred
        self._deferred = []
        if prev:
            held_before = {id(r) for r in prev}
            raws = prev + raws
            _fastpath.sort_by_time(raws)
        else:
            held_before = ()
        tracked = self.tracked
        out = []
        for raw in raws:
            if len(raw) < 12:
                out.append(raw)          # let decoding count it
                continue
            pid = int.from_bytes(raw[4:8], "little")
            if raw[0] == EventType.FORK and len(raw) >= TASK_EVENT.size:
                # A fork belongs to the tree when its parent does (the fork
                # that made the command itself came from buildidd: not kept).
                if int.from_bytes(raw[TASK_FORK_PPID_OFF:TASK_FORK_PPID_OFF + 4], "little") in tracked:
                    self._track(pid)
                    out.append(raw)
                elif id(raw) not in held_before and len(self._deferred) < DEFERRED_MAX:
                    self._deferred.append(raw)
                continue
            if pid in tracked:
                out.append(raw)
                if raw[0] == EventType.EXIT:
                    tracked.discard(pid)         # a reused pid is someone else
            elif id(raw) not in held_before and len(self._deferred) < DEFERRED_MAX:
                self._deferred.append(raw)
        return out

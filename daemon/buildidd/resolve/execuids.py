"""The uid an exec pin is charged to before its exec record confirms it: the exec'd pid's real uid.

A fanotify event names a pid only; its real uid is read from /proc/PID/status
(procfs.read_uid) when the event is read, cached per pid for a user, never
for root (see :meth:`ExecUids.of`).

A process gone by the time its later events are read (a flood of failing execs
from one process that then exits: thousands of its events still queued) keeps
the user's uid it was last read with, for :data:`UID_GONE_S`: charged to no
known uid instead, its leftovers would fill that shared share and close the
provisional pins of everyone else's short-lived programs in it before their
exec records could confirm them.
"""

from __future__ import annotations

import collections
import time

from buildidd.resolve.pinledger import UNKNOWN_UID
from buildidd.resolve.procfs import read_uid

__all__ = ["UID_CACHE_MAX", "UID_CACHE_S", "UID_GONE_S", "ExecUids"]

#: Seconds a pid's uid read from /proc/PID/status is reused for its next events ...
UID_CACHE_S = 0.5
#: ... and pids remembered at most (the least recent forgotten).
UID_CACHE_MAX = 4096
#: Seconds a gone pid's events are still charged to the user's uid it was last read with (a
#: pid is reused only once the pid space wraps; the window bounds the harm if it was).
UID_GONE_S = 30.0


class ExecUids:
    """The real uid of an exec event's pid, a user's cached for UID_CACHE_S.

    No lock of its own: its one caller reads the fanotify queue one thread at a time
    (ExecPins._reading held), and so is the only thread that calls :meth:`of`.
    """

    def __init__(self):
        #: pid -> (uid, time.monotonic() read).  Guarded by the caller's ExecPins._reading.
        self._uids: collections.OrderedDict[int, tuple[int, float]] = collections.OrderedDict()

    def of(self, pid: int) -> int:
        """The real uid of pid (procfs.read_uid); UNKNOWN_UID when it is gone.  A user's uid is reused
        for UID_CACHE_S (a process cannot make its real uid root's again on its own); root's is read
        afresh each time: a root process may drop to a user's uid (setpriv, a login) and exec the user's
        flood at once, which must not be charged to root.  A pid gone keeps the user's uid it was last
        read with for UID_GONE_S (root's is never kept: a gone root pid is UNKNOWN_UID)."""
        now = time.monotonic()
        got = self._uids.get(pid)
        if got is not None:
            uid, read_at = got
            if now - read_at < UID_CACHE_S:
                return uid
        uid = read_uid(pid)
        if uid < 0:                              # gone: the user's uid it last had, if read lately
            return got[0] if got is not None and now - got[1] < UID_GONE_S else UNKNOWN_UID
        if uid == 0:
            self._uids.pop(pid, None)            # reused by root: what a user's process left is void
            return 0
        self._uids[pid] = (uid, now)
        self._uids.move_to_end(pid)
        while len(self._uids) > UID_CACHE_MAX:
            self._uids.popitem(last=False)
        return uid

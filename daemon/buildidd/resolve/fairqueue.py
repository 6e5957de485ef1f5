"""Queues shared by users: each job is charged to the uid that caused it, and served fairly.

A hand-over (resolve.enrich) and a copy (store.copyqueue) are caused by one
task's mapping or exec; its real uid (``Request.uid``, from
``event_header.uid``: cred->uid of the task) is the user charged.  Three
parts, each with no lock of its own (the owner's lock guards every call):

- :class:`Budget`: a count of things (queue slots, held descriptors) with a
  general part any job may use and a reserve only urgent jobs may use; in each
  part a uid other than root holds at most ``uid_share`` of it.  One user's
  flood then costs that user's own jobs (refused ``uid_budget``), never a slot
  or descriptor of root or of another user, and an urgent job of another user
  finds one in the reserve however full the general part is.
- :class:`FairQueue`: the serving order.  Round robin across the uids that
  have a job queued (one job per uid per turn); within one uid, level 0 first
  (store's HandOver order: AT_RISK, LIVE, BULK), first in first out within a
  level.  A job of uid U waits behind at most one job of each other uid with a
  backlog, whatever that backlog's length or level.
- :class:`UidCounts`: counts by uid (refusals, descriptors not given), with a
  bounded number of uids named.

Root (uid 0) is not held to a share (the start-up synthesis alone hands over
every library of every running process, nearly all root's); its jobs still
take turns with everyone else's.  An unknown uid (-1) is one user like any.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

__all__ = ["Budget", "FairQueue", "GENERAL", "OTHER_UIDS", "QUEUE_FULL", "RESERVE", "ROOT_UID", "UID_BUDGET",
           "UidCounts"]

#: The uid never held to a share.
ROOT_UID = 0
#: A refusal: the part of the budget the job may use is full (every uid's jobs together).
QUEUE_FULL = "queue_full"
#: A refusal: the job's uid holds its share of every part the job may use (store.coverage's gap reason).
UID_BUDGET = "uid_budget"
#: Budget parts: the general one (any job), the reserve (urgent jobs only).
GENERAL, RESERVE = 0, 1
#: The key under which UidCounts sums the uids beyond its named ones.
OTHER_UIDS = "other"

T = TypeVar("T")


class Budget:
    """A count of things shared by uids, with a reserve for urgent jobs (see the module docstring).

    Args:
        total: things at most (slots, descriptors), >= 0.
        reserve_fraction: the part of total only urgent jobs may take, in [0, 1).
        uid_share: the part of each part that one uid other than root may hold, in (0, 1].
    Attributes:
        caps: (general, reserve) sizes; uid_caps: (general, reserve) per uid other than root
        (at least 1 of a part that is not empty); used: [general, reserve] held now.
    """

    def __init__(self, total: int, reserve_fraction: float, uid_share: float):
        if total < 0 or not 0 <= reserve_fraction < 1 or not 0 < uid_share <= 1:
            raise ValueError(f"budget {total}, reserve {reserve_fraction}, uid share {uid_share}")
        reserve = int(total * reserve_fraction)
        self.caps = (total - reserve, reserve)
        self.uid_caps = tuple(max(1, int(c * uid_share)) if c else 0 for c in self.caps)
        self.used = [0, 0]
        self._by_uid: dict[int, list[int]] = {}     # uid -> [general, reserve] held; only uids holding some

    @property
    def total(self) -> int:
        """Things held now, both parts."""
        return self.used[GENERAL] + self.used[RESERVE]

    def held(self, uid: int) -> int:
        """Things uid holds now, both parts."""
        got = self._by_uid.get(uid)
        return got[GENERAL] + got[RESERVE] if got else 0

    def take(self, uid: int, urgent: bool) -> int | str:
        """One thing for uid: the part it came from (GENERAL, RESERVE: only when urgent and the general
        part has none for uid), or the refusal (UID_BUDGET when a part had room but uid held its share
        of it, else QUEUE_FULL).  Constant time."""
        mine = self._by_uid.get(uid)
        reason = QUEUE_FULL
        for part in (GENERAL, RESERVE) if urgent else (GENERAL,):
            if self.used[part] >= self.caps[part]:
                continue
            if uid != ROOT_UID and mine is not None and mine[part] >= self.uid_caps[part]:
                reason = UID_BUDGET
                continue
            if mine is None:
                mine = self._by_uid[uid] = [0, 0]
            mine[part] += 1
            self.used[part] += 1
            return part
        return reason

    def release(self, uid: int, part: int) -> None:
        """Give back one thing uid took from part (what take returned)."""
        mine = self._by_uid.get(uid)
        if mine is None or mine[part] <= 0:
            raise ValueError(f"uid {uid} holds nothing in part {part}")
        mine[part] -= 1
        self.used[part] -= 1
        if not mine[GENERAL] and not mine[RESERVE]:
            del self._by_uid[uid]

    def top(self, n: int) -> dict[str, int]:
        """The n uids holding most now: {str(uid): held} (JSON keys are text), most first."""
        ranked = sorted(self._by_uid.items(), key=lambda kv: kv[1][GENERAL] + kv[1][RESERVE], reverse=True)
        return {str(uid): got[GENERAL] + got[RESERVE] for uid, got in ranked[:n]}


class FairQueue(Generic[T]):
    """Items by uid and level, served round robin across uids (see the module docstring).

    Unbounded by itself: its owner admits an item only after a Budget gave it a slot.

    Args:
        levels: priority levels, 0 served first within a uid.
    """

    def __init__(self, levels: int = 1):
        self.levels = levels
        self._by_uid: dict[int, list[deque[T]]] = {}    # only uids with an item queued
        self._ring: deque[int] = deque()                 # those uids, next to serve first
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def push(self, uid: int, level: int, item: T) -> None:
        """Queue item for uid at level (0 <= level < levels); a uid new to the queue is served last."""
        queues = self._by_uid.get(uid)
        if queues is None:
            queues = self._by_uid[uid] = [deque() for _ in range(self.levels)]
            self._ring.append(uid)
        queues[level].append(item)
        self._len += 1

    def pop(self) -> tuple[int, T] | None:
        """(uid, item) next to serve, or None when empty: the first uid in turn, its oldest item of its
        lowest level; that uid then goes to the back of the turn (or leaves it, having no more)."""
        if not self._ring:
            return None
        uid = self._ring[0]
        queues = self._by_uid[uid]
        item = next(q for q in queues if q).popleft()
        self._len -= 1
        if any(queues):
            self._ring.rotate(-1)
        else:
            self._ring.popleft()
            del self._by_uid[uid]
        return uid, item

    def drain(self) -> list[tuple[int, T]]:
        """Every (uid, item) queued, removed, in serving order."""
        out = []
        while (got := self.pop()) is not None:
            out.append(got)
        return out

    def uids(self) -> int:
        """Uids with an item queued."""
        return len(self._ring)


class UidCounts:
    """Counts by uid, at most max_uids uids named; later uids' counts are summed under OTHER_UIDS.

    Args:
        max_uids: uids counted by name at most (a bound whatever uids appear).
    """

    def __init__(self, max_uids: int = 256):
        self.max_uids = max_uids
        self.counts: dict[int, int] = {}
        self.other = 0
        self.total = 0

    def add(self, uid: int, n: int = 1) -> None:
        """Count n for uid."""
        self.total += n
        if uid in self.counts or len(self.counts) < self.max_uids:
            self.counts[uid] = self.counts.get(uid, 0) + n
        else:
            self.other += n

    def get(self, uid: int) -> int:
        """uid's count (0 when none, or when it was summed under OTHER_UIDS)."""
        return self.counts.get(uid, 0)

    def top(self, n: int) -> dict[str, int]:
        """The n uids counted most: {str(uid): count}, most first, plus OTHER_UIDS with the rest's sum
        when any is left out."""
        ranked = sorted(self.counts.items(), key=lambda kv: kv[1], reverse=True)
        out = {str(uid): c for uid, c in ranked[:n]}
        rest = self.total - sum(out.values())
        if rest:
            out[OTHER_UIDS] = rest
        return out

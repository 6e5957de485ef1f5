"""The snapshot copy queue: jobs charged to the uid that mapped, with slots and descriptors per uid.

Every copy job (:class:`CopyJob`) is charged to ``Request.uid``, the task
that mapped or exec'd the file (-1: unknown), never the file's owner.  Two
budgets (resolve.fairqueue.Budget) bound it, both with a reserve only
AT_RISK jobs may use (``at_risk_reserve``: the file is reachable only through
the descriptor the job holds) and a share per uid other than root
(``uid_share``) of each part:

- slots: jobs queued, ``max_jobs`` in all.  A job beyond its part is refused:
  ``queue_full`` when the part is full, ``uid_budget`` when its uid holds its
  share (store.coverage's gap reasons), counted per uid.
- bytes: what queued jobs hold (:func:`job_bytes`: build-id and path by
  length, and a constant), ``max_bytes`` in all, ``uid_share`` of it per uid
  other than root: a user picks how long their paths are.  Refused past it
  as past the slots.
- descriptors: the dup of the hand-over's descriptor a queued job holds,
  ``max_fds`` in all, BULK jobs (the start-up synthesis) a quarter of it at
  most.  A job beyond them is queued without one (path and identity only,
  counted ``no_fd`` per uid): the worker opens its path then, accepted only
  with the mapped file's identity.

Jobs are served round robin across uids, each uid's AT_RISK first, then LIVE,
then BULK (resolve.fairqueue.FairQueue): a flood's backlog delays another
uid's job by at most one job per uid with a backlog.  No lock here: the
Snapshotter's condition guards every call.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from buildidd.kernel.events import Identity
from buildidd.memo import text_bytes
from buildidd.resolve.fairqueue import QUEUE_FULL, ROOT_UID, UID_BUDGET, Budget, FairQueue, UidCounts
from buildidd.resolve.handover import HandOver
from buildidd.store.origin import KEY_GNU

__all__ = ["CopyJob", "CopyQueue", "priority_of"]

#: Uids shown in a status (the most queued first).
TOP_UIDS = 5
#: Bytes of one queued job besides its build-id and path (the tuples, its Identity, the queue's slot).
JOB_FIXED_BYTES = 500


def job_bytes(job: "CopyJob") -> int:
    """What a queued job holds, bytes (estimate): its build-id and path by length, plus JOB_FIXED_BYTES."""
    return text_bytes(job.build_id) + text_bytes(job.path) + JOB_FIXED_BYTES


class CopyJob(NamedTuple):
    """One queued copy.

    Attributes:
        build_id: the store key, lower-case hex (a GNU build-id, or an htlhash, see key);
        path: the mapping's path; ident: the mapped file's identity (None: unknown);
        priority: its HandOver (AT_RISK, LIVE, BULK); uid: the uid charged, the task that mapped or
        exec'd (Request.uid; -1: unknown); key: store.origin.KEYS, what build_id is;
        fd: the descriptor a queued job holds (a dup, closed by whoever takes the job), or None.
    """

    build_id: str
    path: str
    ident: Identity | None
    priority: HandOver = HandOver.LIVE
    uid: int = -1
    key: str = KEY_GNU
    fd: int | None = None


def priority_of(job: CopyJob, fd: int | None) -> HandOver:
    """job's priority, AT_RISK when its path is not absolute or names a deleted file, or when fd's
    file has no link left (fstat st_nlink 0) or cannot be asked."""
    if not job.path.startswith("/") or job.path.endswith(" (deleted)"):
        return HandOver.AT_RISK
    if fd is not None and job.priority != HandOver.AT_RISK:
        try:
            if os.fstat(fd).st_nlink == 0:
                return HandOver.AT_RISK
        except OSError:
            return HandOver.AT_RISK
    return job.priority


class _Queued(NamedTuple):
    """A job and the budget parts it holds (fairqueue.GENERAL or RESERVE; fd_part None: no descriptor)."""
    job: CopyJob
    slot_part: int
    fd_part: int | None


class CopyQueue:
    """The snapshot queue (see the module docstring).

    Args:
        max_jobs: slots; max_fds: descriptors held by queued jobs at most.
        uid_share: the part of each budget part one uid other than root may hold, in (0, 1].
        at_risk_reserve: the part of slots and of descriptors only AT_RISK jobs may take, in [0, 1).
        max_bytes: bytes the queued jobs hold at most (job_bytes), uid_share of it per uid but root.
    Attributes:
        refused: refusals by uid (either reason); no_fd: jobs queued without a descriptor, by uid.
    """

    def __init__(self, max_jobs: int, max_fds: int, uid_share: float, at_risk_reserve: float,
                 max_bytes: int = 4 << 20):
        self.max_bytes = max_bytes
        self.uid_max_bytes = int(max_bytes * uid_share)
        self.bytes = 0
        self._bytes_by_uid: dict[int, int] = {}      # only uids with a job queued
        self.slots = Budget(max_jobs, at_risk_reserve, uid_share)
        self.fds = Budget(max_fds, at_risk_reserve, uid_share)
        self.bulk_fds_max = max_fds // 4
        self._bulk_fds = 0
        self._order: FairQueue[_Queued] = FairQueue(levels=len(HandOver))
        self.refused = UidCounts()
        self.no_fd = UidCounts()

    def __len__(self) -> int:
        return len(self._order)

    def push(self, job: CopyJob, fd: int | None) -> CopyJob | str:
        """Queue job (its fd field ignored) with a dup of fd when a descriptor is left for its uid and
        priority: the job as queued (fd: the dup, or None), or the refusal (fairqueue.QUEUE_FULL,
        UID_BUDGET), counted in :attr:`refused`.  Raises nothing: a dup that fails queues the job
        without a descriptor."""
        urgent = job.priority == HandOver.AT_RISK
        cost = job_bytes(job)
        held = self._bytes_by_uid.get(job.uid, 0)
        if self.bytes + cost > self.max_bytes:
            slot = QUEUE_FULL
        elif job.uid != ROOT_UID and held + cost > self.uid_max_bytes:
            slot = UID_BUDGET
        else:
            slot = self.slots.take(job.uid, urgent)
        if isinstance(slot, str):
            self.refused.add(job.uid)
            return slot
        dup, fd_part = None, None
        if fd is not None:
            fd_part = self._take_fd(job)
            if fd_part is not None:
                try:
                    dup = os.dup(fd)
                except OSError:
                    self._release_fd(job, fd_part)
                    fd_part = None
            if dup is None:
                self.no_fd.add(job.uid)
        job = job._replace(fd=dup)
        self.bytes += cost
        self._bytes_by_uid[job.uid] = held + cost
        self._order.push(job.uid, int(job.priority), _Queued(job, slot, fd_part))
        return job

    def _take_fd(self, job: CopyJob) -> int | None:
        """A descriptor's budget part for job, or None (none left for its uid, or bulk's quarter full)."""
        if job.priority == HandOver.BULK and self._bulk_fds >= self.bulk_fds_max:
            return None
        part = self.fds.take(job.uid, job.priority == HandOver.AT_RISK)
        if isinstance(part, str):
            return None
        if job.priority == HandOver.BULK:
            self._bulk_fds += 1
        return part

    def _release_fd(self, job: CopyJob, part: int) -> None:
        self.fds.release(job.uid, part)
        if job.priority == HandOver.BULK:
            self._bulk_fds -= 1

    def pop(self) -> CopyJob | None:
        """The next job to copy (its slot and descriptor budget given back; the caller now owns and
        closes its fd), or None when empty."""
        got = self._order.pop()
        if got is None:
            return None
        _, queued = got
        self.slots.release(queued.job.uid, queued.slot_part)
        cost = job_bytes(queued.job)
        self.bytes -= cost
        left = self._bytes_by_uid.pop(queued.job.uid) - cost
        if left:
            self._bytes_by_uid[queued.job.uid] = left
        if queued.fd_part is not None:
            self._release_fd(queued.job, queued.fd_part)
        return queued.job

    def clear(self) -> list[CopyJob]:
        """Every job queued, removed in serving order (budgets given back; the caller closes their fds)."""
        out = []
        while (job := self.pop()) is not None:
            out.append(job)
        return out

    def memory(self) -> dict:
        """{"entries", "bytes", "max_bytes", "uid_max_bytes"}: the jobs queued and what they hold."""
        return {"entries": len(self._order), "bytes": self.bytes, "max_bytes": self.max_bytes,
                "uid_max_bytes": self.uid_max_bytes}

    def status(self) -> dict:
        """Small, JSON-ready: slots and descriptors held (in all, and by the TOP_UIDS uids holding most),
        the caps, uids with a job queued, refusals and jobs queued without a descriptor (by uid)."""
        return {"jobs": len(self._order), "fds": self.fds.total, "uids_queued": self._order.uids(),
                "slots_cap": list(self.slots.caps), "slots_uid_cap": list(self.slots.uid_caps),
                "fds_cap": list(self.fds.caps), "fds_uid_cap": list(self.fds.uid_caps),
                "jobs_by_uid": self.slots.top(TOP_UIDS), "fds_by_uid": self.fds.top(TOP_UIDS),
                "refused_by_uid": self.refused.top(TOP_UIDS), "no_fd_by_uid": self.no_fd.top(TOP_UIDS)}

"""The hand-over queue: which sightings the kernel read go to a hand-over worker, and on which pool.

The recording thread offers every mapping whose build-id the kernel read
(:meth:`HandOverQueue.offer`, no system call).  The first sighting of a
build-id at a path from one file (a :class:`~buildidd.resolve.resolution.Sighting`)
is queued as a :class:`~buildidd.resolve.handover.HandOverJob` on one of two
pools of hand-over workers (resolve.workers.WorkerPool, fair by uid); a later
one only lets the file's exec pin go.  The pools: live sightings of mmap'd
files (only their living process reaches them), and the rest: the bulk of the
start-up synthesis and exec'd files already pinned, so that neither queues
ahead of a live one.  A job is charged to Request.uid: refused when its pool
is full (gap ``handover_dropped``) or the uid holds its share of it (gap
``uid_budget``).  Whether the store needs the file at all is the job's first
question (HandOverJob.view, a StoreView: a synchronous call that answers from
memory and a ``stat`` of the store's own entry), asked on the worker today.
"""

from __future__ import annotations

import time

from buildidd.kernel.events import MapOrigin, RawEvent
from buildidd.memo import LruCache, text_bytes
from buildidd.resolve.fairqueue import UID_BUDGET
from buildidd.resolve.handover import HandOverJob
from buildidd.resolve.resolution import Request, Resolution, Sighting, job_cost, request_of
from buildidd.resolve.workers import PoolPolicy, WorkerPool

__all__ = ["HandOverQueue"]

#: Bytes the hand-overs' memory (HandOverQueue.handed, keyed by Sighting) keeps at most.
HANDED_MAX_BYTES = 3 << 20
#: Bytes of a Sighting key and its entry besides the strings counted by length.
_HANDED_FIXED_BYTES = 360
#: Mappings made by execve (the executable, its interpreter): their files have exec pins.
_EXEC_ORIGINS = (MapOrigin.EXEC_MAIN, MapOrigin.EXEC_INTERP)


def handed_cost(key: Sighting, _value: bool) -> int:
    """Bytes one entry of the hand-overs' memory holds (memo.Cost): build-id and path by length."""
    return text_bytes(key.build_id) + text_bytes(key.path) + _HANDED_FIXED_BYTES


class HandOverQueue:
    """The hand-over pools and the memory of what was handed over (see the module docstring).

    Args:
        job: the job its workers run (its pins and on_gap are the queue's too).
        pool: the resolve pool's policy (the hand-over pools take its queue bound, its stuck time and a
            quarter of its threads, at least 2 each).
        uid_share: the part of each pool's queue one uid other than root may hold (Config.queue_uid_share).
        max_entries: sightings remembered as handed over at most (within HANDED_MAX_BYTES).
    Thread safety: :meth:`offer` is the recording thread's; :attr:`handed` and :attr:`dropped` are
    touched by it only (status reads them as a cache and an int: a reader sees the old value or the
    new).  The pools lock themselves.
    """

    def __init__(self, job: HandOverJob, pool: PoolPolicy, uid_share: float, max_entries: int = 65536):
        self.job = job
        self.live = self._pool("buildidd-handover", pool, uid_share)
        self.bulk = self._pool("buildidd-handover-bulk", pool, uid_share)
        #: Sightings whose file was handed over (bounded).  Recording thread only.
        self.handed: LruCache[Sighting, bool] = LruCache("kernel_handed", max_entries, max_bytes=HANDED_MAX_BYTES,
                                                         cost=handed_cost)
        #: Hand-overs refused by a pool (``handovers_dropped``).  Recording thread only.
        self.dropped = 0

    @staticmethod
    def _pool(name: str, p: PoolPolicy, uid_share: float) -> WorkerPool:
        """One fair pool of hand-over workers (workers.WorkerPool.submit_charged)."""
        return WorkerPool(PoolPolicy(workers=1, max_threads=max(2, p.max_threads // 4), queue_max=p.queue_max,
                                     stuck_after_s=p.stuck_after_s, uid_share=uid_share), name=name)

    def offer(self, ev: RawEvent, res: Resolution) -> None:
        """A mapping whose build-id (or verdict) the kernel read (recording thread; no system call).

        Sightings whose hand-over reached no file are forgotten first (their next sighting is
        handed over again).  The first sighting goes to a hand-over worker: the store still wants
        the file, and a root-owned copy met after a user's must reach it too; a later one lets
        the file's exec pin go.  Refused jobs are counted (:attr:`dropped`, and by uid in the
        pool's status) and named to the job's on_gap.
        """
        for gone in self.job.take_unreached():
            self.handed.pop(gone)
        pins = self.job.pins
        seen = Sighting(res.build_id, ev.path, ev.identity.dev, ev.identity.ino)
        if seen in self.handed:
            if pins is not None:
                pins.release(ev.identity)
            return
        self.handed.put(seen, True)
        req = request_of(ev, ev.path)
        # The live pool is for files only a living process reaches (mmap'd); an exec'd file on a
        # marked file system is pinned already, so it waits with the bulk.
        pinned = ev.origin in _EXEC_ORIGINS and pins is not None and pins.covers(ev.identity.dev)
        pool = self.bulk if req.bulk or pinned else self.live
        if pinned:
            pins.claim(ev.identity, ev.pid, ev.uid)     # its pin waits for this hand-over
        got = pool.submit_charged(self._pinned if pinned else self.job.run, (req, res), req.uid, job_cost(ev.path))
        if isinstance(got, str):
            if pinned:
                pins.unclaim(ev.identity)
            self.dropped += 1
            self.handed.pop(seen)
            if self.job.on_gap is not None and res.build_id:
                self.job.on_gap(res.build_id, ev.path, UID_BUDGET if got == UID_BUDGET else "handover_dropped",
                                ev.uid)

    def _pinned(self, arg: tuple[Request, Resolution]) -> bool:
        """HandOverJob.run of an exec'd file whose pin was claimed (ExecPins.claim); the claim ends with it."""
        req, _ = arg
        try:
            return self.job.run(arg)
        finally:
            self.job.pins.unclaim(req.identity)

    def drain(self, timeout_s: float) -> None:
        """Wait for the queued hand-overs to reach the store, both pools within timeout_s seconds in
        all (WorkerPool.drain; any thread but a worker's)."""
        deadline = time.monotonic() + timeout_s
        for pool in (self.live, self.bulk):
            pool.drain(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Stop both pools (blocked workers are left behind)."""
        self.live.close()
        self.bulk.close()

    def status(self) -> dict:
        """The hand-over counters of the ``resolve`` status (JSON-ready): ``handovers_dropped``,
        ``handovers_settled`` (HandOverJob.settled_count) and each pool's WorkerPool.status."""
        return {"handovers_dropped": self.dropped, "handovers_settled": self.job.settled_count,
                "handover_pool": self.live.status(), "bulk_handover_pool": self.bulk.status()}

"""Enrichment: a mapping's file identity → the build-id of that exact file.

Answers are cached by identity (dev, ino, generation, size, mtime), so a library
is opened and parsed once, not once per process.  The cache is a bounded LRU;
answers that depend only on the file's contents (a build-id, no note, not ELF,
malformed, not a regular file, on FUSE) are kept until evicted.  "Could not
open the right file" answers are kept too, but the next event for that
identity retries its own /proc/PID/map_files route, the one route that can
still succeed later.

The recording thread never opens, stats or reads a mapped file itself: every
route (procfs.open_route, open_identified) runs as a job on a
resolve.workers.WorkerPool, and the thread waits for it at most
:attr:`Offload.deadline_s`, and within one step at most the budget given to
:meth:`Enricher.begin_step`.  A job that misses its wait gives the mapping the
reason ``timeout`` at once and goes on; its answer comes back through
:meth:`Enricher.take_late` (the recorder writes it as a ``resolution``
record).  While a device has a job past its deadline (or did in the last
:data:`SUSPECT_S` seconds), new jobs for files on it are queued without
waiting: one stuck file system costs one deadline, not one per file.

Every file read here gets its ``file_id`` (htlhash, resolve.fileid) on its
resolution, and a Go binary without a GNU build-id its ``go_build_id``.  A
file whose build-id the kernel read gets its htlhash from its hand-over
(routes.Routes.hand_over, a worker: the recording thread never reads a file),
once per identity, written later as a ``file_id`` record (:meth:`Enricher.take_file_keys`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from buildidd.config import Config
from buildidd.kernel.events import KERNEL_FINAL, Identity, MapOrigin, RawEvent
from buildidd.memo import LruCache, text_bytes
from buildidd.resolve.fairqueue import UID_BUDGET
from buildidd.resolve.procfs import Source
from buildidd.resolve.reasons import MissReason
from buildidd.resolve.routes import FileKey, OnBuildId, Request, Resolution, Routes, kernel_resolution, make_resolution
from buildidd.resolve.workers import Job, PoolPolicy, WorkerPool

__all__ = ["Enricher", "Offload", "Resolution", "kernel_resolution"]

#: Seconds a device stays suspect after a job on it missed its deadline.
SUSPECT_S = 10.0
#: Suspect devices remembered at most (the oldest forgotten first).
SUSPECT_MAX = 1024
#: Bytes the identity cache keeps at most (resolution_cost of its entries): each answer holds the
#: path it was found at and its JSON tail, and a user picks how long a path is.
IDENTITY_CACHE_MAX_BYTES = 6 << 20
#: Bytes the kernel hand-overs' memory (Enricher.handed, keyed by build-id and path) keeps at most.
HANDED_MAX_BYTES = 3 << 20
#: Bytes of an Identity, a Resolution and their dict entry besides the strings counted by length.
_ANSWER_FIXED_BYTES = 600
#: Bytes of a (build-id, path, dev, inode) key and its entry besides the strings counted by length.
_HANDED_FIXED_BYTES = 360


#: Bytes of a queued job (workers.Job, its Request and Resolution) besides the path counted by length.
_JOB_FIXED_BYTES = 1000


def job_cost(path: str) -> int:
    """Bytes a worker job for a mapping of path holds while it waits (WorkerPool.submit's cost)."""
    return text_bytes(path) + _JOB_FIXED_BYTES


def resolution_cost(_ident: Identity, res: Resolution) -> int:
    """Bytes one identity cache entry holds (memo.Cost): its path, JSON tail and keys by length, plus
    a constant for the objects around them."""
    return (text_bytes(res.path) + text_bytes(res.json_tail) + text_bytes(res.go_build_id)
            + text_bytes(res.file_id) + _ANSWER_FIXED_BYTES)


def handed_cost(key: tuple[str, str, int, int], _value: bool) -> int:
    """Bytes one entry of the kernel hand-overs' memory holds (memo.Cost): build-id and path by length."""
    return text_bytes(key[0]) + text_bytes(key[1]) + _HANDED_FIXED_BYTES


#: Mappings made by execve (the executable, its interpreter): their files have exec pins.
_EXEC_ORIGINS = (MapOrigin.EXEC_MAIN, MapOrigin.EXEC_INTERP)


@dataclass(frozen=True)
class Offload:
    """How resolution is handed to workers: Config.resolve_deadline_s and the pool's sizes;
    handover_uid_share: Config.queue_uid_share, the part of each hand-over pool's queue one uid
    other than root may hold (PoolPolicy.uid_share)."""

    deadline_s: float = 0.2
    pool: PoolPolicy = field(default_factory=PoolPolicy)
    handover_uid_share: float = 0.25

    @classmethod
    def from_config(cls, config: Config) -> "Offload":
        """Config.resolve_deadline_s (seconds), also the time after which a busy worker counts as
        stuck; Config.resolve_workers threads kept, up to 8 times as many while some are stuck."""
        workers = config.resolve_workers
        return cls(config.resolve_deadline_s, PoolPolicy(workers=workers, max_threads=8 * workers,
                                                         stuck_after_s=config.resolve_deadline_s),
                   config.queue_uid_share)


_TIMED_OUT = object()


class Enricher:
    """Resolves identities to build-ids, with a bounded identity cache; file work on workers.

    Args:
        cache_entries: identities kept (LRU), within IDENTITY_CACHE_MAX_BYTES.
        on_resolved: called with (identity, Resolution) when an identity gets a
            final answer (the tracer then stops sending its path); recording thread.
        on_evicted: called with an identity dropped from the cache; recording thread.
        on_build_id: called with (identity, Resolution, fd, routes.HandOver, uid) when a
            build-id was just read from fd (still open: the callee may dup it, e.g.
            to snapshot the exact inode).  Called on a worker thread.
        offload: the deadline and the pool's sizes.
    """

    def __init__(self, cache_entries: int = 65536,
                 on_resolved: Callable[[Identity, Resolution], None] | None = None,
                 on_evicted: Callable[[Identity], None] | None = None,
                 on_build_id: OnBuildId | None = None,
                 offload: Offload | None = None):
        self.cache: LruCache[Identity, Resolution] = LruCache("identity", cache_entries,
                                                              on_evict=self._evicted,
                                                              max_bytes=IDENTITY_CACHE_MAX_BYTES,
                                                              cost=resolution_cost)
        self.on_resolved = on_resolved
        self.on_evicted = on_evicted
        self.routes = Routes(self.cache, on_build_id)
        self.offload = offload or Offload()
        self.pool = WorkerPool(self.offload.pool)
        self.handovers = self._handover_pool("buildidd-handover")
        self.bulk_handovers = self._handover_pool("buildidd-handover-bulk")
        self.resolved = 0
        self.missing: dict[str, int] = {}
        self.timeouts = 0
        self._pending: dict[Identity, Job] = {}
        self._suspect: dict[int, float] = {}
        self._budget_s = float("inf")
        #: (build-id, path) pairs the kernel read whose file was handed to on_build_id (bounded).
        #: Keyed by (build-id, path, dev, inode): a user's file claiming a build-id at a path (a bind
        #: mount in their own namespace) never stands for the root-owned file met there later.
        self.handed: LruCache[tuple[str, str, int, int], bool] = LruCache("kernel_handed", cache_entries,
                                                                            max_bytes=HANDED_MAX_BYTES,
                                                                            cost=handed_cost)
        self.handovers_dropped = 0

    def _handover_pool(self, name: str) -> WorkerPool:
        """Hand-overs' own workers, apart from resolutions the recording thread waits for.  Two
        pools: live sightings of mmap'd files (only their living process reaches them), and the
        rest: the bulk of the start-up synthesis (every DSO of every running process) and exec'd
        files already pinned (resolve.execpins), so that neither queues ahead of a live one.  Each
        is fair: a job is charged to Request.uid, one uid other than root holds at most
        Offload.handover_uid_share of its queue, uids take turns (workers.WorkerPool.submit_charged)."""
        p = self.offload.pool
        return WorkerPool(PoolPolicy(workers=1, max_threads=max(2, p.max_threads // 4), queue_max=p.queue_max,
                                     stuck_after_s=p.stuck_after_s, uid_share=self.offload.handover_uid_share),
                          name=name)

    # -- cache -------------------------------------------------------------
    @property
    def hits(self) -> int:
        """Lookups answered from the identity cache (final answers only)."""
        return self.cache.hits

    @property
    def misses(self) -> int:
        """Lookups that had to open and read a file."""
        return self.cache.misses

    def _evicted(self, ident: Identity, _res: Resolution) -> None:
        if self.on_evicted is not None:
            self.on_evicted(ident)

    def _store(self, ident: Identity, res: Resolution) -> Resolution:
        self.cache.put(ident, res)
        if res.final and self.on_resolved:
            self.on_resolved(ident, res)
        return res

    def count(self, res: Resolution) -> None:
        """Count one recorded mapping's outcome (build-id found, or missing by reason)."""
        if res.build_id:
            self.resolved += 1
        else:
            key = res.error or "unknown"
            self.missing[key] = self.missing.get(key, 0) + 1

    # -- the recording thread's side -----------------------------------------
    def begin_step(self, budget_s: float) -> None:
        """Start a step: the thread waits for workers at most budget_s seconds in all until the next call."""
        self._budget_s = budget_s

    def resolve(self, ev: RawEvent) -> Resolution:
        """The Resolution for a MAP or EXEC event's file (cached, else resolved on a worker).

        Never raises for a per-file problem: the Resolution's error says what
        went wrong (``timeout`` when the worker did not answer in time).
        Raises:
            Exception: whatever unexpected error the worker's job raised (a bug; the caller counts it).
        """
        if ev.pc_status in KERNEL_FINAL:
            self.cache.count_hits(1)     # answered without a file read, as the fast path counts it
            res = kernel_resolution(ev)
            while self.routes.unreached:     # hand-overs that found no route: the next sighting tries again
                self.handed.pop(self.routes.unreached.popleft())
            if self.routes.on_build_id is not None:
                self._hand_over(ev, res)     # with or without a build-id: the store keeps it, and its htlhash
            return res
        ident = ev.identity
        res = self.cache.peek(ident)
        if res is not None and not res.final:
            # Unreachable before: only the mapping itself can still help.
            if ident in self._pending or ev.start == 0 or ev.length == 0:
                return res
            req = _request(ev, ev.path or res.path)
            got = self._offload(ident, self.routes.retry, req, job_cost(req.path))
            return self._store(ident, got) if isinstance(got, Resolution) else res
        res = self.cache.get(ident)         # counts the hit or the miss
        if res is not None:
            return res
        got = self._offload(ident, self.routes.fresh, _request(ev, ev.path), job_cost(ev.path))
        if got is _TIMED_OUT:
            self.timeouts += 1
            return self._store(ident, make_resolution(ident, None, Source.NONE, MissReason.TIMEOUT, ev.path))
        return self._store(ident, got)

    def _hand_over(self, ev: RawEvent, res: Resolution) -> None:
        """The first sighting of a build-id at a path (the kernel read it) goes to a hand-over
        worker: the store still wants the file, and a root-owned copy met after a user's must
        reach it too.  A later one lets the file's exec pin go (Routes.pins).  The job is charged to
        the event's uid: refused when its pool is full (gap ``handover_dropped``) or the uid holds its
        share of it (gap ``uid_budget``), counted ``handovers_dropped`` and by uid in the pool's status."""
        seen = (res.build_id, ev.path, ev.identity.dev, ev.identity.ino)
        if seen in self.handed:
            if self.routes.pins is not None:
                self.routes.pins.release(ev.identity)
            return
        self.handed.put(seen, True)
        req = _request(ev, ev.path)
        pins = self.routes.pins
        # The live pool is for files only a living process reaches (mmap'd); an exec'd file on a
        # marked file system is pinned already, so it waits with the bulk.
        pinned = ev.origin in _EXEC_ORIGINS and pins is not None and pins.covers(ev.identity.dev)
        pool = self.bulk_handovers if req.bulk or pinned else self.handovers
        if pinned:
            pins.claim(ev.identity, ev.pid, ev.uid)     # its pin waits for this hand-over
        got = pool.submit_charged(self._pinned_hand_over if pinned else self.routes.hand_over, (req, res), req.uid,
                                 job_cost(ev.path))
        if isinstance(got, str):
            if pinned:
                pins.unclaim(ev.identity)
            self.handovers_dropped += 1
            self.handed.pop(seen)
            if self.routes.on_gap is not None and res.build_id:
                self.routes.on_gap(res.build_id, ev.path, UID_BUDGET if got == UID_BUDGET else "handover_dropped",
                                   ev.uid)

    def _pinned_hand_over(self, arg: tuple[Request, Resolution]) -> bool:
        """Routes.hand_over of an exec'd file whose pin was claimed (ExecPins.claim); the claim ends with it."""
        try:
            return self.routes.hand_over(arg)
        finally:
            self.routes.pins.unclaim(arg[0].identity)

    def resolve_scanned(self, pid: int, vma: tuple[int, int], path: str) -> tuple[Identity, Resolution] | None:
        """Open pid's mapping vma = (vm_start, vm_end) through map_files (on a worker): (identity, Resolution).

        For the /proc/PID/maps scans.  None when the mapping cannot be opened
        or the worker did not answer in time (its answer is then cached when it
        comes, with no record written).
        Raises:
            Exception: an unexpected error of the job (a bug; the caller counts it).
        """
        got = self._offload(None, self.routes.scan, (pid, vma, path), job_cost(path))
        if got is _TIMED_OUT or got is None:
            return None
        ident, res, cached = got
        if cached:
            self.cache.count_hits(1)
            return ident, res
        self.cache.count_miss()
        if res.final or ident not in self.cache:
            self._store(ident, res)
        return ident, res

    def take_late(self) -> list[tuple[Identity, Resolution]]:
        """Answers of jobs that missed their deadline and have finished since: cached, and returned to be written.

        Only answers for identities whose mappings were recorded (not the
        scans'), and only when they differ from the ``timeout`` recorded.
        """
        out = []
        for job in self.pool.take_late():
            if job.fn == self.routes.scan:
                if job.error is None and job.result is not None and not job.result[2]:
                    ident, res, _ = job.result
                    if res.final and ident not in self.cache:
                        self._store(ident, res)
                continue
            ident = job.arg.identity
            if self._pending.get(ident) is job:
                del self._pending[ident]
            res = job.result
            if job.error is not None or not isinstance(res, Resolution):
                continue
            self._store(ident, res)
            out.append((ident, res))
        return out

    def idle(self) -> bool:
        """True when no late answer waits to be written (as a ``resolution`` record), nor an htlhash (as
        a ``file_id`` record): one still in flight is not waited for, its worker calls pool.on_late when
        it finishes."""
        return not self.pool.has_late() and not self.routes.file_keys

    def take_file_keys(self) -> list[FileKey]:
        """The htlhashes hand-overs computed since the last call (routes.FileKey), to be written as
        ``file_id`` records; recording thread."""
        keys = self.routes.file_keys
        return [keys.popleft() for _ in range(len(keys))]

    def status(self) -> dict:
        """Worker pool and deadline counters (JSON-ready)."""
        now = time.monotonic()
        return {**self.pool.status(), "timeouts": self.timeouts, "pending": len(self._pending),
                "suspect_devices": sum(1 for t in self._suspect.values() if t > now),
                "deadline_s": self.offload.deadline_s, "handovers_dropped": self.handovers_dropped,
                "file_ids_dropped": self.routes.file_keys_dropped,
                "handovers_settled": self.routes.settled_handovers,
                "handover_pool": self.handovers.status(), "bulk_handover_pool": self.bulk_handovers.status()}

    def close(self) -> int:
        """Stop the workers (blocked ones are left behind); the number of resolutions abandoned."""
        self.handovers.close()
        self.bulk_handovers.close()
        return self.pool.close()

    def _offload(self, ident: Identity | None, fn: Callable, arg, cost: int):
        """Run fn(arg) on a worker (a job holding cost bytes while it waits: job_cost) and wait for it
        within the deadline and the step's budget.

        Returns its result, or _TIMED_OUT (the job is then pending: take_late).
        """
        dev = ident.dev if ident is not None else None
        now = time.monotonic()
        wait = min(self.offload.deadline_s, self._budget_s)
        if (dev is not None and self._suspect.get(dev, 0.0) > now) or not self.pool.can_run_now():
            wait = 0.0
        job = self.pool.submit(fn, arg, cost)
        if job is None:
            return _TIMED_OUT
        done = self.pool.wait(job, wait)
        self._budget_s -= time.monotonic() - now
        if done:
            if job.error is not None:
                raise job.error
            return job.result
        if dev is not None:
            self._suspect.pop(dev, None)
            self._suspect[dev] = time.monotonic() + SUSPECT_S
            while len(self._suspect) > SUSPECT_MAX:
                del self._suspect[next(iter(self._suspect))]
        if ident is not None:
            self._pending[ident] = job
        return _TIMED_OUT


def _request(ev: RawEvent, path: str) -> Request:
    return Request(ev.pid, ev.start, ev.length, path, ev.nlink, ev.identity, ev.time_ns,
                   ev.origin == MapOrigin.SYNTHESIZED, ev.uid)

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
mapping whose build-id the kernel read is offered to the hand-over sink given
to the constructor (resolve.handoverqueue.HandOverQueue.offer, through the
recorder); its htlhash comes back from its hand-over (resolve.handover, a
worker: the recording thread never reads a file), once per identity, through
:attr:`Enricher.file_keys`, written later as a ``file_id`` record
(:meth:`Enricher.take_file_keys`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from buildidd.config import Config
from buildidd.kernel.events import KERNEL_FINAL, Identity, RawEvent
from buildidd.memo import LruCache, text_bytes
from buildidd.resolve.filekeys import FileKey, FileKeys
from buildidd.resolve.handover import OnBuildId
from buildidd.resolve.procfs import Source
from buildidd.resolve.reasons import MissReason
from buildidd.resolve.resolution import Resolution, job_cost, kernel_resolution, make_resolution, request_of
from buildidd.resolve.routes import Routes
from buildidd.resolve.workers import Job, PoolPolicy, WorkerPool

__all__ = ["Enricher", "HandOverSink", "Offload", "Resolution", "kernel_resolution"]

#: Seconds a device stays suspect after a job on it missed its deadline.
SUSPECT_S = 10.0
#: Suspect devices remembered at most (the oldest forgotten first).
SUSPECT_MAX = 1024
#: Bytes the identity cache keeps at most (resolution_cost of its entries): each answer holds the
#: path it was found at and its JSON tail, and a user picks how long a path is.
IDENTITY_CACHE_MAX_BYTES = 6 << 20
#: Bytes of an Identity, a Resolution and their dict entry besides the strings counted by length.
_ANSWER_FIXED_BYTES = 600


def resolution_cost(_ident: Identity, res: Resolution) -> int:
    """Bytes one identity cache entry holds (memo.Cost): its path, JSON tail and keys by length, plus
    a constant for the objects around them."""
    return (text_bytes(res.path) + text_bytes(res.json_tail) + text_bytes(res.go_build_id)
            + text_bytes(res.file_id) + _ANSWER_FIXED_BYTES)


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

HandOverSink = Callable[[RawEvent, Resolution], None]
"""``hand_over(event, resolution)``: a MAP or EXEC event whose build-id (or verdict) the kernel read,
offered on the recording thread (resolve.handoverqueue.HandOverQueue.offer); no system call."""


class Enricher:
    """Resolves identities to build-ids, with a bounded identity cache; file work on workers.

    Args:
        cache_entries: identities kept (LRU), within IDENTITY_CACHE_MAX_BYTES.
        on_late: called on a worker thread once a late answer waits for take_late (the recorder's
            wake-up: it ends a quiet wait; WorkerPool.on_late).
        on_evicted: called with an identity dropped from the cache; recording thread.
        on_build_id: called with (identity, Resolution, fd, handover.HandOver, uid) when a
            build-id was just read from fd (still open: the callee may dup it, e.g.
            to snapshot the exact inode).  Called on a worker thread.
        offload: the deadline and the pool's sizes.
        hand_over: where a mapping the kernel read goes (HandOverSink); None: nowhere (no store).
    Attributes:
        file_keys: the htlhashes hand-overs compute (resolve.filekeys.FileKeys; the hand-over job
            is given it), taken by :meth:`take_file_keys`.
    Thread safety: every method is the recording thread's, but :meth:`status` (any thread: its
    counters are ints written by the recording thread only, read as they are).  The worker jobs
    (routes.Routes) only peek the cache.
    """

    def __init__(self, cache_entries: int = 65536,
                 on_late: Callable[[], None] | None = None,
                 on_evicted: Callable[[Identity], None] | None = None,
                 on_build_id: OnBuildId | None = None,
                 offload: Offload | None = None, hand_over: HandOverSink | None = None):
        self.cache: LruCache[Identity, Resolution] = LruCache("identity", cache_entries,
                                                              on_evict=self._evicted,
                                                              max_bytes=IDENTITY_CACHE_MAX_BYTES,
                                                              cost=resolution_cost)
        self.on_evicted = on_evicted
        self.routes = Routes(self.cache, on_build_id)
        self.hand_over = hand_over
        self.file_keys = FileKeys()
        self.offload = offload or Offload()
        self.pool = WorkerPool(self.offload.pool, on_late=on_late)
        self.resolved = 0
        self.missing: dict[str, int] = {}
        self.timeouts = 0
        self._pending: dict[Identity, Job] = {}
        self._suspect: dict[int, float] = {}
        self._budget_s = float("inf")
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
            if self.hand_over is not None:
                self.hand_over(ev, res)      # with or without a build-id: the store keeps it, and its htlhash
            return res
        ident = ev.identity
        res = self.cache.peek(ident)
        if res is not None and not res.final:
            # Unreachable before: only the mapping itself can still help.
            if ident in self._pending or ev.start == 0 or ev.length == 0:
                return res
            req = request_of(ev, ev.path or res.path)
            got = self._offload(ident, self.routes.retry, req, job_cost(req.path))
            return self._store(ident, got) if isinstance(got, Resolution) else res
        res = self.cache.get(ident)         # counts the hit or the miss
        if res is not None:
            return res
        got = self._offload(ident, self.routes.fresh, request_of(ev, ev.path), job_cost(ev.path))
        if got is _TIMED_OUT:
            self.timeouts += 1
            return self._store(ident, make_resolution(ident, None, Source.NONE, MissReason.TIMEOUT, ev.path))
        return self._store(ident, got)

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
        return not self.pool.has_late() and not len(self.file_keys)

    def take_file_keys(self) -> list[FileKey]:
        """The htlhashes hand-overs computed since the last call (filekeys.FileKey), to be written as
        ``file_id`` records; recording thread."""
        return self.file_keys.take()

    def status(self) -> dict:
        """Worker pool and deadline counters (JSON-ready); the hand-overs' are HandOverQueue.status."""
        now = time.monotonic()
        return {**self.pool.status(), "timeouts": self.timeouts, "pending": len(self._pending),
                "suspect_devices": sum(1 for t in self._suspect.values() if t > now),
                "deadline_s": self.offload.deadline_s, "file_ids_dropped": self.file_keys.dropped}

    def close(self) -> int:
        """Stop the workers (blocked ones are left behind); the number of resolutions abandoned."""
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


"""Worker threads for the file system calls of resolution, so the recording thread never blocks on one.

Opening and reading a mapped file can block for as long as the file's owner
wants: a FUSE file system answers when its process decides to, an NFS server
may be gone.  The enricher hands each such job to a :class:`WorkerPool` and
waits for it at most a deadline; a job that misses it goes on in its worker,
and its result is handed back later through :meth:`WorkerPool.take_late`.

Bounds: at most ``queue_max`` jobs wait (beyond: refused and counted), at most
``max_threads`` threads exist.  A worker busy with one job for longer than the
deadline counts as stuck; when no worker is idle, a new one is started (up to
max_threads) so that one stuck file system does not stop the resolution of
files elsewhere; they stay until close.  All are
daemon threads: a worker blocked in a system call never holds up the exit of
the process (:meth:`WorkerPool.close` says how many jobs were abandoned).

A pool with ``PoolPolicy.uid_share`` set (the hand-over pools) is fair:
:meth:`WorkerPool.submit_charged` charges each job to a uid, a uid other than
root holds at most that share of ``queue_max`` (beyond it its jobs are refused,
``uid_budget``, counted per uid), and workers take jobs round robin across uids
(resolve.fairqueue), so that one user's backlog delays another's job by at most
one job.
"""

from __future__ import annotations

import _thread
import collections
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from buildidd.resolve.fairqueue import QUEUE_FULL, ROOT_UID, UID_BUDGET, Budget, FairQueue, UidCounts

__all__ = ["Job", "PoolPolicy", "WorkerPool"]


@dataclass(frozen=True)
class PoolPolicy:
    """Sizes of a WorkerPool.

    Attributes:
        workers: threads kept (idle or busy), >= 1.
        max_threads: threads at most, counting stuck ones (>= workers).
        queue_max: jobs waiting for a thread at most.
        stuck_after_s: a worker on one job this long (seconds) is stuck.
        uid_share: None (first come, first served), or the part of queue_max one uid other than root
            may hold, in (0, 1]: jobs then go through submit_charged and are served round robin by uid.
        queue_max_bytes: the bytes waiting jobs hold at most, as the submitter counts them (the
            cost given to submit: a path's length and a constant); beyond, as beyond queue_max.  In
            a fair pool one uid other than root holds at most uid_share of it too.
    """

    workers: int = 2
    max_threads: int = 16
    queue_max: int = 4096
    stuck_after_s: float = 0.2
    uid_share: float | None = None
    queue_max_bytes: int = 2 << 20

#: What a fair pool's SimpleQueue carries: "take the next job from the fair queue".
_FAIR = object()
#: Uids shown by a fair pool's status.
_TOP_UIDS = 5


class Job:
    """One call fn(arg) to run on a worker.

    Attributes:
        fn, arg: the call.
        result: its return value once done; error: the exception it raised (or None).
        late: the waiter gave up on it; the result goes to WorkerPool.take_late.
        started: time.monotonic() when a worker took it (0 while queued).
    """

    __slots__ = ("fn", "arg", "result", "error", "late", "started", "cost", "_done")

    def __init__(self, fn: Callable[[Any], Any], arg: Any, cost: int = 0):
        self.fn = fn
        self.arg = arg
        self.cost = cost
        self.result: Any = None
        self.error: BaseException | None = None
        self.late = False
        self.started = 0.0
        self._done = threading.Lock()
        self._done.acquire()

    @property
    def done(self) -> bool:
        """True once the call returned or raised."""
        return not self._done.locked()


class WorkerPool:
    """A bounded pool of daemon threads running Jobs (see the module docstring).

    Args:
        policy: its sizes.
        name: thread name prefix.
        on_late: called (on the worker's thread) after a late job finished: e.g. to wake the recorder.
    """

    def __init__(self, policy: PoolPolicy = PoolPolicy(), name: str = "buildidd-resolve",
                 on_late: Callable[[], None] | None = None):
        self.policy = policy
        self.name = name
        #: Guards every field below (counters, queues, threads) but _queue (a SimpleQueue, which locks
        #: itself) and on_late (never changed).
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()   # C: no Python-level wake-up cost
        self._queued = 0
        self._queued_bytes = 0
        self._bytes_by_uid: dict[int, int] = {}      # a fair pool's queued bytes by uid (only uids holding some)
        #: Late jobs finished, appended and taken under _lock.  has_late() and take_late() first look at
        #: its length without the lock, as a hint only: len() of a deque is one C call that the GIL
        #: runs whole, and a job appended just after the look is taken at the next call (its worker
        #: calls on_late after the append, waking the recording thread for it).
        self._late: collections.deque[Job] = collections.deque()
        self.on_late = on_late
        self._running: dict[int, Job] = {}      # thread ident -> its job
        self._threads = 0
        self._idle = 0
        self._closed = False
        #: A fair pool's order, slots by uid and refusals by uid (None: first come, first served).
        self._fair: FairQueue[Job] | None = FairQueue() if policy.uid_share is not None else None
        self._slots = Budget(policy.queue_max, 0.0, policy.uid_share) if policy.uid_share is not None else None
        self.refused = UidCounts()
        self.stats = {"submitted": 0, "completed": 0, "queue_dropped": 0, "timed_out": 0,
                      "late_completed": 0, "threads_started": 0, "threads_failed": 0}
        with self._lock:            # the kept workers, before anyone waits for one
            for _ in range(policy.workers):
                self._start_thread()

    # -- the recording thread's side ----------------------------------------
    def submit(self, fn: Callable[[Any], Any], arg: Any, cost: int = 0) -> Job | None:
        """Queue fn(arg), which holds cost bytes while it waits; the Job, or None when the queue is
        full (queue_max jobs, or queue_max_bytes) or the pool closed (counted)."""
        with self._lock:
            if self._closed or self._queued >= self.policy.queue_max \
                    or self._queued_bytes + cost > self.policy.queue_max_bytes:
                self.stats["queue_dropped"] += 1
                return None
            job = Job(fn, arg, cost)
            self._queued += 1
            self._queued_bytes += cost
            self.stats["submitted"] += 1
            if self._idle < self._queued and self._threads < self.policy.max_threads:
                self._start_thread()
        self._queue.put(job)
        return job

    def submit_charged(self, fn: Callable[[Any], Any], arg: Any, uid: int, cost: int = 0) -> Job | str:
        """Queue fn(arg) charged to uid (a fair pool: PoolPolicy.uid_share set), holding cost bytes while
        it waits: the Job, or why it was refused: fairqueue.QUEUE_FULL (queue_max jobs or queue_max_bytes
        wait, or the pool is closed) or UID_BUDGET (uid holds its share of the slots or of the bytes),
        counted ``queue_dropped`` and in :attr:`refused` by uid.

        Raises:
            ValueError: the pool is not fair.
        """
        if self._fair is None:
            raise ValueError(f"{self.name}: not a fair pool (PoolPolicy.uid_share unset)")
        with self._lock:
            got = self._bytes_refusal(uid, cost) or (QUEUE_FULL if self._closed else self._slots.take(uid, False))
            if isinstance(got, str):
                self.stats["queue_dropped"] += 1
                self.refused.add(uid)
                return got
            job = Job(fn, arg, cost)
            self._fair.push(uid, 0, job)
            self._queued += 1
            self._queued_bytes += cost
            if cost:
                self._bytes_by_uid[uid] = self._bytes_by_uid.get(uid, 0) + cost
            self.stats["submitted"] += 1
            if self._idle < self._queued and self._threads < self.policy.max_threads:
                self._start_thread()
        self._queue.put(_FAIR)
        return job

    def _bytes_refusal(self, uid: int, cost: int) -> str | None:
        """Why a job of uid holding cost bytes may not wait (lock held): QUEUE_FULL past
        queue_max_bytes, UID_BUDGET past uid's share of it (root has none); None: it may."""
        limit = self.policy.queue_max_bytes
        if self._queued_bytes + cost > limit:
            return QUEUE_FULL
        if uid != ROOT_UID and self._bytes_by_uid.get(uid, 0) + cost > limit * self.policy.uid_share:
            return UID_BUDGET
        return None

    def can_run_now(self) -> bool:
        """True when a submitted job would start at once: an idle thread, or room for a new one.  A
        hint read without _lock (three ints, each read whole): a wrong guess only changes whether the
        caller waits for this one job."""
        return self._idle > self._queued or self._threads < self.policy.max_threads

    def wait(self, job: Job, timeout_s: float) -> bool:
        """Wait up to timeout_s seconds for job; True when done.  False marks it late (see take_late)."""
        if timeout_s > 0 and job._done.acquire(timeout=timeout_s):
            job._done.release()
            return True
        with self._lock:
            if job.done:
                return True
            job.late = True
            self.stats["timed_out"] += 1
            return False

    def has_late(self) -> bool:
        """True when a late job has finished and waits for take_late (any thread may call)."""
        return bool(self._late)

    def take_late(self) -> list[Job]:
        """The late jobs finished since the last call (their result or error is set)."""
        if not self._late:
            return []
        with self._lock:
            out = list(self._late)
            self._late.clear()
        return out

    def status(self) -> dict:
        """Counters and gauges (JSON-ready): threads, idle, stuck, queued, in flight late, and stats."""
        now = time.monotonic()
        with self._lock:
            stuck = sum(1 for j in self._running.values() if now - j.started >= self.policy.stuck_after_s)
            out = {**self.stats, "threads": self._threads, "idle": self._idle, "stuck": stuck,
                   "queued": self._queued, "queue_max": self.policy.queue_max,
                   "queued_bytes": self._queued_bytes, "queue_max_bytes": self.policy.queue_max_bytes}
            if self._slots is not None:
                out.update(uid_cap=self._slots.uid_caps[0], queued_by_uid=self._slots.top(_TOP_UIDS),
                           refused_by_uid=self.refused.top(_TOP_UIDS))
            return out

    def drain(self, timeout_s: float, stall_s: float = 2.0) -> bool:
        """Wait until no job is queued or running (True), for at most timeout_s seconds, and no
        longer than stall_s seconds without a job finishing (a worker stuck on a slow file
        system is not waited for): False then.  Any thread but a worker's."""
        deadline = time.monotonic() + timeout_s
        done, progress = self.stats["completed"], time.monotonic()
        while True:
            with self._lock:
                if not self._queued and not self._running:
                    return True
                now = time.monotonic()
                if self.stats["completed"] != done:
                    done, progress = self.stats["completed"], now
            if now >= deadline or now - progress >= stall_s:
                return False
            time.sleep(0.01)

    def close(self) -> int:
        """Stop taking jobs; idle threads exit, busy ones are left (daemon threads).  Jobs abandoned: queued + running."""
        with self._lock:
            self._closed = True
            abandoned = self._queued + len(self._running)
            threads = self._threads
        for _ in range(threads):
            self._queue.put(None)        # wakes idle threads; they exit
        return abandoned

    # -- the workers ----------------------------------------------------------
    def _start_thread(self) -> None:
        """With the lock held: one more worker thread, counted idle until it takes a job.

        _thread.start_new_thread, not threading.Thread.start: start() waits
        until the new thread has run, which it may only do after the GIL and a
        CPU came its way: in a storm, long enough for a ring to overflow.
        Workers are daemon threads either way: the process exits without them.
        """
        try:
            _thread.start_new_thread(self._work, (f"{self.name}-{self.stats['threads_started'] + 1}",))
        except RuntimeError:            # "can't start new thread": no phantom idle worker, counted
            self.stats["threads_failed"] += 1
            return
        self._threads += 1
        self._idle += 1
        self.stats["threads_started"] += 1

    def _work(self, name: str) -> None:
        threading.current_thread().name = name
        me = threading.get_ident()
        lock = self._lock
        while True:
            job = self._queue.get()
            with lock:
                self._idle -= 1
                if job is None or self._closed:
                    self._threads -= 1
                    return
                if job is _FAIR:            # one token per queued job: the fair queue holds one for it
                    uid, job = self._fair.pop()
                    self._slots.release(uid, 0)
                    if job.cost:
                        left = self._bytes_by_uid.pop(uid) - job.cost
                        if left:
                            self._bytes_by_uid[uid] = left
                self._queued -= 1
                self._queued_bytes -= job.cost
                job.started = time.monotonic()
                self._running[me] = job
            try:
                job.result = job.fn(job.arg)
            except BaseException as e:  # handed to the waiter, who counts it by type
                job.error = e
            with lock:
                del self._running[me]
                self._idle += 1
                self.stats["completed"] += 1
                job._done.release()
                late = job.late
                if late:
                    self.stats["late_completed"] += 1
                    self._late.append(job)
            if late and self.on_late is not None:
                self.on_late()

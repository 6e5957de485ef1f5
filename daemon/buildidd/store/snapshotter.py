"""Snapshots: copy each newly met binary into the build-id store, off the event path.

The recorder hands over every build-id it resolves for the first time, with a
duplicate of the descriptor it read the build-id from when it has one (the
exact mapped inode, pinned: it stays readable even if the file is deleted or
replaced before the copy).  One worker thread copies, rate-limited in bytes/s,
by risk (:class:`~buildidd.resolve.handover.HandOver`): first the files that can no longer be reached
any other way (no name left, the process gone), then those of live
processes, last the start-up synthesis' bulk of files that running processes
map.  The queue (:class:`~buildidd.store.copyqueue.CopyQueue`) charges each
job to the uid that mapped the file: a uid other than root holds at most a
share of its slots and descriptors, a reserve of both is kept for AT_RISK
jobs, and uids take turns, so that one user's flood costs that user's own
copies only (refused ``uid_budget``).  The bulk may hold a quarter of the
descriptors.  The same thread runs housekeeping
every ``housekeeping_interval_s``: a callable the caller gives (the capture
stage's session retention and store quota, which must not delete what a
retained session references; the store cannot read sessions itself).

Every outcome goes into the session's :class:`~buildidd.store.coverage.Coverage`
ledger: held, or the reason the store lacks it.  :meth:`Snapshotter.stop`
copies what is queued within a budget, at full speed, and names what it
abandons (``shutdown``).

The hand-over workers only queue (:meth:`Snapshotter.submit` makes no file
system call on the user's path: whether the file is already gone is read from
the descriptor, ``st_nlink``).  A sighting the store needs no file for
(store.settledview.SettledView) is done at submit.  The worker takes the
source's facts (:func:`buildidd.store.origin.origin_of`: owner from ``fstat``,
privacy from the ``lstat`` of each directory on the path) and hands them to
the store, throttled (store.throttle.TokenBucket).

Locks: :attr:`Snapshotter._cv` (a Condition) guards the queue, the
sightings, the counters (``stats``, ``skipped``), ``last_error``, the log
limiter and the stop flag; callers of the ``_``-methods that say so hold it.
The coverage ledger, the settled view and the store guard themselves.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from buildidd.resolve import procfs
from buildidd.resolve.fairqueue import UID_BUDGET
from buildidd.resolve.handover import HandOver
from buildidd.resolve.resolution import Sighting
from buildidd.errors import StoreError, StoreRefusedError
from buildidd.kernel.events import Identity
from buildidd.kernel.sched import make_current_thread_background
from buildidd.store.copyqueue import CopyJob, CopyQueue, priority_of
from buildidd.store.counters import LogLimiter
from buildidd.store.coverage import HELD, Coverage
from buildidd.store.origin import origin_of_fd
from buildidd.store.settledview import SettledView
from buildidd.store.sightings import Sightings
from buildidd.store.store import Store
from buildidd.store.throttle import TokenBucket

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class SnapshotPolicy:
    """How the snapshot worker copies.

    Attributes:
        rate_bytes_per_s: copy bandwidth limit, bytes/s (0: unlimited).
        max_queue: jobs kept; more are dropped and counted (``dropped``; ``queue_full``).
        max_fds: duplicated descriptors held by queued jobs at most; beyond
            it, jobs keep only path + identity.  Bulk jobs (HandOver.BULK) hold a
            quarter of it at most.
        uid_share: the part of the slots (and of the descriptors) one uid other than root may hold,
            in (0, 1]; its jobs beyond are refused (``dropped``, ``uid_budget``) or keep no descriptor.
        at_risk_reserve: the part of the slots and of the descriptors only AT_RISK jobs may take, in [0, 1).
        max_queue_bytes: bytes the queued jobs hold at most (each its build-id and path by length,
            and a constant; CopyQueue's max_bytes): a user picks how long a path is.
        max_seen: sightings (build-id, path, file) remembered as submitted this session; beyond
            it a build-id is still queued but not remembered (``seen_full``), so it may be queued
            again and is not protected by housekeeping.
        max_seen_bytes: ... and the bytes they hold at most (build-ids and paths by length, and
            a constant each); beyond, as beyond max_seen.
        housekeeping_interval_s: seconds between two runs of the housekeeping callable.
    """

    rate_bytes_per_s: int = 50 << 20
    max_queue: int = 8192
    max_fds: int = 1024
    uid_share: float = 0.25
    at_risk_reserve: float = 0.25
    housekeeping_interval_s: float = 600.0
    max_seen: int = 1 << 20
    max_queue_bytes: int = 4 << 20
    max_seen_bytes: int = 6 << 20


Housekeeping = Callable[[set[str], dict[str, int]], None]
"""``housekeeping(referenced, stats)``, run by the worker thread between copies.

``referenced``: the build-ids submitted this session (a copy, taken under the
snapshotter's lock); ``stats``: a dict of the housekeeping's own counters
(``retention_removed``, ``quota_removed``, from 0), to which it adds; the
snapshotter adds them to its counters under its lock afterwards.  An exception it raises is
logged and kept in ``last_error``; the worker goes on.
"""


def open_unchanged(path: str, ident: Identity | None) -> int | None:
    """A descriptor of the file at path when it is still ident's (None: it is gone or another)."""
    try:
        fd = procfs.open_path(path)
    except (OSError, ValueError):
        return None
    try:
        if ident is not None and procfs.mismatch(ident, procfs.identity_of(fd, ident.generation != 0)):
            os.close(fd)
            return None
    except OSError:
        os.close(fd)
        return None
    return fd


class Snapshotter:
    """The snapshot worker thread and its queue (see the module docstring for its lock).

    Args:
        store: the Store to fill; its ``throttle`` is set to the policy's rate.
        policy: rates and bounds (:class:`SnapshotPolicy`).
        housekeeping: run every ``policy.housekeeping_interval_s``; ``None``: nothing is.
        coverage: the session's ledger of build-ids (a new one when None).
        on_held: called on the snapshot thread with the descriptor of a file the store now holds
            (copied, or present already), before it is closed (the exec pins' ignore mark:
            ExecPins.ignore); None: nobody is told.
        view: the store's settled-file view (a new SettledView of store when None); the hand-overs
            ask the same one.
    """

    def __init__(self, store: Store, policy: SnapshotPolicy = SnapshotPolicy(), *,
                 housekeeping: Housekeeping | None = None, coverage: Coverage | None = None,
                 on_held: Callable[[int], None] | None = None, view: SettledView | None = None):
        self.store = store
        self.bucket = TokenBucket(policy.rate_bytes_per_s)
        self.store.throttle = self.bucket
        self.max_queue = policy.max_queue
        self.max_fds = policy.max_fds
        self.max_seen = policy.max_seen
        self.housekeeping_interval_s = policy.housekeeping_interval_s
        self.coverage = coverage if coverage is not None else Coverage()
        self.view = view if view is not None else SettledView(store)
        self.on_held = on_held
        self._housekeeping = housekeeping
        #: Guards every field marked "Guarded by _cv"; the worker waits on it for a job.
        self._cv = threading.Condition()
        #: Guarded by _cv.
        self._queue = CopyQueue(policy.max_queue, policy.max_fds, policy.uid_share, policy.at_risk_reserve,
                                max_bytes=policy.max_queue_bytes)
        #: Guarded by _cv.
        self._stop = False
        #: Sightings submitted this session: the same build-id at the same path from another file (a
        #: user's claim first, root's file later) is queued again.  Guarded by _cv.
        self._sightings = Sightings(policy.max_seen, policy.max_seen_bytes)
        #: Counters by name.  Guarded by _cv (status() copies them under it).
        self.stats = {"stored": 0, "already_present": 0, "failed": 0, "dropped": 0, "urgent": 0,
                      "bulk": 0, "no_fd": 0, "uid_budget": 0, "gone": 0, "abandoned": 0, "retention_removed": 0,
                      "quota_removed": 0, "seen_full": 0}
        #: StoreRefusedError.reason -> count.  Guarded by _cv.
        self.skipped: dict[str, int] = {}
        #: The last failure's text.  Guarded by _cv.
        self.last_error: str | None = None
        #: Per-file lines (skips, failures), limited per reason.  Guarded by _cv.
        self.lines = LogLimiter(log)
        self._thread = threading.Thread(target=self._run, name="buildidd-snapshot", daemon=True)

    # -- producer side (hand-over workers) ------------------------------------
    def submit(self, job: CopyJob, fd: int | None) -> None:
        """Queue a copy of job's file (the first sighting of its build-id at its path, from this file);
        fd, a descriptor of it (None: only the path), is dup'ed (job.fd is ignored).  Any thread.

        The same build-id at another path, or from another file at the same path
        (dev, inode), is queued again: it may be the trusted copy of a build-id a
        user's file claimed first (the worker skips it when the stored copy is
        trusted and public already).

        A sighting without fd that is settled (SettledView.settled) is done at once: counted, its entry
        touched when due, the ledger told it is held; nothing is queued.

        Args:
            job: the CopyJob: build_id (lower-case hex), path (the mapping's: the store's origin
                facts come from it), ident (the mapped file's identity), key (what build_id is,
                store.origin.KEYS: the GNU build-id, or ``htlhash``, the file_id of a file without
                one; the ledger and the housekeeping name it alike), priority (LIVE, or AT_RISK when the
                caller knows no other route is left, or BULK for the start-up synthesis; made AT_RISK
                here too when the file has no name left, ``fstat(fd).st_nlink == 0``: deleted or
                replaced by a rename, or a memfd, or its path is not absolute; no call is made on
                path), uid (the task that mapped or exec'd, Request.uid: the user charged for the
                job's slot and descriptor, :class:`~buildidd.store.copyqueue.CopyQueue`).
            fd: a descriptor of the file, or None.
        A job refused for its uid's share is named ``uid_budget`` in the ledger, for a full queue
        ``queue_full``; both are counted ``dropped``.
        """
        ident = job.ident
        seen = Sighting(job.build_id, job.path, ident.dev if ident else 0, ident.ino if ident else 0)
        with self._cv:
            if seen in self._sightings:
                return
        if fd is None and self.view.settled(job.build_id, ident, job.path):
            # Nothing to copy: the sighting is done here, on the caller's thread, without a trip
            # through the queue and a wake-up of the worker for a touch.
            with self._cv:
                self._note_seen(seen)
            self._held_settled(job)
            return
        job = job._replace(priority=priority_of(job, fd), fd=None)
        with self._cv:
            self._queue_locked(job, fd, seen)

    def _queue_locked(self, job: CopyJob, fd: int | None, seen: Sighting) -> None:
        """Queue job with a dup of fd, counted; caller holds _cv."""
        if self._stop:                      # a hand-over that finished after stop(): nothing copies it now
            self.coverage.outcome(job.build_id, "shutdown", job.path, job.uid)
            return
        got = self._queue.push(job, fd)
        if isinstance(got, str):            # fairqueue.QUEUE_FULL or UID_BUDGET: the ledger's reason too
            self.stats["dropped"] += 1
            if got == UID_BUDGET:
                self.stats["uid_budget"] += 1
            self.coverage.outcome(job.build_id, got, job.path, job.uid)
            return
        if fd is not None and got.fd is None:
            self.stats["no_fd"] += 1
        self._note_seen(seen)
        if job.priority == HandOver.AT_RISK:
            self.stats["urgent"] += 1
        elif job.priority == HandOver.BULK:
            self.stats["bulk"] += 1
        self._cv.notify()

    def queued(self) -> int:
        """Jobs waiting (any thread)."""
        with self._cv:
            return len(self._queue)

    # -- lifecycle ---------------------------------------------------------
    def start(self) -> None:
        """Start the worker thread."""
        self._thread.start()

    def stop(self, budget_s: float = 10.0, stall_s: float = 5.0) -> int:
        """Copy what is queued within budget_s seconds, at full speed (the rate limit is lifted),
        then stop the thread and close held descriptors; returns the jobs abandoned (each named
        ``shutdown`` in the coverage ledger, counted ``abandoned``).  A copy that makes the
        queue no shorter for stall_s seconds (a slow file system) ends the wait early."""
        deadline = time.monotonic() + budget_s
        self.bucket.lift()
        left, progress = self.queued(), time.monotonic()
        while self.queued() and self._thread.is_alive():
            now = time.monotonic()
            if self.queued() != left:
                left, progress = self.queued(), now
            if now >= deadline or now - progress >= stall_s:
                break
            time.sleep(0.02)
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=max(0.0, deadline - time.monotonic()) + 0.5)
        with self._cv:
            left_jobs = self._queue.clear()
            self.stats["abandoned"] += len(left_jobs)
        for job in left_jobs:
            if job.fd is not None:
                os.close(job.fd)
            self.coverage.outcome(job.build_id, "shutdown", job.path, job.uid)
        with self._cv:
            self.lines.flush()
        return len(left_jobs)

    def status(self) -> dict:
        """Counters for `buildidd status`; ``coverage`` is Coverage.report (not final, 8 uids) without its
        list, with the ledger's bytes, budget and top uids (``ledger``); ``queue`` is CopyQueue.status
        (slots and descriptors by uid).  Counters are taken under _cv."""
        c = self.store.counters
        cov = self.coverage.report(self.store.contains, final=False, listed_bytes=0, uids_listed=8)
        del cov["missing"], cov["missing_listed"]
        with self._cv:
            stats, queue, skipped = dict(self.stats), self._queue.status(), dict(self.skipped)
            last_error, suppressed = self.last_error, dict(self.lines.suppressed)
        return {**stats, "queued": queue["jobs"], "queue": queue, "store_bytes": self.store.size_bytes(),
                "store_disk_bytes": self.store.disk_bytes(),
                "quota_bytes": self.store.quota_bytes, "store": str(self.store.root),
                "skipped": skipped, "fds_held": queue["fds"], "coverage": cov,
                "conflicts": c["conflicts"], "promoted": c["promoted"], "untrusted": c["untrusted"],
                "private": c["private"], "evicted": c["evicted"], "evicted_in_use": c["evicted_in_use"],
                "evicted_for_root": c["evicted_for_root"],
                "last_error": last_error, "log_lines_suppressed": suppressed,
                "memory": self.memory()}

    def memory(self) -> dict:
        """What the snapshotter's per-file structures hold (JSON-ready): {name: {"entries", "bytes",
        "max_bytes", ...}} for ``seen`` (sightings and build-ids submitted), ``settled`` (settled
        answers) and ``queue`` (jobs waiting); bytes are estimates (text by length, a constant per
        entry).  Any thread."""
        with self._cv:
            queue, seen = self._queue.memory(), self._sightings.memory()
        return {"seen": seen, "settled": self.view.answers.memory(), "queue": queue}

    # -- the worker --------------------------------------------------------
    def _run(self) -> None:
        make_current_thread_background()
        next_housekeeping = time.monotonic()
        while True:
            with self._cv:
                while not len(self._queue) and not self._stop:
                    self._cv.wait(timeout=max(0.1, next_housekeeping - time.monotonic()))
                    if time.monotonic() >= next_housekeeping:
                        break
                if self._stop:
                    return
                job = self._queue.pop()
            if job is not None:
                try:
                    self._copy(job)
                except Exception as e:      # a bug: counted, named, and the worker goes on
                    self._note("failed", error=f"snapshot worker: {e!r}")
                    self.coverage.outcome(job.build_id, "failed", job.path, job.uid)
                    log.exception("snapshot of %s failed", job.path)
            if time.monotonic() >= next_housekeeping and not self._stop:
                next_housekeeping = time.monotonic() + self.housekeeping_interval_s
                self.housekeeping()

    def _note(self, stat: str | None = None, *, skipped: str | None = None, error: str | None = None,
              line: tuple | None = None) -> None:
        """One outcome, under _cv (caller does not hold it): stats[stat] += 1, skipped[skipped] += 1,
        last_error = error, and line = (key, level, msg, *args) through the log limiter."""
        with self._cv:
            if stat is not None:
                self.stats[stat] += 1
            if skipped is not None:
                self.skipped[skipped] = self.skipped.get(skipped, 0) + 1
            if error is not None:
                self.last_error = error
            if line is not None:
                self.lines.log(*line)

    def _note_seen(self, seen: Sighting) -> None:
        """Remember a submitted sighting (caller holds _cv): it is not queued again, and the
        housekeeping keeps its build-id; beyond max_seen or max_seen_bytes, counted only."""
        if not self._sightings.add(seen):
            self.stats["seen_full"] += 1

    def _held_settled(self, job: CopyJob) -> None:
        """A settled sighting (any thread): its entry touched when due, counted ``already_present``,
        held in the ledger; a touch that fails (the entry evicted since) is counted ``failed``."""
        try:
            self.view.touch(job.build_id)
        except (StoreError, ValueError) as e:
            self._note("failed", error=str(e), line=("failed", logging.WARNING, "touch of %s (%s) failed: %s",
                                                       job.path, job.build_id, e))
            self.coverage.outcome(job.build_id, "failed", job.path, job.uid)
            return
        self._note("already_present")
        self.coverage.outcome(job.build_id, HELD, job.path, job.uid)

    def _copy(self, job: CopyJob) -> None:
        """Copy one job's file into the store (the snapshot thread; it owns and closes job.fd); every
        outcome goes to the ledger, charged to job.uid when the recorder has not named its build-id yet."""
        build_id, path, uid, fd = job.build_id, job.path, job.uid, job.fd
        try:
            if self.view.settled(build_id, job.ident, path):
                self._held_settled(job)     # nothing another file could improve
                if fd is not None and self.on_held is not None:
                    self.on_held(fd)
                return
            if fd is None:
                fd = open_unchanged(path, job.ident)
                if fd is None:
                    self._note("gone")
                    self.coverage.outcome(build_id, "gone", path, uid)
                    return
            origin = origin_of_fd(fd, path)
            res = self.store.add_from_fd(fd, path, build_id, identity=job.ident, key=job.key,
                                         origin=origin.replace(charged_uid=uid) if uid >= 0 else origin)
            self._note("stored" if res.added else "already_present")
            self.coverage.outcome(build_id, HELD, path, uid)
            if self.on_held is not None:
                self.on_held(fd)
            if not res.added:
                self.store.touch(build_id)
        except StoreRefusedError as e:
            self._note(skipped=e.reason, error=str(e), line=(f"skipped: {e.reason}", logging.INFO,
                                                             "snapshot of %s (%s) skipped: %s", path, build_id, e))
            self.coverage.outcome(build_id, e.reason, path, uid)
        except StoreError as e:
            self._note("failed", error=str(e), line=("failed", logging.WARNING, "snapshot of %s (%s) failed: %s",
                                                       path, build_id, e))
            self.coverage.outcome(build_id, "failed", path, uid)
        except OSError as e:
            self._note("failed", error=f"{path}: {e}")
            self.coverage.outcome(build_id, "failed", path, uid)
        finally:
            if fd is not None:
                os.close(fd)

    def housekeeping(self) -> None:
        """Run the housekeeping callable (if any) with a copy of the build-ids submitted this session,
        its counters added to :attr:`stats` under _cv afterwards; never raises."""
        if self._housekeeping is None:
            return
        with self._cv:
            referenced = set(self._sightings.build_ids)
        counts = {"retention_removed": 0, "quota_removed": 0}
        try:
            self._housekeeping(referenced, counts)
        except Exception as e:   # housekeeping must never kill the worker
            self._note(error=f"housekeeping: {e}")
            log.warning("housekeeping failed: %s", e)
        finally:
            with self._cv:
                for name, n in counts.items():
                    self.stats[name] += n

"""Snapshots: copy each newly met binary into the build-id store, off the event path.

The recorder hands over every build-id it resolves for the first time, with a
duplicate of the descriptor it read the build-id from when it has one (the
exact mapped inode, pinned: it stays readable even if the file is deleted or
replaced before the copy).  One worker thread copies, rate-limited in bytes/s,
by risk (:class:`~buildidd.resolve.routes.HandOver`): first the files that can no longer be reached
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

The recording thread only queues (:meth:`Snapshotter.submit` makes no file
system call on the user's path: whether the file is already gone is read from
the descriptor, ``st_nlink``).  The worker takes the source's facts
(:func:`buildidd.store.origin.origin_of`: owner from ``fstat``, privacy from
the ``lstat`` of each directory on the path) and hands them to the store.
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
from buildidd.resolve.routes import HandOver
from buildidd.errors import StoreError, StoreRefusedError
from buildidd.kernel.events import Identity
from buildidd.kernel.sched import make_current_thread_background
from buildidd.store.copyqueue import CopyJob, CopyQueue
from buildidd.store.counters import LogLimiter
from buildidd.store.coverage import HELD, Coverage
from buildidd.store.origin import KEY_GNU, origin_of_fd
from buildidd.store.sightings import Settled, SettledMemory, Sightings, file_of
from buildidd.store.store import Store

log = logging.getLogger(__name__)

#: Seconds a settled answer (Snapshotter.settled) is kept while its entry's stamp is unchanged, and
#: between two touches of a settled entry (the quota's recency needs no finer grain).
SETTLED_TTL_S = 300.0
#: Settled answers kept at most (the memory is dropped whole beyond).
SETTLED_MAX = 65536
#: ... and the bytes they hold at most (sightings.settled_cost): each keeps the sighting's path and
#: its origin's.
SETTLED_MAX_BYTES = 2 << 20


class TokenBucket:
    """Limits a byte stream to rate_bytes_per_s (burst: one second's worth); 0 = unlimited."""

    def __init__(self, rate_bytes_per_s: int):
        self.rate = rate_bytes_per_s
        self.tokens = float(rate_bytes_per_s)
        self.t = time.monotonic()

    def __call__(self, nbytes: int) -> None:
        rate = self.rate            # read once: stop() lifts it (to 0) from another thread
        if rate <= 0:
            return
        now = time.monotonic()
        self.tokens = min(rate, self.tokens + (now - self.t) * rate)
        self.t = now
        self.tokens -= nbytes
        if self.tokens < 0:
            time.sleep(-self.tokens / rate)


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

``referenced``: the build-ids submitted this session (the live set: read it,
never change it); ``stats``: the snapshotter's counters, to which it adds its
own (``retention_removed``, ``quota_removed``).  An exception it raises is
logged and kept in ``last_error``; the worker goes on.
"""


class Snapshotter:
    """The snapshot worker thread and its queue.

    Args:
        store: the Store to fill; its ``throttle`` is set to the policy's rate.
        policy: rates and bounds (:class:`SnapshotPolicy`).
        housekeeping: run every ``policy.housekeeping_interval_s``; ``None``: nothing is.
        coverage: the session's ledger of build-ids (a new one when None).
    """

    def __init__(self, store: Store, policy: SnapshotPolicy = SnapshotPolicy(), *,
                 housekeeping: Housekeeping | None = None, coverage: Coverage | None = None):
        self.store = store
        self.bucket = TokenBucket(policy.rate_bytes_per_s)
        self.store.throttle = self.bucket
        self.max_queue = policy.max_queue
        self.max_fds = policy.max_fds
        self.max_seen = policy.max_seen
        self.housekeeping_interval_s = policy.housekeeping_interval_s
        self.coverage = coverage if coverage is not None else Coverage()
        self._housekeeping = housekeeping
        self._queue = CopyQueue(policy.max_queue, policy.max_fds, policy.uid_share, policy.at_risk_reserve,
                                max_bytes=policy.max_queue_bytes)
        self._cv = threading.Condition()
        self._stop = False
        #: (build-id, path, dev, inode) submitted this session: the same build-id at the same path from
        #: another file (a user's claim first, root's file later) is queued again.
        self._sightings = Sightings(policy.max_seen, policy.max_seen_bytes)
        self._seen: set[str] = self._sightings.build_ids      # build-ids submitted this session
        #: build-id -> what settled() found (Settled): settled() and stored_file_id() answer again
        #: from a readlink and a stat while the stamp is the same.
        self._settled = SettledMemory(SETTLED_MAX, SETTLED_MAX_BYTES)
        self.stats = {"stored": 0, "already_present": 0, "failed": 0, "dropped": 0, "urgent": 0,
                      "bulk": 0, "no_fd": 0, "uid_budget": 0, "gone": 0, "abandoned": 0, "retention_removed": 0,
                      "quota_removed": 0, "seen_full": 0}
        self.skipped: dict[str, int] = {}     # StoreRefusedError.reason → count
        self.last_error: str | None = None
        self.lines = LogLimiter(log)          # per-file lines (skips, failures), limited per reason
        #: on_held(fd): called on this thread with the descriptor of a file the store now holds (copied,
        #: or present already), before it is closed (the exec pins' ignore mark: ExecPins.ignore)
        self.on_held: Callable[[int], None] | None = None
        self._thread = threading.Thread(target=self._run, name="buildidd-snapshot", daemon=True)

    # -- producer side (hand-over workers) ------------------------------------
    def submit(self, job: CopyJob, fd: int | None) -> None:
        """Queue a copy of job's file (the first sighting of its build-id at its path, from this file);
        fd, a descriptor of it (None: only the path), is dup'ed (job.fd is ignored).

        The same build-id at another path, or from another file at the same path
        (dev, inode), is queued again: it may be the trusted copy of a build-id a
        user's file claimed first (the worker skips it when the stored copy is
        trusted and public already).

        A sighting without fd that is settled (:meth:`settled`) is done at once: counted, its entry
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
        build_id, path, ident = job.build_id, job.path, job.ident
        seen = (build_id, path, ident.dev if ident else 0, ident.ino if ident else 0)
        if seen in self._sightings:
            return
        if fd is None and self.settled(build_id, ident, path):
            # Nothing to copy: the sighting is done here, on the caller's thread, without a trip
            # through the queue and a wake-up of the worker for a touch.
            with self._cv:
                self._note_seen(build_id, seen)
            self._held_settled(build_id, path, job.uid)
            return
        job = job._replace(priority=self._priority(job, fd), fd=None)
        with self._cv:
            if self._stop:                      # a hand-over that finished after stop(): nothing copies it now
                self.coverage.outcome(build_id, "shutdown", path, job.uid)
                return
            got = self._queue.push(job, fd)
            if isinstance(got, str):            # fairqueue.QUEUE_FULL or UID_BUDGET: the ledger's reason too
                self.stats["dropped"] += 1
                if got == UID_BUDGET:
                    self.stats["uid_budget"] += 1
                self.coverage.outcome(build_id, got, path, job.uid)
                return
            if fd is not None and got.fd is None:
                self.stats["no_fd"] += 1
            self._note_seen(build_id, seen)
            if job.priority == HandOver.AT_RISK:
                self.stats["urgent"] += 1
            elif job.priority == HandOver.BULK:
                self.stats["bulk"] += 1
            self._cv.notify()

    @staticmethod
    def _priority(job: CopyJob, fd: int | None) -> HandOver:
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

    def queued(self) -> int:
        """Jobs waiting."""
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
        self.bucket.rate = 0
        left, progress = len(self._queue), time.monotonic()
        while len(self._queue) and self._thread.is_alive():
            now = time.monotonic()
            if len(self._queue) != left:
                left, progress = len(self._queue), now
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
        for job in left_jobs:
            if job.fd is not None:
                os.close(job.fd)
            self.coverage.outcome(job.build_id, "shutdown", job.path, job.uid)
        self.stats["abandoned"] += len(left_jobs)
        self.lines.flush()
        return len(left_jobs)

    def status(self) -> dict:
        """Counters for `buildidd status`; ``coverage`` is Coverage.report (not final, 8 uids) without its
        list, with the ledger's bytes, budget and top uids (``ledger``); ``queue`` is CopyQueue.status
        (slots and descriptors by uid, taken under the queue's lock)."""
        c = self.store.counters
        cov = self.coverage.report(self.store.contains, final=False, listed_bytes=0, uids_listed=8)
        del cov["missing"], cov["missing_listed"]
        with self._cv:
            stats, queue = dict(self.stats), self._queue.status()
        return {**stats, "queued": queue["jobs"], "queue": queue, "store_bytes": self.store.size_bytes(),
                "store_disk_bytes": self.store.disk_bytes(),
                "quota_bytes": self.store.quota_bytes, "store": str(self.store.root),
                "skipped": dict(self.skipped), "fds_held": queue["fds"], "coverage": cov,
                "conflicts": c["conflicts"], "promoted": c["promoted"], "untrusted": c["untrusted"],
                "private": c["private"], "evicted": c["evicted"], "evicted_in_use": c["evicted_in_use"],
                "evicted_for_root": c["evicted_for_root"],
                "last_error": self.last_error, "log_lines_suppressed": dict(self.lines.suppressed),
                "memory": self.memory()}

    def memory(self) -> dict:
        """What the snapshotter's per-file structures hold (JSON-ready): {name: {"entries", "bytes",
        "max_bytes", ...}} for ``seen`` (sightings and build-ids submitted), ``settled`` (settled
        answers) and ``queue`` (jobs waiting); bytes are estimates (text by length, a constant per
        entry).  Any thread."""
        with self._cv:
            queue = self._queue.memory()
        return {"seen": self._sightings.memory(), "settled": self._settled.memory(), "queue": queue}

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
                    self._copy(job.build_id, job.path, job.ident, job.fd, job.key, job.uid)
                except Exception as e:      # a bug: counted, named, and the worker goes on
                    self.stats["failed"] += 1
                    self.last_error = f"snapshot worker: {e!r}"
                    self.coverage.outcome(job.build_id, "failed", job.path, job.uid)
                    log.exception("snapshot of %s failed", job.path)
            if time.monotonic() >= next_housekeeping and not self._stop:
                next_housekeeping = time.monotonic() + self.housekeeping_interval_s
                self.housekeeping()

    def settled(self, build_id: str, ident: Identity | None = None, path: str | None = None) -> bool:
        """True when a sighting of build_id (hex) needs no file: the store holds a trusted, public
        copy (nothing another file could improve), or, given the sighting's file (ident, path), its
        main copy was made from that very file, unchanged since (same path, dev, inode, size, mtime
        and ctime: the owner and mode are the same, so its origin facts would be too).  Submit with fd
        None then only touches the entry.

        Reads the store's entry once (Store.stamped_origin); while its Store.origin_stamp stays the
        same (no removal, eviction or new copy since), for SETTLED_TTL_S, the answer is
        remembered.  Any thread may ask."""
        try:
            known = self._settled.get(build_id)
            if known is not None and time.monotonic() - known.found_at < SETTLED_TTL_S \
                    and known.source in (None, file_of(ident, path)) \
                    and known.stamp == self.store.origin_stamp(build_id):
                return True
            found = self.store.stamped_origin(build_id)
        except (ValueError, OSError, StoreError):
            return False
        if found is None:
            return False
        stamp, present = found
        if present.trusted and not present.private:
            source = None                   # settled for every sighting
        elif present.ctime_ns and file_of(ident, path) == (present.path, present.dev, present.ino,
                                                            present.size_bytes, present.mtime_ns, present.ctime_ns):
            source = file_of(ident, path)   # settled for this file only
        else:
            return False
        self._settled.put(build_id, Settled(time.monotonic(), stamp, known.touched_at if known else 0.0, source,
                                            present))
        return True

    def _note_seen(self, build_id: str, seen: tuple[str, str, int, int]) -> None:
        """Remember a submitted sighting (under _cv): it is not queued again, and the housekeeping
        keeps its build-id; beyond max_seen or max_seen_bytes, counted only."""
        if not self._sightings.add(seen):
            self.stats["seen_full"] += 1

    def _held_settled(self, build_id: str, path: str, uid: int = -1) -> None:
        """A settled sighting (any thread): its entry touched when due, counted ``already_present``,
        held in the ledger; a touch that fails (the entry evicted since) is counted ``failed``."""
        try:
            self._touch_settled(build_id)
        except (StoreError, ValueError) as e:
            with self._cv:
                self.stats["failed"] += 1
            self.last_error = str(e)
            self.coverage.outcome(build_id, "failed", path, uid)
            self.lines.log("failed", logging.WARNING, "touch of %s (%s) failed: %s", path, build_id, e)
            return
        with self._cv:
            self.stats["already_present"] += 1
        self.coverage.outcome(build_id, HELD, path, uid)

    def _touch_settled(self, build_id: str) -> None:
        """Store.touch a settled entry (its recency for the quota), at most once per SETTLED_TTL_S."""
        known = self._settled.get(build_id)
        now = time.monotonic()
        if known is not None and now - known.touched_at < SETTLED_TTL_S:
            return
        self.store.touch(build_id)
        if known is not None:
            self._settled.put(build_id, known._replace(touched_at=now))

    def stored_file_id(self, build_id: str, ident: Identity) -> str | None:
        """The htlhash (32 hex) the store recorded for build_id's main copy when that copy was made from
        this very file (origin's dev, inode, size and mtime equal ident's), else None; any thread may ask.
        A settled entry's origin is the one settled() read, while its stamp is the same."""
        try:
            known = self._settled.get(build_id)
            if known is not None and known.stamp == self.store.origin_stamp(build_id):
                o = known.origin
            else:
                o = self.store.origin(build_id)
        except (ValueError, OSError, StoreError):
            return None
        if o is None or not o.file_id or (o.dev, o.ino, o.size_bytes, o.mtime_ns) != (
                ident.dev, ident.ino, ident.size, ident.mtime_ns):
            return None
        return o.file_id

    def _copy(self, build_id: str, path: str, ident: Identity | None, fd: int | None, key: str = KEY_GNU,
              uid: int = -1) -> None:
        """Copy one job's file into the store; every outcome goes to the ledger, charged to uid when the
        recorder has not named build_id yet."""
        try:
            if self.settled(build_id, ident, path):
                self._held_settled(build_id, path, uid)    # nothing another file could improve
                if fd is not None and self.on_held is not None:
                    self.on_held(fd)
                return
            if fd is None:
                fd = self._open_by_path(path, ident)
                if fd is None:
                    self.stats["gone"] += 1
                    self.coverage.outcome(build_id, "gone", path, uid)
                    return
            origin = origin_of_fd(fd, path)
            res = self.store.add_from_fd(fd, path, build_id, identity=ident, key=key,
                                         origin=origin.replace(charged_uid=uid) if uid >= 0 else origin)
            self.stats["stored" if res.added else "already_present"] += 1
            self.coverage.outcome(build_id, HELD, path, uid)
            if self.on_held is not None:
                self.on_held(fd)
            if not res.added:
                self.store.touch(build_id)
        except StoreRefusedError as e:
            self.skipped[e.reason] = self.skipped.get(e.reason, 0) + 1
            self.last_error = str(e)
            self.coverage.outcome(build_id, e.reason, path, uid)
            self.lines.log(f"skipped: {e.reason}", logging.INFO, "snapshot of %s (%s) skipped: %s", path, build_id, e)
        except StoreError as e:
            self.stats["failed"] += 1
            self.last_error = str(e)
            self.coverage.outcome(build_id, "failed", path, uid)
            self.lines.log("failed", logging.WARNING, "snapshot of %s (%s) failed: %s", path, build_id, e)
        except OSError as e:
            self.stats["failed"] += 1
            self.coverage.outcome(build_id, "failed", path, uid)
            self.last_error = f"{path}: {e}"
        finally:
            if fd is not None:
                os.close(fd)

    @staticmethod
    def _open_by_path(path: str, ident: Identity | None) -> int | None:
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

    def housekeeping(self) -> None:
        """Run the housekeeping callable (if any) with the build-ids submitted this session; never raises."""
        if self._housekeeping is None:
            return
        try:
            self._housekeeping(self._seen, self.stats)
        except Exception as e:   # housekeeping must never kill the worker
            self.last_error = f"housekeeping: {e}"
            log.warning("housekeeping failed: %s", e)

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

Files without a GNU build-id get, when they could be read, a ``file_id``
content key and, for Go binaries, their ``go_build_id`` (resolve.fileid).
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from buildidd.config import Config
from buildidd.errors import ElfError, FileRefusedError
from buildidd import clock
from buildidd.kernel.events import KERNEL_FINAL, Identity, PcStatus, RawEvent
from buildidd.memo import LruCache
from buildidd.resolve.buildid import read_build_id_fd
from buildidd.resolve.fileid import file_id, read_go_build_id
from buildidd.resolve.procfs import (Source, changed_near, coarse_tick_ns, open_identified, open_route,
                                     open_scanned)
from buildidd.resolve.reasons import MissReason
from buildidd.resolve.workers import Job, PoolPolicy, WorkerPool

PAGE = os.sysconf("SC_PAGE_SIZE")

#: Seconds a device stays suspect after a job on it missed its deadline.
SUSPECT_S = 10.0
#: Suspect devices remembered at most (the oldest forgotten first).
SUSPECT_MAX = 1024

#: The reasons for which the exact inode was reached: final, like a build-id.
_FINAL_REFUSALS = (MissReason.SLOW_FS, MissReason.NOT_REGULAR)


@dataclass(frozen=True, slots=True)
class Resolution:
    """What is known of one identity.

    Attributes:
        build_id: lower-case hex, or None.
        source: Source value the build-id (or the verdict) came from.
        error: None, or the MissReason there is no build-id (the log's ``error``).
        path: the last path seen for this identity.
        json_tail: the record's identity and build-id fields, JSON-encoded once.
        go_build_id: the Go build ID text (``.note.go.buildid``), for an ELF file without a GNU build-id.
        file_id: 32 hex digits (resolve.fileid.file_id) of a file without a GNU build-id that could be read.
    """

    build_id: str | None
    source: str
    error: MissReason | None
    path: str
    json_tail: str
    go_build_id: str | None = None
    file_id: str | None = None

    @property
    def final(self) -> bool:
        """True when the answer depends only on the file's contents."""
        return self.source != Source.NONE.value


def make_resolution(ident: Identity, build_id: str | None, source: Source, error: MissReason | None,
                    path: str, keys: tuple[str | None, str | None] = (None, None)) -> Resolution:
    """A Resolution with its JSON tail; keys: (go_build_id, file_id)."""
    bid = f'"{build_id}"' if build_id else "null"
    err = f'"{error}"' if error else "null"
    tail = (f'"dev":{ident.dev},"ino":{ident.ino},"ino_generation":{ident.generation},'
            f'"size":{ident.size},"mtime_ns":{ident.mtime_ns},"build_id":{bid},'
            f'"build_id_source":"{source.value}","error":{err}')
    go, fid = keys
    if go:
        tail += f',"go_build_id":{json.dumps(go)}'
    if fid:
        tail += f',"file_id":"{fid}"'
    return Resolution(build_id, source.value, error, path, tail, go, fid)


@dataclass(frozen=True, slots=True)
class Request:
    """One mapping to resolve, as a worker gets it (from a RawEvent).

    Attributes:
        pid: tgid; start, length: the VMA (bytes; 0 for an exec record);
        path: the event's path; nlink: 0 when the file was deleted; identity: the kernel's;
        time_ns: the event's time, ns since boot (0: unknown).
    """

    pid: int
    start: int
    length: int
    path: str
    nlink: int
    identity: Identity
    time_ns: int = 0


@dataclass(frozen=True)
class Offload:
    """How resolution is handed to workers: Config.resolve_deadline_s and the pool's sizes."""

    deadline_s: float = 0.2
    pool: PoolPolicy = field(default_factory=PoolPolicy)


_TIMED_OUT = object()


class Enricher:
    """Resolves identities to build-ids, with a bounded identity cache; file work on workers.

    Args:
        cache_entries: identities kept (LRU).
        on_resolved: called with (identity, Resolution) when an identity gets a
            final answer (the tracer then stops sending its path); recording thread.
        on_evicted: called with an identity dropped from the cache; recording thread.
        on_build_id: called with (identity, Resolution, fd) when a build-id was
            just read from fd (still open: the callee may dup it, e.g. to
            snapshot the exact inode).  Called on a worker thread.
        offload: the deadline and the pool's sizes.
    """

    def __init__(self, cache_entries: int = 65536,
                 on_resolved: Callable[[Identity, Resolution], None] | None = None,
                 on_evicted: Callable[[Identity], None] | None = None,
                 on_build_id: Callable[[Identity, Resolution, int], None] | None = None,
                 offload: Offload | None = None):
        self.cache: LruCache[Identity, Resolution] = LruCache("identity", cache_entries,
                                                              on_evict=self._evicted)
        self.on_resolved = on_resolved
        self.on_evicted = on_evicted
        self.routes = Routes(self.cache, on_build_id)
        self.offload = offload or Offload()
        self.pool = WorkerPool(self.offload.pool)
        self.resolved = 0
        self.missing: dict[str, int] = {}
        self.timeouts = 0
        self._pending: dict[Identity, Job] = {}
        self._suspect: dict[int, float] = {}
        self._budget_s = float("inf")
        #: (build-id, path) pairs the kernel read whose file was handed to on_build_id (bounded).
        self._handed: LruCache[tuple[str, str], bool] = LruCache("kernel_handed", cache_entries)
        self.handovers_dropped = 0

    def configure(self, config: Config) -> None:
        """Take the deadline and pool sizes from config (before the first resolve: the old pool must be unused).

        resolve_deadline_s is also the time after which a busy worker counts as
        stuck; up to 8 * resolve_workers threads exist while some are.
        """
        workers = config.resolve_workers
        self.offload = Offload(config.resolve_deadline_s, PoolPolicy(
            workers=workers, max_threads=8 * workers, stuck_after_s=config.resolve_deadline_s))
        self.pool = WorkerPool(self.offload.pool)

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
                self._handed.pop(self.routes.unreached.popleft())
            seen = (res.build_id, ev.path)
            if res.build_id and self.routes.on_build_id is not None and seen not in self._handed:
                # First sighting of a build-id at this path (the kernel read it): the store still
                # wants the file, and a root-owned copy met after a user's must reach it too.
                self._handed.put(seen, True)
                if self.pool.submit(self.routes.hand_over, (_request(ev, ev.path), res)) is None:
                    self.handovers_dropped += 1
            return res
        ident = ev.identity
        res = self.cache.peek(ident)
        if res is not None and not res.final:
            # Unreachable before: only the mapping itself can still help.
            if ident in self._pending or ev.start == 0 or ev.length == 0:
                return res
            got = self._offload(ident, self.routes.retry, _request(ev, ev.path or res.path))
            return self._store(ident, got) if isinstance(got, Resolution) else res
        res = self.cache.get(ident)         # counts the hit or the miss
        if res is not None:
            return res
        got = self._offload(ident, self.routes.fresh, _request(ev, ev.path))
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
        got = self._offload(None, self.routes.scan, (pid, vma, path))
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

    def status(self) -> dict:
        """Worker pool and deadline counters (JSON-ready)."""
        now = time.monotonic()
        return {**self.pool.status(), "timeouts": self.timeouts, "pending": len(self._pending),
                "suspect_devices": sum(1 for t in self._suspect.values() if t > now),
                "deadline_s": self.offload.deadline_s, "handovers_dropped": self.handovers_dropped}

    def close(self) -> int:
        """Stop the workers (blocked ones are left behind); the number of resolutions abandoned."""
        return self.pool.close()

    def _offload(self, ident: Identity | None, fn: Callable, arg):
        """Run fn(arg) on a worker and wait for it within the deadline and the step's budget.

        Returns its result, or _TIMED_OUT (the job is then pending: take_late).
        """
        dev = ident.dev if ident is not None else None
        now = time.monotonic()
        wait = min(self.offload.deadline_s, self._budget_s)
        if (dev is not None and self._suspect.get(dev, 0.0) > now) or not self.pool.can_run_now():
            wait = 0.0
        job = self.pool.submit(fn, arg)
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


class Routes:
    """The jobs the workers run: open a route, check it is the mapped file, read it.

    No state is shared with the recording thread but on_build_id (called on
    the worker) and the identity cache, only peeked (one OrderedDict.get:
    atomic under CPython's GIL).

    Args:
        cache: the Enricher's identity cache.
        on_build_id: as Enricher's.
    """

    def __init__(self, cache: LruCache, on_build_id: Callable[[Identity, Resolution, int], None] | None):
        self.cache = cache
        self.on_build_id = on_build_id
        #: (build-id, path) of hand-overs that reached no file (appended on workers, drained by the
        #: recording thread, which then hands the next sighting over again; deque appends are atomic).
        self.unreached: deque[tuple[str, str]] = deque(maxlen=4096)
        self.tick_ns = coarse_tick_ns()
        self.wall_offset_ns = clock.boot_to_wall_offset_ns()

    def _read(self, ident: Identity, fd: int, source: Source, path: str) -> Resolution:
        reason = None
        try:
            bid = read_build_id_fd(fd)
        except ElfError as e:
            bid, reason = None, MissReason(e.reason)
        except OSError:
            return make_resolution(ident, None, Source.NONE, MissReason.IO_ERROR, path)
        if bid is not None:
            res = make_resolution(ident, bid.hex, source, None, path)
            if self.on_build_id is not None:
                self.on_build_id(ident, res, fd)
            return res
        try:
            keys = (read_go_build_id(fd) if reason is None else None, file_id(fd))
        except OSError:
            keys = (None, None)          # the verdict stands, without a content key
        return make_resolution(ident, None, source, reason or MissReason.NO_BUILD_ID, path, keys)

    def _open_read(self, req: Request, source: Source, vma: tuple[int, int]) -> Resolution:
        """Open one route, check it is the mapped file, read it.

        Raises:
            OSError: the route cannot be opened; FileRefusedError: another file, or refused.
        """
        pfd = open_route(source, req.pid, req.path, vma)
        try:
            fd = open_identified(pfd, req.identity)
        except FileRefusedError as e:
            if e.reason in _FINAL_REFUSALS and (source is Source.MAP_FILES or e.reason == MissReason.SLOW_FS):
                return make_resolution(req.identity, None, source, MissReason(e.reason), req.path)
            raise
        finally:
            os.close(pfd)
        if req.time_ns and changed_near(req.identity, req.time_ns + self.wall_offset_ns, self.tick_ns, req.nlink):
            os.close(fd)
            return make_resolution(req.identity, None, Source.NONE, MissReason.CHANGED_AT_MAP, req.path)
        try:
            return self._read(req.identity, fd, source, req.path)
        finally:
            os.close(fd)

    def hand_over(self, arg: tuple[Request, Resolution]) -> bool:
        """Give on_build_id an fd of the file whose build-id the kernel read (a worker job).

        The kernel's read needs no file, but the store copies one: the mapped
        file is opened by the same routes as a resolution (map_files first;
        for an exec event, which has no vma, /proc/PID/exe: the executable's
        own inode however its path was replaced since), is accepted only with
        the event's identity and the kernel's build-id, and is closed after
        on_build_id returns.  False when no route reaches it; its (build-id,
        path) then goes to :attr:`unreached`, so a later mapping of it (with a
        vma) is handed over again.
        """
        req, res = arg
        for pfd in self._routes_of(req):
            try:
                fd = open_identified(pfd, req.identity)
            except (OSError, FileRefusedError):
                continue
            finally:
                os.close(pfd)
            try:
                bid = read_build_id_fd(fd)
                if bid is not None and bid.hex == res.build_id:
                    self.on_build_id(req.identity, res, fd)
                    return True
            except (OSError, ElfError):
                continue
            finally:
                os.close(fd)
        self.unreached.append((res.build_id, req.path))
        return False

    @staticmethod
    def _routes_of(req: Request):
        """O_PATH descriptors of the routes to req's file, best first, opened lazily (the caller closes each)."""
        if req.start and req.length:
            vma = (req.start, req.start + ((req.length + PAGE - 1) & ~(PAGE - 1)))
            attempts = [lambda: open_route(Source.MAP_FILES, req.pid, req.path, vma)]
        else:
            attempts = [lambda: os.open(f"/proc/{req.pid}/exe", os.O_PATH | os.O_CLOEXEC)]
        if req.path and "\0" not in req.path and not req.path.startswith("/memfd:"):
            attempts += [lambda: open_route(Source.PROC_ROOT, req.pid, req.path),
                         lambda: open_route(Source.PATH, req.pid, req.path)]
        for attempt in attempts:
            try:
                yield attempt()
            except OSError:
                continue

    def retry(self, req: Request) -> Resolution | None:
        """The map_files route only; None when it does not reach the mapped file."""
        end = req.start + ((req.length + PAGE - 1) & ~(PAGE - 1))
        try:
            return self._open_read(req, Source.MAP_FILES, (req.start, end))
        except (OSError, FileRefusedError):
            return None

    def fresh(self, req: Request) -> Resolution:
        """Every route, best first (procfs docstring); the reason when none reaches the mapped file."""
        if req.start and req.length:
            got = self.retry(req)
            if got is not None:
                return got
        path = req.path
        seen_other = denied = not_regular = False
        if path and "\0" not in path and not path.startswith("/memfd:"):
            for source in (Source.PROC_ROOT, Source.PATH):
                try:
                    return self._open_read(req, source, (0, 0))
                except FileRefusedError as e:
                    not_regular |= e.reason == MissReason.NOT_REGULAR
                    seen_other |= e.reason != MissReason.NOT_REGULAR
                except OSError as e:
                    denied |= e.errno in (errno.EACCES, errno.EPERM)
        if req.nlink == 0 or path.startswith("/memfd:"):
            error = MissReason.FILE_DELETED
        elif not_regular:
            error = MissReason.NOT_REGULAR
        elif seen_other:
            error = MissReason.FILE_REPLACED
        elif denied:
            error = MissReason.PERMISSION
        else:
            error = MissReason.FILE_VANISHED
        return make_resolution(req.identity, None, Source.NONE, error, path)

    def scan(self, arg: tuple[int, tuple[int, int], str]) -> tuple[Identity, Resolution, bool] | None:
        """(identity, Resolution, answered from the cache) of a scanned mapping, or None (gone, refused).

        The cache is only peeked here (one OrderedDict.get: atomic under CPython's GIL).
        """
        pid, vma, path = arg
        try:
            fd, ident = open_scanned(pid, *vma)
        except (OSError, FileRefusedError):
            return None
        try:
            res = self.cache.peek(ident)
            if res is not None and res.final:
                return ident, res, True
            return ident, self._read(ident, fd, Source.MAP_FILES, path), False
        finally:
            os.close(fd)


def _request(ev: RawEvent, path: str) -> Request:
    return Request(ev.pid, ev.start, ev.length, path, ev.nlink, ev.identity, ev.time_ns)


#: The reason of a kernel verdict without a build-id (PcStatus in KERNEL_FINAL).
_KERNEL_VERDICTS = {PcStatus.NOT_ELF: MissReason.NOT_ELF, PcStatus.NOTE_TOO_LARGE: MissReason.MALFORMED_ELF,
                    PcStatus.MALFORMED: MissReason.MALFORMED_ELF}


def kernel_resolution(ev: RawEvent) -> Resolution:
    """The Resolution of a mapping whose page-cache read in the BPF program answered (ev.pc_status
    in KERNEL_FINAL): its build-id (OK) or the verdict on its bytes, source ``kernel``; nothing is read here."""
    if ev.pc_status == PcStatus.OK:
        return make_resolution(ev.identity, ev.pc_build_id.hex(), Source.KERNEL, None, ev.path)
    return make_resolution(ev.identity, None, Source.KERNEL, _KERNEL_VERDICTS[PcStatus(ev.pc_status)], ev.path)

"""The recorder: composes tracer → decode → enrichment → session log.

Lifecycle: :meth:`Recorder.start` loads and attaches the BPF programs, writes
the session record and synthesizes the executable mappings of every running
process (like ``perf record`` synthesizing existing tasks); from then on every
mapping is recordable (READY).  :meth:`Recorder.step` drains the ring buffer
once; :meth:`Recorder.run` steps until told to stop; :meth:`Recorder.close`
drains what is left and closes the session with an ``end`` record.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from buildidd import __version__
from buildidd.capture import _fastpath
from buildidd import clock
from buildidd.resolve import host
from buildidd.resolve import procfs
from buildidd.kernel import sched
from buildidd.config import Config
from buildidd.resolve.enrich import Enricher, Resolution, json_str
from buildidd.errors import SessionLogError, StoreError
from buildidd.kernel.events import (PATH_TRUNCATED, PATH_UNREACHABLE, TASK_EVENT, TASK_PPID_OFF,
                     DecodeError, EventType, Identity, RawEvent, decode,
                     exec_file_key, exec_head, file_key, st_dev_to_kdev)
from buildidd.resolve.procfs import Source
from buildidd.sessionlog.records import (COMM_LINE, EXEC_LINE, EXEC_PREFIX, EXIT_LINE, FORK_LINE, MMAP_LINE, ORIGIN_NAMES, RECOVERED,
                      SYNTHESIZED, dict_line, exec_line, exec_prefix, mmap_line, mmap_tail, res_tail, task_line)
from buildidd.sessionlog import SessionWriter
from buildidd.capture.rings import Rings
from buildidd.kernel.tracer import Tracer

log = logging.getLogger(__name__)

_ORIGINS = {int(k): v for k, v in ORIGIN_NAMES.items()}
#: Record "origin" by map_event.origin, for the fast path (index 0 and unknown values: "mmap").
_ORIGINS_T = tuple(_ORIGINS.get(i, "mmap").encode() for i in range(max(_ORIGINS) + 1))
_COMM_JSON: dict[bytes, bytes] = {}
_fastpath.configure(MMAP_LINE, FORK_LINE, EXIT_LINE, COMM_LINE, EXEC_LINE, EXEC_PREFIX)


_PATH_JSON: dict[bytes, bytes] = {}


def _path_json(raw: bytes) -> bytes:
    """JSON string (bytes) of a raw exec filename, as exec_prefix() encodes it, memoized (bounded)."""
    text = json_str(raw.decode("utf-8", "surrogateescape")).encode("utf-8", "surrogateescape")
    if len(_PATH_JSON) >= 4096:
        _PATH_JSON.clear()
    _PATH_JSON[raw] = text
    return text


def _comm_json(raw: bytes) -> bytes:
    """JSON string (bytes) of a raw 16-byte task comm, memoized (bounded)."""
    text = json_str(raw.split(b"\0", 1)[0].decode("utf-8", "replace")).encode("utf-8", "surrogateescape")
    if len(_COMM_JSON) >= 65536:
        _COMM_JSON.clear()
    _COMM_JSON[raw] = text
    return text

MAP_SHARED, MAP_PRIVATE = 0x01, 0x02


def new_session_dir(root: str) -> Path:
    """A fresh session directory name under root: UTC start time and daemon pid."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return Path(root) / f"{stamp}-{os.getpid()}"


@dataclass
class Stats:
    """Counters of one session (reported in the end record and by status)."""

    events: dict[str, int] = field(default_factory=dict)
    decode_errors: int = 0
    lost: dict[str, int] = field(default_factory=dict)
    recovered: int = 0
    synthesized: int = 0
    synth_skipped: int = 0
    log_write_errors: int = 0
    log_lines_dropped: int = 0
    priority_boosts: int = 0


class Recorder:
    """One recording session.

    Args:
        config: the Config.
        session_dir: where to write (default: a new directory under config.session_root).
        follow: record only the processes given to :meth:`follow` and their
            descendants (``buildidd record``), and synthesize nothing at start;
            False records the whole host.
    Raises (from start):
        ProbeError: the BPF side cannot be loaded or attached.
        SessionLogError: the session directory cannot be created.
    """

    def __init__(self, config: Config, *, session_dir: str | os.PathLike | None = None,
                 follow: bool = False):
        self.config = config
        self.session_dir = Path(session_dir) if session_dir else new_session_dir(config.session_root)
        self.tracked: set[int] | None = set() if follow else None
        self.stats = Stats()
        self.tracer: Tracer | None = None
        self.rings: Rings | None = None
        self.writer: SessionWriter | None = None
        self.enricher = Enricher(config.identity_cache_entries, on_resolved=self._on_resolved,
                                 on_evicted=self._on_evicted, on_build_id=self._on_build_id)
        self.snapshotter = None
        self._pending_lines: list[bytes] = []
        # tid → (raw exec record, step it came in, identity key, exec_prefix()):
        # an exec waiting for its main executable's mapping (see _hold_exec).
        self._held_exec: dict[int, tuple[bytes, int, bytes, bytes]] = {}
        # Fast path: raw kernel file_id bytes → (Resolution, mmap_tail(),
        # None or the reason there is no build-id, res_tail(), the path in
        # mmap_tail() as bytes), for identities with a final answer (see
        # step() and _fastpath.run).
        self._fast: dict[bytes, tuple[Resolution, bytes, str | None, bytes, bytes]] = {}
        # None only to check the fast path against _slow_record (tests).
        self._run_fast = _fastpath.run
        self._deferred: list[bytes] = []      # follow mode: see _follow_filter
        self._steps = 0
        # pid → {(vm_start, identity key)} of its recorded mappings (for the rescan after a loss)
        self._live: dict[int, set[tuple[int, bytes]]] = {}
        self._next_drop_check = 0.0
        self._rescan_pending = False
        self._next_rescan = 0.0
        self.started_mono = time.monotonic()
        self.ready_s: float | None = None
        self._rate_window: collections.deque = collections.deque(maxlen=12)
        self.last_errors: collections.deque = collections.deque(maxlen=10)
        self._rotate_wanted = threading.Event()
        self._rotate_done = threading.Event()
        self._base_nice = 0
        self._boosted = False
        self._calm_since: float | None = None

    # -- lifecycle ---------------------------------------------------------
    def start(self) -> None:
        """Load BPF, open the session, synthesize running processes. Returns at READY."""
        t0 = time.monotonic()
        self.tracer = Tracer(ringbuf_bytes=self.config.ringbuf_bytes,
                             known_ids_max=self.config.identity_cache_entries)
        self.rings = Rings(self.tracer.ring_maps)
        self.writer = SessionWriter(self.session_dir, max_segment_bytes=self.config.segment_max_bytes,
                                    max_segment_age_s=self.config.segment_max_age_s,
                                    compress=self.config.compress)
        record = {"type": "session", "version": __version__, "session": self.session_dir.name,
                  "time_ns": clock.boot_ns(), "boot_to_wall_offset_ns": clock.boot_to_wall_offset_ns(),
                  "daemon_pid": os.getpid(), "bpf_compile_s": round(self.tracer.compile_s, 3),
                  "mode": "host" if self.tracked is None else "command"}
        record.update(host.describe())
        self._emit(dict_line(record))
        if self.config.store_root:
            self._start_snapshots(record.get("kernel_build_id"))
        self._scan(SYNTHESIZED)
        self._flush()
        self.ready_s = time.monotonic() - t0

    def follow(self, pid: int) -> None:
        """Record pid and, from now on, every process it forks (follow mode only)."""
        if self.tracked is None:
            raise ValueError("follow() needs a Recorder made with follow=True")
        self.tracked.add(pid)

    def run(self, should_stop: Callable[[], bool], on_tick: Callable[[], None] | None = None) -> None:
        """Step until should_stop() returns True; on_tick runs after each step.

        The calling thread records; while the rings fill faster than it
        drains them it runs at Config.recording_nice (see _adjust_priority).

        Steps come every poll_interval_s while events arrive in batches of
        SMALL_BATCH or more; after smaller batches the pause doubles up to
        SMALL_BATCH_POLL_S, and while none arrive up to idle_poll_interval_s
        (the rings absorb far more than that pause's worth of events), so an
        idle host costs little and a busy one pays the per-step cost less often.
        """
        base = self.config.poll_interval_s
        idle_max = max(base, self.config.idle_poll_interval_s)
        interval = base
        self._base_nice = os.getpriority(os.PRIO_PROCESS, 0)
        while not should_stop():
            t = time.monotonic()
            n = self.step()
            self._adjust_priority(self.rings.fill, t)
            if on_tick is not None:
                on_tick()
            if n >= self.SMALL_BATCH:
                interval = base
            elif n:
                interval = min(max(base, self.SMALL_BATCH_POLL_S), interval * 2)
            else:
                interval = min(idle_max, interval * 2)
            left = interval - (time.monotonic() - t)
            if left > 0:
                time.sleep(left)

    #: A step that drains fewer events than SMALL_BATCH lets the next one
    #: wait up to SMALL_BATCH_POLL_S: each step costs ~70 µs of CPU besides
    #: its events (measured: a 1,000 events/s trickle costs 16 ms/s), and in
    #: the exec storm 20 ms steps took 0.04 s of daemon CPU against 0.07 s
    #: for 5 ms steps.  Bursts of SMALL_BATCH or more go back to
    #: poll_interval_s.
    SMALL_BATCH = 1024
    SMALL_BATCH_POLL_S = 0.02

    #: A drain that finds a ring at least this full (share of its bytes:
    #: 512 KiB of the default 16 MiB rings, ~3,600 mappings) raises the
    #: recording thread's priority; below CALM_FILL (128 KiB, ~900 mappings
    #: per drain: ~180k/s at the 5 ms poll interval) for CALM_S seconds, it
    #: goes back to the process's own.
    BOOST_FILL = 1 / 32
    CALM_FILL = 1 / 128
    CALM_S = 2.0

    def _adjust_priority(self, fill: float, now: float) -> None:
        """Raise the recording thread to Config.recording_nice while a backlog builds up.

        At its own priority the recorder yields the CPU to the workload and
        catches up when the CPU is free: the cheapest for the workload.  But
        CPU-bound work on every core can hold it off long enough for a ring
        to overflow (measured here: two unpaced mmap storms on 2 CPUs lost
        13-59% of their events at nice 0, none at nice -3 to -10), so a
        drain that finds a ring BOOST_FILL full raises it until the rings stay
        near empty again (auditd's priority_boost, applied only when needed).
        A storm that the raised thread keeps up with still leaves more than
        CALM_FILL per drain, so the boost lasts as long as the storm.
        """
        if fill >= self.BOOST_FILL:
            self._calm_since = None
            if not self._boosted and self.config.recording_nice < self._base_nice:
                self._set_nice(self.config.recording_nice)
                self._boosted = True
                self.stats.priority_boosts += 1
        elif self._boosted and fill < self.CALM_FILL:
            if self._calm_since is None:
                self._calm_since = now
            elif now - self._calm_since >= self.CALM_S:
                self._set_nice(self._base_nice)
                self._boosted = False
        else:
            self._calm_since = None

    def _set_nice(self, nice: int) -> None:
        try:
            sched.set_current_thread_nice(nice)
        except OSError as e:
            self.last_errors.append({"time_ns": clock.boot_ns(), "error": f"recording_nice {nice}: {e}"})

    def rotate(self) -> None:
        """Close the current segment (it is compressed in the background) and start the next.

        A failure (fsync or close of the old segment) is counted in last_errors;
        the writer carries on in a new segment.
        """
        self._flush()
        if self.writer is not None:
            try:
                self.writer.rotate()
            except SessionLogError as e:
                self.stats.log_write_errors += 1
                self.last_errors.append({"time_ns": clock.boot_ns(), "error": f"rotate: {e}"})

    def request_rotate(self, timeout_s: float) -> bool:
        """Ask the recording thread to rotate at its next step; True once done (any thread)."""
        self._rotate_done.clear()
        self._rotate_wanted.set()
        return self._rotate_done.wait(timeout_s)

    def current_segment(self) -> str | None:
        """Path of the segment being written, or None."""
        return self.writer.stats.get("current_segment") if self.writer is not None else None

    def status(self) -> dict:
        """What the daemon is doing (JSON-ready; read by the control socket's thread)."""
        now = time.monotonic()
        window = list(self._rate_window)
        rates = {}
        if len(window) >= 2:
            (t0, c0), (t1, c1) = window[0], window[-1]
            rates = {k: round((v - c0.get(k, 0)) / (t1 - t0), 1) for k, v in c1.items()}
        out = {"session": self.session_dir.name, "session_dir": str(self.session_dir),
               "uptime_s": round(now - self.started_mono, 1), "ready_s": self.ready_s,
               "events_per_s": rates, "last_errors": list(self.last_errors),
               "log": dict(self.writer.stats) if self.writer is not None else None,
               "snapshots": self.snapshotter.status() if self.snapshotter is not None else None}
        out.update(self.summary())
        return out

    def reconfigure(self, config: Config) -> None:
        """Apply a reloaded configuration: rotation limits apply from the next segment."""
        self.config = config
        if self.writer is not None:
            self.writer.set_limits(config.segment_max_bytes, config.segment_max_age_s)

    def status_line(self) -> str:
        """One line for systemd's STATUS=."""
        ev = self.stats.events
        e = self.enricher
        return (f"{sum(ev.values())} events ({ev.get('mmap', 0)} mmap, {ev.get('exec', 0)} exec), "
                f"{e.resolved} build-ids, {sum(e.missing.values())} missing, "
                f"{sum(self.stats.lost.values())} lost")

    def step(self) -> int:
        """Drain the ring buffers once, record what they held; returns the number of events.

        The common events, a mapping of a file whose identity already has a
        final answer (and the held exec it completes), an exec (held) and the
        fork/exit/comm records, are recorded by _fastpath.run (C): a dict
        lookup on the raw identity bytes and one line from records.py's
        template, with no per-event Python objects.
        It stops at the first record that needs Python (an identity not yet
        resolved, a second exec from a tid before its first was completed, a
        path other than the known one, a malformed record): _slow_record
        records that one, and the fast path resumes after it.
        """
        raws = self.rings.drain()
        if self.tracked is not None:
            raws = self._follow_filter(raws)
        run = self._run_fast
        i, n = 0, len(raws)
        n_map = n_resolved = n_fork = n_exit = n_comm = n_exec = 0
        while i < n:
            if run is not None:
                i, a, b, c, d, e, x = run(raws, i, self._fast, self._held_exec, self._live, _COMM_JSON,
                                          _comm_json, _ORIGINS_T, self.enricher.missing, self._pending_lines,
                                          self._steps, _PATH_JSON, _path_json)
                n_map += a
                n_resolved += b
                n_fork += c
                n_exit += d
                n_comm += e
                n_exec += x
                if i >= n:
                    break
            self._slow_record(raws[i])
            i += 1
        ev_counts = self.stats.events
        for name, k in (("mmap", n_map), ("fork", n_fork), ("exit", n_exit), ("comm", n_comm), ("exec", n_exec)):
            if k:
                ev_counts[name] = ev_counts.get(name, 0) + k
        if n_map:
            self.enricher.hits += n_map
            self.enricher.resolved += n_resolved
        self._release_held_exec()
        now = time.monotonic()
        if now >= self._next_drop_check:
            self._next_drop_check = now + self.config.drop_check_interval_s
            self._check_drops()
            if not self._rate_window or now - self._rate_window[-1][0] >= 1.0:
                self._rate_window.append((now, dict(self.stats.events)))
        self._flush()
        if self._rotate_wanted.is_set():
            self._rotate_wanted.clear()
            try:
                self.rotate()
            finally:
                self._rotate_done.set()
        return len(raws)

    def close(self) -> None:
        """Drain what is left, write the end record, close the log and detach BPF."""
        if self.tracer is not None:
            self.step()
        self._release_held_exec(everything=True)
        if self.snapshotter is not None:
            self.snapshotter.stop()
        if self.writer is not None:
            self._emit(dict_line({"type": "end", "time_ns": clock.boot_ns(), **self.summary()}))
            self._flush()
            self.writer.close()
            self.writer = None
        if self.rings is not None:
            self.rings.close()
            self.rings = None
        if self.tracer is not None:
            self.tracer.close()
            self.tracer = None

    def summary(self) -> dict:
        """Totals of the session so far (JSON-ready)."""
        e = self.enricher
        lookups = e.hits + e.misses
        return {"events": dict(self.stats.events), "lost": dict(self.stats.lost),
                "decode_errors": self.stats.decode_errors, "recovered": self.stats.recovered,
                "synthesized": self.stats.synthesized, "synth_skipped": self.stats.synth_skipped,
                "build_ids_resolved": e.resolved, "build_ids_missing": dict(e.missing),
                "identity_cache": {"entries": len(e.cache), "hits": e.hits, "misses": e.misses,
                                   "hit_rate": round(e.hits / lookups, 4) if lookups else None},
                "known_ids_full": self.tracer.known_full if self.tracer else 0,
                "log_write_errors": self.stats.log_write_errors,
                "log_lines_dropped": self.stats.log_lines_dropped,
                "priority_boosts": self.stats.priority_boosts}

    # -- events ------------------------------------------------------------
    def _count(self, name: str) -> None:
        ev = self.stats.events
        ev[name] = ev.get(name, 0) + 1

    def _slow_record(self, raw: bytes) -> None:
        """Record one raw ring record the fast path left to Python (any record type)."""
        etype = raw[0]
        if etype >= EventType.FORK:       # fork, exit, comm
            if len(raw) < TASK_EVENT.size or etype > EventType.COMM:
                self.stats.decode_errors += 1
                return
            _t, pid, tid, _p, time_ns, comm, a, b = TASK_EVENT.unpack(raw)
            if etype == EventType.EXIT:
                self._live.pop(pid, None)
            cj = _COMM_JSON.get(comm)
            if cj is None:
                cj = _comm_json(comm)
            self._emit(task_line(etype, time_ns, pid, tid, cj, a, b))
            self._count(EventType(etype).name.lower())
            return
        try:
            decoded = exec_head(raw) if etype == EventType.EXEC else decode(raw)
        except DecodeError:
            self.stats.decode_errors += 1
            return
        if etype == EventType.EXEC:
            self._hold_exec(raw, decoded)
        else:
            self._handle_map(decoded)

    def _follow_filter(self, raws: list[bytes]) -> list[bytes]:
        """Follow mode: the records of tracked processes (and forks from them), in time order.

        A record of an untracked pid is held back for one step: its parent's
        FORK may sit in another CPU's ring that was read just before the
        parent's CPU committed it.  Held twice, it is dropped.  This is the
        only place follow mode filters: step() then records all it is given.
        """
        prev = self._deferred
        self._deferred = []
        if prev:
            held_before = {id(r) for r in prev}
            raws = prev + raws
            _fastpath.sort_by_time(raws)
        else:
            held_before = ()
        tracked = self.tracked
        out = []
        for raw in raws:
            if len(raw) < 12:
                out.append(raw)          # let decoding count it
                continue
            pid = int.from_bytes(raw[4:8], "little")
            if raw[0] == EventType.FORK and len(raw) >= TASK_EVENT.size:
                # A fork belongs to the tree when its parent does (the fork
                # that made the command itself came from buildidd: not kept).
                if int.from_bytes(raw[TASK_PPID_OFF:TASK_PPID_OFF + 4], "little") in tracked:
                    tracked.add(pid)
                    out.append(raw)
                elif id(raw) not in held_before and len(self._deferred) < 65536:
                    self._deferred.append(raw)
                continue
            if pid in tracked:
                out.append(raw)
                if raw[0] == EventType.EXIT:
                    tracked.discard(pid)         # a reused pid is someone else
            elif id(raw) not in held_before and len(self._deferred) < 65536:
                self._deferred.append(raw)
        return out

    def _handle_map(self, ev: RawEvent) -> None:
        """A mapping whose identity has no final answer yet (or an exec'd one): the slow path."""
        held = self._held_exec.pop(ev.tid, None)
        res = self.enricher.resolve(ev)
        if held is not None:
            self._emit_exec(held, res if held[2] == file_key(ev.identity) else None)
        self._record_map(ev, ORIGIN_NAMES.get(ev.origin, "mmap"), res)

    def _hold_exec(self, raw: bytes, head: tuple[int, int, int, str, int, str]) -> None:
        """Hold an exec until the main executable's mapping (next from this tid) resolves it.

        head: exec_head(raw).  The line's prefix is made now; the identity
        stays raw (the key) until a fallback needs it decoded.
        """
        pid, tid, time_ns, comm, old_pid, path = head
        prev = self._held_exec.pop(tid, None)
        if prev is not None:
            self._emit_exec(prev, None)
        self._held_exec[tid] = (raw, self._steps, exec_file_key(raw),
                                exec_prefix(time_ns, pid, tid, comm, old_pid, path))
        self._live.pop(pid, None)

    def _emit_exec(self, held: tuple[bytes, int, bytes, bytes], res: Resolution | None) -> None:
        """Write a held exec with its executable's Resolution (None: resolved from the exec record)."""
        if res is None:
            res = self.enricher.resolve(decode(held[0]))     # exec_head checked what decode checks
        self._count("exec")
        self._emit(exec_line(held[3], res))

    def _release_held_exec(self, everything: bool = False) -> None:
        # An exec whose main mapping did not follow within one more batch
        # (dropped, or not found): record it with its own resolution.
        self._steps += 1
        for tid, held in list(self._held_exec.items()):
            if everything or held[1] < self._steps - 1:
                del self._held_exec[tid]
                self._emit_exec(held, None)

    def _record_map(self, ev: RawEvent, origin: str, res: Resolution) -> None:
        path = ev.path if ev.path else res.path
        self.enricher.count(res)
        self._count("mmap")
        live = self._live.get(ev.pid)
        if live is None:
            live = self._live[ev.pid] = set()
        key = file_key(ev.identity)
        if len(live) < 4096:
            live.add((ev.start, key))
        # The fast path writes what this method writes for a record without
        # a path (the Resolution's path) or with that same path; so its entry
        # is made from an event that carried that path whole.
        if (res.final and ev.origin is not None and path and path == res.path and key not in self._fast
                and not ev.id_flags & (PATH_TRUNCATED | PATH_UNREACHABLE)):
            self._fast[key] = (res, mmap_tail(path, res), None if res.build_id else res.error or "unknown",
                               res_tail(res), path.encode("utf-8", "surrogateescape"))
        self._emit(mmap_line(ev, origin, path, res))

    def _on_resolved(self, ident: Identity, res: Resolution) -> None:
        if self.tracer is not None:
            self.tracer.mark_known(ident, st_dev_to_kdev(ident.dev))

    def _start_snapshots(self, kernel_build_id: str | None) -> None:
        from buildidd.capture.housekeeping import Housekeeping, RetentionPolicy
        from buildidd.store import SnapshotPolicy, Snapshotter, Store

        cfg = self.config
        store = Store(cfg.store_root, quota_bytes=cfg.store_quota_bytes or None)
        if kernel_build_id:
            try:
                store.add_kallsyms(kernel_build_id)
            except (StoreError, OSError) as e:
                self.last_errors.append({"time_ns": clock.boot_ns(), "error": f"kallsyms snapshot: {e}"})
        retention = RetentionPolicy(session_root=self.session_dir.parent, current_session=self.session_dir,
                                    max_age_s=cfg.session_max_age_s or None,
                                    max_total_bytes=cfg.session_max_total_bytes or None)
        self.snapshotter = Snapshotter(store, SnapshotPolicy(rate_bytes_per_s=cfg.snapshot_rate_bytes_per_s),
                                       housekeeping=Housekeeping(store, retention))
        self.snapshotter.start()

    def _on_build_id(self, ident: Identity, res: Resolution, fd: int) -> None:
        if self.snapshotter is not None:
            self.snapshotter.submit(res.build_id, res.path, ident, fd)

    def _on_evicted(self, ident: Identity) -> None:
        self._fast.pop(file_key(ident), None)
        if self.tracer is not None:
            self.tracer.forget(ident, st_dev_to_kdev(ident.dev))

    # -- /proc scans: synthesis at start, recovery after a loss -------------
    def _scan(self, origin: str) -> None:
        pids = list(self.tracked) if self.tracked is not None else list(procfs.pids())
        me = os.getpid()
        for pid in pids:
            if pid == me and self.tracked is None:
                continue
            try:
                maps = procfs.exec_file_mappings(pid)
            except OSError:
                continue
            comm = procfs.read_comm(pid)
            live = self._live.get(pid, set())
            for m in maps:
                if origin == RECOVERED and any(s == m.start and int.from_bytes(k[:8], "little") == m.ino
                                               for s, k in live):
                    continue
                self._record_scanned(pid, comm, m, origin)

    def _record_scanned(self, pid: int, comm: str, m: procfs.MapsEntry, origin: str) -> None:
        try:
            fd = procfs.open_map_file(pid, m.start, m.end)
        except OSError:
            self.stats.synth_skipped += 1
            return
        try:
            ident = procfs.identity_of(fd)
            res = self.enricher.resolve_open(ident, fd, Source.MAP_FILES, m.path)
        except OSError:
            self.stats.synth_skipped += 1
            return
        finally:
            os.close(fd)
        ev = RawEvent(EventType.MAP, pid, pid, clock.boot_ns(), comm, m.start, m.end - m.start, m.offset,
                      m.prot, MAP_SHARED if m.perms[3] == "s" else MAP_PRIVATE, None, ident,
                      0 if m.deleted else 1, 0, m.path)
        if origin == RECOVERED:
            self.stats.recovered += 1
        else:
            self.stats.synthesized += 1
        self._record_map(ev, origin, res)

    #: At most one recovery rescan of /proc/*/maps per this many seconds: a
    #: storm that keeps overflowing the rings must not also pay a rescan of
    #: every process four times a second.
    RESCAN_MIN_INTERVAL_S = 5.0

    def _check_drops(self) -> None:
        report = self.tracer.drops()
        now = time.monotonic()
        if report.total:
            for cause, n in report.counts.items():
                self.stats.lost[cause] = self.stats.lost.get(cause, 0) + n
            self._emit(dict_line({"type": "lost", "time_ns": clock.boot_ns(), "counts": report.counts,
                                  "first_ns": report.first_ns, "last_ns": report.last_ns,
                                  "recovery": "rescan of /proc/*/maps follows (origin recovered)"}))
            self._rescan_pending = True
        if self._rescan_pending and now >= self._next_rescan:
            self._rescan_pending = False
            self._next_rescan = now + self.RESCAN_MIN_INTERVAL_S
            self._scan(RECOVERED)

    # -- the log -----------------------------------------------------------
    def _emit(self, line: bytes) -> None:
        self._pending_lines.append(line)

    def _flush(self) -> None:
        if not self._pending_lines or self.writer is None:
            return
        try:
            self.writer.write_lines(self._pending_lines, trusted=True)
        except SessionLogError as e:
            # Keep the records (bounded) and retry at the next step.
            self.stats.log_write_errors += 1
            self.last_errors.append({"time_ns": clock.boot_ns(), "error": f"session log: {e}"})
            if self.stats.log_write_errors <= 3 or self.stats.log_write_errors % 1000 == 0:
                log.warning("session log write failed (%d times): %s", self.stats.log_write_errors, e)
            excess = sum(map(len, self._pending_lines)) + len(self._pending_lines) \
                - self.config.pending_lines_max_bytes
            drop = 0
            while excess > 0 and drop < len(self._pending_lines):
                excess -= len(self._pending_lines[drop]) + 1
                drop += 1
            if drop:
                del self._pending_lines[:drop]
                self.stats.log_lines_dropped += drop
            return
        self._pending_lines = []

"""The recorder: composes tracer → decode → enrichment → session log.

Lifecycle: :meth:`Recorder.start` loads and attaches the BPF programs, writes
the session record and synthesizes the executable mappings of every running
process (like ``perf record`` synthesizing existing tasks: one pass of the BPF
task_vma iterator, kernel.synth, its records going through the same paths as
live events); from then on every mapping is recordable (READY).  :meth:`Recorder.step` drains the ring buffers
once; :meth:`Recorder.run` steps until told to stop (loop.py: paced steps,
and quiet waits while idle); :meth:`Recorder.close` drains what is left and
closes the session with an ``end`` record.

Its parts: the C fast path (_fastpath.c) records the common events and
slowpath.py the rest; the exec join (execjoin.py) holds execs until their
executable's mapping; loss recovery (rescan.py) turns drops into ``lost``
records and rescans /proc; pacing (pacing.py) sets the poll interval and the
thread's priority; loop.py steps, and sleeps while idle; logsink.py writes
the lines and rotates; follow mode (follow.py) filters a process tree;
report.py says what it did (status, STATUS=, the end record's totals).
They share tables.Tables.  With a store, wiring.py builds the store side at
start (the copy thread, the exec pins, the hand-over queue).
"""

from __future__ import annotations

import collections
import os
import time
from pathlib import Path
from typing import Callable

from buildidd import __version__, clock
from buildidd.capture import _fastpath, loop, report
from buildidd.capture.execjoin import ExecJoin
from buildidd.capture.follow import FollowFilter
from buildidd.capture.housekeeping import retention_without_store
from buildidd.capture.guard import LoopGuard, call_within
from buildidd.capture.logsink import LogSink
from buildidd.capture.bpfstart import KernelPath, load_programs
from buildidd.capture.pacing import Pacer
from buildidd.capture.rescan import LossRecovery
from buildidd.capture.rings import Rings
from buildidd.capture.slowpath import SlowPath
from buildidd.capture.tables import Stats, Tables
from buildidd.capture.wiring import open_store_side, submit_copy
from buildidd.config import Config
from buildidd.kernel.budget import throttled_record
from buildidd.kernel.events import Identity, RawEvent, file_key
from buildidd.kernel.tracer import Tracer
from buildidd.resolve import host
from buildidd.resolve.enrich import Enricher, Offload, Resolution
from buildidd.resolve.handover import HandOver
from buildidd.sessionlog.records import SYNTHESIZED, dict_line
from buildidd.sessionlog import seal_unclosed_sessions
from buildidd.sessionlog.segments import DIR_MODE

__all__ = ["Recorder", "Stats", "new_session_dir"]

#: Seconds close() adds to Config.snapshot_stop_budget_s before it leaves the
#: snapshotter behind (it may be stuck copying from a slow file system).
SNAPSHOT_STOP_GRACE_S = 1.0
#: The counters of _fastpath.run's result (tables.RunCounts), summed by _record_raws.
RUN_COUNTS = ("mmap", "resolved", "fork", "exit", "comm", "exec")


def new_session_dir(root: str) -> Path:
    """A fresh session directory under root, made now (empty; the writer adopts it): UTC start time
    and daemon pid, then ``.NNNN`` (from 0002, so that names sort in start order) when this process
    already made one in the same second (a restart of the recorder inside one process takes less
    than a second).  When root cannot be written the name is returned unmade: the writer's own
    attempt then reports why.
    """
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    base = Path(root) / f"{stamp}-{os.getpid()}"
    try:
        os.makedirs(root, mode=DIR_MODE, exist_ok=True)
    except OSError:
        return base
    for n in range(1, 10_000):
        path = base if n == 1 else base.with_name(f"{base.name}.{n:04d}")
        try:
            os.mkdir(path, DIR_MODE)
        except FileExistsError:
            continue
        except OSError:
            return path
        return path
    return base.with_name(f"{base.name}.{time.monotonic_ns()}")


def _load_or_unmake(config: Config, session_dir: Path) -> tuple[KernelPath, Tracer]:
    """load_programs(config); when it raises, session_dir (made empty by new_session_dir, nothing
    recorded in it) is removed first."""
    try:
        return load_programs(config)
    except BaseException:
        try:
            os.rmdir(session_dir)
        except OSError:
            pass
        raise


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
        # The sinks below (_on_build_id, _hand_over, _named) reach the store side, which start()
        # builds (wiring.py): these parts exist before it, and the sinks do nothing until then.
        store = bool(config.store_root)
        self.enricher = Enricher(config.identity_cache_entries, on_late=self.wake, on_evicted=self._on_evicted,
                                 on_build_id=self._on_build_id if store else None,
                                 offload=Offload.from_config(config), hand_over=self._hand_over if store else None)
        self.snapshotter = None      # store.Snapshotter once started (with a store)
        self.pins = None             # resolve.execpins.ExecPins once started (with a store and fanotify)
        self.handovers = None        # resolve.handoverqueue.HandOverQueue once started (with a store)
        self.last_errors: collections.deque = collections.deque(maxlen=10)
        self.last_reload: dict | None = None   # {"time_ns", "ok", "error"} of the last SIGHUP (cli.record)
        self.tables = Tables(missing=self.enricher.missing)
        self.log = LogSink(self.tables, self.stats, self.last_errors)
        self.join = ExecJoin(self.tables, self.enricher, self.stats)
        self.slow = SlowPath(self.tables, self.stats, self.enricher, self.join, self._named if store else None)
        self.recovery = LossRecovery(self.tables, self.stats, self.enricher, self.slow.record_map, self.tracked)
        self.pacer = Pacer(config, self.stats, self.last_errors)
        self.follow_filter = FollowFilter(self.tracked) if follow else None
        # None only to check the fast path against _slow_record (tests).
        self._run_fast = _fastpath.run
        self.started_mono = time.monotonic()
        self.ready_s: float | None = None
        self.kernel_path = None      # bpfstart.KernelPath once started
        #: (time.monotonic(), events by type so far), one a second at most: status's events_per_s
        self.rate_window: collections.deque = collections.deque(maxlen=12)
        self.guard = LoopGuard()

    def start(self) -> None:
        """Load BPF, open the session, synthesize running processes. Returns at READY."""
        t0 = time.monotonic()
        # Sessions a crash (kill -9) left open: end record "clean": false, segments compressed.
        seal_unclosed_sessions(self.session_dir.parent, exclude=[self.session_dir], compress=self.config.compress)
        self.kernel_path, self.tracer = _load_or_unmake(self.config, self.session_dir)
        self.tracer.budgets.configure(self.config.uid_record_rate_bytes_per_s, self.config.uid_record_burst_bytes)
        self.rings = Rings(self.tracer.ring_maps)
        self.log.open(self.session_dir, self.config)
        record = session_record(self.session_dir, self.tracer, self.tracked is not None, self.kernel_path)
        self.tables.emit(dict_line(record))
        if self.config.store_root:
            side = open_store_side(self.config, self.session_dir, record.get("kernel_build_id"),
                                   self.last_errors, self.enricher)
            self.snapshotter, self.pins, self.handovers = side.snapshotter, side.pins, side.handovers
        else:  # retention runs on the snapshotter's thread when there is a store
            retention_without_store(self.config, self.session_dir, lambda: self.log.writer is None)
        if self.tracked is None:
            self.recovery.synthesize(self.tracer, self._record_raws, self.log.flush, self.last_errors,
                                     self.config.resolve_deadline_s)
        else:                           # follow mode: the tracked processes (none yet at start)
            self.recovery.scan(SYNTHESIZED)
        self.log.flush()
        self.ready_s = time.monotonic() - t0

    def follow(self, pid: int) -> None:
        """Record pid and, from now on, every process it forks (follow mode only)."""
        if self.tracked is None:
            raise ValueError("follow() needs a Recorder made with follow=True")
        self.tracked.add(pid)

    def run(self, should_stop: Callable[[], bool], on_tick: Callable[[], None] | None = None,
            quiet_s: Callable[[], float] | None = None) -> None:
        """Step until should_stop() returns True, paced by pacing.Pacer, with quiet waits while
        idle when quiet_s is given: see loop.run (which raises BuildiddError after
        LoopGuard.FAILURES_MAX failed steps in a row)."""
        loop.run(self, should_stop, on_tick, quiet_s)

    def wake_on_signals(self) -> None:
        """From start() on, a signal ends the recording thread's sleep at once (main thread only:
        Rings.wake_on_signals)."""
        self.rings.wake_on_signals()

    def wake(self) -> None:
        """End the recording thread's sleep now (any thread): Rings.kick."""
        if self.rings is not None:
            self.rings.kick()

    def idle(self) -> bool:
        """True when nothing but the next record waits for the recording thread: no line left to
        write, no held exec, no late answer to write (Enricher.idle), no rescan after drops
        pending, no rotation asked."""
        tables = self.tables
        return (not (tables.out or tables.held) and self.enricher.idle() and not self.recovery.rescan_pending
                and not self.log.rotate_pending())

    def step(self) -> int:
        """Drain the ring buffers once, record what they held; returns the number of events.

        The common events (a mapping of a file whose identity has a final
        answer and the held exec it completes, an exec (held), fork/exit/comm)
        are recorded by _fastpath.run (C): a dict lookup on the raw identity
        bytes and one line from records.py's template, no per-event Python
        objects.  It stops at the first record that needs Python (an identity not yet
        resolved, a second exec from a tid before its first was completed, a
        path other than the known one, a malformed record): slowpath.SlowPath
        records that one, and the fast path resumes after it.
        """
        self.enricher.begin_step(self.config.resolve_deadline_s)
        taken_ns = clock.boot_ns()          # every record before it is in this batch or an earlier one
        batch = self.rings.take()
        try:
            n = len(batch)
            if n:
                self.tracer.reset_wakeups()
            if self.follow_filter is not None or self._run_fast is None:
                raws = list(batch)              # copies: the rings' space goes back at once
                batch.release()
                self._record_raws(self.follow_filter.filter(raws) if self.follow_filter else raws)
            else:
                self._record_raws(batch)        # read in place; run() gives the space back as it goes
        finally:
            batch.release()
        self.join.release()
        if self.pins is not None:           # the execs it took confirm their pins; the rest failed
            self.pins.recorded(self.tables.execs, taken_ns)
        self.tables.execs.clear()
        self.slow.record_resolutions(self.enricher.take_late())
        self.stats.live_pids_dropped += self.tables.trim_live()
        now = time.monotonic()
        if now >= self.recovery.next_check:
            self.recovery.next_check = now + self.config.drop_check_interval_s
            self.recovery.on_drops(self.tracer.drops())
            if not self.rate_window or now - self.rate_window[-1][0] >= 1.0:
                self.rate_window.append((now, dict(self.stats.events)))
                for held in self.tracer.budgets.report():      # one user's records held back (kernel.budget)
                    self.tables.emit(dict_line(throttled_record(held, clock.boot_ns())))
        self.log.flush()
        self.log.rotate_if_requested()
        return n

    def _record_raws(self, raws: list[bytes] | _fastpath.Batch) -> None:
        """Record raw ring records in order (a list of bytes, or a Batch read in place): the C fast
        path, and the slow path for what it leaves (raws[i]: a copy of a Batch's record)."""
        run, tables = self._run_fast, self.tables
        i, n = 0, len(raws)
        counts = [0] * len(RUN_COUNTS)      # the fast path's, by name in RUN_COUNTS
        while i < n:
            if run is not None:
                done = run(raws, i, tables)
                i = done.next
                counts = [c + getattr(done, name) for c, name in zip(counts, RUN_COUNTS)]
                if i >= n:
                    break
            try:
                self.slow.record(raws[i])
            except Exception as e:          # one event's failure stops no other record
                self.stats.event_error(e)
            i += 1
        got = dict(zip(RUN_COUNTS, counts))
        for name in ("mmap", "fork", "exit", "comm", "exec"):
            if got[name]:
                self.stats.count(name, got[name])
        if got["mmap"]:
            self.enricher.cache.count_hits(got["mmap"])
            self.enricher.resolved += got["resolved"]

    def close(self) -> None:
        """Drain what is left, write the end record, close the log and detach BPF."""
        if self.tracer is not None:
            try:
                self.step()
            except Exception as e:          # the end record is still written
                self.guard.step_failed(e)
        self.join.release(everything=True)
        budget_end = time.monotonic() + self.config.snapshot_stop_budget_s
        if self.handovers is not None:       # hand-overs still queued reach the snapshotter first
            self.handovers.drain(max(0.0, budget_end - time.monotonic()))
            self.slow.record_resolutions([])     # the htlhashes those hand-overs computed: file_id records
            self.handovers.close()
        abandoned = self.enricher.close()
        if self.snapshotter is not None:
            left = max(0.0, budget_end - time.monotonic())
            call_within(lambda: self.snapshotter.stop(budget_s=left), left + SNAPSHOT_STOP_GRACE_S,
                        "snapshotter stop")
        if self.pins is not None:
            self.pins.close()
        if self.log.writer is not None:
            for held in self.tracer.budgets.report() if self.tracer is not None else ():
                self.tables.emit(dict_line(throttled_record(held, clock.boot_ns())))
            self.tables.emit(report.end_line({"type": "end", "time_ns": clock.boot_ns(),
                                              "reason": self.guard.end_reason or "stopped",
                                              "resolutions_abandoned": abandoned, **self.summary(),
                                              "records_lost": self.log.writer.stats["records_lost"],
                                              **report.store_totals(self)}))
            self.log.close()
        if self.rings is not None:
            self.rings.close()
            self.rings = None
        if self.tracer is not None:
            self.tracer.close()
            self.tracer = None

    def rotate(self) -> None:
        """Close the current segment and start the next (LogSink.rotate; recording thread)."""
        self.log.rotate()

    def request_rotate(self, timeout_s: float) -> bool:
        """Ask the recording thread to rotate at its next step; True once done (any thread)."""
        return self.log.request_rotate(timeout_s, self.wake)

    def current_segment(self) -> str | None:
        """Path of the segment being written, or None."""
        return self.log.current_segment()

    def next_segment(self) -> str | None:
        """When no segment is open: the path the next record opens (else None)."""
        return (self.log.stats_or_none() or {}).get("next_segment")

    def reconfigure(self, config: Config) -> None:
        """Apply a reloaded configuration: rotation limits apply from the next segment."""
        self.config = self.pacer.config = config
        self.log.set_limits(config)
        if self.tracer is not None:
            self.tracer.budgets.configure(config.uid_record_rate_bytes_per_s, config.uid_record_burst_bytes)

    # -- status (report.py) --------------------------------------------------
    def status(self) -> dict:
        """What the daemon is doing (JSON-ready; read by the control socket's thread): report.status."""
        return report.status(self)

    def status_line(self) -> str:
        """One line for systemd's STATUS=."""
        return report.status_line(self)

    def summary(self) -> dict:
        """Totals of the session so far (JSON-ready): report.summary."""
        return report.summary(self)

    def _on_build_id(self, ident: Identity, res: Resolution, fd: int | None, urgency: HandOver, uid: int) -> None:
        """A file a resolve worker read (a worker thread): to the copy queue (wiring.submit_copy) once
        the store side exists."""
        snapshotter = self.snapshotter
        if snapshotter is not None:
            submit_copy(snapshotter, ident, res, fd, urgency, uid)

    def _named(self, key: str, path: str, uid: int) -> None:
        """A build-id (or htlhash) recorded (recording thread): to the coverage ledger once the store side exists."""
        if self.snapshotter is not None:
            self.snapshotter.coverage.named(key, path, uid)

    def _hand_over(self, ev: RawEvent, res: Resolution) -> None:
        """A mapping the kernel read (recording thread): to the hand-over queue once the store side exists."""
        if self.handovers is not None:
            self.handovers.offer(ev, res)

    def _on_evicted(self, ident: Identity) -> None:
        self.tables.fast.pop(file_key(ident), None)


def session_record(session_dir: Path, tracer: Tracer, follow: bool, kernel_path: KernelPath) -> dict:
    """The session's first record: daemon, host (resolve.host.describe) and BPF facts.

    Args:
        session_dir: the session's directory (its name is the session id).
        tracer: the loaded Tracer (its BCC compile time, s).
        follow: True in command mode (``buildidd record``), False for the whole host.
        kernel_path: the bpfstart.KernelPath start-up verdict.
    Returns: {"type": "session", ...} with time_ns in ns since boot.
    """
    record = {"type": "session", "version": __version__, "session": session_dir.name,
              "time_ns": clock.boot_ns(), "boot_to_wall_offset_ns": clock.boot_to_wall_offset_ns(),
              "daemon_pid": os.getpid(), "bpf_compile_s": round(tracer.compile_s, 3),
              "bpf_reused": tracer.prog.reused, "bpf_cached": tracer.prog.cached,
              "mode": "command" if follow else "host",
              "kernel_build_id_path": kernel_path.as_dict()}
    record.update(host.describe())
    return record

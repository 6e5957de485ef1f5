"""Pacing of the recording thread: how long it sleeps between steps, and its priority.

Steps come every Config.poll_interval_s while events arrive in batches of
SMALL_BATCH or more; after smaller batches the pause doubles up to
SMALL_BATCH_POLL_S, and while none arrive up to Config.idle_poll_interval_s
(the rings absorb far more than that pause's worth of events), so an idle
host costs little and a busy one pays the per-step cost less often.  A burst
does not wait for the pause to end: the BPF side wakes the recorder every
WAKE_BYTES a CPU writes (capture.rings.Rings.wait).  While
the rings fill faster than the thread drains them it runs at
Config.recording_nice (see Pacer.adjust_priority).
"""

from __future__ import annotations

import collections
import os

from buildidd import clock
from buildidd.capture.tables import Stats
from buildidd.config import Config
from buildidd.kernel import sched


class Pacer:
    """Poll interval back-off and the nice boost of the recording thread.

    Args:
        config: the Config (poll_interval_s, idle_poll_interval_s: taken at
            begin(); recording_nice: read when applied, so a reload changes it).
        stats: counts priority_boosts.
        last_errors: where a refused nice change is noted (a bounded deque of dicts).
    """

    #: A step that drains fewer events than SMALL_BATCH lets the next one
    #: wait up to SMALL_BATCH_POLL_S: each step costs ~70 µs of CPU besides
    #: its events (measured: a 1,000 events/s trickle costs 16 ms/s), and in
    #: the exec storm 20 ms steps took 0.04 s of daemon CPU against 0.07 s
    #: for 5 ms steps.  Bursts of SMALL_BATCH or more go back to
    #: poll_interval_s.
    SMALL_BATCH = 1024
    SMALL_BATCH_POLL_S = 0.02

    #: A drain that finds a ring at least this full (share of its bytes:
    #: 64 KiB of the default 2 MiB rings, ~250 mappings: ~50k/s at the 5 ms
    #: poll interval) raises the recording thread's priority; below
    #: CALM_FILL (16 KiB, ~60 mappings per drain) for CALM_S seconds, it goes
    #: back to the process's own.
    BOOST_FILL = 1 / 32
    CALM_FILL = 1 / 128
    CALM_S = 2.0

    def __init__(self, config: Config, stats: Stats, last_errors: collections.deque):
        self.config = config
        self.stats = stats
        self.last_errors = last_errors
        self.interval_s = self._base_s = self._idle_max_s = config.poll_interval_s
        self._base_nice = 0
        self._boosted = False
        self._calm_since: float | None = None

    def begin(self) -> None:
        """Called on the recording thread before its first step: its own nice is the base."""
        self._base_nice = os.getpriority(os.PRIO_PROCESS, 0)
        self.interval_s = self._base_s = self.config.poll_interval_s
        self._idle_max_s = max(self._base_s, self.config.idle_poll_interval_s)

    def next_interval(self, n: int) -> float:
        """Seconds from the start of a step that drained n events to the start of the next."""
        base = self._base_s
        if n >= self.SMALL_BATCH:
            self.interval_s = base
        elif n:
            self.interval_s = min(max(base, self.SMALL_BATCH_POLL_S), self.interval_s * 2)
        else:
            self.interval_s = min(self._idle_max_s, self.interval_s * 2)
        return self.interval_s

    def woken(self) -> None:
        """A ring's wake-up (a burst: WAKE_BYTES written on one CPU) ended the pause: poll fast again."""
        self.interval_s = self._base_s

    def adjust_priority(self, fill: float, now: float) -> None:
        """Raise the recording thread to Config.recording_nice while a backlog builds up.

        fill: the fullest ring's share of its bytes at the last drain; now:
        time.monotonic().  At its own priority the recorder yields the CPU to
        the workload and catches up when the CPU is free: the cheapest for the
        workload.  But CPU-bound work on every core can hold it off long
        enough for a ring to overflow (measured here: two unpaced mmap storms
        on 2 CPUs lost 13-59% of their events at nice 0, none at nice -3 to
        -10), so a drain that finds a ring BOOST_FILL full raises it until the
        rings stay near empty again (auditd's priority_boost, applied only
        when needed).  A storm that the raised thread keeps up with still
        leaves more than CALM_FILL per drain, so the boost lasts as long as
        the storm.
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

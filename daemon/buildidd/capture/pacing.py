"""Pacing of the recording thread: how long it sleeps between steps, and its priority.

Both follow how fast the rings fill, measured at each drain: the fullest
ring's share found occupied (Rings.fill) over the time since the previous
drain, in rings per second.  The pause is what lets that ring fill to
TARGET_FILL, between Config.poll_interval_s and Config.idle_poll_interval_s;
while no events come it doubles up to the latter (the rings absorb far more
than that pause's worth of events).  Each step costs the recorder far more
than its events when it starts cold (after a sleep, its Python work finds
caches and, on a guest with free page reporting, its memory cold: several
times the CPU it takes warm; scripts/bench prints the machine's cost of
touching memory after a sleep).  So a steady stream is
drained in few large steps, not many small ones; a burst does not wait for
the pause to end: the BPF side wakes the recorder every WAKE_BYTES a CPU
writes (capture.rings.Rings.wait).  While a ring fills fast enough to
overflow soon, the thread runs at Config.recording_nice (see
Pacer.adjust_priority).
"""

from __future__ import annotations

import collections
import os

from buildidd import clock
from buildidd.capture.tables import Stats
from buildidd.config import Config
from buildidd.kernel import sched


class Pacer:
    """Poll interval and the nice boost of the recording thread, from the rings' fill rate.

    Args:
        config: the Config (poll_interval_s, idle_poll_interval_s and
            recording_nice: read at each step, so a reload applies at once).
        stats: counts priority_boosts.
        last_errors: where a refused nice change is noted (a bounded deque of dicts).
    """

    #: The share of a ring a step should find occupied in a steady stream:
    #: a tenth, below the BPF side's wake-up at an eighth.  A slow stream is
    #: then drained every idle_poll_interval_s and a fast one in few large
    #: steps; a smaller share means more steps and more daemon CPU per event
    #: (the A/B runs of `scripts/bench --against` that chose it are in
    #: docs/performance-history.md).
    TARGET_FILL = 1 / 10

    #: Fill rates (rings per second) at or above which the recording thread
    #: is raised: a ring full within 1/BOOST_RATE s (160 ms) at the rate of
    #: the last interval, or a drain that finds one BOOST_FILL full (the
    #: thread came late: a full WAKE_BYTES was waiting).  Below CALM_RATE
    #: (a ring in 640 ms) for CALM_S seconds, it goes back to the process's own.
    #: Unpaced mmap storms fill rings far above BOOST_RATE, an exec storm far
    #: below it, where a recorder at the workload's own priority keeps up
    #: (their fill rates: docs/performance-history.md, 'Pacing').
    BOOST_RATE = 6.25
    BOOST_FILL = 1 / 8
    CALM_RATE = 1.5625
    CALM_S = 2.0

    #: Rates are taken over at least this long (seconds): two drains in a
    #: row (after a wake-up) would otherwise divide a few bytes by ~0.
    MIN_RATE_SPAN_S = 0.002

    def __init__(self, config: Config, stats: Stats, last_errors: collections.deque):
        self.config = config
        self.stats = stats
        self.last_errors = last_errors
        self.interval_s = config.poll_interval_s
        self.rate = 0.0
        self._base_nice = 0
        self._boosted = False
        self._calm_since: float | None = None
        self._last_drain: float | None = None
        # False while the span since the last drain may hold a pause the rings spent
        # empty (an idle step, a wake-up): its rate then underrates a burst that began
        # inside it (a 50 ms idle span ended by the wake-up at 1/8 of a ring reads as
        # 2.5 rings/s, and would set a 25 ms pause before a ring that fills in 15 ms).
        self._rate_trusted = False

    def begin(self) -> None:
        """Called on the recording thread before its first step: its own nice is the base."""
        self._base_nice = os.getpriority(os.PRIO_PROCESS, 0)
        self.interval_s = self.config.poll_interval_s
        self._last_drain = None
        self._rate_trusted = False

    def drained(self, n: int, fill: float, now: float) -> None:
        """Take a step's drain into account: n events, the fullest ring's share fill (0..1), at now.

        now: time.monotonic() when the drain began.  Sets rate (rings per
        second since the previous drain; 0.0 for the first) and interval_s:
        poll_interval_s after the first events that follow a drain of none
        or a wake-up (the span's rate may include an empty pause), else what
        lets the fullest ring reach TARGET_FILL at that rate, within bounds.
        Raises or lowers the thread's priority (adjust_priority).
        """
        last, self._last_drain = self._last_drain, now
        span = None if last is None else max(now - last, self.MIN_RATE_SPAN_S)
        self.rate = fill / span if span else 0.0
        base = self.config.poll_interval_s       # read at each step: a reload applies at once
        top = self._top()
        if n == 0:
            self.interval_s = min(top, self.interval_s * 2)
        elif self._rate_trusted and self.rate > 0:
            self.interval_s = min(top, max(base, self.TARGET_FILL / self.rate))
        else:                   # the first events after a pause: measure the rate over base
            self.interval_s = base
        self._rate_trusted = n > 0
        self.adjust_priority(fill, now)

    def next_interval(self) -> float:
        """Seconds from the start of the last step to the start of the next (set by drained())."""
        return self.interval_s

    def idle(self) -> bool:
        """True when the last steps found the rings empty (the pause has grown to
        idle_poll_interval_s) and the thread is at its own priority."""
        return not self._boosted and self.interval_s >= self._top()

    def _top(self) -> float:
        """The longest pause (s): idle_poll_interval_s, never below poll_interval_s."""
        return max(self.config.poll_interval_s, self.config.idle_poll_interval_s)

    def woken(self) -> None:
        """A ring's wake-up (a burst: WAKE_BYTES written on one CPU) ended the pause: poll fast again.

        The step that follows waits poll_interval_s whatever the rate over its
        span, which may have begun before the burst.
        """
        self.interval_s = self.config.poll_interval_s
        self._rate_trusted = False

    def adjust_priority(self, fill: float, now: float) -> None:
        """Raise the recording thread to Config.recording_nice while a ring would soon overflow.

        fill: the fullest ring's share of its bytes at the last drain; now:
        time.monotonic().  At its own priority the recorder yields the CPU to
        the workload and catches up when the CPU is free: the cheapest for the
        workload.  But CPU-bound work on every core can hold it off long
        enough for a ring to overflow (two unpaced mmap storms on every CPU
        do: scripts/bench's ramp), so a fill rate of BOOST_RATE, or a drain that finds a ring
        BOOST_FILL full, raises it until the rings fill slower than CALM_RATE
        again (auditd's priority_boost, applied only when needed).  A storm
        that the raised thread keeps up with still fills them faster than
        that, so the boost lasts as long as the storm.
        """
        if self.rate >= self.BOOST_RATE or fill >= self.BOOST_FILL:
            self._calm_since = None
            if not self._boosted and self.config.recording_nice < self._base_nice:
                self._set_nice(self.config.recording_nice)
                self._boosted = True
                self.stats.priority_boosts += 1
        elif self._boosted and self.rate < self.CALM_RATE:
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

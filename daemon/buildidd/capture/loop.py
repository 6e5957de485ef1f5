"""The recording loop: steps paced by pacing.Pacer, and quiet waits while nothing happens.

Each pass runs one Recorder.step (drain the rings, record, write), then
sleeps for the pacer's interval.  When a step found the rings empty, the
pacer has reached its idle pause and nothing else waits for the recording
thread (Recorder.idle: no pending line, held exec, late answer, rescan or
rotation), the sleep becomes a quiet wait (Rings.quiet_wait): one sleep in C,
without the step's Python, until the first record (the BPF side wakes a
sleeping consumer: bpf/buildidd.bpf.c wake_flag), a kick (Recorder.wake: a
rotation request, a late answer), a signal (Rings.wake_on_signals), a drop
counter that moved, or quiet_s() seconds.  What an idle host costs is then
that sleep, instead of a step's whole Python every idle_poll_interval_s.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from buildidd.capture.rings import QuietEnd

if TYPE_CHECKING:
    from buildidd.capture.recorder import Recorder

#: Longest quiet wait (seconds) when the caller gives no tighter bound: housekeeping that runs
#: after steps (systemd STATUS=, heap trimming) runs at least this often on an idle host.
QUIET_MAX_S = 30.0


def run(rec: Recorder, should_stop: Callable[[], bool], on_tick: Callable[[], None] | None = None,
        quiet_s: Callable[[], float] | None = None) -> None:
    """Step rec until should_stop() returns True; on_tick runs after each step.

    quiet_s: seconds the next quiet wait may last at most (called before each;
    e.g. until the next systemd watchdog ping is due, or what is left of a --duration),
    None for no quiet waits (a step every idle_poll_interval_s while idle).
    A step that raises is counted (LoopGuard); LoopGuard.FAILURES_MAX in a row
    end the loop, raising BuildiddError (close() writes the reason into the
    ``end`` record).
    """
    pacer = rec.pacer
    pacer.begin()
    while not should_stop():
        t = time.monotonic()
        fill = 0.0
        try:
            n = rec.step()
            fill = rec.rings.fill
            rec.guard.step_done()
        except Exception as e:          # the loop's own failure: counted, bounded
            rec.guard.step_failed(e)    # raises once too many failed in a row
            n = 0                       # (and no fill: the last drain's may be stale)
        pacer.drained(n, fill, t)
        if on_tick is not None:
            on_tick()
        if quiet_s is not None and n == 0 and pacer.idle() and rec.idle():
            end = _quiet_wait(rec, pacer.next_interval(), quiet_s())
            if end is QuietEnd.WOKEN:
                pacer.woken()
            elif end is QuietEnd.DROPS:
                rec.recovery.next_check = 0.0       # the next step reports them
            if end is not None:
                continue
        left = pacer.next_interval() - (time.monotonic() - t)
        if left > 0 and rec.rings.wait(left):
            pacer.woken()


def _quiet_wait(rec: Recorder, poll_s: float, max_s: float) -> QuietEnd | None:
    """rec's quiet wait; None when it failed (counted by the LoopGuard like a failed step: the
    loop then sleeps as it would without quiet waits, so a failure cannot make it spin)."""
    watch = rec.tracer.quiet_watch()
    if rec.pins is not None:        # the rings are empty: the exec pins count the present as read
        rec.pins.waiting()
    try:
        return rec.rings.quiet_wait(watch, poll_s, max_s)
    except Exception as e:
        rec.guard.step_failed(e)
        return None
    finally:
        watch.release()

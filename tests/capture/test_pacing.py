"""The recording thread's pacing: pauses from the rings' fill rate, and the nice boost.

The figures are those a drain reports (Rings.fill: the fullest ring's share
occupied) at the times a recorder would see them; the priority changes are
real setpriority(2) calls on a thread of this test, checked with getpriority.
"""

import collections
import os
import threading

import pytest

from buildidd.capture.pacing import Pacer
from buildidd.capture.tables import Stats
from buildidd.config import Config
from buildidd.errors import ConfigError

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="raising a thread's priority needs CAP_SYS_NICE")


def _pacer(**cfg) -> Pacer:
    """A begun Pacer; recording_nice 0 (never raised) unless given: raise only on _on_own_thread."""
    p = Pacer(Config(**{"recording_nice": 0, **cfg}), Stats(), collections.deque(maxlen=8))
    p.begin()
    return p


def _on_own_thread(fn):
    """Run fn(tid) on a new thread (its nice changes stay there); re-raise what it raised."""
    box = {}

    def body():
        try:
            box["value"] = fn(threading.get_native_id())
        except BaseException as e:      # handed to the test's thread
            box["error"] = e

    t = threading.Thread(target=body)
    t.start()
    t.join(30)
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_a_steady_stream_is_drained_at_the_target_fill_within_the_bounds():
    p = _pacer(poll_interval_s=0.005, idle_poll_interval_s=0.05)
    p.drained(100, 0.001, 10.0)                 # the first drain: no rate yet
    assert p.rate == 0.0 and p.next_interval() == 0.005
    p.drained(100, 0.0005, 10.005)              # the rate is now measured over busy spans
    # The exec storm: 1.2% of a ring per 20 ms (0.6 rings/s): the target is over
    # 100 ms away, so the pause is the latency bound, idle_poll_interval_s.
    p.drained(200, 0.012, 10.025)
    assert p.rate == pytest.approx(0.6)
    assert p.next_interval() == 0.05
    # 5 rings/s (the dlopen storm): the target in 20 ms.
    p.drained(2000, 0.25, 10.075)
    assert p.rate == pytest.approx(5.0)
    assert Pacer.TARGET_FILL < Pacer.BOOST_FILL     # a steady stream is not woken by the BPF side
    assert p.next_interval() == pytest.approx(Pacer.TARGET_FILL / 5.0) == pytest.approx(0.02)
    # An unpaced storm (40 rings/s): never faster than poll_interval_s.
    p.drained(9000, 0.2, 10.080)
    assert p.next_interval() == 0.005


def test_no_events_double_the_pause_up_to_the_idle_bound_and_a_wakeup_resets_it():
    p = _pacer(poll_interval_s=0.005, idle_poll_interval_s=0.05)
    t = 1.0
    pauses = []
    for _ in range(6):
        p.drained(0, 0.0, t)
        pauses.append(p.next_interval())
        t += pauses[-1]
    assert pauses == [0.01, 0.02, 0.04, 0.05, 0.05, 0.05]
    p.woken()
    assert p.next_interval() == 0.005


def test_a_burst_after_a_pause_is_polled_fast_whatever_the_rate_over_the_pause():
    """A span that began in an idle pause underrates the burst that ended it."""
    p = _pacer(poll_interval_s=0.005, idle_poll_interval_s=0.05)
    p.drained(0, 0.0, 1.0)
    # The BPF side's wake-up: an eighth of a ring written, 50 ms after the last drain.
    p.woken()
    p.drained(30000, 0.13, 1.05)
    assert p.rate == pytest.approx(2.6)         # would mean a 24 ms pause
    assert p.next_interval() == 0.005
    p.drained(9000, 0.1, 1.055)                 # over 5 ms of the storm: 20 rings/s
    assert p.next_interval() == 0.005
    # A drain of nothing, then events: the first pause after them is poll_interval_s too.
    p.drained(0, 0.0, 2.0)
    p.drained(50, 0.001, 2.05)
    assert p.next_interval() == 0.005
    p.drained(50, 0.001, 2.055)                 # 0.2 rings/s, measured over a busy span
    assert p.next_interval() == 0.05


def test_a_wakeup_in_a_steady_trickle_ends_the_trust_in_its_rate():
    p = _pacer(poll_interval_s=0.005, idle_poll_interval_s=0.05)
    p.drained(10, 0.001, 3.0)
    p.drained(10, 0.001, 3.05)                  # 0.02 rings/s, trusted: the latency bound
    assert p.next_interval() == 0.05
    p.woken()                                   # a burst began during the pause
    p.drained(5000, 0.126, 3.06)                # 12.6 rings/s over a span that was mostly quiet
    assert p.next_interval() == 0.005


def test_a_reload_applies_to_the_next_pause():
    p = _pacer(poll_interval_s=0.005, idle_poll_interval_s=0.05)
    p.drained(10, 0.001, 4.0)
    p.drained(10, 0.001, 4.05)
    assert p.next_interval() == 0.05
    p.config = Config(recording_nice=0, poll_interval_s=0.002, idle_poll_interval_s=0.02)
    p.drained(10, 0.001, 4.1)
    assert p.next_interval() == 0.02


def test_the_idle_pause_is_checked_against_the_poll_interval():
    Config(poll_interval_s=0.005, idle_poll_interval_s=0.005).validate()
    for bad in (0.001, 2.0):
        with pytest.raises(ConfigError, match="idle_poll_interval_s"):
            Config(poll_interval_s=0.005, idle_poll_interval_s=bad).validate()


def test_two_drains_in_a_row_do_not_divide_by_zero():
    p = _pacer()
    p.drained(10, 0.0, 5.0)
    p.drained(10, 0.001, 5.0)                   # same instant: taken over MIN_RATE_SPAN_S
    assert p.rate == pytest.approx(0.001 / Pacer.MIN_RATE_SPAN_S)


@needs_root
def test_a_fast_fill_raises_the_thread_and_a_calm_lowers_it():
    def body(tid):
        base = os.getpriority(os.PRIO_PROCESS, tid)
        p = _pacer(recording_nice=max(-20, base - 5))
        t = 100.0
        p.drained(10, 0.0, t)
        # The exec storm's rate does not raise it.
        for _ in range(20):
            t += 0.05
            p.drained(1500, 0.03, t)
        steady = os.getpriority(os.PRIO_PROCESS, tid)
        # 20 rings/s (two unpaced mmap storms): raised at once.
        t += 0.005
        p.drained(9000, 0.1, t)
        raised = os.getpriority(os.PRIO_PROCESS, tid)
        # A rate between CALM_RATE and BOOST_RATE keeps it raised, however long.
        for _ in range(100):
            t += 0.05
            p.drained(3000, 0.1, t)             # 2 rings/s
        still = os.getpriority(os.PRIO_PROCESS, tid)
        # Calm (0.2 rings/s) for CALM_S: back to its own.
        lowered_at = None
        for _ in range(100):
            t += 0.05
            p.drained(100, 0.01, t)
            if lowered_at is None and os.getpriority(os.PRIO_PROCESS, tid) == base:
                lowered_at = t
        return base, steady, raised, still, lowered_at, t, p.stats.priority_boosts, list(p.last_errors)

    base, steady, raised, still, lowered_at, end, boosts, errors = _on_own_thread(body)
    assert base > -20, "run from a thread at nice -20: nothing to raise it to"
    assert steady == base
    assert raised == still == max(-20, base - 5) < base
    calm_from = end - 5 + 0.05                  # the first calm drain
    assert lowered_at is not None
    assert calm_from + Pacer.CALM_S <= lowered_at <= calm_from + Pacer.CALM_S + 0.11
    assert boosts == 1
    assert not errors


@needs_root
def test_a_late_drain_raises_it_whatever_the_rate():
    def body(tid):
        base = os.getpriority(os.PRIO_PROCESS, tid)
        p = _pacer(recording_nice=max(-20, base - 3))
        p.drained(10, 0.0, 0.0)
        p.drained(10, Pacer.BOOST_FILL, 100.0)  # 1/8 of a ring waited: the thread came late
        return base, os.getpriority(os.PRIO_PROCESS, tid), p.rate

    base, nice, rate = _on_own_thread(body)
    assert rate < Pacer.CALM_RATE
    assert nice == max(-20, base - 3) < base

"""Quiet waits: an idle recorder sleeps without steps, and wakes for a record, a kick, a drop or a signal.

The first tests drive _fastpath.quiet_wait itself, with the ring positions,
drop counters and flags in plain buffers (what it reads of the mapped BPF
maps is one u64 each) and a real epoll instance.  The others run a real
Recorder: the BPF side wakes a quiet consumer at the first record
(bpf/buildidd.bpf.c wake_flag, drain_gen[DRAIN_GEN_SLEEPING]), which a
process run while the recorder sleeps shows; without it the record would
wait for the quiet wait's end (30 s here).
"""

import os
import select
import signal
import struct
import subprocess
import threading
import time

from buildidd.capture import _fastpath
from buildidd.capture.rings import QuietEnd

from tests.conftest import session_records


class Buffers:
    """Two rings' positions, four drop counters and the sleeping flag; a wake-up pipe in an epoll."""

    def __init__(self):
        self.positions = tuple(bytearray(8) for _ in range(4))   # cons0, prod0, cons1, prod1
        self.drops = bytearray(32)
        self.sleeping = bytearray(8)
        self.r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.epoll = select.epoll()
        self.epoll.register(self.r, select.EPOLLIN | select.EPOLLET)

    def wait(self, poll_s: float = 0.05, max_s: float = 5.0, wake_fd: int | None = None) -> tuple[QuietEnd, float]:
        t = time.monotonic()
        end = _fastpath.quiet_wait(self.epoll.fileno(), self.positions, self.drops, bytes(32), self.sleeping,
                                   self.r if wake_fd is None else wake_fd, poll_s, max_s)
        return QuietEnd(end), time.monotonic() - t

    def close(self):
        self.epoll.close()
        os.close(self.r)
        os.close(self.w)


def _later(delay_s: float, fn) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(delay_s), fn()), daemon=True)
    t.start()
    return t


def test_quiet_wait_sleeps_to_its_end_and_sets_the_sleeping_flag_meanwhile():
    b = Buffers()
    try:
        seen = []
        _later(0.1, lambda: seen.append(struct.unpack("Q", b.sleeping)[0]))
        end, took = b.wait(max_s=0.4)
        assert end is QuietEnd.TIMEOUT and 0.38 <= took < 2.0
        assert seen == [1]                                   # set while it slept
        assert struct.unpack("Q", b.sleeping)[0] == 0        # and cleared after
    finally:
        b.close()


def test_quiet_wait_returns_at_once_for_a_record_or_a_drop():
    b = Buffers()
    try:
        b.positions[3][:] = struct.pack("Q", 64)             # ring 1: producer ahead of the consumer
        assert b.wait()[0] is QuietEnd.RECORDS
        b.positions[2][:] = struct.pack("Q", 64)
        b.drops[8:16] = struct.pack("Q", 1)                  # one more drop of cause 1 than reported
        end, took = b.wait()
        assert end is QuietEnd.DROPS and took < 0.5
    finally:
        b.close()


def test_quiet_wait_ends_when_the_wake_pipe_or_a_ring_fd_is_ready_and_reads_the_pipe_dry():
    b = Buffers()
    try:
        _later(0.3, lambda: os.write(b.w, b"x" * 300))
        end, took = b.wait(poll_s=0.05, max_s=10.0)
        assert end is QuietEnd.KICKED and 0.25 <= took < 2.0  # long after its first poll
        try:
            os.read(b.r, 1)
            assert False, "the wake fd was not read dry"
        except BlockingIOError:
            pass
        # Written before the wait began: it returns at once.
        os.write(b.w, b"k")
        end, took = b.wait(poll_s=0.05, max_s=10.0)
        assert end is QuietEnd.KICKED and took < 0.5
        # Any other fd of the set that becomes ready is a ring's wake-up.
        r2, w2 = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            b.epoll.register(r2, select.EPOLLIN | select.EPOLLET)
            _later(0.2, lambda: os.write(w2, b"r"))
            end, took = b.wait(poll_s=0.05, max_s=10.0)
            assert end is QuietEnd.WOKEN and took < 2.0
        finally:
            os.close(r2)
            os.close(w2)
    finally:
        b.close()


def test_after_its_first_poll_a_quiet_wait_sleeps_until_woken():
    """The first sleep is at most poll_s (a record committed without a wake-up is found then);
    after it, a position that moves without an event is found only at the end."""
    b = Buffers()
    try:
        _later(0.05, lambda: b.positions[1].__setitem__(slice(0, 8), struct.pack("Q", 8)))
        end, took = b.wait(poll_s=1.0, max_s=10.0)
        assert end is QuietEnd.RECORDS and 0.95 <= took < 3.0
        b.positions[0][:] = struct.pack("Q", 8)
        _later(0.3, lambda: b.positions[1].__setitem__(slice(0, 8), struct.pack("Q", 16)))
        end, took = b.wait(poll_s=0.1, max_s=2.0)
        assert end is QuietEnd.RECORDS and took >= 1.95
    finally:
        b.close()


def test_a_signal_ends_a_quiet_wait_after_its_handler_ran():
    """signal.set_wakeup_fd's pipe in the epoll set (Rings.wake_on_signals): a signal wakes the
    wait whichever thread it hit, and its Python handler has run when the wait returns."""
    b = Buffers()
    got = []
    # The handler sees the sleeping flag still set: it ran inside the wait, not after it.
    old = signal.signal(signal.SIGUSR1, lambda signum, _frame: got.append((signum, bytes(b.sleeping))))
    old_fd = signal.set_wakeup_fd(b.w, warn_on_full_buffer=False)
    try:
        _later(0.3, lambda: os.kill(os.getpid(), signal.SIGUSR1))
        end, took = b.wait(poll_s=0.05, max_s=10.0)
        assert end is QuietEnd.KICKED and took < 2.0
        assert got == [(signal.SIGUSR1, struct.pack("Q", 1))]
    finally:
        signal.set_wakeup_fd(old_fd)
        signal.signal(signal.SIGUSR1, old)
        b.close()


class QuietBackground:
    """Recorder.run with quiet waits (at most quiet_s s) in a thread, counting steps and those that
    found the rings empty (polls), until stop()."""

    def __init__(self, rec, quiet_s: float | None):
        self.rec = rec
        self.steps = self.empty = 0
        step = rec.step

        def counted():
            self.steps += 1
            n = step()
            self.empty += n == 0
            return n

        rec.step = counted
        self._stop = threading.Event()
        self.thread = threading.Thread(target=rec.run, args=(self._stop.is_set, None,
                                                             None if quiet_s is None else lambda: quiet_s),
                                       daemon=True)
        self.thread.start()

    def stop(self):
        self._stop.set()
        self.rec.wake()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()


#: Empty steps after a busy one before the pause is idle again: poll_interval_s doubled up to
#: idle_poll_interval_s (config defaults 5 ms -> 50 ms: 10, 20, 40, 50), and one more.
RAMP = 5


def _steps_while_idle(bg: QuietBackground, seconds: float) -> tuple[int, int]:
    """(steps, steps that found nothing) in seconds, once the pacer reached its idle pause."""
    time.sleep(0.5)
    before, empty = bg.steps, bg.empty
    time.sleep(seconds)
    return bg.steps - before, bg.empty - empty


def test_an_idle_recorder_sleeps_and_the_first_record_wakes_it(recorder, workloads):
    rec = recorder()
    quiet_s = 30.0
    bg = QuietBackground(rec, quiet_s=quiet_s)
    try:
        steps, polls = _steps_while_idle(bg, 2.0)
        # Without quiet waits a step runs every idle_poll_interval_s (50 ms): ~40 in 2 s, nearly
        # all of them finding nothing (the next test).  Others' mappings on the host wake it for
        # their records (steps that find some); a step that finds nothing is a poll.  After each
        # such step the pacer doubles its pause back up to the idle one before a quiet wait may
        # begin (pacing.Pacer.drained): at most RAMP polls per busy step, counted, not timed.
        busy = steps - polls
        assert polls <= 12 + RAMP * busy, (steps, polls)
        # It goes quiet (what the control socket's status shows) in the first lull: a host busy with
        # others' work (a bench beside the suite) keeps it awake meanwhile; waited for, not timed.
        deadline = time.monotonic() + 120
        while not ((quiet := rec.status()["quiet"])["waits"] >= 1 and quiet["asleep_s"] > 0.1):
            assert time.monotonic() < deadline, quiet
            time.sleep(0.1)
        before = rec.stats.events.get("exec", 0)
        t0 = time.monotonic()
        subprocess.run([str(workloads["child"])], check=True)
        while rec.stats.events.get("exec", 0) == before and time.monotonic() - t0 < 30:
            time.sleep(0.01)
        took = time.monotonic() - t0
        # Woken by the ring at the record, not at the end of the 30 s wait (the bound is half of
        # it: a busy runner's scheduling delay is not what this shows).
        assert took < quiet_s / 2, took
        # A rotation asked meanwhile (control socket: any thread) is done without waiting out the
        # quiet wait it finds.
        time.sleep(0.5)
        t0 = time.monotonic()
        assert rec.request_rotate(timeout_s=quiet_s / 2)
        assert time.monotonic() - t0 < quiet_s / 2
    finally:
        bg.stop()
    execs = [r for r in session_records(rec.session_dir) if r["type"] == "exec"]
    assert any(r["filename"] == str(workloads["child"]) for r in execs)


def test_without_quiet_waits_an_idle_recorder_steps_every_idle_poll(recorder):
    rec = recorder()
    bg = QuietBackground(rec, quiet_s=None)
    try:
        steps, polls = _steps_while_idle(bg, 2.0)
    finally:
        bg.stop()
    # A step every idle_poll_interval_s at least, whatever the host does; on a host where nothing
    # else mapped anything (no busy step), nearly all of them polls.
    assert steps >= 25 and (polls >= 20 or steps - polls > 0), (steps, polls)


def test_what_keeps_a_recorder_from_going_quiet(recorder):
    """Recorder.idle: each of these waits for the recording thread, through the real paths."""
    from buildidd.kernel.tracer import DropReport

    rec = recorder()
    rec.step()
    assert rec.idle()
    rec.tables.emit(b'{"type":"note"}')                 # a line not yet written
    assert not rec.idle()
    rec.step()
    assert rec.idle()
    rec.recovery.on_drops(DropReport(counts={"no_vma": 1}))   # rescans at once, the next in 5 s
    rec.recovery.on_drops(DropReport(counts={"no_vma": 1}))   # so this one's rescan waits
    assert rec.recovery.rescan_pending and not rec.idle()
    asker = threading.Thread(target=rec.request_rotate, args=(0.5,))
    asker.start()
    time.sleep(0.1)
    assert not rec.idle()                                # asked, not yet done
    asker.join()
    rec.step()                                           # the step rotates
    assert not rec.log.rotate_pending()

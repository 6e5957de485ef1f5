"""Ring-buffer overflow: losses are counted per cause, written as a record, and recovered by a rescan."""

from __future__ import annotations

import os
import subprocess
import time

from conftest import readelf_build_id, session_records

#: Seconds a test waits for the host to be calm (the recorder's pacer: CALM_S without a backlog): a bound
#: against a hang, not a budget; a bench beside the suite keeps the host busy for stretches.
CALM_WAIT_S = 120
#: Records of other processes beyond which the burst's premise (its mappings are what the ring holds)
#: does not hold, and it tries again.
FOREIGN_MAX = 100


def test_overflow_is_recorded_and_live_mappings_recovered(recorder, workloads):
    # t0 before the rings exist: beside other work, they fill (and count losses) before the storm starts
    t0 = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
    rec = recorder(ring_bytes=4096)   # one page per ring: a few dozen events
    subprocess.run([str(workloads["storm"]), "100", str(workloads["child"])], check=True)
    idle = subprocess.Popen([str(workloads["idle"])])
    try:
        time.sleep(0.3)   # idle has mapped its libraries; the ring has long been full
        rec.step()
        rec.recovery.next_check = 0
        rec.step()
        records = session_records(rec.session_dir)
        lost = [r for r in records if r["type"] == "lost"]
        assert len(lost) >= 1
        assert lost[0]["counts"].get("ringbuf_full", 0) > 0
        assert t0 <= lost[0]["first_ns"] <= lost[0]["last_ns"] <= lost[0]["time_ns"]
        assert rec.summary()["lost"]["ringbuf_full"] == sum(r["counts"].get("ringbuf_full", 0) for r in lost)
        recovered = [r for r in records if r["type"] == "mmap" and r["pid"] == idle.pid]
        assert recovered and all(r["origin"] == "recovered" for r in recovered)
        paths = {r["path"] for r in recovered}
        for i in range(4):
            assert str(workloads[f"lib{i}"]) in paths
        assert str(workloads["idle"]) in paths and any("libc.so" in p for p in paths)
        own = {str(workloads[f"lib{i}"]) for i in range(4)} | {str(workloads["idle"])}
        for r in recovered:
            assert r["build_id"] == readelf_build_id(r["path"])
            # Files only idle maps are read through its map_files; a file every process maps (libc)
            # may carry the answer its identity got first, from another process's mapping, by any
            # identity-checked route (that process may have exited before its hand-over).
            assert r["build_id_source"] == "map_files" if r["path"] in own else \
                r["build_id_source"] in ("map_files", "proc_root", "path", "kernel"), r
        # The recovered records come after the lost record that explains them.
        assert records.index(lost[0]) < records.index(recovered[0])
    finally:
        idle.kill()
        idle.wait()


def test_recording_thread_is_raised_while_a_backlog_builds_and_lowered_after(recorder, workloads):
    from conftest import Background

    rec = recorder(ring_bytes=128 << 10, recording_nice=-5)
    bg = Background(rec)
    try:
        tid = bg.thread.native_id
        # No backlog: the process's own.  A burst elsewhere on the host (15 mappings fill 1/32 of
        # this 128 KiB ring; a bench beside the suite makes many) may have raised it already: wait for
        # the calm that lowers it (CALM_S without a backlog; CALM_WAIT_S is a hang bound).
        deadline = time.monotonic() + CALM_WAIT_S
        while time.monotonic() < deadline and os.getpriority(os.PRIO_PROCESS, tid) != 0:
            time.sleep(0.05)
        assert os.getpriority(os.PRIO_PROCESS, tid) == 0
        boosts = rec.summary()["priority_boosts"]
        storm = subprocess.Popen([str(workloads["mmap_storm"]), str(workloads["lib0"]), "300000"],
                                 stdout=subprocess.DEVNULL)
        seen = set()
        while storm.poll() is None:
            seen.add(os.getpriority(os.PRIO_PROCESS, tid))
            time.sleep(0.002)
        assert -5 in seen, seen
        deadline = time.monotonic() + CALM_WAIT_S
        while time.monotonic() < deadline and os.getpriority(os.PRIO_PROCESS, tid) != 0:
            time.sleep(0.05)
        assert os.getpriority(os.PRIO_PROCESS, tid) == 0          # calm again: back down
        assert rec.summary()["priority_boosts"] > boosts
        assert os.getpriority(os.PRIO_PROCESS, 0) == 0            # the caller's thread: untouched
        assert not rec.last_errors
    finally:
        bg.stop()
        bg.thread.join(10)


def test_a_burst_wakes_the_idle_recorder_and_a_trickle_does_not(recorder, workloads):
    """The BPF side forces a ring wake-up every WAKE_BYTES (an eighth of a ring) a CPU writes.

    A recorder that sleeps in Rings.wait is woken by a burst long before its
    timeout, and sleeps through a handful of mappings: the wake-up is what
    keeps a 2 MiB ring from overflowing when a storm starts during the idle
    pause (the smoke bench lost records to it before).  The recorder sees the
    whole host: a window in which other processes mapped files (a file new to
    the build-id memo wakes it too) is tried again, up to CALM_WAIT_S.
    """
    rec = recorder(ring_bytes=1 << 20)
    lib0 = str(workloads["lib0"])
    # Files the build-id memo meets for the first time force a wake-up each (BUILDIDD_BID_NEW):
    # a first trickle makes the storm's files known.
    subprocess.run([str(workloads["mmap_storm"]), lib0, "20"], check=True, stdout=subprocess.DEVNULL)
    rec.step()
    deadline = time.monotonic() + CALM_WAIT_S
    while True:
        woke, slept, ours, foreign, _ = _window(rec, workloads, 20, 0.5)
        if not (woke and foreign) or time.monotonic() > deadline:
            break
        print(f"\ntrickle: woken with {foreign} records of other processes meanwhile; again")
    # A trickle of known files: 20 mappings (~5 KiB) are far below 128 KiB: no wake-up.
    assert woke is False and slept >= 0.45, (woke, slept, foreign)
    assert ours == 20
    # A drain bumps drain_gen through its mapping, and the BPF side reads that very value
    # (bpf(2) lookup): every CPU counts from zero at its next record, so the next wake-up needs
    # WAKE_BYTES more (what the burst below shows).
    gen = rec.tracer.drain_generation()
    rec.tracer.reset_wakeups()
    assert rec.tracer.drain_generation() == gen + 1
    # A burst of 2,000 (~450 KiB, three and a half eighths of the ring): woken at once.
    while True:
        lost_before = dict(rec.summary()["lost"])
        woke, waited, ours, foreign, wakeups = _window(rec, workloads, 2000, 10.0)
        if foreign <= FOREIGN_MAX or time.monotonic() > deadline:
            break
        print(f"\nburst: {foreign} records of other processes meanwhile; again")
    assert woke is True and waited < 5.0
    assert wakeups == 1
    assert ours == 2000
    assert rec.summary()["lost"] == lost_before


def _window(rec, workloads, n: int, wait_s: float) -> tuple[bool, float, int, int, int]:
    """mmap_storm maps lib0 n times while the recorder waits in Rings.wait(wait_s) (the wake-ups earlier
    records forced taken first, the counts reset as a drain does); then a drain.  Returns (woken,
    seconds waited, the storm's mappings of lib0 recorded, records of other processes in the window,
    wake-ups counted by that wait)."""
    lib0 = str(workloads["lib0"])
    rec.rings.wait(0.01)                # takes the wake-ups earlier mappings forced (edge-triggered)
    rec.step()
    rec.tracer.reset_wakeups()          # what a drain of any record does
    seen = len(session_records(rec.session_dir))
    wakeups = rec.rings.wakeups
    storm = subprocess.Popen([str(workloads["mmap_storm"]), lib0, str(n)], stdout=subprocess.DEVNULL)
    try:
        t0 = time.monotonic()
        woke = rec.rings.wait(wait_s)
        waited = time.monotonic() - t0
    finally:
        assert storm.wait() == 0
    rec.step()
    records = session_records(rec.session_dir)[seen:]
    ours = sum(1 for r in records if r["type"] == "mmap" and r.get("pid") == storm.pid and r["path"] == lib0)
    foreign = sum(1 for r in records if r.get("pid") not in (None, storm.pid))
    return woke, waited, ours, foreign, rec.rings.wakeups - wakeups

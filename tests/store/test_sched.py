"""Background threads run in SCHED_BATCH and the idle I/O class (real threads, read back from the kernel).

Not SCHED_IDLE: a background thread holds the GIL at times, and one starved
while holding it stopped the recording thread for up to 1.3 s (kernel/sched.py).
"""

from __future__ import annotations

import os
import time

import psutil

from buildidd.store import SnapshotPolicy, Snapshotter, Store


def test_snapshot_thread_is_batch_for_cpu_and_idle_for_io(tmp_path):
    snap = Snapshotter(Store(tmp_path / "store", debug_root=tmp_path / "no-debug"),
                       SnapshotPolicy(housekeeping_interval_s=3600))
    snap.start()
    try:
        tid = snap._thread.native_id
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and os.sched_getscheduler(tid) != os.SCHED_BATCH:
            time.sleep(0.01)
        assert os.sched_getscheduler(tid) == os.SCHED_BATCH
        assert os.getpriority(os.PRIO_PROCESS, tid) == os.getpriority(os.PRIO_PROCESS, 0)
        assert psutil.Process(tid).ionice().ioclass == psutil.IOPRIO_CLASS_IDLE
        # The caller's own thread is untouched.
        assert os.sched_getscheduler(0) == os.SCHED_OTHER
        assert psutil.Process().ionice().ioclass != psutil.IOPRIO_CLASS_IDLE
    finally:
        snap.stop()

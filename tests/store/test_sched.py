"""Background threads run in SCHED_BATCH and the idle I/O class (real threads, read back from the kernel).

Not SCHED_IDLE: a background thread holds the GIL at times, and one starved
while holding it stopped the recording thread for up to 1.3 s (kernel/sched.py).
"""

from __future__ import annotations

import os
import time

import psutil

from buildidd.store import CopyJob, SnapshotPolicy, Snapshotter, Store


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


def test_the_same_build_id_at_the_same_path_from_another_file_is_queued_again(tmp_path):
    """A user's file claiming a build-id at a path (a bind mount in their own namespace) must not
    stand for the root-owned file met at that path later: the queue keys on the file too."""
    from buildidd.kernel.events import Identity
    from buildidd.store import Snapshotter, Store

    snap = Snapshotter(Store(tmp_path / "store"))
    users, roots = Identity(1, 10, 0, 100, 1), Identity(1, 20, 0, 100, 1)
    snap.submit(CopyJob("ab" * 20, "/usr/bin/x", users), None)
    snap.submit(CopyJob("ab" * 20, "/usr/bin/x", users), None)          # the same file again: once
    snap.submit(CopyJob("ab" * 20, "/usr/bin/x", roots), None)          # another file at that path: queued
    assert snap.queued() == 2

"""CPU scheduling of buildidd's threads: the recording thread first, background work last.

The recording thread must never wait behind background work (segment
fsync and compression, snapshot copies, housekeeping).  Background threads
run Python, so they share the GIL with the recording thread: one preempted
while it holds the GIL stops the recording thread until it runs again.
Under SCHED_IDLE that can be never while the workload keeps every core
busy: a SCHED_IDLE thread holding the GIL is starved, the recording thread
waits for it, and the rings overflow (docs/performance-history.md has the
storms that showed it).  So they run under SCHED_BATCH (sched(7): the process's own nice and
fair share, but no wakeup preemption of the workload), and in the idle I/O
class (ioprio_set(2), IOPRIO_CLASS_IDLE): their reads, writes and fsyncs go
to the disk only when nothing else waits for it (honoured by the bfq
scheduler; with none or mq-deadline the class is accepted and ignored).

The recording thread itself runs at a raised priority (Config.recording_nice,
-5 by default) while the rings fill faster than it drains them: CPU-bound work
on every core would otherwise hold it off the CPU until they overflow (see
pacing.Pacer.adjust_priority).
"""

from __future__ import annotations

import os
import threading

import psutil


def name_current_thread() -> None:
    """Give the calling thread its Python name as its kernel name (``/proc/thread-self/comm``, at
    most 15 bytes, without the ``buildidd-`` prefix every thread's name has), so that ``top -H``,
    ``ps -L`` and per-thread CPU readers (scripts/benchlib.py) tell the threads apart; best effort."""
    name = threading.current_thread().name.removeprefix("buildidd-").encode()[:15]
    try:
        with open("/proc/thread-self/comm", "wb") as f:
            f.write(name)
    except OSError:
        pass


def make_current_thread_background() -> bool:
    """Put the calling thread in SCHED_BATCH (at the process's nice) and the idle I/O class, and
    give it its name in the kernel (name_current_thread).

    Not SCHED_IDLE and not a high nice: the thread holds the GIL at times,
    and a starved GIL holder stalls the recording thread (module docstring).

    Returns True if the CPU policy took (the I/O class is best effort).
    """
    name_current_thread()
    tid = threading.get_native_id()
    try:
        psutil.Process(tid).ionice(psutil.IOPRIO_CLASS_IDLE)
    except (OSError, psutil.Error):
        pass
    try:
        os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
        return True
    except (OSError, AttributeError):
        return False


def set_current_thread_nice(nice: int) -> None:
    """Set the calling thread's nice value (setpriority(2) on its tid; -20..19).

    Raises:
        OSError: EACCES/EPERM without CAP_SYS_NICE for a negative value.
    """
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)

"""CPU scheduling of buildidd's threads: the recording thread first, background work last.

The recording thread must never wait for the CPU behind background work
(segment compression, snapshot copies, housekeeping): on a small host the
workload already takes the other cores.  Background threads therefore run
under SCHED_IDLE (sched(7)): they get only CPU time nothing else wants, and
in the idle I/O class (ioprio_set(2), IOPRIO_CLASS_IDLE): their reads, writes
and fsyncs go to the disk only when nothing else waits for it (honoured by the
bfq scheduler; with none or mq-deadline the class is accepted and ignored).

The recording thread itself runs at a raised priority (Config.recording_nice,
-5 by default) while the rings fill faster than it drains them: CPU-bound work
on every core would otherwise hold it off the CPU until they overflow (see
Recorder._adjust_priority).
"""

from __future__ import annotations

import os
import threading

import psutil


def make_current_thread_idle() -> bool:
    """Put the calling thread in SCHED_IDLE (falling back to nice 19) and the idle I/O class.

    Returns True if the CPU policy took (the I/O class is best effort).
    """
    tid = threading.get_native_id()
    try:
        psutil.Process(tid).ionice(psutil.IOPRIO_CLASS_IDLE)
    except (OSError, psutil.Error):
        pass
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return True
    except (OSError, AttributeError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 19)
        return True
    except OSError:
        return False


def set_current_thread_nice(nice: int) -> None:
    """Set the calling thread's nice value (setpriority(2) on its tid; -20..19).

    Raises:
        OSError: EACCES/EPERM without CAP_SYS_NICE for a negative value.
    """
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)

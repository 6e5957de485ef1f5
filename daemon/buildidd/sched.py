"""CPU scheduling of buildidd's background threads.

The recording thread must never wait for the CPU behind background work
(segment compression, snapshot copies, housekeeping): on a small host the
workload already takes the other cores.  Background threads therefore run
under SCHED_IDLE (sched(7)): they get only CPU time nothing else wants.
"""

from __future__ import annotations

import os
import threading


def make_current_thread_idle() -> bool:
    """Put the calling thread in SCHED_IDLE (falling back to nice 19); True if either worked."""
    tid = threading.get_native_id()
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

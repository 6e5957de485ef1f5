"""Boot-time ns ↔ wall clock.  Nothing else in buildidd converts time.

Event times are ``bpf_ktime_get_boot_ns()``: ns since boot including suspend,
the same clock as user space's CLOCK_BOOTTIME.
"""

from __future__ import annotations

import time


def boot_ns() -> int:
    """Now, in ns since boot (CLOCK_BOOTTIME), the clock of every event's time_ns."""
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME)


def boot_to_wall_offset_ns(samples: int = 5) -> int:
    """wall-clock ns since the epoch minus boot ns, measured now.

    The tightest of a few back-to-back samples is taken, so the error is the
    duration of one clock_gettime pair (well under a µs).  Add it to a time_ns
    to get CLOCK_REALTIME ns; it changes when the wall clock is stepped.
    """
    best = None
    for _ in range(samples):
        b0 = boot_ns()
        wall = time.time_ns()
        b1 = boot_ns()
        if best is None or b1 - b0 < best[0]:
            best = (b1 - b0, wall - (b0 + b1) // 2)
    return best[1]


def wall_ns(time_ns: int, offset_ns: int) -> int:
    """A boot-time ns converted to ns since the epoch with a session's offset."""
    return time_ns + offset_ns

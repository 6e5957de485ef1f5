"""What the memory-bound tests share: deep paths as a hostile user makes them, and tracemalloc's
measure of what a call leaves allocated."""

from __future__ import annotations

import gc
import tracemalloc
from typing import Callable

#: Characters of the flood's directory (issue 42: a user mapped files ~3,760 characters deep).
DEEP_CHARS = 3700
#: Fresh entries each flood makes (each structure's test makes at least this many).
FLOOD_N = 100_000

_DEEP_DIR = "/tmp" + "".join(f"/{c * 200}" for c in "abcdefghijklmnopqrs")[: DEEP_CHARS - 4]


def deep_path(i: int) -> str:
    """The i-th fresh path of a flood: DEEP_CHARS characters of directories, then its own file name."""
    return f"{_DEEP_DIR}/f{i}"


def retained_bytes(fn: Callable[[], object]) -> int:
    """Bytes that fn() leaves allocated (tracemalloc's current size after it, less before it; its
    result dropped, a garbage collection on either side), and print the peak meanwhile."""
    gc.collect()
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        fn()
        gc.collect()
        after, peak = tracemalloc.get_traced_memory()
    finally:
        if started:
            tracemalloc.stop()
    print(f"retained {(after - before) / 2**20:.2f} MiB, peak {(peak - before) / 2**20:.2f} MiB")
    return after - before

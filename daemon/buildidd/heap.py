"""The daemon's C heap (glibc malloc) kept flat over days: a fixed mmap threshold and a periodic trim.

Two glibc behaviours make a long-running, multi-threaded process's RSS creep
up in steps that never come back (mallopt(3), malloc_trim(3)):

- The mmap threshold is dynamic by default: once a block above it (128 KiB)
  that was served by mmap(2) is freed, the threshold rises to its size (up to
  32 MiB), and later blocks of that size come from a heap instead, where
  freeing them leaves the heap's pages resident.  zstd's compression context
  (a few MiB, one per closed segment) and large reads are such blocks.
- Free memory inside a thread's arena is returned only from the top of its
  heap; a block still live above it keeps every free page below resident.
- Each thread that allocates gets an arena of its own (up to eight per CPU),
  and each arena keeps its free top up to the trim threshold: a daemon with a
  dozen worker threads holds several MiB of free memory that way.  The threads
  gain nothing from separate arenas: they run Python, and the interpreter lock
  already serializes nearly all of their allocations.

:func:`configure` fixes the threshold (setting M_MMAP_THRESHOLD turns the
dynamic adjustment off) at :data:`MMAP_THRESHOLD_BYTES` and lets every thread
allocate from the main arena (M_ARENA_MAX :data:`ARENAS`); :func:`trim` runs
malloc_trim(0), which gives back whole free pages in the middle of every arena
too (madvise MADV_DONTNEED, glibc >= 2.8), every :data:`TRIM_INTERVAL_S`.
Without them a long-running daemon's RSS grows in steps and keeps what it
grew (scripts/soak shows it over an hour).
The threshold is not glibc's 128 KiB: a step's joined lines (hundreds of KiB)
would then be mmapped, faulted in and unmapped at every step, which costs
daemon CPU per event and, under storms, lost events (scripts/bench's ramp).

Both are no-ops (returning False) where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["ARENAS", "MMAP_THRESHOLD_BYTES", "TRIM_INTERVAL_S", "configure", "trim"]

#: Fixed mmap threshold (bytes): larger blocks are mmapped and unmapped on free; smaller ones
#: come from the arenas, whose free pages trim() returns.
MMAP_THRESHOLD_BYTES = 4 << 20
#: Seconds between two :func:`trim` calls of the recording loop (malloc_trim(0) walks every arena).
TRIM_INTERVAL_S = 60.0
#: malloc arenas at most (M_ARENA_MAX): the main one only, shared by every thread.
ARENAS = 1
_M_TRIM_THRESHOLD = -1   # <malloc.h>
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        libc.malloc_trim.argtypes = (ctypes.c_size_t,)
        return libc
    except (OSError, AttributeError):   # not glibc (musl has no mallopt/malloc_trim)
        return None


_LIBC = _libc()


def configure() -> bool:
    """Fix malloc's mmap threshold at :data:`MMAP_THRESHOLD_BYTES`, its trim threshold at twice
    that, and its arenas at :data:`ARENAS`.

    Call once at start, before the worker threads allocate (a thread keeps the
    arena it got first).  Returns True when glibc accepted all three (mallopt
    returns 1 on success).
    """
    if _LIBC is None:
        return False
    ok = _LIBC.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    ok = _LIBC.mallopt(_M_ARENA_MAX, ARENAS) == 1 and ok
    return _LIBC.mallopt(_M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD_BYTES) == 1 and ok


def trim() -> bool:
    """Give the kernel back the free pages of every malloc arena (malloc_trim(0)).

    Returns True when some memory was released.
    """
    return _LIBC is not None and _LIBC.malloc_trim(0) == 1

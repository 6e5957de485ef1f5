"""buildidd.heap: the fixed mmap threshold and malloc_trim give freed heap memory back (glibc)."""

import ctypes
import threading

import psutil

from buildidd import heap


def test_configure_is_accepted_by_glibc():
    assert heap.configure() is True


def test_trim_returns_freed_arena_pages_to_the_kernel():
    """A thread's arena keeps freed pages resident below a live block; trim gives them back."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    rss = {}

    def churn():
        # 64 MiB in 16 KiB blocks (below the mmap threshold: from the thread's arena), touched,
        # then all freed but the last one, which pins the top of the heap.
        blocks = []
        for _ in range(4096):
            p = libc.malloc(16 * 1024)
            ctypes.memset(p, 1, 16 * 1024)
            blocks.append(p)
        for p in blocks[:-1]:
            libc.free(p)
        rss["before"] = psutil.Process().memory_info().rss
        rss["released"] = heap.trim()
        rss["after"] = psutil.Process().memory_info().rss
        libc.free(blocks[-1])

    t = threading.Thread(target=churn)
    t.start()
    t.join()
    assert rss["released"] is True
    assert rss["before"] - rss["after"] > 32 << 20, rss


#: Run in a fresh interpreter (a thread keeps the arena it got first): threads started after
#: configure() allocate from the main arena, the [heap] of /proc/self/maps; without it, each gets
#: an arena of its own, mapped elsewhere.
_ARENA_PROBE = r"""
import ctypes, sys, threading
from buildidd import heap
if sys.argv[1] == "configured":
    assert heap.configure()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
got = []
def alloc():
    got.append(libc.malloc(16 * 1024))
threads = [threading.Thread(target=alloc) for _ in range(6)]
for t in threads:
    t.start()
for t in threads:
    t.join()
lo, hi = next([int(x, 16) for x in line.split()[0].split("-")]
              for line in open("/proc/self/maps") if line.rstrip().endswith("[heap]"))
print(sum(1 for p in got if not lo <= p < hi))
"""


def test_worker_threads_share_the_main_arena_after_configure():
    import os
    import subprocess
    import sys

    def outside_main_arena(mode: str) -> int:
        env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_ARENA_MAX", "GLIBC_TUNABLES")}
        return int(subprocess.run([sys.executable, "-c", _ARENA_PROBE, mode], check=True, capture_output=True,
                                  text=True, env=env).stdout)

    assert outside_main_arena("default") > 0       # the probe can tell
    assert outside_main_arena("configured") == 0

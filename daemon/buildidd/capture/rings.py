"""Consuming the kernel's ring buffers: the records of every ring, merged in time order.

The kernel side (bpf/buildidd.bpf.c) writes into one BPF ring buffer per CPU
(at most kernel.tracer.MAX_RINGS); this module maps them.  A step takes the
records of every ring at once, in place and merged by time (Rings.take: the C
fast path's Batch), and copies only those that Python records.
"""

from __future__ import annotations

import enum
import os
import select
import signal
import threading
import time

from buildidd.capture import _fastpath
from buildidd.kernel.tracer import QuietWatch


class RingReader:
    """Consumer of a BPF ring buffer (BPF_MAP_TYPE_RINGBUF) through its mmap'ed pages.

    The layout is the kernel's (kernel/bpf/ringbuf.c, include/uapi/linux/bpf.h):
    page 0 holds consumer_pos (written by user space), page 1 producer_pos,
    then the data area mapped twice in a row so a record that wraps is still
    contiguous.  Each record starts with an 8-byte header, u32 len (with
    BPF_RINGBUF_BUSY_BIT 1<<31 while the producer writes it,
    BPF_RINGBUF_DISCARD_BIT 1<<30 when discarded) and u32 page offset; records
    are 8-byte aligned.  Rings.take reads them in place (_fastpath.take, C), against a ctypes
    callback per record through libbpf.

    Args:
        map_fd: the ring buffer map's fd; size_bytes: its max_entries (power of two).
    Raises:
        OSError: the mmap failed.
    """

    def __init__(self, map_fd: int, size_bytes: int):
        import mmap as _mmap
        page = _mmap.PAGESIZE
        self.size = size_bytes
        self.mask = size_bytes - 1
        self._cons = _mmap.mmap(map_fd, page, _mmap.MAP_SHARED, _mmap.PROT_READ | _mmap.PROT_WRITE, offset=0)
        self._data = _mmap.mmap(map_fd, page + 2 * size_bytes, _mmap.MAP_SHARED, _mmap.PROT_READ, offset=page)
        self._page = page

    def view(self) -> tuple:
        """(cons, data, page, mask): this ring as _fastpath.take (and read_ring) read it."""
        return self._cons, self._data, self._page, self.mask

    def close(self) -> None:
        """Unmap the ring."""
        self._cons.close()
        self._data.close()


class QuietEnd(enum.IntEnum):
    """Why Rings.quiet_wait returned (_fastpath.c enum quiet_end)."""
    TIMEOUT = 0     #: max_s passed
    RECORDS = 1     #: a ring holds a record
    WOKEN = 2       #: a ring's wake-up
    DROPS = 3       #: a kernel drop counter moved
    KICKED = 4      #: a kick (Rings.kick) or a signal (Rings.wake_on_signals)


class Rings:
    """Every ring buffer of a Tracer, drained together.

    Args:
        ring_maps: (map fd, size in bytes) per ring (kernel.tracer.Tracer.ring_maps).
    Attributes:
        fill: the largest share (0..1) of a ring that the last drain found occupied.
        wakeups: how many wait() and quiet_wait() calls a ring's wake-up ended.
        quiet_waits: quiet_wait() calls so far; quiet_since: time.monotonic() when the one
            in progress began, or None (read by other threads: status).
    Raises:
        OSError: mapping a ring or making the epoll instance failed.
    """

    def __init__(self, ring_maps: list[tuple[int, int]]):
        self.rings: list[RingReader] = []
        self._epoll: select.epoll | None = None
        #: the wake-up pipe: its read end in the epoll set, written by kick() and, after
        #: wake_on_signals(), by the interpreter's signal handler (-1 until made)
        self._wake_fd = self._wake_w = -1
        self._kick_lock = threading.Lock()
        self._signals = False
        self._positions: tuple = ()
        self._views: tuple = ()
        try:
            for fd, size in ring_maps:
                self.rings.append(RingReader(fd, size))
            # Edge-triggered: a ring map's poll says "readable" while it holds
            # any record, but its wait queue is woken only by the BPF side's
            # BPF_RB_FORCE_WAKEUP (every WAKE_BYTES, bpf/buildidd.bpf.c), so
            # wait() sleeps through the trickle and wakes for a burst; during a
            # quiet wait, also by the first record (the ring's adaptive wake-up).
            self._epoll = select.epoll()
            for fd, _size in ring_maps:
                self._epoll.register(fd, select.EPOLLIN | select.EPOLLET)
            # A ring holding records when registered is reported ready once: taken
            # here, so that wait() reports wake-ups only (the first drain reads them).
            self._epoll.poll(0)
            self._wake_fd, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            self._epoll.register(self._wake_fd, select.EPOLLIN | select.EPOLLET)
        except OSError:
            self.close()
            raise
        self.fill = 0.0
        self.wakeups = 0
        self.quiet_waits = 0
        self.quiet_since: float | None = None
        #: per ring, the consumer page then the producer page (and data): their positions
        self._positions = tuple(m for ring in self.rings for m in (ring._cons, ring._data))
        self._views = tuple(ring.view() for ring in self.rings)

    def wait(self, timeout_s: float) -> bool:
        """Sleep up to timeout_s (seconds), or until the BPF side wakes a ring or a kick() or signal
        comes; True when a ring woke it."""
        if self._epoll is None:
            return False
        events = self._epoll.poll(timeout_s)      # EINTR: retried by Python (PEP 475)
        if any(fd == self._wake_fd for fd, _ in events):
            self._drain_wake_fd()
        woken = any(fd != self._wake_fd for fd, _ in events)
        if woken:
            self.wakeups += 1
        return woken

    def quiet_wait(self, watch: QuietWatch, poll_s: float, max_s: float) -> QuietEnd:
        """Sleep until a ring holds a record or wakes, another thread kicks (kick()), a signal
        comes (wake_on_signals), a drop counter moves from watch.drops_seen
        (kernel.tracer.Tracer.quiet_watch), or max_s seconds pass.

        What an idle step costs is replaced by one sleep: while it lasts, the BPF
        side commits records with the ring's adaptive wake-up (watch.sleeping), so
        the first record wakes it at once, and nothing runs in between (no poll
        every idle_poll_interval_s).  Only the first sleep is bounded by poll_s,
        for a record whose program read the flag before it was set.  The
        checks run in C (_fastpath.quiet_wait).
        Raises OSError (epoll_wait) or what a signal handler raises.
        """
        if self._epoll is None:
            return QuietEnd.TIMEOUT
        self.quiet_waits += 1
        self.quiet_since = time.monotonic()
        try:
            end = QuietEnd(_fastpath.quiet_wait(self._epoll.fileno(), self._positions, watch.drops,
                                                watch.drops_seen, watch.sleeping, self._wake_fd, poll_s, max_s))
        finally:
            self.quiet_since = None
        if end is QuietEnd.WOKEN:
            self.wakeups += 1
        return end

    def quiet_status(self) -> dict:
        """{"waits": quiet waits so far, "asleep_s": seconds the current one has lasted (0: none)}."""
        since = self.quiet_since
        return {"waits": self.quiet_waits, "asleep_s": round(time.monotonic() - since, 3) if since else 0.0}

    def kick(self) -> None:
        """End the current or next wait()/quiet_wait() (any thread): a byte into the wake-up pipe."""
        with self._kick_lock:           # never a write to the fd number after close() freed it
            if self._wake_w < 0:
                return
            try:
                os.write(self._wake_w, b"k")
            except BlockingIOError:     # full: a wake-up is pending already
                pass

    def wake_on_signals(self) -> None:
        """Make every signal end wait() and quiet_wait() at once, its handler run first
        (signal.set_wakeup_fd on the wake-up pipe): otherwise one delivered to another thread
        waits for the sleep's end.  Main thread only (raises ValueError elsewhere)."""
        if self._wake_w >= 0 and not self._signals:
            signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
            self._signals = True

    def _drain_wake_fd(self) -> None:
        try:
            while os.read(self._wake_fd, 256):
                pass
        except BlockingIOError:
            pass

    def take(self) -> _fastpath.Batch:
        """Every record now in the ring buffers, in place and in time order (_fastpath.take).

        Each ring is in order; records of several rings are merged by
        event_header.time_ns (a stable merge of the presorted runs).  Sets fill: the
        largest share (0..1) of a ring that the batch holds, the backlog the
        consumer let build up since the last one.  The caller records the batch
        (_fastpath.run reads it in place; batch[i] is a copy) and must release() it.
        The rings' space is given back as run() goes (Batch.release_to, every 1024
        records), and wholly at release().
        """
        batch = _fastpath.take(self._views)
        self.fill = batch.fill
        return batch

    def drain(self) -> list[bytes]:
        """Consume every record now in the ring buffers; returns them as raw bytes, in time order
        (take(), copied and released)."""
        batch = self.take()
        try:
            return list(batch)
        finally:
            batch.release()

    def close(self) -> None:
        """Unmap every ring."""
        if self._signals:
            try:
                signal.set_wakeup_fd(-1)
            except ValueError:          # not the main thread: the process is ending anyway
                pass
            self._signals = False
        with self._kick_lock:
            fds, self._wake_fd, self._wake_w = (self._wake_fd, self._wake_w), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)
        if self._epoll is not None:
            self._epoll.close()
            self._epoll = None
        self._positions = self._views = ()
        for ring in self.rings:
            ring.close()
        self.rings = []

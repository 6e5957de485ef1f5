"""BPF ring buffers laid out in memory, for the fast path's in-place reads without a BPF side.

The layout is the kernel's (kernel/bpf/ringbuf.c), as capture/rings.py maps
it: a consumer page (u64 consumer_pos), then a buffer holding the producer
page (u64 producer_pos) and the data area mapped twice in a row.  Each record
is an 8-byte header (u32 len with BPF_RINGBUF_BUSY_BIT / DISCARD_BIT, u32 page
offset) and its bytes, 8-byte aligned.
"""

from __future__ import annotations

import struct

from buildidd.capture import _fastpath

PAGE = 4096
BUSY_BIT = 1 << 31
DISCARD_BIT = 1 << 30


class MemRing:
    """One ring in memory: put() records, then view() for _fastpath.take / read_ring.

    Args:
        size: the data area's bytes (a power of two).
    """

    def __init__(self, size: int = 1 << 16):
        self.size = size
        self.cons = bytearray(PAGE)
        self.data = bytearray(PAGE + 2 * size)
        self.prod = 0

    def put(self, record: bytes, flags: int = 0) -> int:
        """Commit record at producer_pos (flags: BUSY_BIT or DISCARD_BIT to leave it so); returns
        its position (of its header).  Raises ValueError when the ring has no room for it."""
        total = (len(record) + 8 + 7) & ~7
        if self.prod + total - self.consumer() > self.size:
            raise ValueError("ring full")
        chunk = struct.pack("<II", len(record) | flags, 0) + record
        pos, at = self.prod, self.prod % self.size
        for base in (PAGE + at, PAGE + self.size + at):          # the area is mapped twice
            end = min(base + len(chunk), PAGE + 2 * self.size)
            self.data[base:end] = chunk[:end - base]
        if at + len(chunk) > self.size:                           # wraps: the tail lands at the start
            rest = chunk[self.size - at:]
            self.data[PAGE:PAGE + len(rest)] = rest
        self.prod += total
        struct.pack_into("<Q", self.data, 0, self.prod)
        return pos

    def consumer(self) -> int:
        """consumer_pos as the reader left it."""
        return struct.unpack_from("<Q", self.cons, 0)[0]

    def view(self) -> tuple:
        """(cons, data, page, mask), as capture.rings.RingReader.view gives them."""
        return self.cons, self.data, PAGE, self.size - 1


class MemRings:
    """Stands in for capture.rings.Rings: records given to feed() come back from take()."""

    fill = 0.0

    def __init__(self, n: int = 1, size: int = 1 << 20):
        self.rings = [MemRing(size) for _ in range(n)]

    def feed(self, records: list[bytes]) -> None:
        """Put records into the rings, in turn (ring k gets records k, k + n, ...)."""
        for i, r in enumerate(records):
            self.rings[i % len(self.rings)].put(r)

    def take(self) -> _fastpath.Batch:
        batch = _fastpath.take(tuple(r.view() for r in self.rings))
        self.fill = batch.fill
        return batch

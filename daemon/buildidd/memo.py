"""Bounded caches: one LRU type for every memo and cache of the daemon.

Each cache has a name, a capacity (entries), optionally a budget in bytes
(``max_bytes`` with a ``cost`` per entry: what a key and its value hold, e.g.
a path's length plus a fixed overhead), and counts its hits, misses and
evictions; the recorder's ``status`` reports them under ``"caches"``, with
the bytes charged.  A cache keyed or valued by paths has a byte budget: a
user controls how long a path is (up to PATH_MAX), so an entry count alone
bounds nothing.  The
module-level memos (JSON encodings of comms and paths in sessionlog.records,
comm text in kernel.events) register themselves here with :func:`shared`; a
per-object cache (the enricher's identity cache) is reported by its owner.

Storage is an OrderedDict (``entries``): least recently used first.  The C
fast path (capture/_fastpath.c) reads ``entries`` of a :class:`Memo` directly,
adds its hits to ``hits`` at the end of a run, and calls :meth:`Memo.fill` on
a miss; its hits do not refresh recency (a move_to_end call per lookup is a
visible share of the fast path's time per event: docs/performance-history.md,
'Memo recency'), so for entries only C reads, the
order is insertion order: an entry evicted in its turn is computed again.

A shared module: imports no stage of the pipeline (pyproject.toml's contract).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


#: What one entry of an OrderedDict holds besides its key's and value's own bytes (the dict's
#: slot and hash-table share, the linked-list node, the objects' headers), in bytes: the constant
#: the cost functions below add to the lengths they count.
ENTRY_OVERHEAD_BYTES = 120

Cost = Callable[[Any, Any], int]
"""``cost(key, value)``: the bytes one entry holds (an estimate from len() of its bytes and
strings plus a constant; no sys.getsizeof), the same for the same entry every time it is asked."""


def text_bytes(text: str | bytes | None) -> int:
    """The bytes a str or bytes object's characters take, from len() alone: a str that is not ASCII
    is counted at 4 bytes a character (CPython's widest form; str.isascii() reads a flag, it does
    not scan); None is 0."""
    if text is None:
        return 0
    if isinstance(text, str) and not text.isascii():
        return 4 * len(text)
    return len(text)


def text_cost(key: str | bytes, value: str | bytes) -> int:
    """The cost of an entry whose key and value are bytes or str (e.g. a path and its JSON): their
    :func:`text_bytes` plus :data:`ENTRY_OVERHEAD_BYTES` and two objects' headers (at most 48 bytes
    each: a compact ASCII str's)."""
    return text_bytes(key) + text_bytes(value) + ENTRY_OVERHEAD_BYTES + 2 * 48


class LruCache(Generic[K, V]):
    """A bounded map that forgets its least recently used entry when full.

    Args:
        name: the key under which status reports it.
        capacity: entries kept (>= 1).
        on_evict: called with (key, value) of each entry evicted for room
            (not for :meth:`pop` or :meth:`clear`).
        max_bytes: with cost, the bytes kept at most (>= 1): least recent entries are evicted
            until the sum of cost(key, value) over the entries is within it.  An entry
            costing more than max_bytes alone is not kept (counted an eviction).
        cost: Cost of one entry (see :data:`Cost`); asked once when an entry is put and
            once when it leaves.
    Raises:
        ValueError: capacity < 1, max_bytes < 1, or only one of max_bytes and cost.
    """

    __slots__ = ("name", "capacity", "entries", "hits", "misses", "evictions", "on_evict", "max_bytes", "cost",
                 "bytes")

    def __init__(self, name: str, capacity: int, *, on_evict: Callable[[K, V], None] | None = None,
                 max_bytes: int | None = None, cost: Cost | None = None):
        if capacity < 1:
            raise ValueError(f"cache {name}: capacity {capacity} < 1")
        if (max_bytes is None) != (cost is None):
            raise ValueError(f"cache {name}: max_bytes and cost go together")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"cache {name}: max_bytes {max_bytes} < 1")
        self.name = name
        self.capacity = capacity
        self.entries: OrderedDict[K, V] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.on_evict = on_evict
        self.max_bytes = max_bytes
        self.cost = cost
        #: sum of cost(key, value) over the entries (0 without a cost)
        self.bytes = 0

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: K) -> bool:
        return key in self.entries

    def get(self, key: K) -> V | None:
        """The value for key (now the most recent), counted as a hit; None, counted as a miss."""
        entries = self.entries
        value = entries.get(key)
        if value is None:
            self.misses += 1
            return None
        entries.move_to_end(key)
        self.hits += 1
        return value

    def peek(self, key: K) -> V | None:
        """The value for key or None: not counted, recency unchanged."""
        return self.entries.get(key)

    def put(self, key: K, value: V) -> None:
        """Store value (not None) as the most recent entry; evicts the least recent beyond capacity
        and beyond max_bytes."""
        entries = self.entries
        cost = self.cost
        if cost is not None:
            old_value = entries.get(key)
            if old_value is not None:
                self.bytes -= cost(key, old_value)
            self.bytes += cost(key, value)
        entries[key] = value
        entries.move_to_end(key)
        while len(entries) > self.capacity or (cost is not None and self.bytes > self.max_bytes and entries):
            old, old_value = entries.popitem(last=False)
            if cost is not None:
                self.bytes -= cost(old, old_value)
            self.evictions += 1
            if self.on_evict is not None:
                self.on_evict(old, old_value)

    def pop(self, key: K) -> V | None:
        """Remove key (no eviction counted); its value or None."""
        value = self.entries.pop(key, None)
        if value is not None and self.cost is not None:
            self.bytes -= self.cost(key, value)
        return value

    def clear(self) -> None:
        """Forget every entry (counters are kept)."""
        self.entries.clear()
        self.bytes = 0

    def count_hits(self, n: int) -> None:
        """Count n hits served from a copy of this cache's answers (the C fast path's table)."""
        self.hits += n

    def count_miss(self) -> None:
        """Count a lookup that found no usable entry (e.g. one the caller must redo)."""
        self.misses += 1

    def stats(self) -> dict:
        """{entries, capacity, hits, misses, evictions, bytes, max_bytes} (JSON-ready): bytes is the
        sum of the entries' costs (None for a cache without a cost, as its max_bytes)."""
        return {"entries": len(self.entries), "capacity": self.capacity, "hits": self.hits,
                "misses": self.misses, "evictions": self.evictions,
                "bytes": self.bytes if self.cost is not None else None, "max_bytes": self.max_bytes}


class Memo(LruCache[K, V]):
    """An LruCache of a pure function's results: ``memo(key)`` is compute(key), remembered.

    Args:
        name, capacity, max_bytes, cost: as LruCache.
        compute: key -> value (never None); pure, so an evicted entry is
            simply computed again.
    """

    __slots__ = ("compute",)

    def __init__(self, name: str, capacity: int, compute: Callable[[K], V], *,
                 max_bytes: int | None = None, cost: Cost | None = None):
        super().__init__(name, capacity, max_bytes=max_bytes, cost=cost)
        self.compute = compute

    def __call__(self, key: K) -> V:
        value = self.get(key)
        if value is None:
            value = self.compute(key)
            self.put(key, value)
        return value

    def fill(self, key: K) -> V:
        """After a lookup of key missed elsewhere (the C fast path): count the miss, compute, store."""
        self.misses += 1
        value = self.compute(key)
        self.put(key, value)
        return value


_SHARED: dict[str, LruCache] = {}


def shared(name: str, capacity: int, compute: Callable, *, max_bytes: int | None = None,
           cost: Cost | None = None) -> Memo:
    """A module-level Memo (max_bytes and cost: as LruCache's), registered under name for
    :func:`shared_stats`.

    Raises:
        ValueError: name is registered already; the bounds as LruCache's.
    """
    if name in _SHARED:
        raise ValueError(f"a shared cache named {name} exists already")
    memo = Memo(name, capacity, compute, max_bytes=max_bytes, cost=cost)
    _SHARED[name] = memo
    return memo


def shared_stats() -> dict[str, dict]:
    """{name: stats()} of every module-level memo (JSON-ready)."""
    return {name: cache.stats() for name, cache in _SHARED.items()}

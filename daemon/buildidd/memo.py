"""Bounded caches: one LRU type for every memo and cache of the daemon.

Each cache has a name, a capacity (entries), and counts its hits, misses and
evictions; the recorder's ``status`` reports them under ``"caches"``.  The
module-level memos (JSON encodings of comms and paths in sessionlog.records,
comm text in kernel.events) register themselves here with :func:`shared`; a
per-object cache (the enricher's identity cache) is reported by its owner.

Storage is an OrderedDict (``entries``): least recently used first.  The C
fast path (capture/_fastpath.c) reads ``entries`` of a :class:`Memo` directly,
adds its hits to ``hits`` at the end of a run, and calls :meth:`Memo.fill` on
a miss; its hits do not refresh recency (a move_to_end call per lookup cost
~4% of the fast path's time per event), so for entries only C reads, the
order is insertion order: an entry evicted in its turn is computed again.

A shared module: imports no stage of the pipeline (pyproject.toml's contract).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LruCache(Generic[K, V]):
    """A bounded map that forgets its least recently used entry when full.

    Args:
        name: the key under which status reports it.
        capacity: entries kept (>= 1).
        on_evict: called with (key, value) of each entry evicted for room
            (not for :meth:`pop` or :meth:`clear`).
    Raises:
        ValueError: capacity < 1.
    """

    __slots__ = ("name", "capacity", "entries", "hits", "misses", "evictions", "on_evict")

    def __init__(self, name: str, capacity: int, *, on_evict: Callable[[K, V], None] | None = None):
        if capacity < 1:
            raise ValueError(f"cache {name}: capacity {capacity} < 1")
        self.name = name
        self.capacity = capacity
        self.entries: OrderedDict[K, V] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.on_evict = on_evict

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
        """Store value (not None) as the most recent entry; evicts the least recent beyond capacity."""
        entries = self.entries
        entries[key] = value
        entries.move_to_end(key)
        while len(entries) > self.capacity:
            old, old_value = entries.popitem(last=False)
            self.evictions += 1
            if self.on_evict is not None:
                self.on_evict(old, old_value)

    def pop(self, key: K) -> V | None:
        """Remove key (no eviction counted); its value or None."""
        return self.entries.pop(key, None)

    def clear(self) -> None:
        """Forget every entry (counters are kept)."""
        self.entries.clear()

    def count_hits(self, n: int) -> None:
        """Count n hits served from a copy of this cache's answers (the C fast path's table)."""
        self.hits += n

    def count_miss(self) -> None:
        """Count a lookup that found no usable entry (e.g. one the caller must redo)."""
        self.misses += 1

    def stats(self) -> dict:
        """{entries, capacity, hits, misses, evictions} (JSON-ready)."""
        return {"entries": len(self.entries), "capacity": self.capacity, "hits": self.hits,
                "misses": self.misses, "evictions": self.evictions}


class Memo(LruCache[K, V]):
    """An LruCache of a pure function's results: ``memo(key)`` is compute(key), remembered.

    Args:
        name, capacity: as LruCache.
        compute: key -> value (never None); pure, so an evicted entry is
            simply computed again.
    """

    __slots__ = ("compute",)

    def __init__(self, name: str, capacity: int, compute: Callable[[K], V]):
        super().__init__(name, capacity)
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


def shared(name: str, capacity: int, compute: Callable) -> Memo:
    """A module-level Memo, registered under name for :func:`shared_stats`.

    Raises:
        ValueError: name is registered already.
    """
    if name in _SHARED:
        raise ValueError(f"a shared cache named {name} exists already")
    memo = Memo(name, capacity, compute)
    _SHARED[name] = memo
    return memo


def shared_stats() -> dict[str, dict]:
    """{name: stats()} of every module-level memo (JSON-ready)."""
    return {name: cache.stats() for name, cache in _SHARED.items()}

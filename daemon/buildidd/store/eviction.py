"""Which entries a copy may evict to make room, in which order: each copy is charged to its owner.

*Owner.*  A copy is charged to :attr:`buildidd.store.origin.Origin.payer`: root
for a source root owns, else the real uid of the task whose mapping or exec
caused the copy (the hand-over's Request.uid), so that a user who maps another
user's readable files pays for their copies, not that user; the source's owner
when the causing task is not known (a /proc scan, an older entry).  An
*entry's* owner is the uid every copy in it comes from (its main copy and each
``alt/<sha256>``); an entry whose copies come from several owners (a user's
content claiming root's build-id) or that has no ``origin.json`` (the
kernel's) has none.

*Referenced*: a build-id a retained session names (what housekeeping passes
to :meth:`buildidd.store.quota.Quota.enforce`).  *Mapped*: a process maps the
source of one of its copies now (``/proc/PID/maps``; the kernel's always).

Order for a copy charged to a user (uid other than 0), and nothing else:

1. that user's entries no session references, least recently referenced first;
2. that user's referenced entries no process maps, least recently referenced first.

Order for a copy charged to root:

1. users' entries no session references: the user holding the most bytes
   first (its least recently referenced entry, then the biggest user again);
2. root's and owner-less entries no session references, least recently referenced first;
3. root's referenced entries no process maps, least recently referenced first.

Never evicted for a copy: another user's entry (for a user's copy), a user's or
an owner-less entry that a session references, an entry a process maps, the
entry being added to.  :func:`select` picks the fewest from the front of the
order that free enough, or nothing when all of it would not.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator

from buildidd.store.layout import Entry

#: The owner of an entry: one uid, or None (several owners, or none recorded).
Owner = Callable[[Entry], int | None]


def order(entries: list[Entry], owner: Owner, uid: int, referenced: set[str],
          per_uid: dict[int, int]) -> Iterator[tuple[Entry, bool]]:
    """The entries a copy charged to uid may evict, in eviction order (see the module's docstring).

    Args:
        entries: the candidates (the entry being added to already left out).
        owner: an entry's owner (one uid, or None).
        uid: the owner of the copy that needs room.
        referenced: lower-case hex build-ids that retained sessions reference.
        per_uid: disk bytes held by each owner other than root (ranks users for root's copy).

    Yields:
        (entry, is_referenced): a referenced entry may only go when no process maps it
        (the caller checks; see :func:`select`).
    """
    by_age = sorted(entries, key=lambda e: (e.last_ref_ns, e.build_id_hex))
    if uid != 0:
        mine = [e for e in by_age if owner(e) == uid]
        yield from ((e, False) for e in mine if e.build_id_hex not in referenced)
        yield from ((e, True) for e in mine if e.build_id_hex in referenced)
        return
    users: dict[int, list[Entry]] = {}
    rest: list[Entry] = []
    for e in by_age:
        if e.build_id_hex in referenced:
            continue
        o = owner(e)
        if o is not None and o != 0:
            users.setdefault(o, []).append(e)
        else:
            rest.append(e)
    yield from ((e, False) for e in _biggest_first(users, per_uid))
    yield from ((e, False) for e in rest)
    yield from ((e, True) for e in by_age if e.build_id_hex in referenced and owner(e) == 0)


def _biggest_first(users: dict[int, list[Entry]], per_uid: dict[int, int]) -> Iterator[Entry]:
    """Each time the oldest entry of the user that holds the most bytes (after what went before)."""
    heap = [(-per_uid.get(u, 0), u, 0) for u in users]
    heapq.heapify(heap)
    while heap:
        held, u, i = heapq.heappop(heap)
        e = users[u][i]
        yield e
        if i + 1 < len(users[u]):
            heapq.heappush(heap, (held + e.disk_bytes, u, i + 1))


def select(candidates: Iterator[tuple[Entry, bool]], want_bytes: int,
           is_mapped: Callable[[Entry], bool]) -> tuple[list[tuple[Entry, bool]], int]:
    """The front of candidates that frees want_bytes (disk bytes), skipping referenced entries a process maps.

    Returns:
        (chosen, freed_bytes): ``freed_bytes < want_bytes`` when every candidate together would not
        free enough; the caller then evicts nothing.  is_mapped is called for referenced entries only,
        and only once the unreferenced ones before them do not suffice.
    """
    chosen: list[tuple[Entry, bool]] = []
    freed = 0
    for e, is_referenced in candidates:
        if freed >= want_bytes:
            break
        if is_referenced and is_mapped(e):
            continue
        chosen.append((e, is_referenced))
        freed += e.disk_bytes
    return chosen, freed

"""Coverage: which build-ids a session named, and why the store lacks any of them.

Every build-id the recorder writes into a mapping record is *named*; the
hand-over and the snapshot worker then say what became of it: *held* (copied
now, or a copy was there already) or a *gap* with its reason.  At the end of
a session (and in ``status``) every named build-id that the store does not
hold is counted with the last reason given for it, by reason and by the uid
that mapped it, so that no missing binary goes uncounted.  The reasons
(:data:`GAP_REASONS`) are fixed strings; the store's own refusals
(``quota``, ``uid_share``, ``too_large``, ``alt_limit``) pass through under
their own names.  A file without a GNU build-id is tracked under its htlhash
(``file_id``), the key the store keeps it under.

The ledger is bounded in bytes, whatever users map: ``max_bytes`` in all, of
which each uid but root may take ``uid_share`` (root, the system's own
binaries, is bounded by the total only).  An entry is charged to the uid of
the task that mapped it (event_header.uid), or to :data:`UNKNOWN_UID`, a
bucket of its own, when no uid is known.  An outcome that comes, without a
uid, before the recorder named its build-id (a hand-over can finish first)
waits in a short list (:data:`EARLY_MAX`, oldest dropped) for the naming,
which charges the entry to its uid.  A uid over its share, or a ledger at
its total, has its new build-ids counted only (``untracked``, by uid: one
count per naming refused, i.e. per mapping the slow path recorded); no entry
is ever evicted, so a flood costs only the flooding uid's own entries.  Paths longer than :data:`PATH_MAX_CHARS` keep their end (the
file's name) and are marked cut; every path is stored once (interned) and
charged to the uid that brought it first.  Uids beyond
:data:`UID_BUCKETS_MAX` (user namespaces can make many) share one bucket,
:data:`OTHER_UIDS`.

The byte figures are an estimate at ``sys.getsizeof`` level, meant to bound
and to compare, not to match RSS to the byte: an entry costs its build-id
string, its value tuple and :data:`DICT_SLOT_BYTES` for its slot in the
ledger's dict; a path new to the ledger its string and a slot of the intern
table; a uid bucket :data:`BUCKET_BYTES`.  The per-entry slot figure covers a
dict's table right after it doubled (the worst case between two resizes).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

from buildidd.store.gapreport import build_report

__all__ = ["Coverage", "GAP_REASONS", "HELD", "OTHER_UIDS", "UNKNOWN_UID"]

HELD = "held"
"""The state of a build-id the store holds (copied, or present already)."""

GAP_REASONS = {
    "replaced_before_pin": "the process was gone and its path named another file before the file was reached",
    "process_gone": "the process was gone and its path too before the file was reached",
    "unreachable": "no route to the file (refused, or its identity no longer matched)",
    "handover_dropped": "the hand-over queue was full",
    "queue_full": "the snapshot queue was full",
    "uid_budget": "the uid that mapped or exec'd it held its share of the hand-over or snapshot queue "
                  "(queue_uid_share)",
    "file_cap": "its exec pin was closed at pin_max_files (the user holding the most pins lost their oldest) "
                "and its path no longer served",
    "uid_pin_cap": "its exec pin was closed at its user's share of the pins (pin_uid_share: that user's own "
                   "execs filled it) and its path no longer served",
    "gone": "queued without a descriptor, and by the copy its path named another file",
    "failed": "the copy failed (I/O error, full disk)",
    "shutdown": "the daemon stopped before it was copied (stop budget spent)",
    "in_progress": "a hand-over or copy is still under way (status only)",
    "quota": "the store's quota",
    "uid_share": "its owner's share of the store",
    "too_large": "over store_file_max_bytes",
    "alt_limit": "too many other contents claim this build-id",
}
"""Gap reason → what it means (README's table)."""

#: The one object of each state name (a state from elsewhere is replaced by it: no copy per entry).
_STATES = {s: s for s in (HELD, *GAP_REASONS)}

UNKNOWN_UID = -1
"""The bucket of entries whose uid is not known (a hand-over's outcome before the recorder named it)."""
OTHER_UIDS = -2
"""The bucket shared by uids met once :data:`UID_BUCKETS_MAX` buckets exist."""
UID_BUCKETS_MAX = 1024
"""Uid buckets at most (their counters are kept even for a uid over its share)."""

PATH_MAX_CHARS = 512
"""Characters of a path kept at most: a longer one keeps its last PATH_MAX_CHARS (marked cut)."""
DICT_SLOT_BYTES = 48
"""Bytes charged for one dict slot (24-byte entry and its index, with the table's headroom)."""
ENTRY_BYTES = sys.getsizeof((None,) * 4) + DICT_SLOT_BYTES
"""Bytes charged per entry besides its build-id string: the (state, path, uid, cut) tuple and its slot."""
BUCKET_BYTES = 128 + DICT_SLOT_BYTES
"""Bytes charged per uid bucket (a slotted object, its int key and its slot)."""
EARLY_MAX = 4096
"""Outcomes without a uid kept waiting for their build-id's naming, at most."""


class _Bucket:
    """One uid's charge: bytes, entries and untracked build-ids."""

    __slots__ = ("bytes", "entries", "untracked")

    def __init__(self) -> None:
        self.bytes = 0
        self.entries = 0
        self.untracked = 0


class Coverage:
    """The ledger of one session's build-ids (see the module docstring); any thread.

    Args:
        max_bytes: the ledger's budget, bytes (estimated as the module docstring says); > 0.
        uid_share: the part of max_bytes one uid other than root may take, in (0, 1].
    Raises:
        ValueError: a bound out of range.
    """

    def __init__(self, max_bytes: int = 8 << 20, uid_share: float = 0.25):
        if max_bytes <= 0 or not 0 < uid_share <= 1:
            raise ValueError(f"coverage bounds out of range: max_bytes={max_bytes}, uid_share={uid_share}")
        self.max_bytes = max_bytes
        self.uid_share_bytes = int(max_bytes * uid_share)
        self._lock = threading.Lock()
        #: build-id hex -> (state, path, uid bucket key, path cut)
        self._state: dict[str, tuple[str, str, int, bool]] = {}
        self._paths: dict[str, str] = {}        # path (cut) -> the one copy the entries share
        self._buckets: dict[int, _Bucket] = {OTHER_UIDS: _Bucket()}
        #: build-id hex -> the state an outcome without a uid gave before it was named (oldest first)
        self._early: dict[str, str] = {}
        self.bytes = BUCKET_BYTES
        self.untracked = 0
        self.paths_cut = 0
        self.early_dropped = 0

    # -- the writers ---------------------------------------------------------
    def named(self, build_id: str, path: str, uid: int = UNKNOWN_UID) -> None:
        """The session wrote build_id (hex) for a mapping of path by a task of uid (event_header.uid;
        -1: not known); recording thread.  A build-id named already costs a dict lookup."""
        if build_id in self._state:
            return
        with self._lock:
            if build_id in self._state:
                return
            state = self._early.pop(build_id, None)
            if state is not None:
                self.bytes -= _early_cost(build_id)
            self._admit(build_id, state or "in_progress", path, uid)

    def outcome(self, build_id: str, state: str, path: str | None = None, uid: int = UNKNOWN_UID) -> None:
        """What became of build_id: :data:`HELD` or a gap reason.  A gap never replaces HELD (a
        later sighting that failed does not undo a copy).  uid (the task's that mapped it, -1: not
        known) is charged only when build_id was not named yet; without it, the state waits for
        named().  path replaces the entry's when it costs nothing new or fits its uid's share."""
        state = _STATES.get(state, state)
        with self._lock:
            old = self._state.get(build_id)
            if old is None:
                if uid == UNKNOWN_UID:
                    self._wait_named(build_id, state)
                else:            # a refusal is not counted here: named() counts it (it did, or it will)
                    self._admit(build_id, state, path or "", uid, count=False)
                return
            if old[0] == HELD and state != HELD:
                return
            kept, cut = old[1], old[3]
            if path and path != kept:
                stored, new_cut, cost = self._path_cost(path)
                if self._fits(old[2], cost):
                    kept, cut = self._intern(stored, new_cut, old[2], cost), new_cut
            self._state[build_id] = (state, kept, old[2], cut)

    # -- the readers ---------------------------------------------------------
    def state(self, build_id: str) -> str | None:
        """build_id's state (HELD, a gap reason, ``in_progress``; an outcome waiting for its naming
        too), or None when it has none."""
        got = self._state.get(build_id)
        return got[0] if got else self._early.get(build_id)

    def uid_of(self, build_id: str) -> int | None:
        """The uid bucket build_id is charged to (UNKNOWN_UID, OTHER_UIDS or a uid), or None."""
        got = self._state.get(build_id)
        return got[2] if got else None

    def ledger(self, top: int = 8) -> dict:
        """The ledger's size (JSON-ready): {"bytes", "budget_bytes", "uid_share_bytes", "entries",
        "paths", "paths_cut", "early" (outcomes waiting for their naming), "early_dropped",
        "top_uids": [{"uid", "bytes", "entries", "untracked"}, ...]} with the top uids by bytes
        (at most top; uid -1: not known, -2: OTHER_UIDS)."""
        with self._lock:
            rows = [(b.bytes, b.entries, b.untracked, k) for k, b in self._buckets.items()
                    if b.entries or b.untracked]
            out = {"bytes": self.bytes, "budget_bytes": self.max_bytes, "uid_share_bytes": self.uid_share_bytes,
                   "entries": len(self._state), "paths": len(self._paths), "paths_cut": self.paths_cut,
                   "early": len(self._early), "early_dropped": self.early_dropped}
        rows.sort(reverse=True)
        out["top_uids"] = [{"uid": k, "bytes": b, "entries": n, "untracked": u}
                           for b, n, u, k in rows[:top]]
        return out

    def report(self, holds: Callable[[str], bool], *, final: bool, listed_bytes: int | None = None,
               uids_listed: int | None = None, all_gaps: list | None = None) -> dict:
        """Counts, by reason and by uid, and the gaps named inline (JSON-ready); see gapreport.build_report.

        Args:
            holds: True when the store holds a build-id (Store.contains); asked of every
                build-id not known to be held.
            final: the session is over: what is still ``in_progress`` counts as ``shutdown``.
            listed_bytes, uids_listed: bounds of the inline list and of ``by_uid`` (None: gapreport's).
            all_gaps: when given, extended with every gap, in the inline list's order.
        """
        with self._lock:
            items = list(self._state.items())
            untracked = {k: b.untracked for k, b in self._buckets.items() if b.untracked}
        rows = []
        for bid, (state, path, uid, cut) in items:
            if state != HELD and _holds(holds, bid):
                state = HELD
            elif final and state == "in_progress":
                state = "shutdown"
            rows.append((uid, bid, path, cut, state))
        out = build_report(rows, untracked, held=HELD, listed_bytes=listed_bytes,
                           uids_listed=uids_listed, all_gaps=all_gaps)
        out["untracked"] = self.untracked
        out["ledger"] = self.ledger()
        return out

    # -- charging (lock held) ------------------------------------------------
    def _bucket(self, uid: int) -> tuple[int, _Bucket]:
        """uid's bucket key and bucket, made when it fits (else OTHER_UIDS')."""
        b = self._buckets.get(uid)
        if b is not None:
            return uid, b
        if len(self._buckets) >= UID_BUCKETS_MAX or self.bytes + BUCKET_BYTES > self.max_bytes:
            return OTHER_UIDS, self._buckets[OTHER_UIDS]
        b = self._buckets[uid] = _Bucket()
        self.bytes += BUCKET_BYTES
        return uid, b

    def _fits(self, key: int, cost: int) -> bool:
        """cost more bytes fit the total and key's share (root's: the total only)."""
        if self.bytes + cost > self.max_bytes:
            return False
        return key == 0 or self._buckets[key].bytes + cost <= self.uid_share_bytes

    def _path_cost(self, path: str) -> tuple[str, bool, int]:
        """(the path as stored, cut or not, bytes it costs: 0 when interned already)."""
        cut = len(path) > PATH_MAX_CHARS
        stored = path[-PATH_MAX_CHARS:] if cut else path
        return stored, cut, 0 if stored in self._paths else sys.getsizeof(stored) + DICT_SLOT_BYTES

    def _intern(self, stored: str, cut: bool, key: int, cost: int) -> str:
        """The shared copy of stored, charging cost to key when it is new."""
        shared = self._paths.get(stored)
        if shared is not None:
            return shared
        self._paths[stored] = stored
        self._charge(key, cost)
        self.paths_cut += cut
        return stored

    def _charge(self, key: int, cost: int) -> None:
        self._buckets[key].bytes += cost
        self.bytes += cost

    def _admit(self, build_id: str, state: str, path: str, uid: int, count: bool = True) -> bool:
        """A new entry charged to uid, or, when it does not fit, counted untracked (uid's) if count."""
        key, bucket = self._bucket(uid)
        cost = ENTRY_BYTES + sys.getsizeof(build_id)
        stored, cut, path_cost = self._path_cost(path) if self._fits(key, cost) else ("", False, 0)
        if not stored and path or not self._fits(key, cost + path_cost):
            if count:
                bucket.untracked += 1
                self.untracked += 1
            return False
        shared = self._intern(stored, cut, key, path_cost)
        self._state[build_id] = (state, shared, key, cut)
        self._charge(key, cost)
        bucket.entries += 1
        return True

    def _wait_named(self, build_id: str, state: str) -> None:
        """Keep an outcome without a uid for named() (at most EARLY_MAX, oldest dropped, counted)."""
        if build_id in self._early:
            if not (self._early[build_id] == HELD and state != HELD):
                self._early[build_id] = state
            return
        if len(self._early) >= EARLY_MAX:
            oldest = next(iter(self._early))
            del self._early[oldest]
            self.bytes -= _early_cost(oldest)
            self.early_dropped += 1
        cost = _early_cost(build_id)
        if self.bytes + cost > self.max_bytes:
            self.early_dropped += 1
            return
        self._early[build_id] = state
        self.bytes += cost


def _early_cost(build_id: str) -> int:
    """Bytes an early outcome costs: its build-id string and its slot (the state is a shared string)."""
    return sys.getsizeof(build_id) + DICT_SLOT_BYTES


def _holds(holds: Callable[[str], bool], bid: str) -> bool:
    try:
        return holds(bid)
    except (OSError, ValueError):
        return False

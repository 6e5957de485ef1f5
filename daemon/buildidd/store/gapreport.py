"""The coverage report: a ledger's gaps counted by reason and by uid, and listed in a fair order.

The gaps are listed root's first, then each other uid's, the uid with the
fewest gaps first and the one with the most last, so that one user's flood of
gaps cannot crowd out the gaps of root or of any other user.  The inline list
(the end record's ``missing``) stops at :data:`MISSING_LISTED_BYTES` of JSON;
the full list, in the same order, goes to the session's gap file
(sessionlog.gapfile).  ``by_uid`` counts at most :data:`UIDS_LISTED` uids
(root, then the uids with the most gaps and untracked build-ids); the rest
are summed in ``uids_omitted``.  So a report's size is bounded whatever the
ledger holds.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

__all__ = ["MISSING_LISTED_BYTES", "UIDS_LISTED", "build_report"]

#: Bytes of JSON the inline gap list (``missing``) takes at most.
MISSING_LISTED_BYTES = 32 << 10
#: Uids counted one by one in ``by_uid`` at most.
UIDS_LISTED = 16

Row = tuple[int, str, str, bool, str]
"""(uid, build-id hex, path, path cut, state): one ledger entry, its state final for the report."""


class _Counts:
    __slots__ = ("named", "held", "gaps", "untracked")

    def __init__(self) -> None:
        self.named = self.held = self.untracked = 0
        self.gaps: dict[str, int] = {}

    def as_json(self) -> dict:
        return {"named": self.named, "held": self.held, "gaps": dict(self.gaps), "untracked": self.untracked}


def gap_item(uid: int, bid: str, path: str, cut: bool, reason: str) -> dict:
    """One gap as listed: {"build_id", "path", "reason", "uid"} and "path_cut": true when the path
    kept only its end."""
    item = {"build_id": bid, "path": path, "reason": reason, "uid": uid}
    if cut:
        item["path_cut"] = True
    return item


def build_report(rows: Iterable[Row], untracked: dict[int, int], *, held: str, listed_bytes: int | None = None,
                 uids_listed: int | None = None, all_gaps: list | None = None) -> dict:
    """Counts by reason and by uid, and the gaps listed inline (JSON-ready).

    Args:
        rows: the ledger's entries (:data:`Row`); state ``held`` is held, any other a gap reason.
        untracked: uid -> build-ids it named that the ledger did not track.
        listed_bytes: JSON bytes of ``missing`` at most (default MISSING_LISTED_BYTES).
        uids_listed: uids in ``by_uid`` at most (default UIDS_LISTED).
        all_gaps: when given, extended with every gap (gap_item dicts) in the listing order.
    Returns:
        {"named", "held", "gaps": {reason: n}, "gaps_total", "missing": [gap_item, ...],
        "missing_listed", "by_uid": {"<uid>": {"named", "held", "gaps": {reason: n}, "untracked"}},
        "uids_omitted": {"uids", "named", "held", "gaps", "untracked"} (only when some were)}.
    """
    listed_bytes = MISSING_LISTED_BYTES if listed_bytes is None else listed_bytes
    uids_listed = UIDS_LISTED if uids_listed is None else uids_listed
    per: dict[int, _Counts] = {}
    gaps_of: dict[int, list] = {}
    total = _Counts()
    for uid, bid, path, cut, state in rows:
        c = per.get(uid) or per.setdefault(uid, _Counts())
        c.named += 1
        total.named += 1
        if state == held:
            c.held += 1
            total.held += 1
            continue
        c.gaps[state] = c.gaps.get(state, 0) + 1
        total.gaps[state] = total.gaps.get(state, 0) + 1
        gaps_of.setdefault(uid, []).append((bid, path, cut, state))
    for uid, n in untracked.items():
        (per.get(uid) or per.setdefault(uid, _Counts())).untracked = n
    missing = _listed(gaps_of, listed_bytes, all_gaps)
    out = {"named": total.named, "held": total.held, "gaps": total.gaps, "gaps_total": sum(total.gaps.values()),
           "missing": missing, "missing_listed": len(missing)}
    out.update(_by_uid(per, uids_listed))
    return out


def gap_order(gaps_of: dict[int, list]) -> list[int]:
    """The uids in listing order: root (0) first, then by ascending gap count (ties by uid)."""
    return sorted(gaps_of, key=lambda uid: (uid != 0, len(gaps_of[uid]), uid))


def _listed(gaps_of: dict[int, list], listed_bytes: int, all_gaps: list | None) -> list[dict]:
    """The inline list: gaps in gap_order while their JSON fits listed_bytes (every one into all_gaps)."""
    missing: list[dict] = []
    size, full = 2, False                      # "[]"
    for uid in gap_order(gaps_of):
        for bid, path, cut, reason in gaps_of[uid]:
            if full and all_gaps is None:
                return missing
            item = gap_item(uid, bid, path, cut, reason)
            if all_gaps is not None:
                all_gaps.append(item)
            if full:
                continue
            n = len(json.dumps(item, separators=(",", ":"))) + 1    # and its comma
            if size + n > listed_bytes:
                full = True
            else:
                missing.append(item)
                size += n
    return missing


def _by_uid(per: dict[int, _Counts], uids_listed: int) -> dict:
    """``by_uid`` (root, then the uids with the most gaps and untracked) and ``uids_omitted``."""
    ranked = sorted(per, key=lambda u: (u != 0, -(sum(per[u].gaps.values()) + per[u].untracked), u))
    shown, rest = ranked[:uids_listed], ranked[uids_listed:]
    out: dict = {"by_uid": {str(u): per[u].as_json() for u in shown}}
    if rest:
        out["uids_omitted"] = {"uids": len(rest), "named": sum(per[u].named for u in rest),
                               "held": sum(per[u].held for u in rest),
                               "gaps": sum(sum(per[u].gaps.values()) for u in rest),
                               "untracked": sum(per[u].untracked for u in rest)}
    return out

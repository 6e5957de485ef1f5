"""Per-user record budgets: user space's side of the BPF maps ``uid_budget`` and ``uid_budget_cfg``.

The BPF side (bpf/buildidd.bpf.c over_budget) keeps a token bucket in bytes
of ring records per uid (event_header.uid: the real uid of the task that
mapped or exec'd).  A MAP or EXEC record of a uid other than 0 that finds
too few tokens is not sent but counted in the uid's struct uid_budget
(bpf/events.h), so one user's flood of mappings costs that user's own
records, never the ring space (nor the session log, nor the recording
thread's time) of root or another user.  This module writes the settings
and reads the counts: :meth:`UidBudgets.report` gives what each uid had
held back since the previous report, for the session log's ``throttled``
records, and :meth:`UidBudgets.totals` the counts since start.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

__all__ = ["Held", "UidBudget", "UidBudgetCfg", "UidBudgets", "WIRE_STRUCTS", "throttled_record"]


class UidBudget(ctypes.Structure):
    """struct uid_budget of bpf/events.h (see the field comments there)."""
    _fields_ = [("tokens", ctypes.c_uint64), ("last_ns", ctypes.c_uint64), ("records", ctypes.c_uint64),
                ("bytes", ctypes.c_uint64), ("first_ns", ctypes.c_uint64), ("latest_ns", ctypes.c_uint64),
                ("gen", ctypes.c_uint64), ("since_drain", ctypes.c_uint64)]


class UidBudgetCfg(ctypes.Structure):
    """struct uid_budget_cfg of bpf/events.h (bytes per second and bytes; rate 0: no budget)."""
    _fields_ = [("bytes_per_s", ctypes.c_uint64), ("burst_bytes", ctypes.c_uint64)]


#: The budget's wire structs, by C name, for the layout test (tests/kernel/test_events.py).
WIRE_STRUCTS: dict[str, type[ctypes.Structure]] = {"uid_budget": UidBudget, "uid_budget_cfg": UidBudgetCfg}

#: uids read per report at most (the map holds UID_BUDGET_ENTRIES of bpf/buildidd.bpf.c).
REPORT_MAX_UIDS = 10240
#: uids listed by name in totals() at most (status, the end record).
TOTALS_LISTED_MAX = 20


@dataclass(frozen=True, slots=True)
class Held:
    """What one uid's budget held back since the previous report.

    Attributes:
        uid: the real uid charged; records, bytes: records not sent and their ring bytes;
        first_ns, last_ns: the first and the latest of them, ns since boot (the entry's, which
            may be older than the previous report when the uid kept being held back).
    """

    uid: int
    records: int
    bytes: int
    first_ns: int
    last_ns: int


class UidBudgets:
    """The two maps of the per-user record budget (see the module docstring).

    Args:
        table: the ``uid_budget`` map (kernel.bpfsys.Map: keys(), lookup()).
        cfg_table: the ``uid_budget_cfg`` map (one entry, key 0).
    """

    def __init__(self, table, cfg_table):
        self.table = table
        self.cfg_table = cfg_table
        self._seen: dict[int, tuple[int, int]] = {}     # uid -> (records, bytes) as the map last said
        self._totals: dict[int, list[int]] = {}          # uid -> [records, bytes] since start
        self.report()                                    # a program kept pinned from a previous start
        self._totals.clear()                             # counted there: not this session's

    def configure(self, bytes_per_s: int, burst_bytes: int) -> None:
        """Set the budget of every uid but 0: bytes_per_s of records, up to burst_bytes at once; a
        rate of 0 turns it off.

        Raises:
            ValueError: a negative value.
            OSError: the map update failed.
        """
        if bytes_per_s < 0 or burst_bytes < 0:
            raise ValueError("a record budget cannot be negative")
        self.cfg_table.update(ctypes.c_uint32(0), UidBudgetCfg(bytes_per_s, burst_bytes))

    def report(self) -> list[Held]:
        """What each uid had held back since the previous call (uids with nothing new are left out),
        uids in ascending order.  An entry the LRU map evicted and made again counts from zero: its
        new counts are all new.  At most REPORT_MAX_UIDS uids are read.

        Raises:
            OSError: a map read failed.
        """
        out = []
        for n, key in enumerate(self.table.keys()):
            if n >= REPORT_MAX_UIDS:
                break
            raw = self.table.lookup_raw(key)
            if raw is None:
                continue                      # evicted between the two calls
            b = UidBudget.from_buffer_copy(raw)
            uid = int.from_bytes(key, "little")
            seen_records, seen_bytes = self._seen.get(uid, (0, 0))
            if b.records < seen_records:      # made again since: its counts start from zero
                seen_records = seen_bytes = 0
            if b.records == seen_records:
                continue
            self._seen[uid] = (b.records, b.bytes)
            held = Held(uid, b.records - seen_records, max(0, b.bytes - seen_bytes), b.first_ns, b.latest_ns)
            total = self._totals.setdefault(uid, [0, 0])
            total[0] += held.records
            total[1] += held.bytes
            out.append(held)
        out.sort(key=lambda h: h.uid)
        return out

    def totals(self, most: int = TOTALS_LISTED_MAX) -> dict:
        """What was held back since start, as the reports so far have read them (JSON-ready):
        {"records": n, "bytes": n, "by_uid": {"UID": {"records": n, "bytes": n}, ...}} with the
        most uids that had the most records held back (the rest are in the sums only).  Any thread
        (status): the recording thread's dict is copied in one step first."""
        items = [(uid, tuple(rb)) for uid, rb in list(self._totals.items())]
        top = sorted(items, key=lambda kv: -kv[1][0])[:most]
        return {"records": sum(rb[0] for _, rb in items), "bytes": sum(rb[1] for _, rb in items),
                "by_uid": {str(uid): {"records": r, "bytes": b} for uid, (r, b) in top}}


def throttled_record(held: Held, now_ns: int) -> dict:
    """The session log's ``throttled`` record of held (docs/record-format.md)."""
    return {"type": "throttled", "time_ns": now_ns, "uid": held.uid, "records": held.records,
            "bytes": held.bytes, "first_ns": held.first_ns, "last_ns": held.last_ns}

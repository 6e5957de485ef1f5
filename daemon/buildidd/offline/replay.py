"""Replay a session's process history: which mapping covered ADDR in PID at time T.

The session's exec, mmap, fork and exit records rebuild each process's address
space the way ``perf report`` rebuilds its machine state from PERF_RECORD_MMAP2,
FORK, COMM(exec) and EXIT (tools/perf/util/machine.c ``machine__process_*``,
maps.c ``maps__fixup_overlappings``):

* munmap is not recorded: a mapping stays until a later mapping over the same
  addresses supersedes it (perf splits the older map around the newer one);
  so the answer for ADDR is the *latest* mapping at or before T that contains it;
* an exec starts the address space anew (the exec's own mappings follow it);
* a fork (a new tgid: ``pid != ppid``) starts the child as a copy of the
  parent's address space at the fork's time; a new thread (``pid == ppid``)
  shares its process's;
* an exit ends the process; an address asked for after it is answered from
  the last state, with ``exited_ns`` set (perf keeps dead threads too).

A pid's history is cut into *epochs*, one per address space: the one it had
when the session started (filled by ``synthesized`` mappings), then one per
fork or exec.  A fork epoch holds only the child's own mappings and refers to
its parent's epoch at the fork time, so a fork copies nothing; a lookup that
misses in the child continues in the parent at the fork's time.

Many queries are answered in one sweep per epoch: the queries of an epoch are
sorted by time and its mappings applied in time order to a flattened,
non-overlapping interval map (sorted starts, ``bisect``), so a batch of Q
queries over an epoch of M mappings costs O((M + Q) log M).  Records are
sorted per pid by time after reading, because the records of one process
can reach the log out of order (several CPUs' rings).

A mapping recorded with the error ``timeout`` takes the build-id of the
session's later ``resolution`` record for the same file identity
(:mod:`buildidd.offline.resolutions`); an exec epoch keeps the exec record's
``path`` (the ELF the kernel ran; for a ``#!`` script its interpreter, while
``filename`` is the script).

Times are ns since boot (CLOCK_BOOTTIME); what people type (addresses, maps
ranges, wall-clock and perf times) is parsed by :mod:`buildidd.inputs`.
"""

from __future__ import annotations

import os
from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from buildidd.offline.resolutions import LateResolutions
from buildidd.sessionlog import read_session

#: A lookup that misses in a forked child continues in its parent, at most this
#: many times (a fork chain deeper than any real one; bounds a hostile session).
MAX_FORK_HOPS = 4096

_EV_MMAP, _EV_EXEC, _EV_FORK, _EV_EXIT, _EV_COMM = range(5)


class Dso(NamedTuple):
    """A mapped file as the session recorded it (interned: one object per distinct value).

    Attributes:
        path: the path the kernel saw at mapping time.
        build_id: lower-case hex, or ``None``.
        error: why there is no build-id (the record's ``error``), or ``None``.
        deleted: the file had no link left when it was mapped.
    """

    path: str
    build_id: str | None
    error: str | None
    deleted: bool


class Mapping(NamedTuple):
    """One mapping record: [start, end) of pid's address space maps dso from pgoff.

    Attributes:
        time_ns: when it was mapped (ns since boot).
        start: first address (bytes); end: one past the last.
        pgoff: file offset of ``start`` (bytes), as in PERF_RECORD_MMAP2.
        dso: the file.
        origin: the record's origin (``mmap``, ``exec``, ``interp``, ``synthesized`` ...).
        pid: the tgid whose address space it is in.
    """

    time_ns: int
    start: int
    end: int
    pgoff: int
    dso: Dso
    origin: str
    pid: int


@dataclass(eq=False)
class Epoch:
    """One address space of one pid: from start_ns (``None``: before the session) to the next epoch.

    Attributes:
        kind: ``"initial"`` (already running when the session started or first
            seen by a mapping), ``"exec"`` or ``"fork"``.
        parent: for a fork: ``(ppid, fork time ns)``, else ``None``.
        exit_ns: when the process exited, or ``None``.
        comms: every comm the process had in this epoch, in order.
        mappings: its own mappings, in time order.
        exec_path: for an exec epoch, the ELF that ran (the exec record's ``path``,
            else its ``filename``), else ``None``.
    """

    pid: int
    kind: str
    start_ns: int | None
    parent: tuple[int, int] | None = None
    exit_ns: int | None = None
    comms: list[str] = field(default_factory=list)
    mappings: list[Mapping] = field(default_factory=list)
    exec_path: str | None = None


class Query(NamedTuple):
    """Which mapping covered ``addr`` (bytes) in ``pid`` (tgid) at ``time_ns`` (ns since boot)."""

    pid: int
    addr: int
    time_ns: int


class Answer(NamedTuple):
    """The answer to one :class:`Query`.

    Attributes:
        query: what was asked.
        mapping: the mapping that covered the address, or ``None``.
        file_offset: offset of the address in the mapped file (bytes), or ``None``.
        via: the pids the lookup went through to find an inherited mapping
            (the child first); empty when the process mapped it itself.
        exited_ns: the process had exited at this time (ns since boot) before
            ``query.time_ns``; ``None`` if it had not.
        reason: why there is no mapping: ``"unknown_pid"`` (the session has no
            record of the pid at that time) or ``"not_mapped"``; ``None`` on a hit.
        exec_path: what the process ran at that time (:attr:`Epoch.exec_path`), or ``None``
            (it was already running when the session started, or was forked and has not exec'd).
    """

    query: Query
    mapping: Mapping | None
    file_offset: int | None = None
    via: tuple[int, ...] = ()
    exited_ns: int | None = None
    reason: str | None = None
    exec_path: str | None = None


class _Flat:
    """A non-overlapping interval map [start, end) -> Mapping; a later insert supersedes what it overlaps."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.maps: list[Mapping] = []

    def insert(self, m: Mapping) -> None:
        s, e = m.start, m.end
        starts, ends, maps = self.starts, self.ends, self.maps
        lo = bisect_right(starts, s) - 1
        if lo < 0 or ends[lo] <= s:
            lo += 1
        hi = bisect_left(starts, e)          # pieces [lo, hi) overlap [s, e)
        new_s, new_e, new_m = [s], [e], [m]
        if lo < hi:
            if starts[lo] < s:               # the left part of the first one survives
                new_s.insert(0, starts[lo])
                new_e.insert(0, s)
                new_m.insert(0, maps[lo])
            if ends[hi - 1] > e:             # the right part of the last one survives
                new_s.append(e)
                new_e.append(ends[hi - 1])
                new_m.append(maps[hi - 1])
        starts[lo:hi], ends[lo:hi], maps[lo:hi] = new_s, new_e, new_m

    def find(self, addr: int) -> Mapping | None:
        i = bisect_right(self.starts, addr) - 1
        return self.maps[i] if i >= 0 and addr < self.ends[i] else None


class Replay:
    """A session's epochs, indexed for queries.  Build with :meth:`load`.

    Attributes:
        session: the session record (``{}`` if the session has none).
        first_ns, last_ns: time of the first and last record (ns since boot).
        records: records read; skipped: records ignored as malformed.
        late: the session's resolution records (``late.completed``: mappings they completed).
    """

    def __init__(self) -> None:
        self.session: dict = {}
        self.first_ns: int | None = None
        self.last_ns: int | None = None
        self.records = 0
        self.skipped = 0
        self.late = LateResolutions()
        self._epochs: dict[int, list[Epoch]] = {}
        self._starts: dict[int, list[int]] = {}

    @classmethod
    def load(cls, session_dir: str | os.PathLike) -> Replay:
        """Read a session (streaming, via ``read_session``) and index its processes.

        Memory is proportional to the mapping, exec, fork and exit records
        (one small tuple each; files are interned).  The session is read twice:
        its ``resolution`` records first (they follow the mappings they complete).

        Raises:
            SessionLogError: the session cannot be read.
        """
        self = cls()
        self.late = LateResolutions.scan(session_dir)
        events: dict[int, list[tuple]] = defaultdict(list)
        dsos: dict[tuple, Dso] = {}
        for seq, r in enumerate(read_session(session_dir)):
            self.records += 1
            try:
                self._take(r, seq, events, dsos)
            except (KeyError, TypeError, ValueError):
                self.skipped += 1
        for pid, evs in events.items():
            evs.sort(key=lambda ev: (ev[0], ev[1]))
            self._build(pid, evs)
        return self

    def _take(self, r: dict, seq: int, events: dict, dsos: dict) -> None:
        """File one record under its pid (raises KeyError/TypeError/ValueError when malformed)."""
        kind = r.get("type")
        if kind == "session":
            self.session = r
            return
        t = r.get("time_ns")
        if not isinstance(t, int):
            return
        self.first_ns = t if self.first_ns is None else min(self.first_ns, t)
        self.last_ns = t if self.last_ns is None else max(self.last_ns, t)
        if kind == "mmap":
            r = self.late.complete(r)
            key = (str(r["path"]), r.get("build_id"), r.get("error"), bool(r.get("deleted")))
            dso = dsos.get(key)
            if dso is None:
                dso = dsos[key] = Dso(*key)
            start, length, pid = _uint(r["start"]), _uint(r["len"]), _uint(r["pid"])
            m = Mapping(t, start, start + length, _uint(r["pgoff"]), dso, str(r.get("origin")), pid)
            events[pid].append((t, seq, _EV_MMAP, m, r.get("comm")))
        elif kind == "exec":
            ran = r.get("path") or r.get("filename")
            events[_uint(r["pid"])].append((t, seq, _EV_EXEC, ran if isinstance(ran, str) else None, r.get("comm")))
        elif kind == "fork":
            pid, ppid = _uint(r["pid"]), _uint(r["ppid"])
            if pid != ppid:                  # a new thread shares its process's address space
                events[pid].append((t, seq, _EV_FORK, ppid, r.get("comm")))
        elif kind == "exit":
            events[_uint(r["pid"])].append((t, seq, _EV_EXIT, None, None))
        elif kind == "comm":
            events[_uint(r["pid"])].append((t, seq, _EV_COMM, None, r.get("comm")))

    def _build(self, pid: int, evs: list[tuple]) -> None:
        cur = Epoch(pid, "initial", None)
        epochs = [cur]
        for t, _seq, kind, arg, comm in evs:
            if kind == _EV_EXEC:
                cur = Epoch(pid, "exec", t, exec_path=arg)
                epochs.append(cur)
            elif kind == _EV_FORK:
                cur = Epoch(pid, "fork", t, parent=(arg, t))
                epochs.append(cur)
            elif kind == _EV_MMAP:
                cur.mappings.append(arg)
            elif kind == _EV_EXIT:
                cur.exit_ns = t
                continue
            if isinstance(comm, str) and (not cur.comms or cur.comms[-1] != comm):
                cur.comms.append(comm)
        if not epochs[0].mappings and len(epochs) > 1 and not epochs[0].comms:
            epochs.pop(0)                    # nothing known before the first fork/exec
        self._epochs[pid] = epochs
        self._starts[pid] = [-1 if e.start_ns is None else e.start_ns for e in epochs]

    # -- queries ----------------------------------------------------------------------

    @property
    def end_ns(self) -> int:
        """The session's last time (ns since boot): the default query time."""
        return self.last_ns if self.last_ns is not None else 0

    def pids(self) -> list[int]:
        """Every tgid with at least one epoch, sorted."""
        return sorted(self._epochs)

    def epochs(self, pid: int) -> list[Epoch]:
        """The epochs of pid in time order ([] if the session never saw it)."""
        return self._epochs.get(pid, [])

    def epoch_at(self, pid: int, time_ns: int) -> Epoch | None:
        """The epoch of pid that was current at time_ns, or ``None`` (pid unknown, or not yet born)."""
        starts = self._starts.get(pid)
        if starts is None:
            return None
        i = bisect_right(starts, time_ns) - 1
        return self._epochs[pid][i] if i >= 0 else None

    def resolve(self, pid: int, addr: int, time_ns: int | None = None) -> Answer:
        """One query (see :meth:`resolve_many`); time_ns ``None``: the end of the session."""
        return self.resolve_many([Query(pid, addr, self.end_ns if time_ns is None else time_ns)])[0]

    def resolve_many(self, queries: Iterable[Query]) -> list[Answer]:
        """Answer every query, in the order given.

        Queries are grouped by epoch and each epoch is swept once per round
        (round k answers lookups inherited across k forks), so the cost is
        O((M + Q) log M) per epoch and round.
        """
        queries = list(queries)
        answers: list[Answer | None] = [None] * len(queries)
        exited: list[int | None] = [None] * len(queries)
        ran: list[str | None] = [None] * len(queries)
        # pending: epoch -> [(time_ns, addr, query index, via pids)]
        pending: dict[Epoch, list[tuple[int, int, int, tuple[int, ...]]]] = defaultdict(list)
        for i, q in enumerate(queries):
            e = self.epoch_at(q.pid, q.time_ns)
            if e is None:
                answers[i] = Answer(q, None, None, (), None, "unknown_pid")
                continue
            if e.exit_ns is not None and e.exit_ns < q.time_ns:
                exited[i] = e.exit_ns
            ran[i] = e.exec_path
            pending[e].append((q.time_ns, q.addr, i, ()))
        for _hop in range(MAX_FORK_HOPS + 1):
            if not pending:
                break
            inherited: dict[Epoch, list] = defaultdict(list)
            for epoch, items in pending.items():
                parent = self.epoch_at(*epoch.parent) if epoch.parent else None
                for (_t, addr, i, via), m in zip(items, _sweep(epoch, items)):
                    if m is not None:
                        answers[i] = Answer(queries[i], m, addr - m.start + m.pgoff, via, exited[i], None, ran[i])
                    elif parent is None or len(via) >= MAX_FORK_HOPS:
                        answers[i] = Answer(queries[i], None, None, (), exited[i], "not_mapped", ran[i])
                    else:
                        inherited[parent].append((epoch.parent[1], addr, i, via + (epoch.pid,)))
            pending = inherited
        return answers


def _sweep(epoch: Epoch, items: list[tuple[int, int, int, tuple]]) -> list[Mapping | None]:
    """For each (time_ns, addr, ...) in items, the epoch's own mapping covering addr at that time."""
    order = sorted(range(len(items)), key=lambda k: items[k][0])
    out: list[Mapping | None] = [None] * len(items)
    flat = _Flat()
    maps = epoch.mappings
    applied = 0
    for k in order:
        t, addr = items[k][0], items[k][1]
        while applied < len(maps) and maps[applied].time_ns <= t:
            flat.insert(maps[applied])
            applied += 1
        out[k] = flat.find(addr)
    return out


def _uint(value) -> int:
    """A record's non-negative integer field (raises TypeError/ValueError otherwise)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"not a non-negative integer: {value!r}")
    return value

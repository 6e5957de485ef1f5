"""Joining a profile's mappings with a session's mapping records: which build-id each perf MMAP had.

A perf PERF_RECORD_MMAP/MMAP2 and a session ``mmap`` record name the same
mapping when they agree on its identity: ``pid`` (the tgid), ``start``
(vm_start, bytes) and ``pgoff`` (bytes), and, where the perf record has them
(MMAP2 without a build-id), the file's dev (major, minor), inode and
ino_generation (inode->i_generation; perf's records synthesized from
/proc/PID/maps carry 0 there, so a 0 is not compared).  The session's ``dev``
is the user-space st_dev, compared through os.major/os.minor.

Path.  A perf record without dev and inode (an MMAP2 carrying the kernel's
build-id, or an old MMAP) is compared by its filename with the session's
``path`` (both are the path in the process's mount namespace; a trailing
`` (deleted)``, which d_path() appends and the session gives as ``deleted``,
is not compared); a session path read only in part (``path_truncated``) is
not compared.  Without it, the libraries a process dlopens one after another
at one address would be one identity.

Time.  perf's default clock is perf_clock (the kernel's local_clock, a
sched_clock): it has no reference point in perf.data and is not
CLOCK_BOOTTIME, the clock of the session's ``time_ns``; the two drift apart
(NTP slew of CLOCK_BOOTTIME, suspend).  So time is used only when the
profile was recorded on CLOCK_BOOTTIME (``perf record -k boottime``:
attr.use_clockid, clockid 7).  The kernel writes perf's record of a mapping
inside the mmap (perf_event_mmap()), exec or mprotect; the session's is
stamped after it, at the syscall's exit or at sched_process_exec.  So of
several session records of one identity, the first at or after the perf
record's time, and at most :data:`SLACK_NS` after it, is that mapping's.
When none is that close (the session began after the mapping and
synthesized it, or lost its record), or without the clock, the session's
records of that identity must agree: one identity with records of different
build-ids (a file rewritten in place under a reused pid) is left unmatched
as ``ambiguous``, never guessed.

Memory: only the session records whose (pid, start, pgoff) the profile has
are kept (the profile's keys are collected first).
"""

from __future__ import annotations

import base64
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from buildidd.offline.resolutions import TIMEOUT, LateResolutions
from buildidd.sessionlog import read_session

#: A session record may come this long after perf's record of the same mapping (ns, CLOCK_BOOTTIME):
#: the mmap's return, or the rest of an exec, with the task preempted in between.
SLACK_NS = 50_000_000
#: What d_path() appends to the name of an unlinked file (perf's filename); the session says ``deleted``.
DELETED_SUFFIX = b" (deleted)"
#: Distinct pids remembered from the session (for the reason ``pid_not_in_session``).
MAX_PIDS = 1 << 22

# Reasons a perf mapping is not given a build-id (InjectStats.not_matched keys).
NOT_A_FILE = "not_a_file"                 # [vdso], [vsyscall], //anon, [uprobes]
PID_NOT_IN_SESSION = "pid_not_in_session"
NOT_IN_SESSION = "mapping_not_in_session"
IDENTITY_DIFFERS = "identity_differs"     # the session mapped another file there (dev/ino/generation, else path)
AMBIGUOUS = "ambiguous"                   # several build-ids for one identity, and no clock or no record just after perf's
TOO_LONG = "build_id_over_20_bytes"       # perf's MMAP2 holds at most 20 bytes
INVALID_BUILD_ID = "invalid_build_id"     # the session's build-id is not hex (a damaged or forged log)
HEX_BUILD_ID = re.compile(r"(?:[0-9a-f]{2})+")          #: a build-id as the session writes it: lower-case hex


@dataclass(frozen=True)
class PerfMapping:
    """The identity fields of a perf MMAP/MMAP2 record.

    Attributes:
        pid: tgid.  start, pgoff: bytes.  time_ns: the sample_id time (perf's clock), or ``None``.
        dev: (major, minor) or ``None`` (MMAP, or MMAP2 carrying a build-id).
        ino, ino_generation: of the file, or ``None`` as dev.
        filename: bytes, as perf recorded it.
    """

    pid: int
    start: int
    pgoff: int
    time_ns: int | None
    dev: tuple[int, int] | None
    ino: int | None
    ino_generation: int | None
    filename: bytes


@dataclass(frozen=True)
class _Candidate:
    time_ns: int
    dev: int | None
    ino: int | None
    ino_generation: int | None
    build_id: str | None
    error: str | None
    path: bytes | None          # the kernel's bytes; None when not read whole


@dataclass
class SessionIndex:
    """A session's mapping records, kept for the keys a profile asks about.

    Attributes:
        session: the session's first record (kernel_build_id, host, kernel_release).
        boottime: the profile's times are CLOCK_BOOTTIME ns (``perf record -k boottime``).
        skipped: session records ignored as malformed.
    """

    session: dict = field(default_factory=dict)
    boottime: bool = False
    skipped: int = 0
    _by_key: dict[tuple[int, int, int], list[_Candidate]] = field(default_factory=dict)
    _pids: set[int] = field(default_factory=set)

    @classmethod
    def load(cls, session_dir: str | os.PathLike, keys: Iterable[tuple[int, int, int]],
             boottime: bool) -> SessionIndex:
        """The session's mapping records whose (pid, start, pgoff) is in keys, in one streaming pass; a
        mapping recorded with the error ``timeout`` takes the answer of a later ``resolution`` record
        (offline.resolutions).

        Raises:
            SessionLogError: the session cannot be read.
        """
        wanted = set(keys)
        idx = cls(boottime=boottime)
        late = LateResolutions()
        timed_out: list[tuple[tuple, int, dict]] = []     # records waiting for a later resolution record
        for r in read_session(session_dir):
            kind = r.get("type")
            if kind == "resolution":
                late.add(r)
            elif kind == "session":
                idx.session = r
            if kind != "mmap":
                continue
            try:
                key = (int(r["pid"]), int(r["start"]), int(r["pgoff"]))
                if len(idx._pids) < MAX_PIDS:
                    idx._pids.add(key[0])
                if key not in wanted:
                    continue
                cands = idx._by_key.setdefault(key, [])
                cands.append(_candidate(r))
                if r.get("error") == TIMEOUT:
                    timed_out.append((key, len(cands) - 1, r))
            except (KeyError, TypeError, ValueError):
                idx.skipped += 1
        for key, i, r in timed_out:
            done = late.complete(r)
            if done is not r:
                idx._by_key[key][i] = _candidate(done)
        return idx

    def match(self, m: PerfMapping) -> tuple[str | None, str | None]:
        """``(build-id hex, None)`` for the session's build-id of m, or ``(None, reason)``."""
        if m.filename.startswith((b"[", b"//anon")) or not m.filename.startswith(b"/"):
            return None, NOT_A_FILE
        cands = self._by_key.get((m.pid, m.start, m.pgoff))
        if not cands:
            return None, NOT_IN_SESSION if m.pid in self._pids else PID_NOT_IN_SESSION
        same = [c for c in cands if _same_file(m, c)]
        if not same:
            return None, IDENTITY_DIFFERS
        if self.boottime and m.time_ns:
            same = _at_time(same, m.time_ns)
        answers = {c.build_id for c in same}
        if len(answers) > 1:
            return None, AMBIGUOUS
        best = same[-1]
        if best.build_id is None:
            return None, best.error
        if len(best.build_id) > 40:
            return None, TOO_LONG
        return best.build_id, None


def _candidate(r: dict) -> _Candidate:
    """A session mmap record as a match candidate (a build-id that is not hex is the error ``invalid_build_id``).

    Raises:
        KeyError, TypeError, ValueError: a malformed record.
    """
    bid = r.get("build_id")
    error = str(r.get("error") or "no_build_id")
    if not isinstance(bid, str) or not bid:
        bid = None
    elif not HEX_BUILD_ID.fullmatch(bid):
        bid, error = None, INVALID_BUILD_ID
    return _Candidate(int(r["time_ns"]), _int_or_none(r.get("dev")), _int_or_none(r.get("ino")),
                      _int_or_none(r.get("ino_generation")), bid, error, _path(r))


def _path(r: dict) -> bytes | None:
    """A session record's path as the kernel's bytes (``path_bytes`` when it was not UTF-8: records.name_json),
    or ``None`` when the record has none, a malformed one, or one read only in part.

    Raises:
        ValueError: ``path_bytes`` is not base64.
    """
    path = r.get("path")
    if not isinstance(path, str) or r.get("path_truncated") is True:
        return None
    raw = r.get("path_bytes")
    return base64.b64decode(raw, validate=True) if isinstance(raw, str) else path.encode("utf-8", "surrogateescape")


def _at_time(same: list[_Candidate], t_ns: int) -> list[_Candidate]:
    """Of the session records of one identity, those that may be perf's record at t_ns (CLOCK_BOOTTIME ns):
    the first at or after it within SLACK_NS, else all of them (module doc)."""
    after = [c for c in same if t_ns <= c.time_ns <= t_ns + SLACK_NS]
    return [min(after, key=lambda c: c.time_ns)] if after else same


def _int_or_none(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _same_file(m: PerfMapping, c: _Candidate) -> bool:
    """Whether the session record c may be the file of perf mapping m (fields either lacks are not compared):
    dev, inode and ino_generation where perf's record has them, else the path (module doc)."""
    if m.dev is None:
        return c.path is None or c.path == m.filename.removesuffix(DELETED_SUFFIX) or c.path == m.filename
    if c.dev is not None and (os.major(c.dev), os.minor(c.dev)) != m.dev:
        return False
    if c.ino is not None and m.ino and c.ino != m.ino:
        return False
    return not (m.ino_generation and c.ino_generation is not None and c.ino_generation != m.ino_generation)

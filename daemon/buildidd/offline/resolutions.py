"""Late answers: ``resolution`` records completing mappings recorded with the error ``timeout``.

The recorder never stalls on a file: a mapping whose build-id could not be
read before its deadline is recorded with ``"error": "timeout"`` and no
build-id, and when the worker answers later a ``resolution`` record follows
(capture.slowpath ``RESOLUTION_LINE``): ``time_ns`` (when the answer came), the
file's identity (``dev``, ``ino``, ``ino_generation``, ``size``, ``mtime_ns``:
its ``stat``, as on the mapping records) and the answer (``build_id``,
``build_id_source``, ``error``, perhaps ``go_build_id``/``file_id``).  It
completes every earlier ``mmap`` and ``exec`` record of that identity.

A ``file_id`` record (sessionlog.records.FILE_ID_LINE) gives the htlhash of a
file whose build-id the kernel read, computed by its hand-over to the store:
every ``mmap`` and ``exec`` record of that identity without a ``file_id``
(before or after it) gets it, so each mapping carries its htlhash.

:class:`LateResolutions` holds a session's resolution records by identity and
completes records with them; the readers that stream a session (buildid-list,
export --perf, replay) read the session's resolutions first with
:meth:`LateResolutions.scan`, since a resolution comes after the records it completes.
"""

from __future__ import annotations

import os
from bisect import bisect_left
from dataclasses import dataclass, field

from buildidd.sessionlog import read_session

__all__ = ["IDENTITY_FIELDS", "KEY_FIELDS", "LATE_FIELDS", "MAX_RESOLUTIONS", "TIMEOUT", "LateResolutions", "identity_of"]

IDENTITY_FIELDS = ("dev", "ino", "ino_generation", "size", "mtime_ns")
"""The fields naming one file's content on mmap, exec and resolution records."""

LATE_FIELDS = ("build_id", "build_id_source", "error", "go_build_id", "file_id")
"""The fields a resolution record gives a completed record (absent ones are removed from it)."""

KEY_FIELDS = ("build_id", "file_id", "go_build_id")
"""The fields of a ``file_id`` record (sessionlog.records.FILE_ID_LINE) a record of its identity is given
(build_id only to check it is the same answer)."""

TIMEOUT = "timeout"
"""The error of a record whose resolution missed its deadline (a resolution record may follow)."""

MAX_RESOLUTIONS = 1_000_000
"""Resolution records kept at most (one per timed-out file; further ones are counted in ``dropped``)."""


def _is_file_id(value) -> bool:
    return isinstance(value, str) and len(value) == 32 and all(c in "0123456789abcdef" for c in value)


def identity_of(r: dict) -> tuple | None:
    """The identity fields of a record as a key, or ``None`` when dev or ino is not an integer."""
    key = tuple(r.get(k) for k in IDENTITY_FIELDS)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in key[:2]):
        return None
    return key


@dataclass
class LateResolutions:
    """A session's resolution records, by identity, in time order.

    Attributes:
        dropped: resolution and file_id records not kept (beyond :data:`MAX_RESOLUTIONS`, or malformed).
        completed: records :meth:`complete` gave a late answer to.
        keyed: records :meth:`complete` gave the htlhash of a ``file_id`` record to.
    """

    dropped: int = 0
    completed: int = 0
    keyed: int = 0
    _by_identity: dict[tuple, tuple[list[int], list[dict]]] = field(default_factory=dict)
    _keys: dict[tuple, dict] = field(default_factory=dict)
    _count: int = 0

    def __len__(self) -> int:
        return self._count

    def add(self, r: dict) -> None:
        """Keep one ``resolution`` record (its time and late fields)."""
        key, t = identity_of(r), r.get("time_ns")
        if key is None or not isinstance(t, int) or self._count >= MAX_RESOLUTIONS:
            self.dropped += 1
            return
        times, answers = self._by_identity.setdefault(key, ([], []))
        i = bisect_left(times, t)
        times.insert(i, t)
        answers.insert(i, {k: r[k] for k in LATE_FIELDS if k in r})
        self._count += 1

    def answer(self, r: dict) -> dict | None:
        """The late fields for a record (mmap or exec) with the error ``timeout``: those of the first
        resolution of its identity at or after its time; ``None`` for any other record, or none such."""
        if r.get("error") != TIMEOUT or r.get("build_id") or not self._by_identity:
            return None
        key, t = identity_of(r), r.get("time_ns")
        entry = self._by_identity.get(key) if key is not None else None
        if entry is None or not isinstance(t, int):
            return None
        times, answers = entry
        i = bisect_left(times, t)
        return answers[i] if i < len(times) else None

    def add_key(self, r: dict) -> None:
        """Keep one ``file_id`` record (the htlhash a hand-over computed for a file identity)."""
        key, fid = identity_of(r), r.get("file_id")
        if key is None or not _is_file_id(fid) or len(self._keys) >= MAX_RESOLUTIONS:
            self.dropped += 1
            return
        self._keys[key] = {k: r[k] for k in KEY_FIELDS if k in r and r[k] is not None}

    def complete(self, r: dict) -> dict:
        """r with its late answer applied (a new dict whose build_id, build_id_source, error, go_build_id
        and file_id are the resolution's), and then with the ``file_id`` (and ``go_build_id``) of its
        identity's ``file_id`` record when it has none; r itself when neither applies."""
        late = self.answer(r)
        out = r
        if late is not None:
            self.completed += 1
            out = {k: v for k, v in r.items() if k not in LATE_FIELDS}
            out.update(late)
            out.setdefault("error", None)
        if self._keys and not out.get("file_id") and out.get("type") in ("mmap", "exec"):
            key = identity_of(out)
            known = self._keys.get(key) if key is not None else None
            if known is not None and (out.get("build_id") or None) == known.get("build_id"):
                out = {**out, **known}
                self.keyed += 1
        return out

    @classmethod
    def scan(cls, session_dir: str | os.PathLike) -> LateResolutions:
        """The resolution records of a session (one streaming pass over it).

        Raises:
            SessionLogError: the session cannot be read.
        """
        late = cls()
        for r in read_session(session_dir):
            kind = r.get("type")
            if kind == "resolution":
                late.add(r)
            elif kind == "file_id":
                late.add_key(r)
        return late

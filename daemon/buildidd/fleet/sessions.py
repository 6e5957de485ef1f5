"""Sessions to the bucket: closed segments, then the manifest, then the closed marker.

A segment is closed once it is compressed (``segment-N.jsonl.zst``: the
writer compresses only what it rotated away from), or when its session is
closed (the ``.closed`` marker: then every segment is final, compressed or
not).  The open segment stays on the host until it is closed.

Per session, under ``sessions/HOST/SESSION/``: each closed segment as it is on
the host, then ``manifest.json`` (the archive manifest of what has been
pushed so far: offline.manifest's format, naming every build-id the session
references with its provenance and why one is missing), rewritten whenever
more segments went up, and ``.closed`` last, once the session is closed, so a
reader that sees ``.closed`` knows the manifest and segments are final.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from buildidd.fleet.bucket import Bucket
from buildidd.fleet.keys import Keys
from buildidd.fleet.ledger import Ledger
from buildidd.offline import manifest as mf
from buildidd.offline.archive import build_manifest
from buildidd.offline.sessions import read_marker_bytes, session_dirs, session_facts
from buildidd.sessionlog import list_segments
from buildidd.store import Store

__all__ = ["Destination", "SessionWork", "session_work", "push_session", "MANIFEST_KEY_NAME"]

MANIFEST_KEY_NAME = mf.MANIFEST_NAME


@dataclass
class SessionWork:
    """What of one session is not yet in the bucket.

    Attributes:
        directory: the session directory.
        closed: it has its closed marker.
        segments: the closed segments not yet pushed (at their current size): (path, size_bytes, mtime_ns).
        pushed: names of the closed segments the ledger says are pushed.
        manifest_due: the manifest (or the marker) must be written.
    """

    directory: Path
    closed: bool
    segments: list[tuple[Path, int, int]] = field(default_factory=list)
    pushed: list[str] = field(default_factory=list)
    manifest_due: bool = False

    @property
    def name(self) -> str:
        return self.directory.name

    def manifest_stamp(self) -> str:
        """What the ledger keeps for the manifest: the segments it covers and whether the session was closed."""
        names = sorted(self.pushed + [p.name for p, _, _ in self.segments])
        return hashlib.sha256(("\n".join(names) + f"\nclosed={self.closed}").encode()).hexdigest()[:32]


def _closed_segments(directory: Path, closed: bool) -> list[Path]:
    return [p for p in list_segments(directory) if closed or p.name.endswith(".zst")]


def session_work(session_root: str | os.PathLike, ledger: Ledger, skip: frozenset[str] | set[str] = frozenset(),
                 finished: set[str] | None = None) -> list[SessionWork]:
    """Every session under session_root with something to push, oldest first.

    Args:
        skip: names of sessions not to look at (closed ones already wholly pushed: a closed session
            never changes).
        finished: when given, the names of the closed sessions found wholly pushed are added to it.

    Raises:
        SessionLogError: a session directory cannot be listed.
    """
    out = []
    for d in session_dirs(session_root):
        name = d.name
        if name in skip:
            continue
        closed = read_marker_bytes(d) is not None
        done = ledger.stamps(f"session:{name}/")
        work = SessionWork(d, closed)
        for p in _closed_segments(d, closed):
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                continue                       # compressed and unlinked meanwhile: its .zst is listed next pass
            if done.get(f"session:{name}/{p.name}") == str(st.st_size):
                work.pushed.append(p.name)
            else:
                work.segments.append((p, st.st_size, st.st_mtime_ns))
        if not work.segments and not work.pushed:
            continue
        work.manifest_due = done.get(f"session:{name}/{MANIFEST_KEY_NAME}") != work.manifest_stamp()
        if work.segments or work.manifest_due:
            out.append(work)
        elif closed and finished is not None:
            finished.add(name)
    return out


@dataclass
class SessionResult:
    """What :func:`push_session` sent: bytes and objects."""

    sent_bytes: int = 0
    objects: int = 0


@dataclass(frozen=True)
class Destination:
    """Where sessions go: the bucket, this host's keys, and the ledger that remembers what went."""

    bucket: Bucket
    keys: Keys
    ledger: Ledger


def push_session(dest: Destination, work: SessionWork, store: Store | None, *,
                 share_private: bool = False, stop=lambda: False, manifest: bool = True) -> SessionResult:
    """Push a session's closed segments not yet pushed, then its manifest and marker (see the module docstring).

    Args:
        dest: the bucket, keys and ledger.
        work: the session's work (:func:`session_work`).
        store: the store whose entries the manifest describes (None: every build-id ``no_store``).
        share_private: the manifest lists private entries as held (``store_share_private``).
        stop: called between segments; True ends the push early (what is left is pushed next time).
        manifest: write the manifest (and marker) after the segments; False: the segments only (the
            manifest reads the whole session: the caller rations it for an open session).

    Raises:
        PushError: a request failed, or a segment could not be read (``source``).
        SessionLogError: the session cannot be read for its manifest.
    """
    bucket, keys, ledger = dest.bucket, dest.keys, dest.ledger
    result = SessionResult()
    for path, size, _mtime in work.segments:
        if stop():
            return result
        result.sent_bytes += bucket.put_file(path, keys.session_file(work.name, path.name), {}, if_absent=False)
        result.objects += 1
        ledger.mark(f"session:{work.name}/{path.name}", str(size))
    if not manifest:
        return result
    marker = read_marker_bytes(work.directory) if work.closed else None
    facts = session_facts(work.directory)
    names = sorted(work.pushed + [p.name for p, _, _ in work.segments])
    sizes = {p.name: s for p, s, _ in work.segments}
    refs = [mf.SegmentRef(mf.segment_member(work.name, n), sizes.get(n) or _size(work.directory / n))
            for n in names]
    manifest = build_manifest(facts, refs, store, share_private=share_private)
    if marker is not None:
        manifest.closed_marker = mf.SegmentRef(mf.closed_marker_member(work.name), len(marker))
    data = manifest.to_json()
    bucket.put_bytes(keys.session_file(work.name, MANIFEST_KEY_NAME), data, {"host": keys.host})
    result.sent_bytes, result.objects = result.sent_bytes + len(data), result.objects + 1
    if marker is not None:
        bucket.put_bytes(keys.session_file(work.name, mf.CLOSED_MARKER), marker)
        result.sent_bytes, result.objects = result.sent_bytes + len(marker), result.objects + 1
    ledger.mark(f"session:{work.name}/{MANIFEST_KEY_NAME}", work.manifest_stamp())
    return result


def _size(path: Path) -> int:
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0

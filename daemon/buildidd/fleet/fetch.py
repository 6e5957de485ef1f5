"""The read side of the fleet: the sessions a bucket holds, and one of them fetched for the analyst.

``buildidd fleet sessions`` lists ``P/sessions/HOST/SESSION/`` (keys.Keys);
``buildidd fleet pull HOST/SESSION`` fetches that session's ``manifest.json``,
its segments and ``.closed``, and every binary its manifest names, into the
analyst's session root and store as ``buildidd import`` lays them out
(offline.importer.import_members: staged, each ELF file's build-id or htlhash
checked, then installed).  So a session of a host that no longer exists is
resolved and injected offline like an imported one.

The bucket is hostile like an archive:

* every key read is made by :class:`~buildidd.fleet.keys.Keys` from a checked
  host, session name, build-id (hex) and entry, so it lies under the prefix;
  listed names that are not such are skipped and counted;
* the manifest is at most ``ImportLimits.max_manifest_bytes`` and checked by
  ``Manifest.from_json``; each object is at most ``max_member_bytes`` and read
  as a stream (one chunk in memory), of exactly the length a HEAD gave;
* trust comes from where an object lies, never from what the host claimed: a
  build-id the manifest calls ``trusted`` is read only at the canonical keys
  (where push puts trusted entries only, and never overwrites one); any other
  from ``hosts/HOST/``, and installed under import's untrusted policy (marked
  by default).  A binary the bucket lacks becomes ``missing`` (``not_in_bucket``).
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass

from buildidd.errors import ArchiveError
from buildidd.fleet.bucket import Bucket
from buildidd.fleet.keys import DEBUG_SELF, DEBUGINFO, EXECUTABLE, Keys, check_host, check_prefix
from buildidd.offline import manifest as mf
from buildidd.offline.importer import ImportReport, import_members
from buildidd.offline.untar import ImportLimits
from buildidd.store import DEBUG_NAME, ELF_NAME, TRUSTED

__all__ = ["RemoteSession", "Target", "list_sessions", "fetch_session", "NOT_IN_BUCKET"]

NOT_IN_BUCKET = "not_in_bucket"
"""A manifest's build-id whose objects the bucket does not hold (the reason of a ``missing`` ref)."""

MAX_SESSIONS = 100_000
"""Hosts, and sessions per host, listed at most."""

_SESSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,200}")
#: An entry's executable file, by the name the manifest gives it (the others are an ELF binary's).
_EXEC_NAMES = (mf.VDSO_NAME, mf.VMLINUX_NAME)


@dataclass(frozen=True)
class RemoteSession:
    """A session in the bucket: its host, its name, and whether its ``.closed`` marker is there."""

    host: str
    name: str
    closed: bool


def _names(bucket: Bucket, prefix: str, check) -> tuple[list[str], int]:
    """The common prefixes one level under prefix that check accepts, and how many it refused."""
    good, bad = [], 0
    for key, _ in bucket.list(prefix, delimiter="/", max_keys=MAX_SESSIONS):
        name = key[len(prefix):].rstrip("/") if key.startswith(prefix) and key.endswith("/") else ""
        if check(name):
            good.append(name)
        else:
            bad += 1
    return good, bad


def _host_ok(name: str) -> bool:
    try:
        return check_host(name) == name
    except ValueError:
        return False


def list_sessions(bucket: Bucket, prefix: str, host: str | None = None) -> tuple[list[RemoteSession], int]:
    """Every session under ``P/sessions/`` (one host's when host is given), by host then name.

    Returns:
        (sessions, names refused: malformed host or session names, or keys outside the prefix).

    Raises:
        PushError: a request failed.
        ValueError: a malformed prefix or host.
    """
    base = f"{check_prefix(prefix)}/sessions/" if prefix else "sessions/"
    hosts, refused = ([check_host(host)], 0) if host else _names(bucket, base, _host_ok)
    out = []
    for h in hosts:
        names, bad = _names(bucket, f"{base}{h}/", lambda n: bool(_SESSION_RE.fullmatch(n)))
        refused += bad
        keys = Keys(prefix, h)
        out.extend(RemoteSession(h, n, bucket.head(keys.session_file(n, mf.CLOSED_MARKER)) is not None)
                   for n in names)
    return out, refused


def _manifest(bucket: Bucket, keys: Keys, session: str, limits: ImportLimits) -> mf.Manifest:
    key = keys.session_file(session, mf.MANIFEST_NAME)
    head = bucket.head(key)
    if head is None:
        raise ArchiveError("bad_manifest", f"{key}: no such object (a session not pushed, or not yet)")
    size = int(head.get("content-length") or 0)
    if size > limits.max_manifest_bytes:
        raise ArchiveError("too_large", f"{key}: {size} bytes (limit {limits.max_manifest_bytes})")
    with bucket.open(key, size) as body:
        data = body.read(size)
    m = mf.Manifest.from_json(data)
    if m.session.get("name") != session:
        raise ArchiveError("bad_manifest", f"{key}: names the session {m.session.get('name')!r}")
    return m


def _size(head: dict | None) -> int | None:
    try:
        return int(head["content-length"]) if head is not None else None
    except (KeyError, TypeError, ValueError):
        return None


def _locate(bucket: Bucket, keys: Keys, ref: mf.BuildIdRef, where: dict[str, str]) -> None:
    """Point ref's files at the bucket's objects (where: archive member -> key), or mark it missing."""
    trusted = ref.provenance == TRUSTED
    exec_key = keys.binary(ref.build_id, EXECUTABLE, trusted)
    head = bucket.head(exec_key)
    exec_size = _size(head)
    if exec_size is None:
        ref.status, ref.reason, ref.files = mf.MISSING, NOT_IN_BUCKET, []
        return
    exec_name = next((f.name for f in ref.files if f.name in _EXEC_NAMES), ELF_NAME)
    files = [mf.FileRef(exec_name, exec_size)]
    where[mf.cache_member(ref.entry, exec_name)] = exec_key
    if head.get("debuginfo") != DEBUG_SELF:      # "none" too: a debuginfo may have been added later (binaries)
        debug_key = keys.binary(ref.build_id, DEBUGINFO, trusted)
        debug_size = _size(bucket.head(debug_key))
        if debug_size is not None:
            files.append(mf.FileRef(DEBUG_NAME, debug_size))
            where[mf.cache_member(ref.entry, DEBUG_NAME)] = debug_key
    ref.status, ref.reason, ref.files = mf.ARCHIVED, None, files


@dataclass(frozen=True)
class Target:
    """Where a pulled session goes, as for ``buildidd import``.

    Attributes:
        debug_dir: the analyst's store (perf's build-id cache layout); created.
        session_root: where the session's directory goes; created.
        untrusted: import's policy for build-ids not ``trusted`` (``mark``, ``skip``, ``refuse``).
        limits: import's bounds (manifest and object sizes, bytes).
    """

    debug_dir: str
    session_root: str
    untrusted: str = "mark"
    limits: ImportLimits = ImportLimits()


def fetch_session(bucket: Bucket, prefix: str, host: str, session: str, target: Target) -> ImportReport:
    """Fetch host's session and the binaries it names from the bucket into the target's roots.

    Args:
        bucket: the bucket.
        prefix: the key prefix (``Config.push_prefix``).
        host, session: which session (``fleet sessions`` lists them).
        target: the analyst's roots and import's policy and bounds.

    Returns:
        The import's report (its ``missing`` includes build-ids the bucket lacks: ``not_in_bucket``).

    Raises:
        PushError: a request failed (nothing was installed).
        ArchiveError: the manifest or a file is refused (see offline.importer); nothing was installed.
        ValueError: a malformed prefix, host or session name.
    """
    keys = Keys(prefix, host)
    if not _SESSION_RE.fullmatch(session):
        raise ValueError(f"session name {session!r}")
    untrusted = target.untrusted
    m = _manifest(bucket, keys, session, target.limits)
    where = {s.member: keys.session_file(session, s.member.rsplit("/", 1)[1]) for s in m.segments}
    if m.closed_marker is not None:
        where[m.closed_marker.member] = keys.session_file(session, mf.CLOSED_MARKER)
    for ref in m.build_ids:
        if ref.status == mf.ARCHIVED and ref.entry and (ref.provenance == TRUSTED or untrusted != "skip"):
            _locate(bucket, keys, ref, where)
        else:
            if ref.status == mf.ARCHIVED:
                ref.status, ref.reason = mf.MISSING, "untrusted"
            ref.files = [f for f in ref.files if f.upstream]

    @contextmanager
    def open_member(member: str, size: int):
        with bucket.open(where[member], size) as body:
            yield body

    return import_members(m, open_member, debug_dir=target.debug_dir, session_root=target.session_root,
                          untrusted=untrusted, limits=target.limits)

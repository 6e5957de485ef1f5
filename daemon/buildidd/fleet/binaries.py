"""One store entry → its objects in the bucket, under the trust rules.

What is pushed for an entry is what ``buildidd serve`` answers a caller with
rights (offline.serve.debuginfod's ``find_executable`` and ``find_debuginfo``:
the store's best copy, trusted first; the host's debuginfo, else the binary
itself when it has a symbol table), so the bucket and serve agree.

The rules (README "fleet"):

* **private** entries (a source other users could not read, a memfd) are not
  pushed unless ``store_share_private`` (as archive and serve); counted ``skipped_private``.
* only **trusted** entries (store.origin: root-owned, not writable by others,
  under the system directories) go to the canonical keys; others go to
  ``hosts/HOST/`` (``push_untrusted = "host"``) or nowhere (``"skip"``, counted).
* **one existence check**: a HEAD of the executable key, once per (host,
  entry); the ledger remembers the answer.  The executable object is written
  last (after its debuginfo), so its presence means the build-id is complete.
* **debuginfo that comes later**: an entry whose store copy gains a separate
  debuginfo after its executable was pushed changes its ledger stamp, so it is
  planned again; the executable is then present, and the debuginfo goes up
  when the bucket has none at that key (counted ``debuginfo_added``).  The
  executable's ``debuginfo`` metadata stays as first written (objects never
  change): readers look for the debuginfo key unless it says ``self``.
* **one upload across hosts**: a large canonical entry is claimed first (fleet.claims);
  a host that finds another's live claim leaves it and looks again later.
* **never overwrite**: writes are conditional (``If-None-Match: *``) where the
  server supports it; a present object whose sha256 differs from this host's
  copy is left alone and this host's copy is kept aside at
  ``conflicts/HEX/SHA256/executable`` (counted ``conflicts_kept_aside``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from buildidd.fleet.bucket import Bucket, Exists
from buildidd.fleet.claims import ClaimPolicy, take
from buildidd.fleet.keys import DEBUG_NONE, DEBUG_SELF, DEBUG_SEPARATE, DEBUGINFO, EXECUTABLE, Keys, ObjectFacts
from buildidd.offline.serve.debuginfod import Privacy, Unavailable, Withheld, find_debuginfo, find_executable
from buildidd.store import DEBUG_NAME, TRUSTED, Store
from buildidd.store.origin import sha256_fd

__all__ = ["EntryPlan", "plan_entry", "entry_stamp", "push_entry", "SKIP_REASONS", "OUTCOMES"]

SKIP_REASONS = ("private", "untrusted", "no_file", "unavailable")
"""Why an entry has no object: private (store_share_private off), untrusted (push_untrusted = "skip"),
no_file (a kernel entry without vmlinux: nothing a debuginfod client could fetch), unavailable (the
store could not be read just now; tried again next pass)."""

OUTCOMES = ("uploaded", "present", "debuginfo_added", "conflict", "claimed_elsewhere")
"""What a push of an entry did: uploaded its objects; found them present (same content); found the
executable present and added the separate debuginfo the bucket lacked; found another content at the
canonical key and kept this host's aside; left it to the host whose claim on it is live (fleet.claims)."""


@dataclass(frozen=True)
class EntryPlan:
    """What to push for one entry.

    Attributes:
        hex_key: the entry's key (build-id or htlhash), lower-case hex.
        trusted: canonical keys (else the host's tree).
        executable: the file for ``executable``.
        debug: the separate file for ``debuginfo``, or None.
        debug_self: the executable is its own debuginfo (it has a symbol table).
        provenance, quality, key_kind: the store's words for it (ObjectFacts).
        first_seen_ns: when the store took its copy, ns since the epoch.
    """

    hex_key: str
    trusted: bool
    executable: Path
    debug: Path | None
    debug_self: bool
    provenance: str
    quality: str
    key_kind: str
    first_seen_ns: int

    @property
    def size_bytes(self) -> int:
        """Bytes to upload (executable + separate debuginfo), from lstat; 0 for a file gone since."""
        total = 0
        for p in (self.executable, self.debug):
            try:
                total += os.lstat(p).st_size if p is not None else 0
            except OSError:
                pass
        return total


def entry_stamp(store: Store, hex_key: str, policy: str) -> str:
    """What the ledger compares to tell whether an entry changed since it was pushed: the store's origin
    stamp (a new main copy, a promotion or a removal change it), whether a host debuginfo file is there,
    and the push policy (share_private, push_untrusted)."""
    stamp = store.origin_stamp(hex_key)
    main = store.path_of(hex_key)
    debug = main is not None and os.path.isfile(main.parent / DEBUG_NAME)
    return f"{stamp}|debug={int(debug)}|{policy}"


def plan_entry(store: Store, hex_key: str, privacy: Privacy, untrusted: str) -> EntryPlan | str:
    """The objects to push for an entry, or the reason there are none (:data:`SKIP_REASONS`).

    Args:
        store: the store.
        hex_key: the entry's key.
        privacy: serve's privacy policy (``Privacy(store_share_private)``).
        untrusted: ``Config.push_untrusted`` (``host`` or ``skip``).
    """
    try:
        held = find_executable(store, hex_key, privacy)
        if held is None:
            return "no_file"
        origin = store.origin(hex_key)
        trusted = origin.trusted if origin is not None else held.provenance == TRUSTED
        if not trusted and untrusted == "skip":
            return "untrusted"
        debug = find_debuginfo(store, hex_key, privacy)
        first_seen = origin.time_ns if origin is not None and origin.time_ns else os.stat(held.path).st_mtime_ns
    except Withheld:
        return "private"
    except (Unavailable, OSError):
        return "unavailable"
    separate = debug is not None and debug.path != held.path
    return EntryPlan(hex_key, trusted, held.path, debug.path if separate else None,
                     debug is not None and not separate, held.provenance or "unknown", held.quality or "none",
                     held.key or "gnu", first_seen)


def _sha256(path: Path) -> tuple[str, int]:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        return sha256_fd(fd, size), size
    finally:
        os.close(fd)


def _facts(plan: EntryPlan, host: str, path: Path, debuginfo: str = "") -> ObjectFacts:
    sha, size = _sha256(path)
    return ObjectFacts(plan.provenance, plan.quality, plan.key_kind, host, plan.first_seen_ns, sha, size, debuginfo)


@dataclass
class EntryResult:
    """What :func:`push_entry` did: outcome (:data:`OUTCOMES`), bytes uploaded, objects written, copies."""

    outcome: str
    sent_bytes: int = 0
    objects: int = 0
    copies: int = 0


def push_entry(bucket: Bucket, keys: Keys, plan: EntryPlan, claims: ClaimPolicy | None = None) -> EntryResult:
    """Push one entry's objects (see the module docstring for the order and the rules).

    Args:
        claims: take a claim (fleet.claims) before uploading a large canonical entry; None: never.

    Returns:
        What it did; ``claimed_elsewhere``: another host holds a live claim on it, nothing was uploaded,
        and the entry is to be looked at again later.

    Raises:
        PushError: a request failed, or a store file could not be read (``source``); what was
            written stays (objects are whole or absent), and the entry is pushed again next pass.
    """
    exe_key = keys.binary(plan.hex_key, EXECUTABLE, plan.trusted)
    debug_kind = DEBUG_SEPARATE if plan.debug is not None else DEBUG_SELF if plan.debug_self else DEBUG_NONE
    exe = _facts(plan, keys.host, plan.executable, debug_kind)
    have = bucket.head(exe_key)                       # the one existence check
    if have is not None:
        return _present(bucket, keys, plan, exe, have)
    claim = None
    if claims is not None and plan.trusted and claims.wanted(bucket, plan.size_bytes):
        claim = take(bucket, keys.claim(plan.hex_key), keys.host, claims.lease_s)
        if not claim.held:
            return EntryResult("claimed_elsewhere", sent_bytes=claim.sent_bytes)
    try:
        # a claim freed by a winner that finished between the HEAD above and the claim: look once more
        have = bucket.head(exe_key) if claim is not None else None
        result = _present(bucket, keys, plan, exe, have) if have is not None else _upload(bucket, keys, plan, exe,
                                                                                          exe_key)
    finally:
        if claim is not None:
            claim.release(bucket)
    result.sent_bytes += claim.sent_bytes if claim is not None else 0
    return result


def _upload(bucket: Bucket, keys: Keys, plan: EntryPlan, exe: ObjectFacts, exe_key: str) -> EntryResult:
    """The uploads of an entry found absent: its debuginfo, then its executable (conditional writes)."""
    result = EntryResult("uploaded")
    debug_key = keys.binary(plan.hex_key, DEBUGINFO, plan.trusted)
    if plan.debug is not None:
        _put(bucket, plan.debug, debug_key, _facts(plan, keys.host, plan.debug).metadata(), result)
    try:
        if plan.debug_self:
            # the bytes go up once, as debuginfo; the executable is a server-side copy of it, made last
            try:
                result.sent_bytes += bucket.put_file(plan.executable, debug_key, exe.metadata(), if_absent=True)
                result.objects += 1
            except Exists as e:
                result.sent_bytes, e.sent_bytes = result.sent_bytes + e.sent_bytes, 0
                if (bucket.head(debug_key) or {}).get("sha256") != exe.sha256:
                    raise                             # not ours: never copied under the executable key
            bucket.copy(debug_key, exe_key, exe.metadata())
            result.copies += 1
        else:
            result.sent_bytes += bucket.put_file(plan.executable, exe_key, exe.metadata(), if_absent=True)
            result.objects += 1
    except Exists as e:                               # another host was quicker: compare with its object
        have = bucket.head(exe_key) or {}
        found = _present(bucket, keys, plan, exe, have)
        found.sent_bytes += result.sent_bytes + e.sent_bytes
        found.objects += result.objects
        return found
    return result


def _put(bucket: Bucket, path: Path, key: str, metadata: dict, result: EntryResult) -> None:
    """A conditional upload; a key already taken is left as it is (objects never change)."""
    try:
        result.sent_bytes += bucket.put_file(path, key, metadata, if_absent=True)
        result.objects += 1
    except Exists as e:
        result.sent_bytes += e.sent_bytes


def _late_debuginfo(bucket: Bucket, keys: Keys, plan: EntryPlan, result: EntryResult) -> None:
    """This host has a separate debuginfo the bucket's executable object was pushed without (it came to
    the store later, or another host pushed the binary without one): upload it when the debuginfo key is
    free (a HEAD first: a server without conditional writes would overwrite), never over another object."""
    debug_key = keys.binary(plan.hex_key, DEBUGINFO, plan.trusted)
    if bucket.head(debug_key) is None:
        _put(bucket, plan.debug, debug_key, _facts(plan, keys.host, plan.debug).metadata(), result)
        result.outcome = "debuginfo_added" if result.objects else result.outcome


def _present(bucket: Bucket, keys: Keys, plan: EntryPlan, exe: ObjectFacts, have: dict) -> EntryResult:
    """The executable key is taken: the same content is ``present``; another is left alone and this
    host's copy kept aside under ``conflicts/`` (never at the canonical key)."""
    if have.get("sha256") == exe.sha256:
        result = EntryResult("present")
        if plan.debug is not None and have.get("debuginfo") != DEBUG_SEPARATE:
            _late_debuginfo(bucket, keys, plan, result)
        return result
    result = EntryResult("conflict")
    aside = keys.conflict(plan.hex_key, exe.sha256, EXECUTABLE, plan.trusted)
    meta = {**exe.metadata(), "canonical-sha256": str(have.get("sha256", "unknown"))[:64]}
    _put(bucket, plan.executable, aside, meta, result)
    return result

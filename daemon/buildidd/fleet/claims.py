"""Claims: hosts that see the same large file at the same moment upload it once.

A HEAD before an upload does not stop three hosts with cold stores from each
finding a new build-id absent and each sending its bytes; the conditional PUT
then lets only one object land, but every copy crossed the wire.  So before
uploading a canonical object of at least ``push_claim_min_bytes``, a host
takes a claim: a conditional PUT (``If-None-Match: *``) of a small object at
``PREFIX/claims/HEX`` naming the host and the time.  The host that wins uploads
and then deletes its claim; a loser leaves the entry in its queue and looks
again (a HEAD) on a later pass, when the object is usually there.  A claim
older than ``push_claim_lease_s`` is taken over (its host died or stalled
mid-upload), so no build-id waits for ever; one this host left (a pass that
failed before it could delete it: one push service per host and bucket) is
taken over at once.  The time is the claimer's clock
(``claimed-ns`` metadata): hosts whose clocks differ by more than the lease
may take over a live claim, which costs one extra upload, never a wrong
object (the upload itself stays conditional).

On a server without conditional writes (Bucket.conditional false) a claim
would prove nothing, and none is taken.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from buildidd.errors import PushError
from buildidd.fleet.bucket import Bucket, Exists

__all__ = ["ClaimPolicy", "Claim", "take"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClaimPolicy:
    """When to claim: files of at least min_bytes (0: never); a claim older than lease_s seconds is taken over."""

    min_bytes: int
    lease_s: float

    @classmethod
    def from_config(cls, cfg) -> ClaimPolicy:
        return cls(cfg.push_claim_min_bytes, cfg.push_claim_lease_s)

    def wanted(self, bucket: Bucket, size_bytes: int) -> bool:
        """A claim is to be taken for an upload of size_bytes."""
        return self.min_bytes > 0 and size_bytes >= self.min_bytes and bucket.conditional


@dataclass
class Claim:
    """The outcome of :func:`take`: held (this host may upload), the key, the bytes its requests sent."""

    held: bool
    key: str
    sent_bytes: int = 0

    def release(self, bucket: Bucket) -> None:
        """Delete a held claim; a failure is logged (the lease ends it)."""
        if self.held:
            try:
                bucket.delete(self.key)
            except PushError as e:
                log.info("push: claim %s not released (%s); it lapses after its lease", self.key, e)


def take(bucket: Bucket, key: str, host: str, lease_s: float) -> Claim:
    """Take the claim at key for host, or find another host's live claim there.

    Returns:
        Claim(held=True) when this host took it (or took over its own, or one older than lease_s seconds),
        Claim(held=False) when another host's claim younger than the lease is there.

    Raises:
        PushError: a request failed.
    """
    claim = Claim(False, key)
    for _ in range(2):                            # the second time: after a stale claim was deleted
        now = time.time_ns()
        body = json.dumps({"host": host, "time_ns": now}).encode()
        claim.sent_bytes += len(body)
        try:
            bucket.put_bytes(key, body, {"host": host, "claimed-ns": str(now)}, if_absent=True)
            claim.held = True
            return claim
        except Exists:
            pass
        have = bucket.head(key)
        if have is None:
            continue                              # released meanwhile: try to take it
        try:
            age_s = (time.time_ns() - int(have.get("claimed-ns", "0"))) / 1e9
        except ValueError:
            age_s = float("inf")                  # not a claim this code wrote: treat as stale
        if age_s <= lease_s and have.get("host") != host:
            return claim                          # this host's own is left by an earlier pass that failed
        log.info("push: claim %s of %s is %.0f s old: taken over", key, have.get("host", "?"), age_s)
        bucket.delete(key)
    return claim

"""Where each object goes in the bucket, and the metadata it carries.

The layout (``P`` is ``Config.push_prefix``, ``HOST`` ``Config.push_host``)::

    P/buildid/HEX/executable                 a trusted store entry's binary (debuginfod's URL space)
    P/buildid/HEX/debuginfo                  its debuginfo: the host's separate file, or the binary itself
                                             when it has a symbol table (as ``buildidd serve`` answers)
    P/conflicts/HEX/SHA256/executable        another content under a build-id whose canonical object exists
    P/hosts/HOST/buildid/HEX/executable      an untrusted entry (push_untrusted = "host"), this host's only
    P/hosts/HOST/conflicts/HEX/SHA256/...    ... and its own conflicts
    P/sessions/HOST/SESSION/segment-N.jsonl.zst   closed segments, as on the host
    P/sessions/HOST/SESSION/.closed          the closed marker, once the session is closed
    P/sessions/HOST/SESSION/manifest.json    the archive manifest of the session (offline.manifest)

HEX is an entry's key: a GNU build-id, or for a file without one its htlhash
(the store keeps both kinds alike; the ``key-kind`` metadata says which).
debuginfod clients ask ``<url>/buildid/HEX/executable`` and ``.../debuginfo``
(elfutils debuginfod-client.c), so ``DEBUGINFOD_URLS=<endpoint>/<bucket>/P``
reads the canonical tree; the per-host tree is ``.../P/hosts/HOST``.

Object metadata (S3 user metadata, ``x-amz-meta-*``, ASCII only): see :class:`ObjectFacts`.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

__all__ = ["EXECUTABLE", "DEBUGINFO", "ObjectFacts", "Keys", "check_host", "check_prefix", "iso_utc"]

EXECUTABLE, DEBUGINFO = "executable", "debuginfo"
#: What a binary's executable object says of its debuginfo object (metadata ``debuginfo``).
DEBUG_SEPARATE, DEBUG_SELF, DEBUG_NONE = "separate", "self", "none"

_HOST_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_PREFIX_PART_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_HEX_RE = re.compile(r"[0-9a-f]{4,128}")
_SESSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,200}")


def check_host(host: str) -> str:
    """A host name for keys: letters, digits, ``.``, ``_``, ``-``, at most 63 characters.

    Raises:
        ValueError: it is not.
    """
    if not _HOST_RE.fullmatch(host or ""):
        raise ValueError(f"host name {host!r}: letters, digits, '.', '_' and '-' only, at most 63")
    return host


def check_prefix(prefix: str) -> str:
    """A key prefix: ``""`` or ``/``-separated parts of letters, digits, ``.``, ``_``, ``-``.

    Raises:
        ValueError: it is not.
    """
    if prefix and not all(_PREFIX_PART_RE.fullmatch(p) for p in prefix.split("/")):
        raise ValueError(f"prefix {prefix!r}: parts of letters, digits, '.', '_' and '-' separated by '/'")
    return prefix


def iso_utc(time_ns: int) -> str:
    """ISO 8601 UTC text (``YYYY-MM-DDTHH:MM:SSZ``) for ns since the epoch."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time_ns / 1e9))


@dataclass(frozen=True)
class ObjectFacts:
    """The metadata of a binary's object (``x-amz-meta-<name>``).

    Attributes:
        provenance: the store's word for the entry (store.PROVENANCES): ``trusted`` at canonical keys.
        quality: what it is good for (store.quality.QUALITIES).
        key_kind: ``gnu`` (a GNU build-id) or ``htlhash``.
        first_host: the host that pushed it (the first to, for a canonical object, which is never replaced).
        first_seen_ns: ns since the epoch when that host's store took its copy.
        sha256: the object's content hash, lower-case hex.
        size_bytes: its length.
        debuginfo: on an executable object, what its debuginfo object is (``separate``, ``self``, ``none``).
    """

    provenance: str
    quality: str
    key_kind: str
    first_host: str
    first_seen_ns: int
    sha256: str
    size_bytes: int
    debuginfo: str = ""

    def metadata(self) -> dict[str, str]:
        """The S3 user metadata (names lower-case, values ASCII)."""
        out = {"provenance": self.provenance, "quality": self.quality, "key-kind": self.key_kind,
               "first-host": self.first_host, "first-seen": iso_utc(self.first_seen_ns),
               "sha256": self.sha256, "size": str(self.size_bytes)}
        if self.debuginfo:
            out["debuginfo"] = self.debuginfo
        return out


class Keys:
    """The object keys of one host under one prefix.

    Args:
        prefix: ``Config.push_prefix`` (checked by :func:`check_prefix`).
        host: ``Config.push_host`` (checked by :func:`check_host`).

    Raises:
        ValueError: a malformed prefix or host.
    """

    def __init__(self, prefix: str, host: str):
        self.prefix = check_prefix(prefix)
        self.host = check_host(host)
        self._base = f"{prefix}/" if prefix else ""

    def tree(self, trusted: bool) -> str:
        """The key prefix of the build-id tree: canonical (trusted) or this host's own (``hosts/HOST/``)."""
        return self._base if trusted else f"{self._base}hosts/{self.host}/"

    def binary(self, hex_key: str, kind: str, trusted: bool) -> str:
        """``[P/][hosts/HOST/]buildid/HEX/KIND`` (KIND: executable or debuginfo).

        Raises:
            ValueError: HEX is not lower-case hex, or an unknown kind.
        """
        if not _HEX_RE.fullmatch(hex_key) or kind not in (EXECUTABLE, DEBUGINFO):
            raise ValueError(f"binary key {hex_key!r}/{kind!r}")
        return f"{self.tree(trusted)}buildid/{hex_key}/{kind}"

    def conflict(self, hex_key: str, sha256: str, kind: str, trusted: bool) -> str:
        """``[P/][hosts/HOST/]conflicts/HEX/SHA256/KIND``: a content kept aside."""
        if not _HEX_RE.fullmatch(hex_key) or not re.fullmatch(r"[0-9a-f]{64}", sha256):
            raise ValueError(f"conflict key {hex_key!r}/{sha256!r}")
        return f"{self.tree(trusted)}conflicts/{hex_key}/{sha256}/{kind}"

    def claim(self, hex_key: str) -> str:
        """``PREFIX/claims/HEX``: the claim a host takes before uploading a large canonical object (fleet.claims)."""
        return f"{self._base}claims/{hex_key}"

    def sessions(self, host: str | None = None) -> str:
        """``[P/]sessions/HOST/`` (this host's when host is None)."""
        return f"{self._base}sessions/{check_host(host or self.host)}/"

    def session_file(self, session: str, name: str, host: str | None = None) -> str:
        """``[P/]sessions/HOST/SESSION/NAME``.

        Raises:
            ValueError: a malformed session name or file name.
        """
        if not _SESSION_RE.fullmatch(session) or not re.fullmatch(r"\.?[A-Za-z0-9][A-Za-z0-9._-]{0,100}", name):
            raise ValueError(f"session file {session!r}/{name!r}")
        return f"{self.sessions(host)}{session}/{name}"

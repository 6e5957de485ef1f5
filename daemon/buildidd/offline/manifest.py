"""The archive's manifest and member layout, shared by the writer (archive) and the reader (importer).

An archive is one zstd stream (RFC 8878, content checksums on) of one POSIX
tar (pax format).  Members, in this order::

    manifest.json                          this module's Manifest, as JSON (first member)
    session/NAME/segment-000000.jsonl.zst  the session's segments, as stored
    session/NAME/.closed                   the session's closed marker, when it has one
    cache/<path>/<build-id>/elf            store entries, perf's build-id cache layout
    cache/<path>/<build-id>/debug             (debug, probes; kallsyms, modules and
    cache/[kernel.kallsyms]/<build-id>/kallsyms  vmlinux for the kernel)
    cache/.build-id/xx/rest -> ../../<path>/<build-id>   symlink, as perf makes it

so that ``tar -x --zstd`` of an archive gives a tree ``perf --buildid-dir cache``
reads (perf's tools/perf/util/build-id.c ``build_id_cache__add`` layout).  The
importer does not trust these links: it checks and remakes them.

Manifest fields (``format_version`` 1): ``format``, ``format_version``,
``buildidd_version``, ``created_wall_ns`` (ns since the epoch), ``session``
(:meth:`buildidd.offline.sessions.SessionInfo.to_json` less ``path``),
``segments`` (member, size_bytes), ``closed_marker`` (member, size_bytes of the
session's hidden ``.closed`` file, which the session writer or the sealing at
the next start leaves in a closed session; ``null`` for a live one and in
archives made before it existed), ``build_ids`` (one :class:`BuildIdRef`
each), ``unresolved`` (mappings without a build-id: path, error, records),
``upstream`` (the ``--exclude-upstream`` check: url, reachable, error,
excluded), ``store_root``.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

from buildidd.errors import ArchiveError
from buildidd.store import (BUILD_ID_DIR, DEBUG_NAME, ELF_NAME, KALLSYMS_NAME, MODULES_NAME, PROBES_NAME,
                            PROVENANCES, VDSO_NAME)
from buildidd.store.origin import KEY_GNU, KEYS
from buildidd.store.quality import QUALITIES

__all__ = ["FORMAT", "FORMAT_VERSION", "MANIFEST_NAME", "SESSION_PREFIX", "CACHE_PREFIX", "ENTRY_FILES",
           "ELF_FILES", "FileRef", "BuildIdRef", "SegmentRef", "Manifest"]

FORMAT = "buildidd-archive"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
SESSION_PREFIX = "session"
CACHE_PREFIX = "cache"

#: The store writes a kernel image with a matching build-id under this name
#: (buildidd.store's VMLINUX_NAME; not among its package's public names).
VMLINUX_NAME = "vmlinux"

#: Files of a store entry that an archive carries, in archive order.
ENTRY_FILES = (ELF_NAME, KALLSYMS_NAME, VDSO_NAME, DEBUG_NAME, VMLINUX_NAME, MODULES_NAME, PROBES_NAME)
#: Those that are ELF files with the entry's build-id (checked on import).
ELF_FILES = frozenset({ELF_NAME, VDSO_NAME, DEBUG_NAME, VMLINUX_NAME})

#: status of a build-id in the archive.
ARCHIVED, UPSTREAM, MISSING = "archived", "upstream", "missing"

#: What to do to include a build-id an archive left out, by BuildIdRef.reason (an ``unreadable: ...``
#: reason is looked up as ``unreadable``).
MISSING_HINTS = {
    "private": "their source was not readable by every user on the recording host",
    "not_in_store": "the store never got it, or its quota removed it; the session's end record "
                    "(store_coverage) says why",
    "no_store": "archived without a store; give --store-root",
    "invalid_build_id": "too short for the build-id cache's layout",
    "unreadable": "the store's copy could not be read; check the store's permissions",
}


def missing_hint(reason: str | None) -> str:
    """How to include a build-id left out for reason (:data:`MISSING_HINTS`), or ""."""
    return MISSING_HINTS.get((reason or "").split(":", 1)[0], "")

SEGMENT_RE = re.compile(r"segment-\d{6,12}\.jsonl(\.zst)?")

#: The hidden file a closed session directory holds (buildidd.sessionlog's CLOSED_MARKER, not among its
#: package's public names): one JSON object ``{"clean": bool, ...}``.
CLOSED_MARKER = ".closed"
#: A closed marker longer than this is neither archived nor accepted (the writer's is under 100 bytes).
CLOSED_MARKER_MAX_BYTES = 4096
_HEX_RE = re.compile(r"[0-9a-f]{4,128}")
_SESSION_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,200}")


def cache_member(entry: str, name: str) -> str:
    """Archive name of a store file: ``cache/<entry>/<name>``."""
    return f"{CACHE_PREFIX}/{entry}/{name}"


def link_member(build_id_hex: str) -> str:
    """Archive name of a build-id's link: ``cache/.build-id/xx/rest``."""
    return f"{CACHE_PREFIX}/{BUILD_ID_DIR}/{build_id_hex[:2]}/{build_id_hex[2:]}"


def link_target(entry: str) -> str:
    """The relative target of ``.build-id/xx/rest`` for an entry (perf: ``"../.."`` + path)."""
    return f"../../{entry}"


def segment_member(session_name: str, segment_name: str) -> str:
    """Archive name of a segment: ``session/NAME/segment-…``."""
    return f"{SESSION_PREFIX}/{session_name}/{segment_name}"


@dataclass
class FileRef:
    """One file of a store entry: its name in the entry (``elf``, ``debug`` ...), size, and
    whether it was left out because the upstream debuginfod serves it."""

    name: str
    size_bytes: int
    upstream: bool = False


@dataclass
class BuildIdRef:
    """A build-id the session references, and what the archive holds of it.

    Attributes:
        build_id: lower-case hex.
        kind: ``file``, ``kernel`` or ``module`` (sessions.KIND_*).
        paths: paths it was seen at (module names for modules), at most 16.
        records: mmap/exec records naming it.
        status: ``archived`` (files in the archive), ``upstream`` (the binary
            is served by the ``--exclude-upstream`` debuginfod), ``missing``.
        reason: why it is missing: ``no_store`` (archived without a store),
            ``not_in_store`` (never snapshotted, or removed by the quota),
            ``invalid_build_id`` (too short for the ``xx/rest`` layout),
            ``private`` (the store's copy came from a file other users could not
            read, or a memfd, and ``store_share_private`` is off),
            ``unreadable: <error>``; ``None`` otherwise.
        provenance: where the store's copies came from (``Store.provenance``: ``trusted``,
            ``untrusted``, ``conflict``, ``unknown``); ``None`` when not in the store.  The
            importer can refuse or mark what is not ``trusted``.
        quality: what the store's copies are good for (``Store.quality``: ``dwarf``, ``symtab``,
            ``minidebuginfo``, ``go_pclntab``, ``dynsym``, ``none``); ``None`` when not in the store.
        entry: the entry's directory relative to the cache, ``<path>/<build-id>``.
        files: the entry's files (:class:`FileRef`), archived or upstream.
        key: what build_id is (store.origin.KEYS): ``gnu``, a GNU build-id; ``htlhash``, the
            file_id (OpenTelemetry htlhash) of a file without one, under which it is stored and
            served; the importer verifies the file by it.
        owner: the user who owned the store copy's source, by name on the recording host (``uid N``
            when it had no name there); set for a ``private`` one, else ``None``.
        private_by: for a ``private`` one, what made it private (store.origin.private_cause): the
            directory on its path other users could not enter (``/root``), the file itself when its own
            mode kept them out, or the memfd; ``None`` otherwise or when not known.
        private_by_mode: that directory's or file's permission bits on the recording host; ``None``
            when unknown (not checkable, a memfd, or not private).
    """

    build_id: str
    kind: str
    paths: list[str] = field(default_factory=list)
    records: int = 0
    status: str = MISSING
    reason: str | None = None
    provenance: str | None = None
    quality: str | None = None
    entry: str | None = None
    files: list[FileRef] = field(default_factory=list)
    key: str = KEY_GNU
    owner: str | None = None
    private_by: str | None = None
    private_by_mode: int | None = None


@dataclass
class SegmentRef:
    """A session segment in the archive: member name and size in bytes."""

    member: str
    size_bytes: int


@dataclass
class Manifest:
    """The first member of an archive (see the module docstring)."""

    session: dict
    segments: list[SegmentRef] = field(default_factory=list)
    closed_marker: SegmentRef | None = None
    build_ids: list[BuildIdRef] = field(default_factory=list)
    unresolved: list[dict] = field(default_factory=list)
    upstream: dict | None = None
    store_root: str | None = None
    created_wall_ns: int = 0
    buildidd_version: str = ""
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    def missing_by_reason(self) -> dict[str, list[BuildIdRef]]:
        """The build-ids left out (status ``missing``), grouped by their reason (``unreadable: ...`` as ``unreadable``)."""
        out: dict[str, list[BuildIdRef]] = {}
        for ref in self.build_ids:
            if ref.status == MISSING:
                out.setdefault((ref.reason or "unknown").split(":", 1)[0], []).append(ref)
        return out

    def counts(self) -> dict[str, int]:
        """Build-ids by status: ``{"archived": n, "upstream": n, "missing": n}``."""
        out = dict.fromkeys((ARCHIVED, UPSTREAM, MISSING), 0)
        for ref in self.build_ids:
            out[ref.status] = out.get(ref.status, 0) + 1
        return out

    def to_json(self) -> bytes:
        """The manifest as UTF-8 JSON (indented: people read it with ``tar -xO``)."""
        body = asdict(self)
        head = {"format": body.pop("format"), "format_version": body.pop("format_version")}
        return json.dumps({**head, **body}, indent=1, ensure_ascii=False).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Parse and check a manifest read from an archive (hostile input).

        Checks types, the format and version, build-ids (lower-case hex),
        entry and segment names (relative, no ``..``, no empty or hidden
        component), and file names (:data:`ENTRY_FILES`), sizes (>= 0).

        Raises:
            ArchiveError: ``bad_manifest`` with what is wrong.
        """
        try:
            raw = json.loads(data)
            _check(isinstance(raw, dict), "not a JSON object")
            _check(raw.get("format") == FORMAT, f"format is {raw.get('format')!r}, not {FORMAT!r}")
            _check(raw.get("format_version") == FORMAT_VERSION,
                   f"format_version {raw.get('format_version')!r} is not supported (this reader: {FORMAT_VERSION})")
            session = raw.get("session")
            _check(isinstance(session, dict) and _SESSION_NAME_RE.fullmatch(str(session.get("name", ""))),
                   "session name missing or malformed")
            m = cls(session=session, upstream=raw.get("upstream"), store_root=raw.get("store_root"),
                    created_wall_ns=_int(raw.get("created_wall_ns", 0)),
                    buildidd_version=str(raw.get("buildidd_version", "")))
            m.segments = [_segment(s, session["name"]) for s in _list(raw.get("segments"))]
            if raw.get("closed_marker") is not None:
                m.closed_marker = _closed_marker(raw["closed_marker"], session["name"])
            m.build_ids = [_ref(r) for r in _list(raw.get("build_ids"))]
            m.unresolved = [u for u in _list(raw.get("unresolved")) if isinstance(u, dict)]
        except (ValueError, TypeError, KeyError, RecursionError) as e:
            raise ArchiveError("bad_manifest", f"manifest: {e}") from e
        seen = set()
        for ref in m.build_ids:
            if ref.build_id in seen:
                raise ArchiveError("bad_manifest", f"manifest: build-id {ref.build_id} listed twice")
            seen.add(ref.build_id)
        return m


def _check(ok, what: str) -> None:
    if not ok:
        raise ValueError(what)


def _int(v) -> int:
    _check(isinstance(v, int) and not isinstance(v, bool) and v >= 0, f"{v!r} is not a size")
    return v


def _list(v) -> list:
    _check(isinstance(v, list), f"{type(v).__name__} where a list belongs")
    return v


def _segment(s, session_name: str) -> SegmentRef:
    _check(isinstance(s, dict), "segment is not an object")
    member = s.get("member")
    _check(isinstance(member, str) and member.count("/") == 2, f"segment member {member!r}")
    prefix, name, seg = member.split("/")
    _check(prefix == SESSION_PREFIX and name == session_name and SEGMENT_RE.fullmatch(seg),
           f"segment member {member!r}")
    return SegmentRef(member, _int(s.get("size_bytes")))


def closed_marker_member(session_name: str) -> str:
    """Archive name of a session's closed marker: ``session/NAME/.closed``."""
    return f"{SESSION_PREFIX}/{session_name}/{CLOSED_MARKER}"


def _closed_marker(s, session_name: str) -> SegmentRef:
    _check(isinstance(s, dict) and s.get("member") == closed_marker_member(session_name),
           f"closed_marker {s!r}")
    size = _int(s.get("size_bytes"))
    _check(size <= CLOSED_MARKER_MAX_BYTES, f"closed_marker of {size} bytes (limit {CLOSED_MARKER_MAX_BYTES})")
    return SegmentRef(s["member"], size)


def check_entry(entry, build_id: str) -> str:
    """An entry directory name from an archive: ``<relative path>/<build-id>``, no ``..``, ``.``,
    empty or hidden first component, at most 4096 bytes, components at most 255.

    Raises:
        ValueError: it is not.
    """
    _check(isinstance(entry, str) and 0 < len(entry.encode("utf-8", "surrogateescape")) <= 4096,
           f"entry {entry!r}")
    parts = entry.split("/")
    _check(len(parts) >= 2 and parts[-1] == build_id, f"entry {entry!r} does not end with its build-id")
    for p in parts:
        _check(p not in ("", ".", "..") and "\0" not in p and len(p.encode("utf-8", "surrogateescape")) <= 255,
               f"entry {entry!r} has a component {p!r}")
    _check(not parts[0].startswith("."), f"entry {entry!r} starts with a hidden directory")
    return entry


#: An owner name or a private_by path longer than this (in characters) is dropped on reading.
TEXT_FIELD_MAX = 4096


def _short_text(v) -> str | None:
    """An optional text field from a hostile manifest: a string of at most TEXT_FIELD_MAX characters, else None."""
    return v if isinstance(v, str) and len(v) <= TEXT_FIELD_MAX else None


def _ref(r) -> BuildIdRef:
    _check(isinstance(r, dict), "build-id entry is not an object")
    bid = r.get("build_id")
    _check(isinstance(bid, str) and _HEX_RE.fullmatch(bid) and len(bid) % 2 == 0, f"build-id {bid!r}")
    status = r.get("status")
    _check(status in (ARCHIVED, UPSTREAM, MISSING), f"{bid}: status {status!r}")
    ref = BuildIdRef(build_id=bid, kind=str(r.get("kind")), status=status, records=_int(r.get("records", 0)),
                     reason=r.get("reason") if isinstance(r.get("reason"), str) else None,
                     paths=[p for p in _list(r.get("paths", [])) if isinstance(p, str)][:64])
    provenance = r.get("provenance")
    _check(provenance is None or provenance in PROVENANCES, f"{bid}: provenance {provenance!r}")
    ref.provenance = provenance
    quality = r.get("quality")
    _check(quality is None or quality in QUALITIES, f"{bid}: quality {quality!r}")
    ref.quality = quality
    key = r.get("key", KEY_GNU)
    _check(key in KEYS and (key == KEY_GNU or len(bid) == 32), f"{bid}: key {key!r}")
    ref.key = key
    ref.owner, ref.private_by = _short_text(r.get("owner")), _short_text(r.get("private_by"))
    mode = r.get("private_by_mode")
    ref.private_by_mode = mode if isinstance(mode, int) and not isinstance(mode, bool) and 0 <= mode <= 0o7777 \
        else None
    if status != MISSING:
        ref.entry = check_entry(r.get("entry"), bid)
        names = set()
        for f in _list(r.get("files")):
            _check(isinstance(f, dict) and f.get("name") in ENTRY_FILES and f["name"] not in names,
                   f"{bid}: file {f!r}")
            names.add(f["name"])
            ref.files.append(FileRef(f["name"], _int(f.get("size_bytes")), bool(f.get("upstream", False))))
    return ref

"""``buildidd inject``: a perf.data profile rewritten so every mapping carries its exact build-id.

Like ``perf inject --buildid-all``, but the build-ids come from the session
buildidd recorded (read from the very file each process mapped), not from
the paths as they are when inject runs.  Three streaming passes, memory
bounded by the profile's mappings, never by its size:

1. :func:`scan`: :class:`~buildidd.offline.perffile.PerfFile` checks the
   header, and every record of the data section is stepped over once: the
   offset and (pid, start, pgoff) of each user-space PERF_RECORD_MMAP/MMAP2
   kept, each user-space sample counted against the mapping record that
   covers it (:mod:`~buildidd.offline.injectcover`).  A corrupt record stops
   inject here, before any output is written;
2. the session's ``mmap`` records with those keys are loaded
   (:class:`~buildidd.offline.injectmatch.SessionIndex`); then :func:`plan`
   reads the mapping records again, by their offsets, and names apart the
   versions of each path that will carry more than one build-id
   (:mod:`~buildidd.offline.injectnames`: ``PATH@BIDPREFIX``);
3. :class:`_Rewriter`: the data section is copied in chunks to a temporary
   file beside OUT, each mapping record as the match and the names say, and
   renamed into place at the end (the input is only read).

Each user-space MMAP or MMAP2 the session matches is written as a
PERF_RECORD_MMAP2 with PERF_RECORD_MISC_MMAP_BUILD_ID (perf_event.h: ``u8
build_id_size, res; u16 res; u8 build_id[20]`` in place of maj/min/ino/
ino_generation; an MMAP becomes an MMAP2 with prot ``PROT_READ|PROT_EXEC``,
``PROT_READ`` for PERF_RECORD_MISC_MMAP_DATA, and flags ``MAP_PRIVATE``).  A
record that already carries a build-id keeps it: when the session's
differs, that is a disagreement, counted and shown, never overwritten.  A
mapping of a path that carries several build-ids in the output is written
as an MMAP2 under its version's name.  Everything else is copied byte for
byte.  The HEADER_BUILD_ID feature is rewritten to agree
(:func:`~buildidd.offline.injectheader.build_id_section`); the other
features are copied.
"""

from __future__ import annotations

import contextlib
import os
import struct
import tempfile
import time
from array import array
from collections import Counter
from dataclasses import dataclass, field

from buildidd.errors import AnalysisError
from buildidd.offline.injectcover import MAX_PENDING, Coverage, SampleLayout
from buildidd.offline.injectheader import MAX_BUILD_ID_SECTION, build_id_section, parse_build_id_section
from buildidd.offline.injectmatch import TOO_LONG, PerfMapping, SessionIndex
from buildidd.offline.injectnames import VersionNames
from buildidd.offline.perfabi import (BUILD_ID_SIZE, CLOCK_BOOTTIME, EVENT_HEADER, FILE_HEADER, HEADER_BUILD_ID,
                                      HEADER_HOSTNAME, HEADER_OSRELEASE, HEADER_STRING, MAP_PRIVATE, MAX_RECORD_BYTES,
                                      MMAP2_BUILD_ID, MMAP2_ID, MMAP2_NAME_AT, MMAP2_PROT_FLAGS, MMAP2_UNION_AT,
                                      MMAP_HEAD, MMAP_NAME_AT, PERF_RECORD_FINISHED_ROUND, PERF_RECORD_FORK,
                                      PERF_RECORD_MISC_CPUMODE_MASK, PERF_RECORD_MISC_GUEST_KERNEL,
                                      PERF_RECORD_MISC_KERNEL, PERF_RECORD_MISC_MMAP_BUILD_ID,
                                      PERF_RECORD_MISC_MMAP_DATA, PERF_RECORD_MMAP, PERF_RECORD_MMAP2, PROT_EXEC,
                                      PROT_READ, SECTION, set_feature)
from buildidd.offline.perffile import Copy, PerfDataError, PerfFile, Tally

_U64 = struct.Struct("<Q")
#: Where an MMAP2's build-id starts, and its prot and flags (from the record's first byte).
_BUILD_ID_AT = MMAP2_UNION_AT + MMAP2_BUILD_ID.offset_of("build_id")
_PROT_AT = MMAP2_UNION_AT + MMAP2_ID.size
#: User-space mapping records a profile may have (pass 1 keeps 8 bytes of offset and a key for each).
MAX_MAPPINGS = 1 << 23
#: Disagreements shown in the summary (all are counted).
MAX_EXAMPLES = 20
COPY_CHUNK = 1 << 20
#: The records pass 1 looks at (samples are collected by the walk itself).
_LOOKED_AT = frozenset((PERF_RECORD_MMAP, PERF_RECORD_MMAP2, PERF_RECORD_FORK, PERF_RECORD_FINISHED_ROUND))


@dataclass
class InjectStats:
    """What :func:`inject` did.

    Attributes:
        records: data records read.  mmap_records: PERF_RECORD_MMAP and MMAP2 among them.
        kernel_mmaps: kernel and module mappings (not the session's concern; copied).
        matched: user-space mappings given the session's build-id.
        agreed: mappings that carried a build-id equal to the session's.
        perf_only: mappings that carried a build-id the session has no answer for (kept).
        flag_without_build_id: MMAP2 records flagged as carrying a build-id that hold a dev/inode
            (:func:`flag_without_build_id`): given ours, or their flag cleared.
        disagreements: mappings whose build-id differs from the session's (perf's kept);
            examples: the first :data:`MAX_EXAMPLES` of them.
        not_matched: reason → user-space mappings left without a build-id (injectmatch reasons,
            or the session's error for the file).
        samples: Coverage counts (injectcover).
        clock: how time joins the match ("boottime": used; "perf_clock": not used).
        header: HEADER_BUILD_ID entries: written, kept_from_perf, dropped_from_perf, kernel_added.
        versions: paths that carry several build-ids in the output (injectnames): ``paths`` named apart,
            ``named`` versions given a name, ``mappings`` records written under one, ``too_long`` versions
            left under the path's name, ``names``: the first :data:`MAX_EXAMPLES` as {path, build_id, name}.
        warnings: facts the analyst should see (another host, another kernel).
        session_records_skipped: malformed session mapping records ignored.
        bytes_in, bytes_out: file sizes; seconds: wall time of the three passes.
    """

    records: int = 0
    mmap_records: int = 0
    kernel_mmaps: int = 0
    matched: int = 0
    agreed: int = 0
    perf_only: int = 0
    flag_without_build_id: int = 0
    disagreements: int = 0
    examples: list[dict] = field(default_factory=list)
    not_matched: Counter = field(default_factory=Counter)
    samples: dict = field(default_factory=dict)
    clock: str = "perf_clock"
    header: dict = field(default_factory=dict)
    versions: dict = field(default_factory=lambda: {"paths": 0, "named": 0, "mappings": 0, "too_long": 0,
                                                    "names": []})
    warnings: list[str] = field(default_factory=list)
    session_records_skipped: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict:
        """The summary as ``inject --json`` prints it."""
        user = self.mmap_records - self.kernel_mmaps
        return {"records": self.records, "mmap_records": self.mmap_records, "user_mappings": user,
                "kernel_mappings": self.kernel_mmaps, "matched": self.matched, "agreed": self.agreed,
                "perf_only": self.perf_only, "flag_without_build_id": self.flag_without_build_id,
                "disagreements": self.disagreements,
                "disagreement_examples": self.examples, "not_matched": dict(self.not_matched.most_common()),
                "samples": self.samples, "clock": self.clock, "header_build_ids": self.header,
                "versions": self.versions,
                "warnings": self.warnings, "session_records_skipped": self.session_records_skipped,
                "bytes_in": self.bytes_in, "bytes_out": self.bytes_out, "seconds": round(self.seconds, 3),
                "records_per_s": round(self.records / self.seconds) if self.seconds else None}


def parse_mmap(pf: PerfFile, rtype: int, rec: memoryview) -> tuple[PerfMapping, bytes | None, int]:
    """A PERF_RECORD_MMAP/MMAP2's identity, the build-id it carries (or ``None``), and where its name ends.

    Raises:
        PerfDataError: the record is too short for its fields and trailer.
    """
    name_at = MMAP_NAME_AT if rtype == PERF_RECORD_MMAP else MMAP2_NAME_AT
    trailer_at = len(rec) - pf.id_hdr_size
    if trailer_at < name_at:
        raise PerfDataError(f"{pf.path}: a PERF_RECORD_MMAP{'2' if rtype != PERF_RECORD_MMAP else ''} of "
                            f"{len(rec)} bytes, too short for its fields")
    head = MMAP_HEAD.fields_from(rec, EVENT_HEADER.size)
    pid, start, pgoff = head.pid, head.start, head.pgoff
    misc = EVENT_HEADER.fields_from(rec).misc
    dev = ino = gen = bid = None
    if rtype == PERF_RECORD_MMAP2:
        size = rec[MMAP2_UNION_AT]          # MMAP2_BUILD_ID.build_id_size
        if misc & PERF_RECORD_MISC_MMAP_BUILD_ID and 0 < size <= BUILD_ID_SIZE:
            bid = bytes(rec[_BUILD_ID_AT:_BUILD_ID_AT + size])
        else:       # see flag_without_build_id()
            maj, mnr, ino, gen = MMAP2_ID.unpack_from(rec, MMAP2_UNION_AT)
            dev = (maj, mnr)
    t = _U64.unpack_from(rec, trailer_at + pf.time_at)[0] if pf.time_at is not None else None
    name = bytes(rec[name_at:trailer_at]).split(b"\0", 1)[0]
    return PerfMapping(pid, start, pgoff, t, dev, ino, gen, name), bid, trailer_at


def flag_without_build_id(rtype: int, misc: int, rec: memoryview) -> bool:
    """Whether an MMAP2 has PERF_RECORD_MISC_MMAP_BUILD_ID but a build_id_size of 0 or over 20: then its union
    holds maj/min/ino/ino_generation.  The kernel (kernel/events/core.c perf_event_mmap_output) sets the flag
    in the mmap event it shares between all perf events and never clears it, so while one perf session records
    with --buildid-mmap, another one's MMAP2 records get the flag over their dev/inode (seen here: a size byte
    of 254, the low byte of the disk's major; perf report then fails an assertion and aborts)."""
    return rtype == PERF_RECORD_MMAP2 and bool(misc & PERF_RECORD_MISC_MMAP_BUILD_ID) and \
        not 0 < rec[MMAP2_UNION_AT] <= BUILD_ID_SIZE


def with_build_id(pf: PerfFile, rtype: int, rec: memoryview, bid: bytes, trailer_at: int,
                  name: bytes | None = None) -> bytes:
    """rec (MMAP or MMAP2) as an MMAP2 carrying bid (at most 20 bytes), its trailer unchanged, and its filename
    unchanged or, with name, that name (NUL-terminated, padded to 8 bytes as the kernel writes it).

    Raises:
        PerfDataError: the new record would exceed 65535 bytes.
    """
    misc = EVENT_HEADER.fields_from(rec).misc | PERF_RECORD_MISC_MMAP_BUILD_ID
    union = MMAP2_BUILD_ID.pack(len(bid), 0, 0, bid)
    if rtype == PERF_RECORD_MMAP:
        prot = PROT_READ if misc & PERF_RECORD_MISC_MMAP_DATA else PROT_READ | PROT_EXEC
        prot_flags, name_at = MMAP2_PROT_FLAGS.pack(prot, MAP_PRIVATE), MMAP_NAME_AT
    else:
        prot_flags, name_at = bytes(rec[_PROT_AT:MMAP2_NAME_AT]), MMAP2_NAME_AT
    filename = bytes(rec[name_at:trailer_at]) if name is None else name + b"\0" * (8 - len(name) % 8)
    head = bytes(rec[EVENT_HEADER.size:EVENT_HEADER.size + MMAP_HEAD.size])
    body = head + union + prot_flags + filename + bytes(rec[trailer_at:])
    size = EVENT_HEADER.size + len(body)
    if size > MAX_RECORD_BYTES:
        raise PerfDataError(f"{pf.path}: a mapping record of {size} bytes does not fit perf's u16 size")
    return EVENT_HEADER.pack(PERF_RECORD_MMAP2, misc, size) + body


def _is_kernel(misc: int, pid: int) -> bool:
    mode = misc & PERF_RECORD_MISC_CPUMODE_MASK
    return mode in (PERF_RECORD_MISC_KERNEL, PERF_RECORD_MISC_GUEST_KERNEL) or pid == 0xFFFFFFFF


@dataclass
class _Scan:
    """Pass 1's findings: where each user-space mapping record is, their keys, and the samples' coverage."""

    offsets: array = field(default_factory=lambda: array("q"))     # file offset of each, by serial
    keys: set = field(default_factory=set)                          # (pid, start, pgoff)
    tally: Tally = field(default_factory=Tally)
    cover: Coverage | None = None


def scan(pf: PerfFile, src, stats: InjectStats) -> _Scan:
    """Pass 1: every record's size checked; user-space mapping records located and their keys collected;
    each user-space sample counted against the mapping record that covers it (injectcover).

    Raises:
        PerfDataError: a corrupt record, or more than :data:`MAX_MAPPINGS` mapping records.
    """
    sc = _Scan(cover=Coverage(SampleLayout.of(pf.attrs)))
    cover = sc.cover
    layout = cover.layout
    copy = Copy(None, cover.pending if layout else None, layout.ip_at if layout else 0, MAX_PENDING)
    for off, rtype, misc, rec in pf.walk(src, _LOOKED_AT, sc.tally, copy):
        if rtype == PERF_RECORD_MMAP or rtype == PERF_RECORD_MMAP2:
            stats.mmap_records += 1
            m = parse_mmap(pf, rtype, rec)[0]
            if _is_kernel(misc, m.pid):
                stats.kernel_mmaps += 1
                continue
            if len(sc.offsets) >= MAX_MAPPINGS:
                raise PerfDataError(f"{pf.path}: more than {MAX_MAPPINGS} mapping records")
            sc.offsets.append(off)
            sc.keys.add((m.pid, m.start, m.pgoff))
            cover.map(m.pid, m.start, MMAP_HEAD.unpack_from(rec, EVENT_HEADER.size)[3])
        elif rtype == PERF_RECORD_FORK:
            cover.fork(rec)
        else:           # FLUSH, FINISHED_ROUND
            cover.flush()
    cover.flush()
    stats.records = sc.tally.records
    return sc


def _carried(index: SessionIndex, m: PerfMapping, had: bytes | None) -> tuple[str | None, str | None, str | None]:
    """The session's answer for m (build-id hex, or ``None`` and the reason), and the build-id the output
    record carries: the one it had, else the session's when perf's MMAP2 can hold it, else ``None``."""
    ours, why = index.match(m)
    if had is not None:
        return ours, why, had.hex()
    return ours, why, ours if ours is not None and len(ours) <= 2 * BUILD_ID_SIZE else None


def plan(pf: PerfFile, src, offsets: array, index: SessionIndex) -> VersionNames:
    """Pass 2b: each user-space mapping record read again at its offset, and the build-id its output record
    will carry noted by filename; the versions of a path with several named apart (injectnames).

    Raises:
        PerfDataError: a record is no longer the mapping record pass 1 found there.
    """
    names = VersionNames()
    for off in offsets:
        rtype, _misc, rec = _mapping_at(pf, src, off, seek=True)
        m, had, _trailer_at = parse_mmap(pf, rtype, rec)
        names.see(m.filename, _carried(index, m, had)[2])
    names.assign()
    return names


def _mapping_at(pf: PerfFile, src, off: int, seek: bool) -> tuple[int, int, memoryview]:
    """The mapping record at off (type, misc, bytes), read from src (there already unless seek).

    Raises:
        PerfDataError: it is not an MMAP/MMAP2 record any more, or the file ends inside it.
    """
    head = _read(pf, src, off, EVENT_HEADER.size, seek=seek)
    rtype, misc, size = EVENT_HEADER.unpack(head)
    if rtype not in (PERF_RECORD_MMAP, PERF_RECORD_MMAP2) or size < MMAP_NAME_AT:
        raise pf.fail(off, "the file changed while inject read it")
    return rtype, misc, memoryview(head + _read(pf, src, off + EVENT_HEADER.size, size - EVENT_HEADER.size,
                                                seek=False))


class _Rewriter:
    """Pass 3: the input copied to the output, each user-space mapping record as :meth:`mapping` says;
    the build-ids the output's mappings carry."""

    def __init__(self, pf: PerfFile, index: SessionIndex, stats: InjectStats, names: VersionNames):
        self.pf, self.index, self.stats, self.names = pf, index, stats, names
        self.carried: dict[tuple[str, str], tuple[int, str]] = {}     # (build-id, path) -> (first pid, name)
        self.unmatched_paths: set[str] = set()

    def run(self, src, out, sc: _Scan) -> None:
        """Copy the data section from src (positioned at its start) to out."""
        pf = self.pf
        has_bid = bytearray(len(sc.offsets))
        pos = pf.data_offset
        for serial, off in enumerate(sc.offsets):
            _copy_on(src, out, off - pos)
            rtype, misc, rec = _mapping_at(pf, src, off, seek=False)
            data, has_bid[serial] = self.mapping(rtype, misc, rec)
            out.write(data)
            pos = off + len(rec)
        _copy_on(src, out, pf.data_offset + pf.data_size - pos)
        self.stats.samples = sc.cover.counts(sc.tally.samples, has_bid)

    def mapping(self, rtype: int, misc: int, rec: memoryview) -> tuple[bytes | memoryview, bool]:
        """A user-space MMAP/MMAP2 record as written to the output, and whether it carries a build-id."""
        st = self.stats
        m, had, trailer_at = parse_mmap(self.pf, rtype, rec)
        ours, why, bid = _carried(self.index, m, had)
        path = m.filename.decode("utf-8", "surrogateescape")
        if had is not None:
            if ours is None:
                st.perf_only += 1
            elif bytes.fromhex(ours) == had:
                st.agreed += 1
            else:
                st.disagreements += 1
                if len(st.examples) < MAX_EXAMPLES:
                    st.examples.append({"pid": m.pid, "start": f"{m.start:#x}", "pgoff": m.pgoff, "path": path,
                                        "perf": had.hex(), "session": ours})
            name = self._carry(bid, m, path)
            return (rec if name is None else with_build_id(self.pf, rtype, rec, had, trailer_at, name)), True
        bogus = flag_without_build_id(rtype, misc, rec)
        st.flag_without_build_id += bogus
        if bid is None:
            st.not_matched[why or TOO_LONG] += 1
            self.unmatched_paths.add(path)
            if bogus:       # what the kernel wrote is a dev/inode: say so
                return EVENT_HEADER.pack(rtype, misc & ~PERF_RECORD_MISC_MMAP_BUILD_ID, len(rec)) + \
                    bytes(rec[EVENT_HEADER.size:]), False
            return rec, False
        st.matched += 1
        name = self._carry(bid, m, path)
        return with_build_id(self.pf, rtype, rec, bytes.fromhex(bid), trailer_at, name), True

    def _carry(self, bid: str, m: PerfMapping, path: str) -> bytes | None:
        """Note that the output carries (bid, path); the version's own name when it has one, else ``None``."""
        name = self.names.name(m.filename, bid)
        given = name if name != m.filename else None
        if given is not None:
            self.stats.versions["mappings"] += 1
        self.carried.setdefault((bid, path), (m.pid, name.decode("utf-8", "surrogateescape")))
        return given


def inject(profile: str | os.PathLike, session_dir: str | os.PathLike, out_path: str | os.PathLike) -> InjectStats:
    """Write profile with the session's build-ids to out_path (see the module doc); the summary.

    Raises:
        PerfDataError: the profile is not a perf.data file inject reads, or is truncated or corrupt.
        AnalysisError: out_path is the profile, or cannot be written.
        SessionLogError: the session cannot be read.
    """
    t0 = time.monotonic()
    stats = InjectStats()
    profile, out_path = os.fspath(profile), os.fspath(out_path)
    if os.path.isdir(profile):
        raise PerfDataError(f"{profile}: a directory (perf record --threads); not supported")
    with contextlib.suppress(FileNotFoundError):
        if os.path.samefile(profile, out_path):
            raise AnalysisError(f"{out_path}: is the input; inject never writes over its input")
    with open(profile, "rb") as src:
        pf = PerfFile.open(profile, src)
        stats.bytes_in = pf.size
        boottime = pf.clockid == CLOCK_BOOTTIME
        stats.clock = "boottime" if boottime else "perf_clock"
        sc = scan(pf, src, stats)
        index = SessionIndex.load(session_dir, sc.keys, boottime)
        stats.session_records_skipped = index.skipped
        same_host = _check_host(pf, src, index.session, stats)
        names = plan(pf, src, sc.offsets, index)
        stats.versions.update(paths=names.paths_renamed, named=len(names.names), too_long=names.too_long, names=[
            {"path": path.decode("utf-8", "surrogateescape"), "build_id": bid,
             "name": name.decode("utf-8", "surrogateescape")}
            for (path, bid), name in list(names.names.items())[:MAX_EXAMPLES]])
        rw = _Rewriter(pf, index, stats, names)
        perf_entries = parse_build_id_section(pf, pf.read_feature(src, HEADER_BUILD_ID, MAX_BUILD_ID_SECTION) or b"")
        kernel_bid = index.session.get("kernel_build_id") if same_host else None
        stats.bytes_out = _write(pf, src, out_path, (rw, sc), perf_entries, kernel_bid)
    stats.seconds = time.monotonic() - t0
    return stats


def _check_host(pf: PerfFile, src, session: dict, stats: InjectStats) -> bool:
    """Warnings when the profile's HEADER_HOSTNAME / HEADER_OSRELEASE differ from the session's; whether
    both agree (or the profile does not say)."""
    same = True
    for bit, key in ((HEADER_HOSTNAME, "host"), (HEADER_OSRELEASE, "kernel_release")):
        raw = pf.read_feature(src, bit, 1 << 16)
        if raw is None or len(raw) < HEADER_STRING.size or not session.get(key):
            continue
        at = HEADER_STRING.size
        text = raw[at:at + HEADER_STRING.fields_from(raw).len].split(b"\0", 1)[0].decode("utf-8", "replace")
        if text != session[key]:
            stats.warnings.append(f"the profile's {key} is {text!r}, the session's {session[key]!r}")
            same = False
    return same


def _write(pf: PerfFile, src, out_path: str, passes: tuple[_Rewriter, _Scan], perf_entries: list, kernel_bid) -> int:
    """Pass 3 into a temporary file beside out_path, renamed into place; its size."""
    rw, sc = passes
    d = os.path.dirname(os.path.abspath(out_path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".inject-", suffix=".tmp", dir=d)
    except OSError as e:
        raise AnalysisError(f"{out_path}: cannot write: {e.strerror}") from e
    try:
        with os.fdopen(fd, "wb", buffering=COPY_CHUNK) as out:
            _copy(src, out, 0, pf.data_offset)
            rw.run(src, out, sc)
            data_size = out.tell() - pf.data_offset
            header = {"written": 0, "kept_from_perf": 0, "dropped_from_perf": 0, "kernel_added": False}
            bid_section = build_id_section(perf_entries, rw.carried, rw.unmatched_paths, kernel_bid, header)
            rw.stats.header = header
            bits = sorted(set(pf.features) | {HEADER_BUILD_ID})
            sizes = {b: len(bid_section) if b == HEADER_BUILD_ID else pf.features[b][1] for b in bits}
            at = out.tell() + SECTION.size * len(bits)
            for b in bits:
                out.write(SECTION.pack(at, sizes[b]))
                at += sizes[b]
            for b in bits:
                if b == HEADER_BUILD_ID:
                    out.write(bid_section)
                else:
                    _copy(src, out, *pf.features[b])
            size = out.tell()
            out.seek(0)
            head = FILE_HEADER.fields_from(_read(pf, src, 0, FILE_HEADER.size))
            out.write(FILE_HEADER.pack_fields(head._replace(
                data_size=data_size, adds_features=set_feature(head.adds_features, HEADER_BUILD_ID))))
        os.rename(tmp, out_path)
        return size
    except OSError as e:
        raise AnalysisError(f"{out_path}: cannot write: {e.strerror}") from e
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _read(pf: PerfFile, src, off: int, n: int, seek: bool = True) -> bytes:
    if seek:
        src.seek(off)
    data = src.read(n)
    if len(data) != n:
        raise pf.fail(off, "file shrank while inject read it")
    return data


def _copy(src, out, off: int, n: int) -> None:
    """n bytes of src from off to out, a chunk at a time."""
    src.seek(off)
    _copy_on(src, out, n)


def _copy_on(src, out, n: int) -> None:
    """The next n bytes of src to out, a chunk at a time."""
    while n > 0:
        chunk = src.read(min(COPY_CHUNK, n))
        if not chunk:
            raise PerfDataError(f"{src.name}: file shrank while inject read it")
        out.write(chunk)
        n -= len(chunk)

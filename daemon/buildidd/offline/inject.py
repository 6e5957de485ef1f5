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
   (:class:`~buildidd.offline.injectmatch.SessionIndex`);
3. :class:`_Rewriter`: the data section is copied in chunks to a temporary
   file beside OUT, each mapping record as the match says, and renamed into
   place at the end (the input is only read).

Each user-space MMAP or MMAP2 the session matches is written as a
PERF_RECORD_MMAP2 with PERF_RECORD_MISC_MMAP_BUILD_ID (perf_event.h: ``u8
build_id_size, res; u16 res; u8 build_id[20]`` in place of maj/min/ino/
ino_generation; an MMAP becomes an MMAP2 with prot ``PROT_READ|PROT_EXEC``,
``PROT_READ`` for PERF_RECORD_MISC_MMAP_DATA, and flags ``MAP_PRIVATE``).  A
record that already carries a build-id keeps it: when the session's
differs, that is a disagreement, counted and shown, never overwritten.
Everything else is copied byte for byte.  The HEADER_BUILD_ID feature is
rewritten to agree (:func:`build_id_section`); the other features are copied.
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
from buildidd.offline.injectmatch import HEX_BUILD_ID, TOO_LONG, PerfMapping, SessionIndex
from buildidd.offline.perfdata import (BUILD_ID_ENTRY, HOST_KERNEL_ID, MAX_BUILD_ID_BYTES, MMAP2_BUILD_ID,
                                       PERF_RECORD_MISC_BUILD_ID_SIZE, PERF_RECORD_MISC_KERNEL,
                                       PERF_RECORD_MISC_MMAP_BUILD_ID, build_id_entry, user_build_id_entries)
from buildidd.offline.perffile import (CLOCK_BOOTTIME, EVENT_HEADER, FILE_HEADER, HEADER_BUILD_ID,
                                       PERF_RECORD_FINISHED_ROUND, PERF_RECORD_FORK, PERF_RECORD_MMAP,
                                       PERF_RECORD_MMAP2, SECTION, Copy, PerfDataError, PerfFile, Tally)
from buildidd.store import KALLSYMS_DSO

MMAP_HEAD = struct.Struct("<IIQQQ")             # pid, tid, start, len, pgoff (after perf_event_header)
MMAP2_ID = struct.Struct("<IIQQ")               # maj, min, ino, ino_generation
PROT_FLAGS = struct.Struct("<II")
MMAP_NAME_AT = EVENT_HEADER.size + MMAP_HEAD.size                                     # 40
MMAP2_NAME_AT = MMAP_NAME_AT + MMAP2_ID.size + PROT_FLAGS.size                        # 72
PERF_RECORD_MISC_CPUMODE_MASK, PERF_RECORD_MISC_GUEST_KERNEL = 7, 4
PERF_RECORD_MISC_MMAP_DATA = 1 << 13
PROT_READ, PROT_EXEC, MAP_PRIVATE = 1, 4, 2
HEADER_HOSTNAME, HEADER_OSRELEASE = 3, 4
#: Largest HEADER_BUILD_ID section read from the input (bytes).
MAX_BUILD_ID_SECTION = 256 << 20
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
    pid, _tid, start, _len, pgoff = MMAP_HEAD.unpack_from(rec, EVENT_HEADER.size)
    misc = EVENT_HEADER.unpack_from(rec)[1]
    dev = ino = gen = bid = None
    if rtype == PERF_RECORD_MMAP2:
        size = rec[MMAP_NAME_AT]
        if misc & PERF_RECORD_MISC_MMAP_BUILD_ID and 0 < size <= MAX_BUILD_ID_BYTES:
            bid = bytes(rec[MMAP_NAME_AT + 4:MMAP_NAME_AT + 4 + size])
        else:       # see flag_without_build_id()
            maj, mnr, ino, gen = MMAP2_ID.unpack_from(rec, MMAP_NAME_AT)
            dev = (maj, mnr)
    t = struct.unpack_from("<Q", rec, trailer_at + pf.time_at)[0] if pf.time_at is not None else None
    name = bytes(rec[name_at:trailer_at]).split(b"\0", 1)[0]
    return PerfMapping(pid, start, pgoff, t, dev, ino, gen, name), bid, trailer_at


def flag_without_build_id(rtype: int, misc: int, rec: memoryview) -> bool:
    """Whether an MMAP2 has PERF_RECORD_MISC_MMAP_BUILD_ID but a build_id_size of 0 or over 20: then its union
    holds maj/min/ino/ino_generation.  The kernel (kernel/events/core.c perf_event_mmap_output) sets the flag
    in the mmap event it shares between all perf events and never clears it, so while one perf session records
    with --buildid-mmap, another one's MMAP2 records get the flag over their dev/inode (seen here: a size byte
    of 254, the low byte of the disk's major; perf report then fails an assertion and aborts)."""
    return rtype == PERF_RECORD_MMAP2 and bool(misc & PERF_RECORD_MISC_MMAP_BUILD_ID) and \
        not 0 < rec[MMAP_NAME_AT] <= MAX_BUILD_ID_BYTES


def with_build_id(pf: PerfFile, rtype: int, rec: memoryview, bid: bytes, trailer_at: int) -> bytes:
    """rec (MMAP or MMAP2) as an MMAP2 carrying bid (at most 20 bytes), name and trailer unchanged.

    Raises:
        PerfDataError: the new record would exceed 65535 bytes.
    """
    misc = EVENT_HEADER.unpack_from(rec)[1] | PERF_RECORD_MISC_MMAP_BUILD_ID
    union = MMAP2_BUILD_ID.pack(len(bid), 0, 0, bid)
    if rtype == PERF_RECORD_MMAP:
        prot = PROT_READ if misc & PERF_RECORD_MISC_MMAP_DATA else PROT_READ | PROT_EXEC
        body = bytes(rec[EVENT_HEADER.size:MMAP_NAME_AT]) + union + PROT_FLAGS.pack(prot, MAP_PRIVATE) \
            + bytes(rec[MMAP_NAME_AT:])
    else:
        body = bytes(rec[EVENT_HEADER.size:MMAP_NAME_AT]) + union + bytes(rec[MMAP_NAME_AT + 24:])
    size = EVENT_HEADER.size + len(body)
    if size > 0xFFFF:
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


class _Rewriter:
    """Pass 3: the input copied to the output, each user-space mapping record as :meth:`mapping` says;
    the build-ids the output's mappings carry."""

    def __init__(self, pf: PerfFile, index: SessionIndex, stats: InjectStats):
        self.pf, self.index, self.stats = pf, index, stats
        self.carried: dict[tuple[str, str], int] = {}     # (build-id, path) -> first pid
        self.unmatched_paths: set[str] = set()

    def run(self, src, out, sc: _Scan) -> None:
        """Copy the data section from src (positioned at its start) to out."""
        pf = self.pf
        has_bid = bytearray(len(sc.offsets))
        pos = pf.data_offset
        for serial, off in enumerate(sc.offsets):
            _copy_on(src, out, off - pos)
            head = _read(pf, src, off, EVENT_HEADER.size, seek=False)
            rtype, misc, size = EVENT_HEADER.unpack(head)
            if rtype not in (PERF_RECORD_MMAP, PERF_RECORD_MMAP2) or size < MMAP_NAME_AT:
                raise pf.fail(off, "the file changed while inject read it")
            rec = memoryview(head + _read(pf, src, off + EVENT_HEADER.size, size - EVENT_HEADER.size, seek=False))
            data, has_bid[serial] = self.mapping(rtype, misc, rec)
            out.write(data)
            pos = off + size
        _copy_on(src, out, pf.data_offset + pf.data_size - pos)
        self.stats.samples = sc.cover.counts(sc.tally.samples, has_bid)

    def mapping(self, rtype: int, misc: int, rec: memoryview) -> tuple[bytes | memoryview, bool]:
        """A user-space MMAP/MMAP2 record as written to the output, and whether it carries a build-id."""
        st = self.stats
        m, had, trailer_at = parse_mmap(self.pf, rtype, rec)
        ours, why = self.index.match(m)
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
            self._carry(had.hex(), path, m.pid)
            return rec, True
        bogus = flag_without_build_id(rtype, misc, rec)
        st.flag_without_build_id += bogus
        if ours is None or len(ours) > 2 * MAX_BUILD_ID_BYTES:
            st.not_matched[why or TOO_LONG] += 1
            self.unmatched_paths.add(path)
            if bogus:       # what the kernel wrote is a dev/inode: say so
                return EVENT_HEADER.pack(rtype, misc & ~PERF_RECORD_MISC_MMAP_BUILD_ID, len(rec)) + \
                    bytes(rec[EVENT_HEADER.size:]), False
            return rec, False
        st.matched += 1
        self._carry(ours, path, m.pid)
        return with_build_id(self.pf, rtype, rec, bytes.fromhex(ours), trailer_at), True

    def _carry(self, bid: str, path: str, pid: int) -> None:
        self.carried.setdefault((bid, path), pid)


def parse_build_id_section(pf: PerfFile, raw: bytes) -> list[tuple[int, int, str, str, bytes]]:
    """HEADER_BUILD_ID entries as (misc, pid, build-id hex, filename, entry bytes) (header.c
    ``perf_header__read_build_ids``: a build-id of ``size`` bytes with PERF_RECORD_MISC_BUILD_ID_SIZE, else 20).

    Raises:
        PerfDataError: an entry with a size under 36 bytes or past the section's end.
    """
    out, at = [], 0
    while at < len(raw):
        if len(raw) - at < BUILD_ID_ENTRY.size:
            raise PerfDataError(f"{pf.path}: HEADER_BUILD_ID ends inside an entry")
        _t, misc, size, pid, bid, bsize, _r1, _r2 = BUILD_ID_ENTRY.unpack_from(raw, at)
        if size < BUILD_ID_ENTRY.size or size > len(raw) - at:
            raise PerfDataError(f"{pf.path}: HEADER_BUILD_ID entry of {size} bytes at {at} of {len(raw)}")
        n = bsize if misc & PERF_RECORD_MISC_BUILD_ID_SIZE and bsize <= MAX_BUILD_ID_BYTES else MAX_BUILD_ID_BYTES
        name = raw[at + BUILD_ID_ENTRY.size:at + size].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        out.append((misc, pid, bid[:n].hex(), name, raw[at:at + size]))
        at += size
    return out


def build_id_section(perf_entries: list, rw: _Rewriter, kernel_bid: str | None, header: dict) -> bytes:
    """The new HEADER_BUILD_ID: perf's kernel and module entries; perf's user-space entries for paths whose
    every mapping carries a build-id only when theirs is among those (the others are dropped: perf read the
    path after the profile, and the path held another build by then); then one entry per (build-id, path)
    the output's MMAP2 records carry.  The host kernel's from the session (kernel_bid) when perf wrote none;
    kernel_bid is ``None`` when the profile names another host or kernel release than the session."""
    kernel, user = [], []
    have = {(bid, path) for bid, path in rw.carried}
    carried_paths = {path for _bid, path in rw.carried}
    for misc, pid, bid, name, raw in perf_entries:
        if misc & PERF_RECORD_MISC_CPUMODE_MASK in (PERF_RECORD_MISC_KERNEL, PERF_RECORD_MISC_GUEST_KERNEL):
            kernel.append(raw)
        elif (bid, name) in have:
            continue                          # written below, with ours
        elif name in carried_paths and name not in rw.unmatched_paths:
            header["dropped_from_perf"] += 1
        else:
            header["kept_from_perf"] += 1
            user.append((bid, name, pid))
    if isinstance(kernel_bid, str) and not kernel and HEX_BUILD_ID.fullmatch(kernel_bid) and \
            len(kernel_bid) <= 2 * MAX_BUILD_ID_BYTES:
        kernel.append(build_id_entry(kernel_bid, KALLSYMS_DSO, True, HOST_KERNEL_ID))
        header["kernel_added"] = True
    user += [(bid, path, pid) for (bid, path), pid in rw.carried.items()]
    entries = kernel + user_build_id_entries(user)
    header["written"] = len(entries)
    return b"".join(entries)


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
        rw = _Rewriter(pf, index, stats)
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
        if raw is None or len(raw) < 4 or not session.get(key):
            continue
        text = raw[4:4 + struct.unpack_from("<I", raw)[0]].split(b"\0", 1)[0].decode("utf-8", "replace")
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
            bid_section = build_id_section(perf_entries, rw, kernel_bid, header)
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
            head = bytearray(_read(pf, src, 0, FILE_HEADER.size))
            struct.pack_into("<Q", head, 48, data_size)
            bitmap = list(struct.unpack_from("<4Q", head, 72))
            bitmap[HEADER_BUILD_ID // 64] |= 1 << (HEADER_BUILD_ID % 64)
            struct.pack_into("<4Q", head, 72, *bitmap)
            out.write(head)
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

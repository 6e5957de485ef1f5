"""Reading a perf.data file that ``perf record`` wrote, in bounded memory and bounded work.

The layout follows tools/perf/Documentation/perf.data-file-format.txt (and
tools/perf/util/header.h, header.c); every number the file gives is checked
against the file's size before it is used, so a truncated, corrupt or hostile
file gets a :class:`PerfDataError` naming the offset and the fault, never a
loop or an allocation its numbers choose.  Only the "file" form is read:
little-endian ``PERFILE2`` with a 104-byte ``perf_file_header`` (the pipe
form, a byte-swapped file and the directory form of ``perf record
--threads`` are refused with the reason).

Records (``struct perf_event_header {u32 type; u16 misc; u16 size}`` and a
body, include/uapi/linux/perf_event.h) are yielded from the data section as
``(offset, type, misc, memoryview)`` out of a buffer of :data:`READ_CHUNK_BYTES`
(a record is at most 65535 bytes).  Each record must have ``size >= 8`` and
end inside the data section.  PERF_RECORD_AUXTRACE (whose payload follows
outside ``size``) and PERF_RECORD_COMPRESSED (perf record -z) are refused.

With ``attr.sample_id_all`` every non-sample record ends with a ``sample_id``
trailer (``{u32 pid, tid}`` TID, ``{u64 time}`` TIME, ``{u64 id}`` ID,
``{u64 stream_id}`` STREAM_ID, ``{u32 cpu, res}`` CPU, ``{u64 id}``
IDENTIFIER, in that order): its size is :attr:`PerfFile.id_hdr_size`.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

from buildidd.errors import BuildiddError
from buildidd.offline.perfabi import (ATTR_FLAG_SAMPLE_ID_ALL, ATTR_FLAG_USE_CLOCKID, ATTR_HEAD, EVENT_HEADER,
                                      FILE_HEADER, MAX_RECORD_BYTES, PERF_ATTR_SIZE_VER0, PERF_EVENT_ATTR, PERF_MAGIC,
                                      PERF_MAGIC_SWAPPED, PERF_PIPE_HEADER_SIZE, PERF_RECORD_AUXTRACE,
                                      PERF_RECORD_COMPRESSED, PERF_RECORD_MISC_CPUMODE_MASK, PERF_RECORD_MISC_USER,
                                      PERF_RECORD_SAMPLE, PERF_SAMPLE_CPU, PERF_SAMPLE_ID, PERF_SAMPLE_IDENTIFIER,
                                      PERF_SAMPLE_STREAM_ID, PERF_SAMPLE_TID, PERF_SAMPLE_TIME, SECTION, feature_bits)

_CLOCKID = struct.Struct("<i")     #: perf_event_attr.clockid (s32)
_U64 = struct.Struct("<Q")
_CLOCKID_AT = PERF_EVENT_ATTR.offset_of("clockid")
_ALL_TYPES = range(1 << 32)        #: every u32 record type (walk()'s wanted=None)
FLUSH = -1                          #: walk()'s pseudo record type: the collected samples want emptying
_IP_PID = struct.Struct("<QI")      #: PERF_SAMPLE_IP then PERF_SAMPLE_TID's pid

#: Bytes read from the data section at a time (records are cut out of this buffer).
READ_CHUNK_BYTES = 4 << 20
#: perf_file_attr entries accepted (perf record opens one per event).
MAX_ATTRS = 4096
#: Event ids accepted over all attrs (one per event per CPU or thread).
MAX_IDS = 1 << 22
#: Largest perf_event_attr accepted (the kernel's is 136 bytes in 6.x; PAGE_SIZE is its own limit).
MAX_ATTR_BYTES = 4096


class PerfDataError(BuildiddError):
    """The perf.data file is truncated, corrupt, or of a form not supported (message: path, offset, fault)."""


@dataclass(frozen=True)
class Attr:
    """One event's perf_event_attr as far as inject needs it (include/uapi/linux/perf_event.h).

    Attributes:
        sample_type: PERF_SAMPLE_* bits.
        sample_id_all: non-sample records carry a sample_id trailer.
        clockid: the clock of the event's times when attr.use_clockid is set
            (e.g. 7, CLOCK_BOOTTIME with ``perf record -k boottime``), else ``None``
            (perf_clock: the kernel's local_clock, no reference in the file).
        ids: the event ids of this attr (perf_file_attr.ids).
    """

    sample_type: int
    sample_id_all: bool
    clockid: int | None
    ids: tuple[int, ...]


@dataclass
class Tally:
    """Records :meth:`PerfFile.walk` stepped over: all of them, and the PERF_RECORD_SAMPLEs among them."""

    records: int = 0
    samples: int = 0


@dataclass
class Copy:
    """What :meth:`PerfFile.walk` does with the records it steps over (see there).

    Attributes:
        out: a binary file the records not yielded are written to.
        samples: ``(ip, pid)`` of user-space samples are appended here (``None``: not collected).
        ip_at: byte offset of a sample's ip in its record (PERF_SAMPLE_IDENTIFIER puts an id before it).
        cap: length of samples at which FLUSH is yielded.
    """

    out: object
    samples: list | None = None
    ip_at: int = 0
    cap: int = 1 << 20


def id_hdr_size(sample_type: int) -> int:
    """Bytes of the sample_id trailer for that sample_type (perf's evsel id_hdr_size)."""
    bits = (PERF_SAMPLE_TID, PERF_SAMPLE_TIME, PERF_SAMPLE_ID, PERF_SAMPLE_STREAM_ID, PERF_SAMPLE_CPU,
            PERF_SAMPLE_IDENTIFIER)
    return 8 * sum(1 for b in bits if sample_type & b)


@dataclass
class PerfFile:
    """The header of a perf.data file, checked (see module doc).

    Attributes:
        path: the file.
        size: its size, bytes.
        data_offset, data_size: the data section (bytes).
        features: set feature bit → (offset, size) of its section, in bit order.
        attrs: the events.
        id_hdr_size: bytes of the sample_id trailer of non-sample records (0 without sample_id_all).
        time_at: offset of ``time`` inside that trailer, or ``None`` when it has none.
    """

    path: str
    size: int
    data_offset: int
    data_size: int
    features: dict[int, tuple[int, int]]
    attrs: list[Attr]
    id_hdr_size: int
    time_at: int | None

    @property
    def clockid(self) -> int | None:
        """The clock all events share through attr.use_clockid, else ``None``."""
        ids = {a.clockid for a in self.attrs}
        return ids.pop() if len(ids) == 1 else None

    def fail(self, offset: int, what: str) -> PerfDataError:
        """A PerfDataError naming this file and a byte offset in it."""
        return PerfDataError(f"{self.path}: corrupt perf.data at byte {offset}: {what}")

    @classmethod
    def open(cls, path: str | os.PathLike, f) -> PerfFile:
        """Read and check the header, attrs and feature index of the open file f (binary, seekable).

        Raises:
            PerfDataError: not a perf.data file of the supported form, or a size or offset
                that points outside the file.
        """
        path = os.fspath(path)
        size = os.fstat(f.fileno()).st_size
        raw = _read_at(f, 0, FILE_HEADER.size)
        if raw[:8] == PERF_MAGIC_SWAPPED:
            raise PerfDataError(f"{path}: a big-endian perf.data (recorded on another byte order); not supported")
        if raw[:8] != PERF_MAGIC:
            raise PerfDataError(f"{path}: not a perf.data file (no PERFILE2 magic)")
        at = FILE_HEADER.offset_of
        if len(raw) < PERF_PIPE_HEADER_SIZE:
            raise PerfDataError(f"{path}: truncated perf.data ({size} bytes)")
        if _U64.unpack_from(raw, at("size"))[0] == PERF_PIPE_HEADER_SIZE:
            raise PerfDataError(f"{path}: a pipe-mode perf.data (perf record -o -); record to a file, "
                                "or convert it with 'perf inject -i IN -o OUT'")
        if len(raw) < FILE_HEADER.size:
            raise PerfDataError(f"{path}: truncated perf.data ({size} bytes, the header alone is "
                                f"{FILE_HEADER.size})")
        h = FILE_HEADER.fields_from(raw)
        attr_size, a_off, a_size, d_off, d_size = h.attr_size, h.attrs_offset, h.attrs_size, h.data_offset, h.data_size
        pf = cls(path, size, d_off, d_size, {}, [], 0, None)
        if h.size != FILE_HEADER.size:
            raise pf.fail(at("size"), f"header size {h.size}, expected {FILE_HEADER.size}")
        if not FILE_HEADER.size <= d_off <= size or d_size > size - d_off:
            raise pf.fail(at("data_offset"), f"data section [{d_off}, +{d_size}) outside the file of {size} bytes "
                                             "(truncated, or perf record did not finish)")
        if not PERF_ATTR_SIZE_VER0 + SECTION.size <= attr_size <= MAX_ATTR_BYTES + SECTION.size:
            raise pf.fail(at("attr_size"), f"attr_size {attr_size} out of range")
        if a_size % attr_size or not 0 < a_size // attr_size <= MAX_ATTRS or not _within(a_off, a_size, d_off):
            raise pf.fail(at("attrs_offset"), f"attrs section [{a_off}, +{a_size}) is not whole attrs of "
                                              f"{attr_size} bytes before the data")
        pf.attrs = _read_attrs(pf, f, a_off, a_size // attr_size, attr_size)
        pf.features = _read_feature_index(pf, f, h.adds_features)
        first = pf.attrs[0]
        if any(a.sample_id_all != first.sample_id_all or (a.sample_id_all and id_hdr_size(a.sample_type)
               != id_hdr_size(first.sample_type)) for a in pf.attrs):
            raise PerfDataError(f"{path}: events disagree on their sample_id trailer; not supported")
        if first.sample_id_all:
            pf.id_hdr_size = id_hdr_size(first.sample_type)
            if first.sample_type & PERF_SAMPLE_TIME:
                pf.time_at = 8 if first.sample_type & PERF_SAMPLE_TID else 0
        return pf

    def records(self, f) -> Iterator[tuple[int, int, int, memoryview]]:
        """Yield ``(file offset, type, misc, record bytes)`` for every record of the data section, in file order
        (:meth:`walk` with every type wanted).

        Raises:
            PerfDataError: as :meth:`walk`.
        """
        yield from self.walk(f, None, Tally())

    def walk(self, f, wanted: frozenset[int] | None, tally: Tally,
             copy: Copy | None = None) -> Iterator[tuple[int, int, int, memoryview | None]]:
        """Yield ``(file offset, type, misc, record bytes)`` for the records of the data section whose type is in
        wanted (every record when ``None``), in file order; count all of them in tally.

        The others are stepped over in a tight loop; with copy, they are written to ``copy.out`` in runs (a
        yielded record is the caller's to write: as it is, or changed), and the ``(ip, pid)`` of each user-space
        PERF_RECORD_SAMPLE is appended to ``copy.samples`` (ip at byte ``copy.ip_at``, pid after it); when that
        list reaches ``copy.cap``, ``(offset, FLUSH, 0, None)`` is yielded for the caller to empty it.  A yielded
        memoryview is valid until the next record is asked for.

        Raises:
            PerfDataError: a record with size < 8, or one that runs past the end of the data section; the file
                shorter than its data section; AUXTRACE or COMPRESSED records (not supported).
        """
        end = self.data_offset + self.data_size
        base = self.data_offset         # file offset of buf[0]
        f.seek(base)
        buf, view, at, run = b"", memoryview(b""), 0, 0
        unpack = EVENT_HEADER.unpack_from
        out = copy.out if copy is not None else None
        samples = copy.samples if copy is not None and copy.samples is not None else None
        pid_ip = _IP_PID.unpack_from
        ip_at, cap = (copy.ip_at, copy.cap) if samples is not None else (0, 0)
        n = nsamples = 0
        sample_t, aux_t, compressed_t = PERF_RECORD_SAMPLE, PERF_RECORD_AUXTRACE, PERF_RECORD_COMPRESSED
        user, cpumode, max_rec = PERF_RECORD_MISC_USER, PERF_RECORD_MISC_CPUMODE_MASK, MAX_RECORD_BYTES
        if wanted is None:
            wanted = _ALL_TYPES
        try:
            while base + at < end:
                unread = end - base - len(buf)
                if unread:
                    if out is not None and run < at:
                        out.write(view[run:at])
                    more = f.read(min(READ_CHUNK_BYTES, unread))
                    if not more or len(more) < min(READ_CHUNK_BYTES, unread):
                        raise self.fail(end - unread, "file shorter than its data section (truncated)")
                    base += at
                    buf = buf[at:] + more
                    view = memoryview(buf)
                    at = run = 0
                    unread -= len(more)
                # Records starting before limit lie whole in buf (a record is at most MAX_RECORD_BYTES); after the
                # last read, buf ends where the data section does.
                blen = len(buf)
                limit = blen - max_rec if unread else blen
                while at < limit:
                    try:
                        rtype, misc, size = unpack(buf, at)
                    except struct.error:
                        raise self.fail(base + at, f"{blen - at} bytes left in the data section, less than a "
                                                   "record header") from None
                    if size < 8 or at + size > blen:
                        raise self.fail(base + at, f"record of type {rtype} with size {size} (data section ends "
                                                   f"at {end})")
                    n += 1
                    if rtype == sample_t:
                        nsamples += 1
                        if samples is not None and misc & cpumode == user and size >= ip_at + 12:
                            samples.append(pid_ip(buf, at + ip_at))
                            if len(samples) >= cap:
                                yield base + at, FLUSH, 0, None
                    elif rtype == aux_t:
                        raise PerfDataError(f"{self.path}: AUX area data (PERF_RECORD_AUXTRACE) is not supported")
                    elif rtype == compressed_t:
                        raise PerfDataError(f"{self.path}: compressed records (perf record -z) are not supported; "
                                            "decompress first: perf inject -i IN -o OUT")
                    if rtype in wanted:
                        if out is not None and run < at:
                            out.write(view[run:at])
                        yield base + at, rtype, misc, view[at:at + size]
                        run = at + size
                    at += size
            if out is not None and run < at:
                out.write(view[run:at])
        finally:
            tally.records += n
            tally.samples += nsamples

    def read_feature(self, f, bit: int, limit: int) -> bytes | None:
        """The bytes of feature section ``bit`` (``None`` when absent).

        Raises:
            PerfDataError: the section is larger than limit bytes, or the file ends inside it.
        """
        if bit not in self.features:
            return None
        off, size = self.features[bit]
        if size > limit:
            raise self.fail(off, f"feature {bit} of {size} bytes (more than {limit})")
        return _read_exact(self, f, off, size)


def _within(off: int, size: int, limit: int) -> bool:
    return 0 <= off and size <= limit and off <= limit - size


def _read_at(f, off: int, n: int) -> bytes:
    f.seek(off)
    return f.read(n)


def _read_exact(pf: PerfFile, f, off: int, n: int) -> bytes:
    data = _read_at(f, off, n)
    if len(data) != n:
        raise pf.fail(off, f"file ends inside a section of {n} bytes (truncated)")
    return data


def _read_attrs(pf: PerfFile, f, off: int, count: int, attr_size: int) -> list[Attr]:
    raw = _read_exact(pf, f, off, count * attr_size)
    attrs, total_ids = [], 0
    for i in range(count):
        base = i * attr_size
        head = ATTR_HEAD.fields_from(raw, base)
        size, sample_type, flags = head.size, head.sample_type, head.flags
        if size != attr_size - SECTION.size:
            raise pf.fail(off + base + ATTR_HEAD.offset_of("size"),
                          f"attr.size {size} disagrees with attr_size {attr_size}")
        clockid = None
        if flags & ATTR_FLAG_USE_CLOCKID and size >= _CLOCKID_AT + _CLOCKID.size:
            clockid = _CLOCKID.unpack_from(raw, base + _CLOCKID_AT)[0]
        ids_off, ids_size = SECTION.unpack_from(raw, base + size)
        if ids_size % 8 or not _within(ids_off, ids_size, pf.data_offset):
            raise pf.fail(off + base + size, f"ids section [{ids_off}, +{ids_size}) outside the header")
        total_ids += ids_size // 8
        if total_ids > MAX_IDS:
            raise pf.fail(off + base + size, f"more than {MAX_IDS} event ids")
        ids = struct.unpack(f"<{ids_size // 8}Q", _read_exact(pf, f, ids_off, ids_size)) if ids_size else ()
        attrs.append(Attr(sample_type, bool(flags & ATTR_FLAG_SAMPLE_ID_ALL), clockid, ids))
    return attrs


def _read_feature_index(pf: PerfFile, f, bitmap: tuple[int, ...]) -> dict[int, tuple[int, int]]:
    bits = feature_bits(bitmap)
    if not bits:
        return {}
    at = pf.data_offset + pf.data_size
    raw = _read_exact(pf, f, at, SECTION.size * len(bits))
    out = {}
    room = pf.size - at      # the features follow the data: together no larger than what follows it
    for i, bit in enumerate(bits):
        off, size = SECTION.unpack_from(raw, i * SECTION.size)
        if not _within(off, size, pf.size) or off < at or size > room:
            raise pf.fail(at + i * SECTION.size, f"feature {bit} section [{off}, +{size}) outside the "
                                                 f"{pf.size - at} bytes after the data section")
        room -= size
        out[bit] = (off, size)
    return out

"""The perf.data ABI: every record type, flag bit, feature bit and struct layout buildidd reads or writes.

One definition, each with its source; :mod:`~buildidd.offline.perffile` (reading), :mod:`~buildidd.offline.perfdata`
(``export --perf``) and :mod:`~buildidd.offline.inject` take them from here.  Two sources:

* the kernel ABI, include/uapi/linux/perf_event.h: ``struct perf_event_header``, ``struct perf_event_attr``,
  ``enum perf_event_type`` (PERF_RECORD_*), ``PERF_RECORD_MISC_*``, ``PERF_SAMPLE_*``;
  tests/offline/test_perfabi.py compiles a C file against the installed header and compares every value and
  offset here that it defines;
* perf's file format, tools/perf/util/header.h (``struct perf_file_header``, ``struct perf_file_section``,
  ``HEADER_*`` feature bits), tools/lib/perf/include/perf/event.h (``enum perf_user_event_type``, ``struct
  perf_record_header_build_id``) and tools/perf/Documentation/perf.data-file-format.txt; these headers are not
  installed, so perf itself checks them (tests/offline/test_perfdata.py and test_inject*.py read the files
  buildidd writes with ``perf buildid-list``, ``perf script`` and ``perf report``).

All integers are little-endian (x86_64, the order of the files read and written; a big-endian file is refused).
"""

from __future__ import annotations

import re
import struct
from collections import namedtuple


class Layout(struct.Struct):
    """A C struct's little-endian layout with named fields: a :class:`struct.Struct` (its ``unpack_from``
    and ``pack`` give and take the flat values) that also knows each field's name and byte offset.

    Args:
        c_name: the C struct it mirrors (for messages and docs).
        fields: ``(name, struct format)`` pairs in C order, e.g. ``("magic", "8s")``, ``("features", "4Q")``;
            a repeated non-string format (``"4Q"``) is one field holding a tuple.

    Raises:
        ValueError: a format that is not one struct code with an optional count.
    """

    def __init__(self, c_name: str, fields: tuple[tuple[str, str], ...]):
        super().__init__("<" + "".join(fmt for _, fmt in fields))
        self.c_name = c_name
        self.names = tuple(name for name, _ in fields)
        self._counts, self._offsets, at = [], {}, 0
        for name, fmt in fields:
            m = re.fullmatch(r"(\d*)([a-zA-Z?])", fmt)
            if m is None:
                raise ValueError(f"{c_name}.{name}: format {fmt!r} is not one struct code")
            n, code = int(m.group(1) or 1), m.group(2)
            self._offsets[name] = at
            at += struct.calcsize("<" + fmt)
            self._counts.append(1 if code in "sp" else n)
        self.Fields = namedtuple(c_name, self.names)

    def offset_of(self, name: str) -> int:
        """Byte offset of field name in the struct (offsetof).

        Raises:
            KeyError: no such field.
        """
        return self._offsets[name]

    def fields_from(self, buf, offset: int = 0):
        """The struct at buf[offset:] as a named tuple (a repeated field as a tuple).

        Raises:
            struct.error: buf too short.
        """
        flat, out, at = self.unpack_from(buf, offset), [], 0
        for n in self._counts:
            out.append(flat[at] if n == 1 else tuple(flat[at:at + n]))
            at += n
        return self.Fields(*out)

    def pack_fields(self, values) -> bytes:
        """The bytes of a named tuple (or sequence in field order) as :meth:`fields_from` gives it.

        Raises:
            struct.error: a value out of its field's range, or a repeated field of the wrong length.
        """
        flat = []
        for n, v in zip(self._counts, values, strict=True):
            flat.extend(v if n != 1 else (v,))
        return self.pack(*flat)


# -- include/uapi/linux/perf_event.h -------------------------------------------------------------------------

#: struct perf_event_header, the head of every record and of each HEADER_BUILD_ID entry.
EVENT_HEADER = Layout("perf_event_header", (("type", "I"), ("misc", "H"), ("size", "H")))
#: Largest record: perf_event_header.size is a u16.
MAX_RECORD_BYTES = 0xFFFF

PERF_ATTR_SIZE_VER0 = 64                     #: the first published perf_event_attr
PERF_ATTR_SIZE_VER7 = 128                    #: up to sig_data (the size export writes)
_ATTR_FIELDS = (
    ("type", "I"), ("size", "I"), ("config", "Q"), ("sample_period", "Q"), ("sample_type", "Q"),
    ("read_format", "Q"), ("flags", "Q"), ("wakeup_events", "I"), ("bp_type", "I"), ("config1", "Q"),
    ("config2", "Q"), ("branch_sample_type", "Q"), ("sample_regs_user", "Q"), ("sample_stack_user", "I"),
    ("clockid", "i"), ("sample_regs_intr", "Q"), ("aux_watermark", "I"), ("sample_max_stack", "H"),
    ("reserved_2", "H"), ("aux_sample_size", "I"), ("reserved_3", "I"), ("sig_data", "Q"))
#: struct perf_event_attr as of PERF_ATTR_SIZE_VER7; ``flags`` is the u64 of bit-fields (disabled, inherit, ...).
PERF_EVENT_ATTR = Layout("perf_event_attr", _ATTR_FIELDS)
#: perf_event_attr up to its flags: what every version has (a reader takes any size from VER0 on).
ATTR_HEAD = Layout("perf_event_attr_head", _ATTR_FIELDS[:7])

# perf_event_attr.flags bits, in the order of the bit-fields (disabled is bit 0).
ATTR_FLAG_MMAP, ATTR_FLAG_COMM, ATTR_FLAG_TASK = 1 << 8, 1 << 9, 1 << 13
ATTR_FLAG_SAMPLE_ID_ALL, ATTR_FLAG_MMAP2, ATTR_FLAG_COMM_EXEC = 1 << 18, 1 << 23, 1 << 24
ATTR_FLAG_USE_CLOCKID, ATTR_FLAG_BUILD_ID = 1 << 25, 1 << 34

PERF_TYPE_SOFTWARE, PERF_COUNT_SW_DUMMY = 1, 9                  # enum perf_type_id, enum perf_sw_ids

# enum perf_event_sample_format.
PERF_SAMPLE_IP, PERF_SAMPLE_TID, PERF_SAMPLE_TIME = 1 << 0, 1 << 1, 1 << 2
PERF_SAMPLE_ID, PERF_SAMPLE_CPU, PERF_SAMPLE_STREAM_ID = 1 << 6, 1 << 7, 1 << 9
PERF_SAMPLE_IDENTIFIER = 1 << 16

# enum perf_event_type.
PERF_RECORD_MMAP, PERF_RECORD_COMM, PERF_RECORD_EXIT, PERF_RECORD_FORK = 1, 3, 4, 7
PERF_RECORD_SAMPLE, PERF_RECORD_MMAP2 = 9, 10

# perf_event_header.misc.
PERF_RECORD_MISC_CPUMODE_MASK = 7
PERF_RECORD_MISC_KERNEL, PERF_RECORD_MISC_USER, PERF_RECORD_MISC_GUEST_KERNEL = 1, 2, 4
PERF_RECORD_MISC_MMAP_DATA = 1 << 13         #: on MMAP/MMAP2: a data (not executable) mapping
PERF_RECORD_MISC_COMM_EXEC = 1 << 13         #: on COMM: the name changed by exec (same bit, other record)
PERF_RECORD_MISC_MMAP_BUILD_ID = 1 << 14     #: on MMAP2: the union holds a build-id, not maj/min/ino
PERF_RECORD_MISC_BUILD_ID_SIZE = 1 << 15     #: on a HEADER_BUILD_ID entry: its ``size`` byte is valid

#: PERF_RECORD_MMAP's fixed part after perf_event_header (then ``char filename[]``).
MMAP_HEAD = Layout("perf_record_mmap_head", (("pid", "I"), ("tid", "I"), ("start", "Q"), ("len", "Q"),
                                              ("pgoff", "Q")))
#: PERF_RECORD_MMAP2's union, dev/inode form.
MMAP2_ID = Layout("perf_record_mmap2_id", (("maj", "I"), ("min", "I"), ("ino", "Q"), ("ino_generation", "Q")))
#: PERF_RECORD_MMAP2's union, build-id form (PERF_RECORD_MISC_MMAP_BUILD_ID).
MMAP2_BUILD_ID = Layout("perf_record_mmap2_build_id", (("build_id_size", "B"), ("res0", "B"), ("res1", "H"),
                                                       ("build_id", "20s")))
#: PERF_RECORD_MMAP2's prot and flags (after the union, before the filename).
MMAP2_PROT_FLAGS = Layout("perf_record_mmap2_prot", (("prot", "I"), ("flags", "I")))
#: PERF_RECORD_MMAP2's fixed part after perf_event_header (the union as 24 bytes).
MMAP2_BODY = Layout("perf_record_mmap2_body", (
    ("pid", "I"), ("tid", "I"), ("addr", "Q"), ("len", "Q"), ("pgoff", "Q"), ("union", "24s"), ("prot", "I"),
    ("flags", "I")))
#: Where the filename starts in a PERF_RECORD_MMAP and in a PERF_RECORD_MMAP2 (from the record's first byte).
MMAP_NAME_AT = EVENT_HEADER.size + MMAP_HEAD.size
MMAP2_NAME_AT = EVENT_HEADER.size + MMAP2_BODY.size
#: Where an MMAP2's union starts (from the record's first byte).
MMAP2_UNION_AT = EVENT_HEADER.size + MMAP2_BODY.offset_of("union")
#: PERF_RECORD_FORK / PERF_RECORD_EXIT body.
TASK_BODY = Layout("perf_record_fork", (("pid", "I"), ("ppid", "I"), ("tid", "I"), ("ptid", "I"), ("time", "Q")))
#: PERF_RECORD_COMM's fixed part (then ``char comm[]``).
COMM_HEAD = Layout("perf_record_comm_head", (("pid", "I"), ("tid", "I")))
#: The sample_id trailer of sample_id_all with PERF_SAMPLE_TID | PERF_SAMPLE_TIME (what export writes).
SAMPLE_ID_TID_TIME = Layout("sample_id", (("pid", "I"), ("tid", "I"), ("time", "Q")))

BUILD_ID_SIZE = 20                           #: bytes of a build-id a record or HEADER_BUILD_ID entry holds
TASK_COMM_LEN = 16                           #: a comm's bytes with its NUL (include/linux/sched.h)

# -- tools/lib/perf/include/perf/event.h, tools/perf/util/header.h ----------------------------------------------

# enum perf_user_event_type: records perf itself writes.
PERF_RECORD_FINISHED_ROUND, PERF_RECORD_AUXTRACE, PERF_RECORD_COMPRESSED = 68, 71, 81

PERF_MAGIC = b"PERFILE2"                     #: header.c __perf_magic2 (little-endian file)
PERF_MAGIC_SWAPPED = b"2ELIFREP"             #: the same magic written on a big-endian host
PERF_PIPE_HEADER_SIZE = 16                   #: perf_pipe_file_header: magic and size only

#: struct perf_file_section.
SECTION = Layout("perf_file_section", (("offset", "Q"), ("size", "Q")))
#: struct perf_file_header (the sections attrs, data and event_types inline); adds_features is the
#: 256-bit feature bitmap (HEADER_FEAT_BITS) as four u64.
FILE_HEADER = Layout("perf_file_header", (
    ("magic", "8s"), ("size", "Q"), ("attr_size", "Q"), ("attrs_offset", "Q"), ("attrs_size", "Q"),
    ("data_offset", "Q"), ("data_size", "Q"), ("event_types_offset", "Q"), ("event_types_size", "Q"),
    ("adds_features", "4Q")))
HEADER_FEAT_BITS = 256

# enum HEADER_* feature bits.
HEADER_BUILD_ID, HEADER_HOSTNAME, HEADER_OSRELEASE = 2, 3, 4

#: struct perf_record_header_build_id: one HEADER_BUILD_ID entry before its filename.
BUILD_ID_ENTRY = Layout("perf_record_header_build_id", (
    ("type", "I"), ("misc", "H"), ("size", "H"), ("pid", "i"), ("build_id", "20s"), ("build_id_size", "B"),
    ("res0", "B"), ("res1", "H")))
#: struct perf_header_string's head (HEADER_HOSTNAME, HEADER_OSRELEASE): ``u32 len`` then ``char str[len]``.
HEADER_STRING = Layout("perf_header_string", (("len", "I"),))
NAME_ALIGN = 64                              #: header.h: filenames in features are padded to this
HOST_KERNEL_ID = -1                          #: machine.h: a HEADER_BUILD_ID entry's pid for the host

# -- include/uapi/linux/time.h, include/uapi/asm-generic/mman-common.h ----------------------------------------

CLOCK_BOOTTIME = 7
PROT_READ, PROT_EXEC, MAP_PRIVATE = 1, 4, 2


def set_feature(bitmap: tuple[int, ...], bit: int) -> tuple[int, ...]:
    """adds_features (four u64) with feature bit set (header.c ``perf_header__set_feat``)."""
    words = list(bitmap)
    words[bit // 64] |= 1 << (bit % 64)
    return tuple(words)


def feature_bits(bitmap: tuple[int, ...]) -> list[int]:
    """The feature bits set in adds_features, in bit order (the order of the feature index)."""
    return [b for b in range(HEADER_FEAT_BITS) if bitmap[b // 64] >> (b % 64) & 1]

"""The raw BTF blob: header, type records, string section and name indexes.

The parser under :class:`~buildidd.kernel.btf.Btf` (which answers the
questions: offsets, sizes, enumerators).  It follows the raw BTF format of
the kernel's Documentation/bpf/btf.rst and include/uapi/linux/btf.h:

* ``struct btf_header`` (24 bytes): magic 0xeB9F, version 1, flags, hdr_len,
  then type_off/type_len and str_off/str_len, both offsets in bytes relative to
  the end of the header (``hdr_len``).
* the type section: ``struct btf_type`` records (name_off, info, size|type;
  12 bytes) numbered from type id 1 (id 0 is ``void``), each followed by
  kind-specific data whose length depends on the kind and on ``vlen``.
* the string section: NUL-terminated names; offset 0 is the empty string.

Loading walks the type section once, keeping only the byte position of each
record and a name index for STRUCT, UNION, TYPEDEF, ENUM, ENUM64 and INT; every
other question (members, array lengths, enumerators) is answered by decoding the
few records it touches.  Every type id and string offset is bounds-checked and
every chain of references is depth-capped, so a corrupt file raises
:class:`~buildidd.errors.BtfError`, never ``IndexError`` or a hang.

Only little-endian BTF is read (x86_64 and arm64); big-endian BTF is rejected.
"""

from __future__ import annotations

import bisect
import struct
from typing import Self

from buildidd.errors import BtfError

__all__ = ["BtfBlob", "MAX_BTF_BYTES", "MAX_RESOLVE_DEPTH", "VMLINUX_BTF_PATH"]

#: Where the kernel exposes its own BTF (CONFIG_DEBUG_INFO_BTF, sysfs).
VMLINUX_BTF_PATH = "/sys/kernel/btf/vmlinux"

#: Largest BTF file :meth:`BtfBlob.load` reads, in bytes.  vmlinux BTF is a few
#: MB (docs/performance-history.md, 'BTF'); the cap only bounds a runaway read.
MAX_BTF_BYTES = 256 * 1024 * 1024

#: Longest chain of TYPEDEF/CONST/VOLATILE/RESTRICT/TYPE_TAG links, nested
#: ARRAY element types, or anonymous struct/union members followed before the
#: file is declared corrupt (a cycle would otherwise never end).
MAX_RESOLVE_DEPTH = 32

# include/uapi/linux/btf.h: BTF_MAGIC, BTF_VERSION, BTF_MAX_TYPE.
_BTF_MAGIC = 0xEB9F
_BTF_VERSION = 1
_BTF_MAX_TYPE = 0xFFFFF

_HEADER = struct.Struct("<HBBIIIII")  # struct btf_header, 24 bytes
_TYPE = struct.Struct("<III")  # struct btf_type: name_off, info, size|type
_U32 = struct.Struct("<I")
BTF_ARRAY = struct.Struct("<III")  # struct btf_array: type, index_type, nelems
_MEMBER = struct.Struct("<III")  # struct btf_member: name_off, type, offset
BTF_ENUM = struct.Struct("<Ii")  # struct btf_enum: name_off, val
BTF_ENUM64 = struct.Struct("<III")  # struct btf_enum64: name_off, val_lo32, val_hi32

# BTF_KIND_* (include/uapi/linux/btf.h).
KIND_INT = 1
KIND_PTR = 2
KIND_ARRAY = 3
KIND_STRUCT = 4
KIND_UNION = 5
KIND_ENUM = 6
KIND_FWD = 7
KIND_TYPEDEF = 8
KIND_VOLATILE = 9
KIND_CONST = 10
KIND_RESTRICT = 11
KIND_FUNC = 12
KIND_FUNC_PROTO = 13
KIND_VAR = 14
KIND_DATASEC = 15
KIND_FLOAT = 16
KIND_DECL_TAG = 17
KIND_TYPE_TAG = 18
KIND_ENUM64 = 19

KIND_NAMES = (
    "UNKN", "INT", "PTR", "ARRAY", "STRUCT", "UNION", "ENUM", "FWD", "TYPEDEF",
    "VOLATILE", "CONST", "RESTRICT", "FUNC", "FUNC_PROTO", "VAR", "DATASEC",
    "FLOAT", "DECL_TAG", "TYPE_TAG", "ENUM64",
)

# Bytes that follow a struct btf_type, per kind: fixed part + vlen * per-entry
# part (btf.rst section 2.2).  None marks a kind this reader does not know.
_EXTRA_FIXED = (
    None,  # 0 UNKN: invalid in a type section
    4,     # INT: u32 encoding | offset << 16 | bits
    0,     # PTR
    12,    # ARRAY: struct btf_array
    0, 0,  # STRUCT, UNION: members only
    0,     # ENUM: enumerators only
    0, 0, 0, 0, 0, 0,  # FWD, TYPEDEF, VOLATILE, CONST, RESTRICT, FUNC
    0,     # FUNC_PROTO: params only
    4,     # VAR: struct btf_var (linkage)
    0,     # DATASEC: var_secinfo only
    0,     # FLOAT
    4,     # DECL_TAG: struct btf_decl_tag (component_idx)
    0,     # TYPE_TAG
    0,     # ENUM64: enumerators only
)
_EXTRA_PER_VLEN = (
    0, 0, 0, 0,
    12, 12,  # STRUCT, UNION: struct btf_member
    8,       # ENUM: struct btf_enum
    0, 0, 0, 0, 0, 0,
    8,       # FUNC_PROTO: struct btf_param
    0,
    12,      # DATASEC: struct btf_var_secinfo
    0, 0, 0,
    12,      # ENUM64: struct btf_enum64
)

# Kinds whose names are indexed at load time, by namespace.
NS_STRUCT = "struct/union"
NS_TYPEDEF = "typedef"
NS_ENUM = "enum"
NS_INT = "int"
_INDEXED_NS = {
    KIND_STRUCT: NS_STRUCT,
    KIND_UNION: NS_STRUCT,
    KIND_TYPEDEF: NS_TYPEDEF,
    KIND_ENUM: NS_ENUM,
    KIND_ENUM64: NS_ENUM,
    KIND_INT: NS_INT,
}
_INDEXED = tuple(k in _INDEXED_NS for k in range(len(KIND_NAMES)))

# Kinds that only qualify or rename another type (size|type field is a type id).
_MODIFIERS = frozenset(
    (KIND_TYPEDEF, KIND_VOLATILE, KIND_CONST, KIND_RESTRICT, KIND_TYPE_TAG)
)
_SIZED = frozenset(
    (KIND_INT, KIND_STRUCT, KIND_UNION, KIND_ENUM, KIND_ENUM64, KIND_FLOAT)
)


def _fail(source: str, message: str) -> BtfError:
    return BtfError(f"{source}: {message}")


def _sections(data: bytes, source: str) -> tuple[int, int, int, int]:
    """``(type_start, type_end, str_start, str_len)`` in bytes from the start of
    ``data``, from a checked ``struct btf_header``; ``source`` names the blob in errors.

    Raises:
        BtfError: bad magic, version or flags, big-endian BTF, a section past
            the end of the data, misaligned or overlapping sections, or a string
            section that does not start and end with NUL.
    """
    size = len(data)
    if size < _HEADER.size:
        raise _fail(source, f"truncated: {size} bytes, struct btf_header needs {_HEADER.size}")
    if data[0:2] == b"\xeb\x9f":
        raise _fail(source, "big-endian BTF is not supported")
    (magic, version, flags, hdr_len,
     type_off, type_len, str_off, str_len) = _HEADER.unpack_from(data, 0)
    if magic != _BTF_MAGIC:
        raise _fail(source, f"bad magic {magic:#06x}, expected {_BTF_MAGIC:#06x}")
    if version != _BTF_VERSION:
        raise _fail(source, f"unsupported BTF version {version}")
    if flags != 0:
        raise _fail(source, f"unsupported header flags {flags:#x}")
    if hdr_len < _HEADER.size or hdr_len > size:
        raise _fail(source, f"hdr_len {hdr_len} outside [{_HEADER.size}, {size}]")
    type_start = hdr_len + type_off
    type_end = type_start + type_len
    str_start = hdr_len + str_off
    str_end = str_start + str_len
    if type_end > size:
        raise _fail(source,
                    f"type section [{type_start}, {type_end}) past end of file ({size} bytes)")
    if str_end > size:
        raise _fail(source,
                    f"string section [{str_start}, {str_end}) past end of file ({size} bytes)")
    if type_off % 4 or type_len % 4:
        raise _fail(source, "type section not 4-byte aligned")
    if type_start < str_end and str_start < type_end:
        raise _fail(source, "type and string sections overlap")
    if str_len == 0 or data[str_start] != 0 or data[str_end - 1] != 0:
        raise _fail(source, "string section must start with the empty string and end with NUL")
    return type_start, type_end, str_start, str_len


class BtfBlob:
    """One raw BTF blob, parsed and indexed, with its record decoders.

    Construct with :meth:`load` (a file) or ``BtfBlob(data)`` (bytes already
    read).  The constructor walks the type section once (the position of each
    record, a name index per C namespace); the ``_``-methods decode single
    records on demand.  :class:`~buildidd.kernel.btf.Btf` adds the queries.

    Raises:
        BtfError: from the constructor when the blob is not valid little-endian
            BTF version 1 (bad header, section out of the file, a record running
            past its section, an unknown kind, a name offset out of the string
            section), and from the decoders when a reference inside the blob is
            out of bounds or cyclic.
    """

    __slots__ = ("source", "_data", "_str_start", "_str_len", "_offsets",
                 "_index", "_dups", "_ptr_size")

    def __init__(self, data: bytes, source: str = "<bytes>"):
        """Parse ``data``, a complete raw BTF blob; ``source`` names it in errors."""
        self.source = source
        self._data = bytes(data)
        self._parse()

    @classmethod
    def load(cls, path: str = VMLINUX_BTF_PATH) -> Self:
        """Read and parse the raw BTF file at ``path`` (at most MAX_BTF_BYTES).

        Raises:
            BtfError: the file cannot be read, is larger than MAX_BTF_BYTES, or
                is not valid BTF.
        """
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_BTF_BYTES + 1)
        except OSError as e:
            raise BtfError(f"cannot read BTF {path}: {e.strerror or e}") from e
        if len(data) > MAX_BTF_BYTES:
            raise BtfError(f"{path}: BTF larger than {MAX_BTF_BYTES} bytes")
        return cls(data, source=path)

    # ----------------------------------------------------------------- parsing

    def _fail(self, message: str) -> BtfError:
        return _fail(self.source, message)

    def _parse(self) -> None:
        data = self._data
        type_start, type_end, str_start, str_len = _sections(data, self.source)
        self._str_start = str_start
        self._str_len = str_len

        # One pass over the type section: the byte position of every record and
        # the ids of records whose names are indexed.  Kept deliberately flat:
        # this loop runs once per type, over a hundred thousand for vmlinux.
        offsets = [-1]  # type id 0 is void and has no record
        append = offsets.append
        named = []
        add_named = named.append
        unpack = _TYPE.unpack_from
        fixed = _EXTRA_FIXED
        per_vlen = _EXTRA_PER_VLEN
        indexed = _INDEXED
        nkinds = len(fixed)
        off = type_start
        while off < type_end:
            if off + 12 > type_end:
                raise self._fail(
                    f"type id {len(offsets)}: record at byte {off} runs past the type section")
            name_off, info, _ = unpack(data, off)
            kind = (info >> 24) & 0x1F
            if kind >= nkinds or kind == 0:
                raise self._fail(f"type id {len(offsets)}: unknown kind {kind}")
            if name_off >= str_len:
                raise self._fail(
                    f"type id {len(offsets)}: name offset {name_off} outside string "
                    f"section ({str_len} bytes)")
            if name_off and indexed[kind]:
                add_named(len(offsets))
            append(off)
            off += 12 + fixed[kind] + (info & 0xFFFF) * per_vlen[kind]
        if off != type_end:
            raise self._fail(
                f"type id {len(offsets) - 1}: record runs past the type section")
        if len(offsets) - 1 > _BTF_MAX_TYPE:
            raise self._fail(f"{len(offsets) - 1} types, more than BTF_MAX_TYPE")
        self._offsets = offsets
        self._index_names(named)

    def _index_names(self, named: list[int]) -> None:
        """The name index (namespace → name → first type id) of the named records, their
        duplicates, and the pointer size."""
        data, offsets, unpack = self._data, self._offsets, _TYPE.unpack_from
        index: dict[str, dict[str, int]] = {ns: {} for ns in set(_INDEXED_NS.values())}
        dups: dict[tuple[str, str], list[int]] = {}
        name_of = self._name
        for tid in named:
            off = offsets[tid]
            name_off, info, _ = unpack(data, off)
            ns = _INDEXED_NS[(info >> 24) & 0x1F]
            name = name_of(name_off)
            table = index[ns]
            first = table.setdefault(name, tid)
            if first != tid:
                dups.setdefault((ns, name), [first]).append(tid)
        self._index = index
        self._dups = dups

        # BTF records no pointer size; like libbpf's btf__pointer_size(), take
        # it from the C "long" type.  8 on x86_64 and arm64.
        self._ptr_size = 8
        for long_name in ("long unsigned int", "long int"):
            tid = index[NS_INT].get(long_name)
            if tid is not None:
                self._ptr_size = self._record(tid)[4]
                break

    # ------------------------------------------------------------ raw records

    def _name(self, name_off: int) -> str:
        """The string at ``name_off`` in the string section ('' for 0)."""
        if not 0 <= name_off < self._str_len:
            raise self._fail(
                f"string offset {name_off} outside string section ({self._str_len} bytes)")
        start = self._str_start + name_off
        end = self._data.index(b"\0", start)  # the section ends with NUL
        try:
            return self._data[start:end].decode("utf-8")
        except UnicodeDecodeError as e:
            raise self._fail(f"string at offset {name_off} is not UTF-8") from e

    def _record(self, tid: int) -> tuple[int, int, int, int, int, int]:
        """``(kind, kind_flag, vlen, name_off, size_or_type, offset)`` of type ``tid``.

        ``offset`` is the byte position of the kind-specific data after the
        struct btf_type.  Raises BtfError for void (0) or an id out of range.
        """
        if not 0 < tid < len(self._offsets):
            if tid == 0:
                raise self._fail("reference to void (type id 0) where a type is needed")
            raise self._fail(
                f"type id {tid} out of range (1..{len(self._offsets) - 1})")
        off = self._offsets[tid]
        name_off, info, size_or_type = _TYPE.unpack_from(self._data, off)
        return ((info >> 24) & 0x1F, info >> 31, info & 0xFFFF,
                name_off, size_or_type, off + 12)

    def _describe(self, tid: int) -> str:
        kind, _, _, name_off, _, _ = self._record(tid)
        name = self._name(name_off) or "(anon)"
        return f"{KIND_NAMES[kind]} '{name}' [id {tid}]"

    def _strip(self, tid: int) -> int:
        """Follow TYPEDEF/CONST/VOLATILE/RESTRICT/TYPE_TAG links from ``tid``.

        Returns the first type id of another kind (0 for void).  Raises BtfError
        after MAX_RESOLVE_DEPTH links (a cycle) or on an id out of range.
        """
        for _ in range(MAX_RESOLVE_DEPTH):
            if tid == 0:
                return 0
            kind, _, _, _, ref, _ = self._record(tid)
            if kind not in _MODIFIERS:
                return tid
            tid = ref
        raise self._fail(
            f"type id {tid}: more than {MAX_RESOLVE_DEPTH} typedef/qualifier links (cycle?)")

    def _members(self, tid: int):
        """Yield ``(name_off, type_id, bit_offset, bitfield_size_bits)`` of a STRUCT/UNION.

        Source: struct btf_member; with kind_flag set the member's ``offset``
        carries the bitfield size in bits 24-31 and the bit offset in bits 0-23.
        """
        kind, kflag, vlen, _, _, off = self._record(tid)
        if kind not in (KIND_STRUCT, KIND_UNION):
            raise self._fail(f"{self._describe(tid)} is not a struct or union")
        data = self._data
        unpack = _MEMBER.unpack_from
        for i in range(vlen):
            name_off, mtype, moff = unpack(data, off + 12 * i)
            if kflag:
                yield name_off, mtype, moff & 0xFFFFFF, moff >> 24
            else:
                yield name_off, mtype, moff, 0

    def _int_bitfield(self, mtype: int) -> tuple[int, int]:
        """``(bit offset within the int, size in bits)`` when a member of a
        kind_flag=0 struct is a bitfield, else ``(0, 0)``.

        Without kind_flag the bitfield is encoded in the member's INT type:
        a non-zero BTF_INT_OFFSET or BTF_INT_BITS smaller than the int's size.
        """
        tid = self._strip(mtype)
        if tid == 0:
            return 0, 0
        kind, _, _, _, size, off = self._record(tid)
        if kind != KIND_INT:
            return 0, 0
        (encoding,) = _U32.unpack_from(self._data, off)
        shift, bits = (encoding >> 16) & 0xFF, encoding & 0xFF
        return (shift, bits) if shift or bits != size * 8 else (0, 0)

    def _size(self, tid: int, depth: int = 0) -> int:
        """Size in bytes of type ``tid`` (typedefs and qualifiers resolved)."""
        if depth >= MAX_RESOLVE_DEPTH:
            raise self._fail(f"arrays nested more than {MAX_RESOLVE_DEPTH} deep")
        cur = self._strip(tid)
        if cur == 0:
            raise self._fail(f"type id {tid} resolves to void, which has no size")
        kind, _, _, _, size, off = self._record(cur)
        if kind in _SIZED:
            return size
        if kind == KIND_PTR:
            return self._ptr_size
        if kind == KIND_ARRAY:
            elem, _, nelems = BTF_ARRAY.unpack_from(self._data, off)
            return nelems * self._size(elem, depth + 1)
        raise self._fail(f"{self._describe(cur)} has no size")

    # ---------------------------------------------------------- name lookups

    def _ids(self, ns: str, name: str) -> list[int]:
        dup = self._dups.get((ns, name))
        if dup is not None:
            return dup
        tid = self._index[ns].get(name)
        return [] if tid is None else [tid]

    def type_ids(self, kind: int, name: str) -> list[int]:
        """Ids of the ``kind`` records named ``name``: an indexed kind, or FUNC (not indexed: the type section is
        searched for its name_off, the name's first copy, and info, vlen 0-2).  ValueError: another kind."""
        if kind in _INDEXED_NS:
            return [t for t in self._ids(_INDEXED_NS[kind], name) if self._record(t)[0] == kind]
        if kind != KIND_FUNC:
            raise ValueError(f"BTF records of kind {kind} are not looked up by name")
        data, offsets, found = self._data, self._offsets, []
        pos = data.find(b"\0" + name.encode() + b"\0", self._str_start, self._str_start + self._str_len)
        if pos < 0 or len(offsets) < 2:
            return found
        for vlen in range(3):
            key = _TYPE.pack(pos + 1 - self._str_start, kind << 24 | vlen, 0)[:8]
            at = data.find(key, offsets[1], offsets[-1] + 8)
            while at >= 0:
                i = bisect.bisect_left(offsets, at)
                if offsets[i] == at:
                    found.append(i)
                at = data.find(key, at + 1, offsets[-1] + 8)
        return sorted(found)

    @property
    def type_count(self) -> int:
        """Number of types in the blob (the largest type id; void not counted)."""
        return len(self._offsets) - 1

"""Kernel struct layout from the kernel's own BTF (/sys/kernel/btf/vmlinux).

The BPF programs read kernel struct fields with ``bpf_probe_read_kernel`` at
byte offsets handed to them at start-up.  Those offsets come from here, from the
running kernel's BTF, never from installed kernel headers: on the development
machines the headers describe 6.1 while the kernel is 6.18, and e.g.
``task_struct.mm`` sits at 2272 in the headers but at 1136 in the kernel.

The reader is pure Python and bounded; the blob itself (header, type records,
string section, name indexes) is parsed by :mod:`buildidd.kernel.btf_blob`,
and this module answers questions about it: member offsets along a dotted
path, bit members, sizes, array lengths and enumerator values.  Every chain of
references is depth-capped, so a corrupt file raises
:class:`~buildidd.errors.BtfError`, never ``IndexError`` or a hang.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from buildidd.errors import BtfError
from buildidd.kernel.btf_blob import (
    BTF_ARRAY, BTF_ENUM, BTF_ENUM64, KIND_ARRAY, KIND_ENUM, KIND_ENUM64, KIND_NAMES, KIND_PTR,
    KIND_STRUCT, KIND_UNION, MAX_BTF_BYTES, MAX_RESOLVE_DEPTH, NS_ENUM, NS_INT, NS_STRUCT,
    NS_TYPEDEF, VMLINUX_BTF_PATH, BtfBlob,
)

__all__ = ["Btf", "MAX_BTF_BYTES", "VMLINUX_BTF_PATH"]

_T = TypeVar("_T")


class Btf(BtfBlob):
    """The type information of one raw BTF blob (normally the running kernel's).

    Construct with :meth:`load` (a file) or ``Btf(data)`` (bytes already read).
    All sizes and offsets returned are in bytes.  Names are looked up per C
    namespace: struct/union tags, typedef names, enum tags, base int names.

    A name defined more than once (vmlinux BTF has a few: two different
    ``struct console``, two ``enum energy_perf_value_index``) is answered only
    when every definition gives the same answer; otherwise :class:`BtfError`
    says the name is ambiguous rather than guessing an offset.

    Raises:
        BtfError: from the constructor when the blob is not valid little-endian
            BTF version 1 (bad header, section out of the file, a record running
            past its section, an unknown kind, a name offset out of the string
            section), and from the queries when a name or member is absent or a
            reference inside the blob is out of bounds or cyclic.
    """

    __slots__ = ()

    def _find_member(self, tid: int, name: str, depth: int = 0):
        """``(bit_offset, type_id, bitfield_bits)`` of member ``name`` of a struct/union
        (bitfield_bits: the bitfield's size, 0 when the member is not one).

        Anonymous struct/union members are searched recursively (their offsets
        added), as C does.  Returns None when absent.
        """
        if depth >= MAX_RESOLVE_DEPTH:
            raise self._fail(
                f"{self._describe(tid)}: anonymous members nested more than "
                f"{MAX_RESOLVE_DEPTH} deep (cycle?)")
        for name_off, mtype, bit_off, bitfield in self._members(tid):
            if name_off:
                if self._name(name_off) == name:
                    if bitfield:
                        return bit_off, mtype, bitfield
                    shift, bits = self._int_bitfield(mtype)
                    return bit_off + shift, mtype, bits
                continue
            inner = self._strip(mtype)
            if inner and self._record(inner)[0] in (KIND_STRUCT, KIND_UNION):
                found = self._find_member(inner, name, depth + 1)
                if found is not None:
                    return bit_off + found[0], found[1], found[2]
        return None

    def _resolve_path(self, tid: int, field_path: str):
        """``(bit_offset, type_id, bitfield_bits)`` of dotted ``field_path`` inside ``tid``."""
        parts = field_path.split(".")
        if not all(parts):
            raise BtfError(f"bad field path {field_path!r}")
        bits = 0
        mtype = tid
        bitfield = 0
        walked = []
        for part in parts:
            cur = self._strip(mtype)
            kind = self._record(cur)[0] if cur else 0
            if kind not in (KIND_STRUCT, KIND_UNION):
                where = ".".join(walked) or "(top)"
                what = "a pointer (offsets do not follow pointers)" if kind == KIND_PTR \
                    else ("void" if cur == 0 else KIND_NAMES[kind])
                raise self._fail(
                    f"cannot take member {part!r}: {where} is {what}, not a struct or union")
            found = self._find_member(cur, part)
            if found is None:
                where = ".".join(walked)
                raise self._fail(
                    f"{self._describe(cur)}{' (' + where + ')' if where else ''} "
                    f"has no member {part!r}")
            bits += found[0]
            mtype = found[1]
            bitfield = found[2]
            walked.append(part)
        return bits, mtype, bitfield

    def _composite_ids(self, name: str) -> list[int]:
        """Type ids of the struct/union called ``name`` (else of typedef ``name``)."""
        ids = self._ids(NS_STRUCT, name)
        if ids:
            return ids
        ids = self._ids(NS_TYPEDEF, name)
        if not ids:
            raise self._fail(f"no struct, union or typedef named {name!r}")
        return ids

    def _unique(self, what: str, ids: list[int], answer: Callable[[int], _T]) -> _T:
        """``answer(id)`` when every candidate that has an answer agrees on it."""
        if len(ids) == 1:
            return answer(ids[0])
        results: dict = {}
        first_error = None
        for tid in ids:
            try:
                results.setdefault(answer(tid), []).append(tid)
            except BtfError as e:
                first_error = first_error or e
        if len(results) == 1:
            return next(iter(results))
        if not results:
            raise first_error  # type: ignore[misc]
        detail = ", ".join(f"{v} (ids {t})" for v, t in results.items())
        raise self._fail(f"{what} is ambiguous: {len(ids)} definitions give {detail}")

    # -------------------------------------------------------------- queries

    def has_struct(self, name: str) -> bool:
        """True when a struct or union tagged ``name`` exists (typedefs not followed)."""
        return name in self._index[NS_STRUCT]

    def offsetof(self, struct: str, field_path: str) -> int:
        """Byte offset of a member, following a dotted path through embedded
        (non-pointer) struct/union members, e.g. ``offsetof("file", "f_path.dentry")``,
        ``offsetof("vm_area_struct", "vm_flags")``.

        Anonymous struct/union members are searched transparently (in 6.18
        ``file.f_path`` sits in an anonymous union, and ``vm_area_struct.vm_flags``
        sits in an anonymous union with ``__vm_flags``).  ``struct`` names a
        struct or union, or a typedef of one.  Offsets come from struct
        btf_member.offset (bits), summed along the path.

        Raises:
            BtfError: a name is missing, the path crosses a pointer or a
                non-struct, the member is a bitfield or not byte aligned, or the
                name is ambiguous.
        """
        def answer(tid: int) -> int:
            bits, _, bitfield = self._resolve_path(tid, field_path)
            if bitfield or bits % 8:
                raise self._fail(
                    f"{struct}.{field_path} is a bitfield or not byte aligned "
                    f"(bit offset {bits})")
            return bits // 8
        return self._unique(f"offsetof({struct}, {field_path})",
                            self._composite_ids(struct), answer)

    def bit_member(self, struct: str, field_path: str) -> tuple[int, int]:
        """``(bit offset from the struct's start, size in bits)`` of a member,
        bitfield or not, e.g. ``bit_member("task_struct", "in_execve")`` (a
        1-bit field in 6.18).  Source: struct btf_member (offset and, with
        kind_flag, bitfield size), else the member INT's BTF_INT_BITS.  On
        little-endian machines bit N is bit N % 8 of byte N // 8.

        Raises:
            BtfError: a name is missing, the path crosses a pointer, or the
                name is ambiguous.
        """
        def answer(tid: int) -> tuple[int, int]:
            bits, mtype, bitfield = self._resolve_path(tid, field_path)
            return bits, bitfield or self._size(mtype) * 8
        return self._unique(f"bit_member({struct}, {field_path})",
                            self._composite_ids(struct), answer)

    def sizeof(self, type_name: str) -> int:
        """Size in bytes of the struct/union, typedef, base int or enum ``type_name``.

        Looked up in that order of namespaces (so ``sizeof("u64")`` is the
        typedef, ``sizeof("file")`` the struct).  A typedef of a pointer is the
        pointer size.

        Raises:
            BtfError: no such name, it has no size, or it is ambiguous.
        """
        for ns in (NS_STRUCT, NS_TYPEDEF, NS_INT, NS_ENUM):
            ids = self._ids(ns, type_name)
            if ids:
                return self._unique(f"sizeof({type_name})", ids, self._size)
        raise self._fail(f"no type named {type_name!r}")

    def array_len(self, struct: str, field_path: str) -> int:
        """Element count of an array member (typedefs and qualifiers followed),
        e.g. ``array_len("mm_struct", "saved_auxv")``; source: struct btf_array.nelems.

        Raises:
            BtfError: a name is missing, the member is not an array, or ambiguous.
        """
        def answer(tid: int) -> int:
            _, mtype, _ = self._resolve_path(tid, field_path)
            cur = self._strip(mtype)
            kind = self._record(cur)[0] if cur else 0
            if kind != KIND_ARRAY:
                raise self._fail(f"{struct}.{field_path} is not an array")
            return BTF_ARRAY.unpack_from(self._data, self._record(cur)[5])[2]
        return self._unique(f"array_len({struct}, {field_path})",
                            self._composite_ids(struct), answer)

    def member_size(self, struct: str, field_path: str) -> int:
        """Size in bytes of the member's type (typedef/const/volatile resolved;
        a pointer is the pointer size, 8 on 64-bit kernels; an array is
        nelems * element size).

        Raises:
            BtfError: a name is missing, the member is a bitfield or has no
                size (void, function), or the name is ambiguous.
        """
        def answer(tid: int) -> int:
            _, mtype, bitfield = self._resolve_path(tid, field_path)
            if bitfield:
                raise self._fail(f"{struct}.{field_path} is a bitfield")
            return self._size(mtype)
        return self._unique(f"member_size({struct}, {field_path})",
                            self._composite_ids(struct), answer)

    def enum_value(self, enum_name: str, enumerator: str) -> int:
        """Value of ``enumerator`` in the enum tagged ``enum_name`` (ENUM or ENUM64;
        a typedef of an enum is followed), e.g. ``enum_value("maple_type",
        "maple_arange_64")``.

        Source: struct btf_enum (s32 val) and struct btf_enum64 (val_lo32,
        val_hi32); kind_flag set means signed, clear means unsigned, as
        bpftool prints them.

        Raises:
            BtfError: no such enum or enumerator, or the name is ambiguous.
        """
        ids = self._ids(NS_ENUM, enum_name) or self._ids(NS_TYPEDEF, enum_name)
        if not ids:
            raise self._fail(f"no enum named {enum_name!r}")

        def answer(tid: int) -> int:
            cur = self._strip(tid)
            kind, kflag, vlen, _, _, off = self._record(cur) if cur else (0,) * 6
            data = self._data
            if kind == KIND_ENUM:
                for i in range(vlen):
                    name_off, val = BTF_ENUM.unpack_from(data, off + 8 * i)
                    if self._name(name_off) == enumerator:
                        return val if kflag else val & 0xFFFFFFFF
            elif kind == KIND_ENUM64:
                for i in range(vlen):
                    name_off, lo, hi = BTF_ENUM64.unpack_from(data, off + 12 * i)
                    if self._name(name_off) == enumerator:
                        val = hi << 32 | lo
                        return val - (1 << 64) if kflag and hi >> 31 else val
            else:
                raise self._fail(f"{enum_name!r} is not an enum")
            raise self._fail(f"enum {enum_name} has no enumerator {enumerator!r}")
        return self._unique(f"enum_value({enum_name}, {enumerator})", ids, answer)

    def __repr__(self) -> str:
        return f"<Btf {self.source}: {self.type_count} types>"

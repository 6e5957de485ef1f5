"""Tests of buildidd.btf: the running kernel's BTF against bpftool, and crafted blobs.

The oracle for the kernel's BTF is ``bpftool btf dump file ... format raw``, parsed
here independently of buildidd.btf.  Crafted blobs are built byte by byte with
struct.pack following Documentation/bpf/btf.rst (struct btf_header, btf_type,
btf_member, btf_array, btf_enum, btf_enum64, ...).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import struct
import subprocess
import time

import pytest

from buildidd.kernel.btf import Btf
from buildidd.errors import BtfError, ProbeError

VMLINUX = "/sys/kernel/btf/vmlinux"


def _enum_val(text: str) -> int:
    """bpftool prints ENUM64 values with a C suffix: 18446744073709551584ULL, -1LL."""
    return int(text.rstrip("UL"))


def _skip_or_fail(reason: str):
    if os.environ.get("BUILDIDD_REQUIRE_BPF") == "1":
        pytest.fail(f"{reason} (BUILDIDD_REQUIRE_BPF=1)")
    pytest.skip(reason)


# --------------------------------------------------------------------------
# The oracle: bpftool's raw dump, parsed into {type id: Type}.

_HEAD = re.compile(r"^\[(\d+)\] (\w+) '([^']*)'(.*)$")
_MEMBER = re.compile(r"^\t'([^']*)'(.*)$")
_ATTR = re.compile(r"(\w+)=([^\s,]+)")
_MODIFIERS = {"TYPEDEF", "CONST", "VOLATILE", "RESTRICT", "TYPE_TAG"}


class Type:
    __slots__ = ("kind", "name", "attrs", "members")

    def __init__(self, kind, name, attrs):
        self.kind = kind
        self.name = name
        self.attrs = attrs
        self.members = []  # (name, attrs) for STRUCT/UNION/ENUM/ENUM64/FUNC_PROTO


class Oracle:
    """Kernel types as bpftool prints them; offsets in bits as printed."""

    def __init__(self, text: str):
        self.types: dict[int, Type] = {}
        self.by_name: dict[tuple[str, str], list[int]] = {}
        cur = None
        for line in text.splitlines():
            m = _HEAD.match(line)
            if m:
                tid, kind, name, rest = int(m[1]), m[2], m[3], m[4]
                cur = Type(kind, name, dict(_ATTR.findall(rest)))
                self.types[tid] = cur
                if name != "(anon)":
                    ns = "struct" if kind in ("STRUCT", "UNION") else kind
                    self.by_name.setdefault((ns, name), []).append(tid)
                continue
            m = _MEMBER.match(line)
            if m and cur is not None:
                cur.members.append((m[1], dict(_ATTR.findall(m[2]))))

    def struct_id(self, name: str) -> int:
        ids = self.by_name[("struct", name)]
        assert len(ids) == 1, f"struct {name} defined {len(ids)} times in bpftool output"
        return ids[0]

    def strip(self, tid: int) -> int:
        while tid and self.types[tid].kind in _MODIFIERS:
            tid = int(self.types[tid].attrs["type_id"])
        return tid

    def find(self, tid: int, name: str):
        """(bits_offset, type_id, bitfield_size) of a member, through anonymous members."""
        for mname, attrs in self.types[tid].members:
            bits = int(attrs["bits_offset"])
            mtype = int(attrs["type_id"])
            if mname == name:
                return bits, mtype, int(attrs.get("bitfield_size", 0))
            if mname == "(anon)":
                inner = self.strip(mtype)
                if self.types[inner].kind in ("STRUCT", "UNION"):
                    found = self.find(inner, name)
                    if found:
                        return bits + found[0], found[1], found[2]
        return None

    def member(self, struct_name: str, path: str):
        tid = self.struct_id(struct_name)
        bits = 0
        mtype = tid
        for part in path.split("."):
            found = self.find(self.strip(mtype), part)
            assert found is not None, f"bpftool: {struct_name} has no {path}"
            bits += found[0]
            mtype = found[1]
        return bits, mtype

    def size(self, tid: int) -> int:
        t = self.types[self.strip(tid)]
        if t.kind == "PTR":
            return 8
        if t.kind == "ARRAY":
            return int(t.attrs["nr_elems"]) * self.size(int(t.attrs["type_id"]))
        return int(t.attrs["size"])

    def array_len(self, tid: int) -> int:
        t = self.types[self.strip(tid)]
        assert t.kind == "ARRAY"
        return int(t.attrs["nr_elems"])

    def enum(self, name: str) -> dict[str, int]:
        ids = self.by_name.get(("ENUM", name), []) + self.by_name.get(("ENUM64", name), [])
        assert len(ids) == 1
        return {n: _enum_val(a["val"]) for n, a in self.types[ids[0]].members}


@pytest.fixture(scope="module")
def kernel_btf() -> Btf:
    if not os.path.exists(VMLINUX):
        _skip_or_fail(f"{VMLINUX} absent (kernel without CONFIG_DEBUG_INFO_BTF)")
    return Btf.load(VMLINUX)


@pytest.fixture(scope="module")
def oracle() -> Oracle:
    if not os.path.exists(VMLINUX):
        _skip_or_fail(f"{VMLINUX} absent")
    bpftool = shutil.which("bpftool") or shutil.which("bpftool", path="/usr/sbin:/sbin")
    if bpftool is None:
        _skip_or_fail("bpftool not installed")
    out = subprocess.run([bpftool, "btf", "dump", "file", VMLINUX, "format", "raw"],
                         check=True, capture_output=True, text=True).stdout
    return Oracle(out)


# Every field the BPF programs read, as (struct, dotted path).
FIELDS = [
    ("task_struct", "mm"), ("task_struct", "tgid"), ("task_struct", "pid"),
    ("task_struct", "comm"), ("task_struct", "files"),
    ("mm_struct", "exe_file"), ("mm_struct", "saved_auxv"), ("mm_struct", "mm_mt"),
    ("maple_tree", "ma_root"),
    ("maple_range_64", "pivot"), ("maple_range_64", "slot"),
    ("maple_arange_64", "pivot"), ("maple_arange_64", "slot"),
    ("vm_area_struct", "vm_start"), ("vm_area_struct", "vm_end"),
    ("vm_area_struct", "vm_pgoff"), ("vm_area_struct", "vm_file"),
    ("vm_area_struct", "vm_flags"),
    ("file", "f_path"), ("file", "f_path.dentry"), ("file", "f_path.mnt"),
    ("file", "f_inode"),
    ("inode", "i_ino"), ("inode", "i_sb"), ("inode", "i_size"),
    ("inode", "i_generation"), ("inode", "i_mtime_sec"), ("inode", "i_mtime_nsec"),
    ("super_block", "s_dev"),
    ("dentry", "d_name"), ("dentry", "d_name.name"), ("dentry", "d_parent"),
    ("linux_binprm", "file"), ("linux_binprm", "filename"),
    ("files_struct", "fdt"), ("fdtable", "fd"), ("fdtable", "max_fds"),
    ("mount", "mnt"), ("mount", "mnt_parent"), ("mount", "mnt_mountpoint"),
    ("vfsmount", "mnt_root"),
    ("task_struct", "stack"), ("task_struct", "personality"),
    ("pt_regs", "orig_ax"), ("pt_regs", "ax"), ("pt_regs", "dx"),
]
ARRAYS = [
    ("task_struct", "comm"), ("mm_struct", "saved_auxv"),
    ("maple_range_64", "pivot"), ("maple_range_64", "slot"),
    ("maple_arange_64", "pivot"), ("maple_arange_64", "slot"),
]
STRUCTS = sorted({s for s, _ in FIELDS} | {"path", "qstr"})


@pytest.mark.parametrize("struct_name,path", FIELDS, ids=[f"{s}.{p}" for s, p in FIELDS])
def test_offset_and_size_match_bpftool(kernel_btf, oracle, struct_name, path):
    bits, mtype = oracle.member(struct_name, path)
    assert bits % 8 == 0
    assert kernel_btf.offsetof(struct_name, path) == bits // 8
    assert kernel_btf.member_size(struct_name, path) == oracle.size(mtype)


@pytest.mark.parametrize("struct_name,path", ARRAYS, ids=[f"{s}.{p}" for s, p in ARRAYS])
def test_array_len_matches_bpftool(kernel_btf, oracle, struct_name, path):
    _, mtype = oracle.member(struct_name, path)
    assert kernel_btf.array_len(struct_name, path) == oracle.array_len(mtype)


@pytest.mark.parametrize("name", STRUCTS)
def test_sizeof_matches_bpftool(kernel_btf, oracle, name):
    assert kernel_btf.has_struct(name)
    assert kernel_btf.sizeof(name) == int(oracle.types[oracle.struct_id(name)].attrs["size"])


def test_maple_type_enum_matches_bpftool(kernel_btf, oracle):
    values = oracle.enum("maple_type")
    assert {"maple_leaf_64", "maple_range_64", "maple_arange_64"} <= values.keys()
    for name, value in values.items():
        assert kernel_btf.enum_value("maple_type", name) == value


def test_every_unique_struct_and_enum_matches_bpftool(kernel_btf, oracle):
    """Sweep: sizes and top-level member offsets of every uniquely named struct/union,
    every enumerator of every uniquely named enum; bitfields must be refused."""
    checked = bitfields = 0
    for (ns, name), ids in oracle.by_name.items():
        if len(ids) != 1:
            continue
        t = oracle.types[ids[0]]
        if ns == "struct":
            assert kernel_btf.sizeof(name) == int(t.attrs["size"]), name
            seen = set()
            for mname, attrs in t.members:
                if mname == "(anon)" or mname in seen:
                    continue
                seen.add(mname)
                bits = int(attrs["bits_offset"])
                if int(attrs.get("bitfield_size", 0)) or bits % 8:
                    with pytest.raises(BtfError):
                        kernel_btf.offsetof(name, mname)
                    bitfields += 1
                else:
                    assert kernel_btf.offsetof(name, mname) == bits // 8, (name, mname)
                checked += 1
        elif ns in ("ENUM", "ENUM64") and not oracle.by_name.get(
                ("ENUM64" if ns == "ENUM" else "ENUM", name)):
            for ename, attrs in t.members:
                assert kernel_btf.enum_value(name, ename) == _enum_val(attrs["val"]), (name, ename)
    assert checked > 10000 and bitfields > 0


def test_struct_and_kfunc_ids_match_bpftool(kernel_btf, oracle):
    """The ids the BPF side casts to (bpf/kfuncs.h, BTF_ID_*) and calls (the kfunc's FUNC id)."""
    from buildidd.kernel.btf_blob import KIND_ENUM, KIND_FUNC, KIND_STRUCT
    from buildidd.kernel.compiled import KFUNCS
    from buildidd.kernel.layout import KLD_STRUCTS, btf_id
    for name in KLD_STRUCTS:
        assert btf_id(kernel_btf, KIND_STRUCT, name) == oracle.struct_id(name)
        assert oracle.types[btf_id(kernel_btf, KIND_STRUCT, name)].kind == "STRUCT"
    for name in KFUNCS + ("vfs_read", "do_mmap"):
        ids = oracle.by_name[("FUNC", name)]
        assert len(ids) == 1 and kernel_btf.type_ids(KIND_FUNC, name) == ids
    assert kernel_btf.type_ids(KIND_FUNC, "bpf_no_such_kfunc") == []
    assert kernel_btf.type_ids(KIND_FUNC, "task_struct") == []              # a struct, not a FUNC
    assert kernel_btf.type_ids(KIND_STRUCT, "maple_type") == []             # an enum
    assert kernel_btf.type_ids(KIND_ENUM, "maple_type") == oracle.by_name[("ENUM", "maple_type")]
    with pytest.raises(BtfError, match="0 BTF FUNC types named 'bpf_no_such_kfunc'"):
        btf_id(kernel_btf, KIND_FUNC, "bpf_no_such_kfunc")


def test_type_count_matches_bpftool(kernel_btf, oracle):
    assert kernel_btf.type_count == max(oracle.types)


def test_ambiguous_duplicate_struct_refused(kernel_btf, oracle):
    for (ns, name), ids in oracle.by_name.items():
        sizes = {oracle.types[i].attrs.get("size") for i in ids}
        if ns == "struct" and len(sizes) > 1:
            with pytest.raises(BtfError, match="ambiguous"):
                kernel_btf.sizeof(name)
            return
    pytest.skip("no struct name defined twice with different sizes in this kernel")


def test_kernel_lookup_errors(kernel_btf):
    with pytest.raises(BtfError, match="no struct"):
        kernel_btf.offsetof("no_such_struct_buildidd", "x")
    with pytest.raises(BtfError, match="no member"):
        kernel_btf.offsetof("task_struct", "no_such_field")
    with pytest.raises(BtfError, match="pointer"):
        kernel_btf.offsetof("task_struct", "mm.exe_file")
    with pytest.raises(BtfError, match="not an array"):
        kernel_btf.array_len("task_struct", "mm")
    with pytest.raises(BtfError):
        kernel_btf.enum_value("maple_type", "no_such_enumerator")
    with pytest.raises(BtfError):
        kernel_btf.sizeof("no_such_type_buildidd")
    assert not kernel_btf.has_struct("no_such_struct_buildidd")
    assert issubclass(BtfError, ProbeError)


def test_kernel_load_reads_every_type():
    """The whole of the kernel's BTF loads and answers.  How long a load takes is a performance
    target: the bench measures it (a wall-clock budget here would fail on a busy runner)."""
    if not os.path.exists(VMLINUX):
        _skip_or_fail(f"{VMLINUX} absent")
    start = time.perf_counter()
    btf = Btf.load(VMLINUX)
    print(f"\nloading {VMLINUX}: {time.perf_counter() - start:.3f} s, {btf.type_count} types")
    assert btf.type_count > 10_000 and btf.has_struct("task_struct")


def test_truncated_kernel_btf(tmp_path):
    if not os.path.exists(VMLINUX):
        _skip_or_fail(f"{VMLINUX} absent")
    with open(VMLINUX, "rb") as f:
        data = f.read()
    for cut in (0, 10, 24, 4096, len(data) // 2, len(data) - 1):
        path = tmp_path / f"cut{cut}"
        path.write_bytes(data[:cut])
        with pytest.raises(BtfError):
            Btf.load(str(path))


# --------------------------------------------------------------------------
# Crafted blobs.

INT, PTR, ARRAY, STRUCT, UNION, ENUM, FWD, TYPEDEF = 1, 2, 3, 4, 5, 6, 7, 8
VOLATILE, CONST, RESTRICT, FUNC, FUNC_PROTO, VAR, DATASEC = 9, 10, 11, 12, 13, 14, 15
FLOAT, DECL_TAG, TYPE_TAG, ENUM64 = 16, 17, 18, 19


class BtfBuilder:
    """Writes raw BTF: struct btf_header, then the type section, then strings."""

    def __init__(self):
        self.strings = bytearray(b"\0")
        self.types: list[bytes] = []

    def s(self, name: str) -> int:
        if not name:
            return 0
        off = len(self.strings)
        self.strings += name.encode() + b"\0"
        return off

    def add(self, kind, name="", vlen=0, size_or_type=0, extra=b"", kflag=0) -> int:
        info = (kflag << 31) | (kind << 24) | vlen
        self.types.append(struct.pack("<III", self.s(name), info, size_or_type) + extra)
        return len(self.types)  # the new type id

    def int_(self, name, size, bits, signed=True, bit_offset=0):
        enc = (1 if signed else 0) << 24 | bit_offset << 16 | bits
        return self.add(INT, name, 0, size, struct.pack("<I", enc))

    def array(self, elem, index, nelems):
        return self.add(ARRAY, "", 0, 0, struct.pack("<III", elem, index, nelems))

    def composite(self, kind, name, size, members, kflag=0):
        extra = b""
        for mname, mtype, bits, bitfield in members:
            off = (bitfield << 24 | bits) if kflag else bits
            extra += struct.pack("<III", self.s(mname), mtype, off)
        return self.add(kind, name, len(members), size, extra, kflag)

    def build(self, **hdr) -> bytes:
        types = b"".join(self.types)
        fields = dict(magic=0xEB9F, version=1, flags=0, hdr_len=24, type_off=0,
                      type_len=len(types), str_off=len(types), str_len=len(self.strings))
        fields.update(hdr)
        header = struct.pack("<HBBIIIII", *fields.values())
        return header + types + bytes(self.strings)


def sample_builder() -> BtfBuilder:
    """One of every kind.  C equivalent of the interesting part:

        struct outer {            // size 24
            int x;                // 0
            union { int a; int b[2]; };   // 4 (anonymous)
            int y;                // 12
            struct outer *p;      // 16
        };
        typedef const struct outer outer_t;   (via CONST)
        struct bits { int lo:3, hi:5; int whole; };   // kind_flag
        enum color { RED, BLUE = 0xffffffff };
        enum big : s64 { NEG = -2, HUGE = 1 << 40 };
        struct last { long pad; volatile __tag int q; };   // after every other kind
    """
    b = BtfBuilder()
    t_int = b.int_("int", 4, 32)                                   # 1
    t_arr = b.array(t_int, t_int, 2)                               # 2
    t_union = b.composite(UNION, "", 8, [("a", t_int, 0, 0), ("b", t_arr, 0, 0)])  # 3
    t_outer = b.composite(STRUCT, "outer", 24, [                   # 4
        ("x", t_int, 0, 0), ("", t_union, 32, 0), ("y", t_int, 96, 0), ("p", 5, 128, 0)])
    b.add(PTR, "", 0, t_outer)                                     # 5
    t_const = b.add(CONST, "", 0, t_outer)                         # 6
    b.add(TYPEDEF, "outer_t", 0, t_const)                          # 7
    b.composite(STRUCT, "bits", 8, [                               # 8
        ("lo", t_int, 0, 3), ("hi", t_int, 3, 5), ("whole", t_int, 32, 0)], kflag=1)
    b.add(ENUM, "color", 2, 4, struct.pack("<IiIi", b.s("RED"), 0, b.s("BLUE"), -1))  # 9
    b.add(ENUM64, "big", 2, 8, struct.pack(                        # 10
        "<IIIIII", b.s("NEG"), 0xFFFFFFFE, 0xFFFFFFFF, b.s("HUGE"), 0, 1 << 8), kflag=1)
    t_proto = b.add(FUNC_PROTO, "", 2, t_int, struct.pack(         # 11
        "<IIII", b.s("arg0"), t_int, b.s("arg1"), 5))
    t_func = b.add(FUNC, "f", 1, t_proto)                          # 12
    t_var = b.add(VAR, "v", 0, t_int, struct.pack("<I", 1))        # 13
    b.add(DATASEC, ".data", 1, 4, struct.pack("<III", t_var, 0, 4))  # 14
    b.add(FLOAT, "double", 0, 8)                                   # 15
    b.add(DECL_TAG, "tag", 0, t_func, struct.pack("<i", -1))       # 16
    t_tag = b.add(TYPE_TAG, "user", 0, t_int)                      # 17
    t_vol = b.add(VOLATILE, "", 0, t_tag)                          # 18
    b.add(RESTRICT, "", 0, 5)                                      # 19
    b.add(FWD, "fwd", 0, 0)                                        # 20
    t_long = b.int_("long int", 8, 64)                             # 21
    b.composite(STRUCT, "last", 16, [("pad", t_long, 0, 0), ("q", t_vol, 64, 0)])  # 22
    return b


def test_crafted_blob(tmp_path):
    path = tmp_path / "btf"
    path.write_bytes(sample_builder().build())
    btf = Btf.load(str(path))
    assert btf.type_count == 22
    assert btf.has_struct("outer") and not btf.has_struct("outer_t")
    assert [btf.offsetof("outer", f) for f in ("x", "a", "b", "y", "p")] == [0, 4, 4, 12, 16]
    assert btf.offsetof("outer_t", "y") == 12          # typedef -> const -> struct
    assert btf.sizeof("outer") == btf.sizeof("outer_t") == 24
    assert btf.sizeof("int") == 4 and btf.sizeof("long int") == 8
    assert btf.member_size("outer", "a") == 4
    assert btf.member_size("outer", "b") == 8
    assert btf.member_size("outer", "p") == 8
    assert btf.array_len("outer", "b") == 2
    assert btf.offsetof("bits", "whole") == 4
    for bitfield in ("lo", "hi"):
        with pytest.raises(BtfError, match="bitfield"):
            btf.offsetof("bits", bitfield)
    assert btf.enum_value("color", "RED") == 0
    assert btf.enum_value("color", "BLUE") == 0xFFFFFFFF   # kind_flag 0: unsigned
    assert btf.enum_value("big", "NEG") == -2              # kind_flag 1: signed
    assert btf.enum_value("big", "HUGE") == 1 << 40
    assert btf.offsetof("last", "q") == 8
    assert btf.member_size("last", "q") == 4               # through VOLATILE, TYPE_TAG
    with pytest.raises(BtfError, match="pointer"):
        btf.offsetof("outer", "p.x")
    with pytest.raises(BtfError, match="not an array"):
        btf.array_len("outer", "a")
    with pytest.raises(BtfError):
        btf.offsetof("outer", "b.x")
    with pytest.raises(BtfError):
        btf.offsetof("outer", "")
    with pytest.raises(BtfError):
        btf.enum_value("outer", "x")


def test_int_bitfield_without_kind_flag():
    """kind_flag 0: the bitfield lives in the member's INT encoding (btf.rst 2.2.1)."""
    b = BtfBuilder()
    t_int = b.int_("int", 4, 32)
    t_bf = b.int_("", 4, 3)                    # int:3
    b.composite(STRUCT, "s", 8, [("f", t_bf, 0, 0), ("g", t_int, 32, 0)])
    btf = Btf(b.build())
    with pytest.raises(BtfError, match="bitfield"):
        btf.offsetof("s", "f")
    assert btf.offsetof("s", "g") == 4


def test_duplicate_names_agree_or_are_ambiguous():
    b = BtfBuilder()
    t_int = b.int_("int", 4, 32)
    b.composite(STRUCT, "dup", 8, [("a", t_int, 0, 0), ("b", t_int, 32, 0)])
    b.composite(STRUCT, "dup", 8, [("b", t_int, 0, 0), ("a", t_int, 32, 0)])
    b.composite(STRUCT, "dup", 8, [("a", t_int, 0, 0), ("c", t_int, 32, 0)])
    btf = Btf(b.build())
    assert btf.sizeof("dup") == 8
    with pytest.raises(BtfError, match="ambiguous"):
        btf.offsetof("dup", "a")
    assert btf.offsetof("dup", "c") == 4       # only one definition has it


def _write(tmp_path, data: bytes) -> str:
    path = tmp_path / "btf"
    path.write_bytes(data)
    return str(path)


def _hdr(data: bytes) -> dict:
    return dict(zip(("magic", "version", "flags", "hdr_len", "type_off", "type_len",
                     "str_off", "str_len"), struct.unpack_from("<HBBIIIII", data)))


@pytest.mark.parametrize("case", [
    "truncated_header", "truncated_strings", "bad_magic", "big_endian", "version",
    "flags", "hdr_len", "type_off_past_end", "str_off_past_end", "type_len_unaligned",
    "no_terminating_nul", "name_off_out_of_range",
])
def test_corrupt_header_or_sections(tmp_path, case):
    good = sample_builder().build()
    h = _hdr(good)
    data = {
        "truncated_header": good[:10],
        "truncated_strings": good[:-1],
        "bad_magic": b"\x00\x00" + good[2:],
        "big_endian": b"\xeb\x9f" + good[2:],
        "version": sample_builder().build(version=2),
        "flags": sample_builder().build(flags=1),
        "hdr_len": sample_builder().build(hdr_len=len(good) + 1),
        "type_off_past_end": sample_builder().build(type_off=len(good)),
        "str_off_past_end": sample_builder().build(str_off=h["str_off"] + 8),
        "type_len_unaligned": sample_builder().build(type_len=h["type_len"] - 2),
        "no_terminating_nul": good[:-1] + b"x",
        "name_off_out_of_range": good[:24] + struct.pack("<I", h["str_len"]) + good[28:],
    }[case]
    with pytest.raises(BtfError):
        Btf.load(_write(tmp_path, data))
    with pytest.raises(BtfError, match="big-endian" if case == "big_endian" else None):
        Btf(data)


def test_unknown_kind_and_overlong_record():
    b = BtfBuilder()
    b.add(25, "", 0, 0)
    with pytest.raises(BtfError, match="unknown kind"):
        Btf(b.build())
    b = BtfBuilder()
    b.add(STRUCT, "s", 5, 8)                   # claims 5 members, has none
    with pytest.raises(BtfError, match="past the type section"):
        Btf(b.build())


def test_bad_references_raise_btf_error():
    b = BtfBuilder()
    t_int = b.int_("int", 4, 32)
    bad_name = b.add(STRUCT, "badname", 1, 4, struct.pack("<III", 10**6, t_int, 0))
    b.composite(STRUCT, "badtype", 4, [("m", 999, 0, 0)])
    b.add(TYPEDEF, "loop_a", 0, 5)             # 4 -> 5 -> 4
    b.add(TYPEDEF, "loop_b", 0, 4)
    b.composite(STRUCT, "self", 4, [("", 6, 0, 0)])   # anonymous member is itself
    b.composite(STRUCT, "loopy", 4, [("m", 4, 0, 0)])
    btf = Btf(b.build())
    assert bad_name == 2
    with pytest.raises(BtfError, match="string offset"):
        btf.offsetof("badname", "m")
    with pytest.raises(BtfError, match="out of range"):
        btf.member_size("badtype", "m")
    with pytest.raises(BtfError, match="cycle"):
        btf.sizeof("loop_a")
    with pytest.raises(BtfError, match="cycle"):
        btf.member_size("loopy", "m")
    with pytest.raises(BtfError, match="cycle"):
        btf.offsetof("self", "nothing")


def test_fuzzed_blobs_raise_only_btf_error():
    """Random byte flips and cuts: parsing and every query either work or raise BtfError."""
    good = sample_builder().build()
    rng = random.Random(20261122)
    queries = [
        lambda b: b.offsetof("outer", "y"), lambda b: b.offsetof("outer_t", "a"),
        lambda b: b.member_size("outer", "b"), lambda b: b.array_len("outer", "b"),
        lambda b: b.sizeof("outer"), lambda b: b.sizeof("int"),
        lambda b: b.enum_value("big", "NEG"), lambda b: b.enum_value("color", "BLUE"),
        lambda b: b.offsetof("last", "q"), lambda b: b.member_size("last", "q"),
        lambda b: b.offsetof("bits", "whole"), lambda b: b.has_struct("outer"),
    ]
    parsed = 0
    for _ in range(3000):
        data = bytearray(good)
        if rng.random() < 0.2:
            data = data[:rng.randrange(len(data))]
        for _ in range(rng.randint(1, 4)):
            if data:
                data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            btf = Btf(bytes(data))
        except BtfError:
            continue
        parsed += 1
        for query in queries:
            try:
                query(btf)
            except BtfError:
                pass
    assert parsed > 100


def test_bit_member_matches_bpftool_for_a_kernel_bitfield(kernel_btf, oracle):
    """task_struct.in_execve (a 1-bit field: offsetof refuses it) at bpftool's bits_offset."""
    bits, _, size = oracle.find(oracle.struct_id("task_struct"), "in_execve")
    assert size == 1
    assert kernel_btf.bit_member("task_struct", "in_execve") == (bits, 1)
    assert kernel_btf.bit_member("task_struct", "pid") == (kernel_btf.offsetof("task_struct", "pid") * 8, 32)
    assert kernel_btf.bit_member("file", "f_path.dentry") == (kernel_btf.offsetof("file", "f_path.dentry") * 8, 64)


def test_bit_member_of_both_bitfield_encodings():
    """kind_flag 1: size in the member's offset word; kind_flag 0: in the INT encoding (btf.rst 2.2.1)."""
    b = BtfBuilder()
    t_int = b.int_("int", 4, 32)
    b.composite(STRUCT, "k", 8, [("a", t_int, 0, 0), ("flag", t_int, 35, 1)], kflag=1)
    t_bf = b.int_("", 4, 3, bit_offset=2)      # int:3 at bit 2 of its int
    b.composite(STRUCT, "n", 8, [("f", t_bf, 32, 0)])
    btf = Btf(b.build())
    assert btf.bit_member("k", "flag") == (35, 1)
    assert btf.bit_member("k", "a") == (0, 32)
    assert btf.bit_member("n", "f") == (34, 3)
    with pytest.raises(BtfError, match="no member"):
        btf.bit_member("k", "missing")

"""perf's SDT probe cache: the ``probes`` file of an entry, from the ELF file's SDT notes.

Byte for byte what ``perf buildid-cache -a`` writes (util/probe-file.c
``probe_cache__scan_sdt``, ``probe_cache__commit``), so that ``perf probe``
finds the store's ``sdt_*`` events as its own.
"""

from __future__ import annotations

import os
import platform
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from elftools.common.exceptions import ELFError, ELFParseError
from elftools.elf.elffile import ELFFile

from buildidd.errors import StoreError
from buildidd.store.debuginfo import CopySections, lacks_section

_SDT_SECTION_MAX_BYTES = 16 << 20
"""A .note.stapsdt longer than this is not scanned (the probes file stays empty)."""

_SDT_SECTION = b".note.stapsdt"
_SDT_NOTE_NAME = b"stapsdt\0"
_SDT_NOTE_TYPE = 3
_SHF_ALLOC = 0x2

#: util/probe-file.c ``type_to_suffix``, indexed by the argument's size + 8.
_TYPE_SUFFIX = (b":s64", b"", b"", b"", b":s32", b"", b":s16", b":s8",
                b"", b":u8", b":u16", b"", b":u32", b"", b"", b"", b":u64")

#: arch/x86/util/perf_regs.c ``sdt_reg_tbl``: gas register name → uprobe name.
_X86_SDT_REGS = (
    (b"%eax", b"%ax"), (b"%rax", b"%ax"), (b"%al", b"%ax"), (b"%ah", b"%ax"),
    (b"%ebx", b"%bx"), (b"%rbx", b"%bx"), (b"%bl", b"%bx"), (b"%bh", b"%bx"),
    (b"%ecx", b"%cx"), (b"%rcx", b"%cx"), (b"%cl", b"%cx"), (b"%ch", b"%cx"),
    (b"%edx", b"%dx"), (b"%rdx", b"%dx"), (b"%dl", b"%dx"), (b"%dh", b"%dx"),
    (b"%esi", b"%si"), (b"%rsi", b"%si"), (b"%sil", b"%si"),
    (b"%edi", b"%di"), (b"%rdi", b"%di"), (b"%dil", b"%di"),
    (b"%ebp", b"%bp"), (b"%rbp", b"%bp"), (b"%bpl", b"%bp"),
    (b"%rsp", b"%sp"), (b"%esp", b"%sp"), (b"%spl", b"%sp"),
    *((b"%r" + n + s, b"%r" + n) for n in (b"8", b"9", b"10", b"11", b"12", b"13", b"14", b"15")
      for s in (b"b", b"w", b"d")),
)

#: arch/x86/util/perf_regs.c ``SDT_OP_REGEX``: ``+/-NUM(REG)``, each part but REG optional.
_X86_SDT_OP = re.compile(rb"([+\-]?)([0-9]*)(\(?)(%[a-z][a-z0-9]+)(\)?)")
_X86_SDT_REG_NAME_SIZE = 6
_STRTOL = re.compile(rb"[ \t\n\v\f\r]*([+\-]?[0-9]+)")


class _NoSdt(Exception):
    """perf's scan fails or finds nothing: the probes file stays empty."""


@dataclass
class _SdtNote:
    provider: bytes
    name: bytes
    args: bytes | None
    loc: int
    ref_ctr: int


def sdt_probe_cache(f, path: str, *, machine: str | None = None) -> bytes:
    """The text perf writes to ``probes`` for an ELF file's SDT notes (``b""``: none).

    perf: util/probe-file.c ``probe_cache__scan_sdt`` (one entry per
    provider:name, in note order, ``%sdt_PROVIDER:NAME=NAME``, then its probe
    commands sorted and deduplicated, a strlist), ``synthesize_sdt_probe_command``
    (``p:sdt_PROVIDER/NAME PATH:0xLOC[(0xREFCTR)] argN=OP:TYPE…``) and
    ``probe_cache__commit``; util/symbol-elf.c ``construct_sdt_notes_list`` and
    ``populate_sdt_note`` (notes named ``stapsdt`` of type 3 in the first
    non-allocated SHT_NOTE section ``.note.stapsdt``; location adjusted by
    ``.stapsdt.base``'s file offset, semaphore by ``.probes``' address − offset).
    Arguments follow perf's x86 rules (arch/x86/util/perf_regs.c
    ``arch_sdt_arg_parse_op``: ``+/-NUM(%REG)`` with gas names renamed for
    uprobes, others skipped); on other machines perf's generic rule (every
    argument skipped) is used.  Where perf's scan fails (no or malformed
    notes, an argument size outside -8..8), perf leaves the file empty, and
    so does this.

    Args:
        f: the ELF file, a binary file object open for reading.
        path: the path written into each probe command (perf: the realpath).
        machine: ``platform.machine()`` of the host perf would run on.
    """
    try:
        notes = _sdt_notes(f)
    except _NoSdt:
        return b""
    except (ELFError, ELFParseError, struct.error, ValueError, IndexError, KeyError, AssertionError,
            OverflowError):
        return b""  # pyelftools' ways of saying "malformed"; perf fails the same scan
    x86 = (machine or platform.machine()) in ("x86_64", "amd64", "i386", "i486", "i586", "i686")
    target = os.fsencode(path)
    entries: dict[tuple[bytes, bytes], set[bytes]] = {}
    for note in notes:
        group = (b"sdt_" + note.provider)[:63]  # snprintf(sdtgrp, 64, "sdt_%s", …)
        command = _sdt_command(note, target, group, x86)
        if command is None:
            return b""
        entries.setdefault((group, note.name), set()).add(command)
    out = []
    for (group, name), commands in entries.items():
        out.append(b"%" + group + b":" + name + b"=" + name + b"\n")
        out.extend(c + b"\n" for c in sorted(commands))
    return b"".join(out)


def _first_section(elf: ELFFile, name: str):
    """The first section named name (libelf-style ``elf_section_by_name``; pyelftools' map keeps the last)."""
    for section in elf.iter_sections():
        if section.name == name:
            return section
    return None


def _sdt_notes(f) -> list[_SdtNote]:
    elf = ELFFile(f)
    section = _first_section(elf, _SDT_SECTION.decode())
    if section is None or section["sh_type"] != "SHT_NOTE" or section["sh_flags"] & _SHF_ALLOC:
        raise _NoSdt
    if section["sh_size"] > _SDT_SECTION_MAX_BYTES:
        raise _NoSdt
    data = section.data()
    order = "<" if elf.little_endian else ">"
    bit32 = elf.elfclass == 32
    addr = struct.Struct(order + ("III" if bit32 else "QQQ"))
    mask = (1 << (32 if bit32 else 64)) - 1
    base = _first_section(elf, ".stapsdt.base")
    probes = _first_section(elf, ".probes")
    align = 8 if section["sh_addralign"] == 8 else 4
    nhdr = struct.Struct(order + "III")

    notes = []
    offset = 0
    while len(data) - offset >= nhdr.size:  # gelf_getnote
        namesz, descsz, ntype = nhdr.unpack_from(data, offset)
        name_off = offset + nhdr.size
        desc_off = (name_off + namesz + align - 1) & -align if align == 8 else (name_off + namesz + 3) & -4
        if namesz > len(data) - name_off or desc_off > len(data) or descsz > len(data) - desc_off:
            break
        offset = (desc_off + descsz + align - 1) & -align
        if data[name_off:name_off + namesz] != _SDT_NOTE_NAME:
            continue
        if ntype != _SDT_NOTE_TYPE:
            break  # perf: "goto out_ret" keeping the notes read so far
        notes.append(_sdt_note(data[desc_off:desc_off + descsz], addr, bit32, mask, base, probes))
    if not notes:
        raise _NoSdt
    return notes


def _sdt_note(desc: bytes, addr: struct.Struct, bit32: bool, mask: int, base, probes) -> _SdtNote:
    """One note's descriptor: three addresses, provider, name, args (util/symbol-elf.c ``populate_sdt_note``)."""
    if len(desc) < addr.size + 3:
        raise _NoSdt
    loc, base_addr, ref_ctr = addr.unpack_from(desc, 0)
    rest = desc[addr.size:]
    end = rest.find(b"\0")
    if end < 0:
        raise _NoSdt
    provider = rest[:end]
    rest = rest[end + 1:]
    end = rest.find(b"\0")
    name = rest[:end] if end >= 0 else rest
    if end < 0 or len(rest) - end < 2 or rest[end + 1:end + 2] in (b":", b"\0"):
        args = None
    else:
        args = rest[end + 1:].split(b"\0", 1)[0]
    if base is not None and base["sh_offset"]:
        loc = (loc + base["sh_offset"] - base_addr) & mask
    if probes is not None and probes["sh_offset"] and ref_ctr:
        ref_ctr = (ref_ctr - (probes["sh_addr"] - probes["sh_offset"])) & mask
    return _SdtNote(provider, name, args, loc, ref_ctr)


def _sdt_command(note: _SdtNote, target: bytes, group: bytes, x86: bool) -> bytes | None:
    """``synthesize_sdt_probe_command``; None where perf's fails."""
    out = [b"p:%s/%s %s:0x%x" % (group, note.name, target, note.loc)]
    if note.ref_ctr:
        out.append(b"(0x%x)" % note.ref_ctr)
    if note.args is not None:
        args = note.args.split()  # argv_split: on isspace()
        i = arg_idx = 0
        while i < len(args):
            # perf's arm64 fixup: "-4@[sp, 12]" was split in two at the space.
            if b"[sp," in args[i] and i + 1 < len(args):
                arg = args[i] + b" " + args[i + 1]
                i += 2
            else:
                arg = args[i]
                i += 1
            text = _sdt_arg(arg_idx, arg, x86)
            if text is None:
                return None
            out.append(text)
            arg_idx += 1
    return b"".join(out)


def _sdt_arg(index: int, arg: bytes, x86: bool) -> bytes | None:
    """``synthesize_sdt_probe_arg``: ``b" argN=OP:TYPE"``, ``b""`` if skipped, None on failure."""
    suffix = b""
    if b"@" in arg:
        size_text, op = arg.split(b"@", 1)
        m = _STRTOL.match(size_text)
        size = int(m.group(1)) if m else 0
        if not -8 <= size <= 8:
            return None
        suffix = _TYPE_SUFFIX[size + 8]
    else:
        op = arg
    new_op = _x86_sdt_op(op) if x86 else None
    if new_op is None:
        return b""
    return b" arg%d=%s%s" % (index + 1, new_op, suffix)


def _x86_sdt_op(op: bytes) -> bytes | None:
    """arch/x86/util/perf_regs.c ``arch_sdt_arg_parse_op``; None: skipped."""
    m = _X86_SDT_OP.fullmatch(op)
    if b"," in op or b"$" in op or m is None or len(m.group(4)) > _X86_SDT_REG_NAME_SIZE:
        return None
    sign, num, paren, reg, close = m.groups()
    prefix = b""
    if paren:
        prefix = sign if sign else (b"+" if num else b"+0")
    for gas, uprobe in _X86_SDT_REGS:
        if gas.startswith(reg):  # strncmp(sdt_name, reg, len(reg))
            reg = uprobe
            break
    return prefix + num + paren + reg + close


def probes_text(elf: Path, path: str, known: CopySections | None = None) -> bytes:
    """The ``probes`` file's contents for the stored copy elf of the file named path (see :func:`sdt_probe_cache`).

    Most files have no ``.note.stapsdt``: when the bounded section reader shows the whole section
    table without one (debuginfo.lacks_section), the answer is ``b""`` without pyelftools, whose
    parse of the headers costs more than the rest of a small file's copy.

    known: elf's sections, read already (debuginfo.copy_sections): when they show no ``.note.stapsdt``,
    elf is not opened.

    Raises:
        StoreError: elf cannot be opened or read.
    """
    if known is not None and known.lacks(_SDT_SECTION):
        return b""
    try:
        with open(elf, "rb") as f:
            if lacks_section(f.fileno(), _SDT_SECTION):
                return b""
            return sdt_probe_cache(f, path)
    except OSError as e:
        raise StoreError(f"{elf}: cannot read for its SDT notes: {e.strerror}") from e

"""The bounded ELF walker that finds the GNU build-id note of an ELF image.

The reader follows the kernel's ``lib/buildid.c`` and perf's approach:

1. The ELF header (first 52 or 64 bytes; ELF gABI "ELF Header").
2. The program headers; every ``PT_NOTE`` segment is walked as a list of
   notes and the first well-formed GNU build-id note wins.
3. When no segment yields one (objects without program headers, odd
   debuginfo files), the ``SHT_NOTE`` sections are walked the same way.

Note format (ELF gABI "Note Section"): a 12-byte header of three 4-byte
words ``namesz``, ``descsz``, ``type`` in the file's byte order, for both
ELF classes; then ``namesz`` bytes of name; then ``descsz`` bytes of
descriptor.  Name and descriptor are padded to the note alignment: 4 bytes,
or 8 bytes when the segment's ``p_align`` (section's ``sh_addralign``) is 8,
as for ``.note.gnu.property`` of newer toolchains.  The 8-byte rule is
elfutils' ``ELF_T_NHDR8`` (``gelf_getnote``): the descriptor starts at the
next multiple of 8 after the name and the next note at the next multiple of 8
after the descriptor.  The kernel always uses 4, which gives the same result
for the 4-aligned ``.note.gnu.build-id`` every linker emits.

Every size and offset read from the file is checked against the file's size
before it is used.  Python integers do not wrap, so ``offset + size`` is
compared exactly even for values near 2**64, where C code must test for
overflow.  Fixed caps (below) bound the work no matter what the file says:
at most :data:`MAX_READ_BYTES` read, :data:`MAX_NOTES` notes walked.

Problems are judged like the kernel judges them: the ELF header and the
header tables must be sound, or :class:`~buildidd.errors.ElfError` is raised
at once.  A single note segment or note that is out of bounds or invalid is
skipped and remembered; if a valid build-id is found elsewhere it is
returned, otherwise the first remembered problem is raised.  ``None`` means
that the tables are sound, every note region lies in the file and was read
in full, and none of them holds a GNU build-id note.
(Regions that do not contain the 8 bytes ``type=3, "GNU\\0"`` are checked
with one ``bytes.find`` rather than walked, so a malformed note in such a
region goes unreported: it could not have been a build-id.)

The reasons raised are :class:`~buildidd.resolve.reasons.MissReason` values.
:mod:`buildidd.resolve.buildid` wraps the descriptor found in a ``BuildId``.
"""

from __future__ import annotations

import os
import struct

from buildidd.errors import ElfError
from buildidd.resolve.reasons import MissReason

__all__ = [
    "BUILD_ID_MAX_BYTES",
    "BUILD_ID_MIN_BYTES",
    "GNU_OWNER",
    "HEAD_READ_BYTES",
    "MAX_NOTES",
    "MAX_NOTE_REGION_BYTES",
    "MAX_PHDRS",
    "MAX_READ_BYTES",
    "MAX_SHDRS",
    "NHDR_BYTES",
    "NT_GNU_BUILD_ID",
    "ElfNotes",
]

# --- Limits -----------------------------------------------------------------

BUILD_ID_MIN_BYTES = 1
"""Shortest build-id accepted, in bytes."""

BUILD_ID_MAX_BYTES = 64
"""Longest build-id accepted, in bytes.  The kernel's ``BUILD_ID_SIZE_MAX`` is
20 (a SHA-1); the note format allows any length, so we take up to 64 and call
a longer descriptor malformed."""

HEAD_READ_BYTES = 4096
"""Bytes read from offset 0 in the first ``pread``.  The ELF header, program
headers and note segments of ordinary executables and libraries all lie in
the first page, so one read usually answers."""

MAX_PHDRS = 256
"""Program headers considered, as the kernel's ``MAX_PHDR_CNT`` (Linux 6.12
``lib/buildid.c``).  Real files have about 15."""

MAX_SHDRS = 1024
"""Section headers considered in the fallback (64 KiB of ELF64 headers).
Linked files have about 40; relocatable objects with thousands of sections
carry no build-id."""

MAX_NOTE_REGION_BYTES = 64 * 1024
"""Bytes read and walked per note segment or note section; of a longer one
only the first this many.  ``.note.gnu.build-id`` is 36 bytes for a SHA-1."""

MAX_READ_BYTES = 1024 * 1024
"""Bytes read from an fd per file in total, the first :data:`HEAD_READ_BYTES`
included.  (:func:`~buildidd.resolve.buildid.parse_build_id` reads nothing:
its data is in memory.)"""

MAX_NOTES = 1024
"""Notes walked per file, over all segments and sections."""

# --- ELF constants (ELF gABI; <elf.h>) ---------------------------------------

_ELF_MAGIC = b"\x7fELF"
_EI_NIDENT = 16
_ELFCLASS32 = 1
_ELFCLASS64 = 2
_ELFDATA2LSB = 1
_ELFDATA2MSB = 2
_PT_NOTE = 4
_SHT_NOTE = 7
_PN_XNUM = 0xFFFF
NT_GNU_BUILD_ID = 3
GNU_OWNER = b"GNU\0"
NHDR_BYTES = 12


class _Layout:
    """The struct formats of one ELF class and byte order.

    Only the fields the reader uses are decoded; ``x`` skips the others.
    ``types(sections, n)`` decodes just the type word of ``n`` consecutive
    header-table entries in one call; it is what makes scanning fast.
    """

    __slots__ = (
        "order", "ehdr", "ehdr_bytes", "phdr", "phdr_bytes", "shdr", "shdr_bytes", "nhdr",
        "build_id_mark", "_types",
    )

    def __init__(self, is64: bool, order: str):
        self.order = order
        if is64:
            # Elf64_Ehdr: e_phoff, e_shoff, e_phentsize, e_phnum, e_shentsize,
            # e_shnum (skipped: e_ident, e_type, e_machine, e_version,
            # e_entry, e_flags, e_ehsize, e_shstrndx).
            self.ehdr = struct.Struct(order + "16x8x8xQQ4x2xHHHH2x")
            self.ehdr_bytes = 64
            # Elf64_Phdr: p_type, p_offset, p_filesz, p_align.
            self.phdr = struct.Struct(order + "I4xQ16xQ8xQ")
            self.phdr_bytes = 56
            # Elf64_Shdr: sh_type, sh_offset, sh_size, sh_info, sh_addralign.
            self.shdr = struct.Struct(order + "4xI16xQQ4xIQ8x")
            self.shdr_bytes = 64
        else:
            self.ehdr = struct.Struct(order + "16x8x4xII4x2xHHHH2x")
            self.ehdr_bytes = 52
            # Elf32_Phdr: p_type, p_offset, p_filesz, p_align.
            self.phdr = struct.Struct(order + "II8xI8xI")
            self.phdr_bytes = 32
            # Elf32_Shdr: sh_type, sh_offset, sh_size, sh_info, sh_addralign.
            self.shdr = struct.Struct(order + "4xI8xII4xII4x")
            self.shdr_bytes = 40
        # Elf32_Nhdr and Elf64_Nhdr are the same: namesz, descsz, type.
        self.nhdr = struct.Struct(order + "III")
        # n_type NT_GNU_BUILD_ID then the name "GNU\0": in every build-id note.
        self.build_id_mark = struct.pack(order + "I", NT_GNU_BUILD_ID) + GNU_OWNER
        self._types: dict[tuple[bool, int], struct.Struct] = {}

    def types(self, sections: bool, n: int) -> struct.Struct:
        """A struct decoding the type word of ``n`` program headers (or
        section headers).  Cached for ``n <= 64``, the counts real files
        have, so odd files cannot grow the cache (a Struct for 1024
        entries holds tens of KiB)."""
        key = (sections, n)
        st = self._types.get(key)
        if st is None:
            if sections:  # sh_type follows the 4-byte sh_name
                entry = f"4xI{self.shdr_bytes - 8}x"
            else:  # p_type comes first
                entry = f"I{self.phdr_bytes - 4}x"
            st = struct.Struct(self.order + entry * n)
            if n <= 64:
                self._types[key] = st
        return st


_LAYOUTS = {
    (_ELFCLASS32, _ELFDATA2LSB): _Layout(False, "<"),
    (_ELFCLASS32, _ELFDATA2MSB): _Layout(False, ">"),
    (_ELFCLASS64, _ELFDATA2LSB): _Layout(True, "<"),
    (_ELFCLASS64, _ELFDATA2MSB): _Layout(True, ">"),
}


class _StopSearch(Exception):
    """A cap was reached; the search ends with what was remembered."""


class _ElfBytes:
    """The bytes of one parse: their source, the budgets, the remembered problem.

    The source is ``head``, the file's bytes from offset 0 (all of them, the
    first :data:`HEAD_READ_BYTES`, or a prefix given to
    :func:`~buildidd.resolve.buildid.parse_build_id`), and, when ``fd`` is
    set, ``os.pread`` beyond it.
    """

    __slots__ = ("fd", "head", "head_is_all", "size", "read_left", "notes_left", "problem")

    def __init__(self, head: bytes, fd: int | None, size: int | None, head_is_all: bool):
        self.fd = fd
        self.head = head
        self.head_is_all = head_is_all  # no byte of the file lies beyond head
        self.size = size  # file size in bytes; None until needed
        self.read_left = MAX_READ_BYTES - len(head)
        self.notes_left = MAX_NOTES
        self.problem: tuple[MissReason, str] | None = None

    def file_size(self) -> int:
        """The file's size in bytes; ``os.fstat`` only when the head does not tell."""
        if self.size is None:
            if self.head_is_all or self.fd is None:
                self.size = len(self.head)
            else:
                self.size = os.fstat(self.fd).st_size
        return self.size

    def in_file(self, offset: int, length: int) -> bool:
        """Whether ``length`` bytes at ``offset`` lie inside the file."""
        end = offset + length
        return end <= len(self.head) or end <= self.file_size()

    def read(self, offset: int, length: int) -> tuple[bytes, int]:
        """``(buf, pos)``: the ``length`` bytes at file ``offset`` are
        ``buf[pos:pos + length]``.  The caller has checked :meth:`in_file`.

        Raises:
            _StopSearch: the per-file read budget would be exceeded.
            ElfError: ``malformed_elf`` when the file ends sooner than its
                size said (it shrank while being read); ``unsupported_elf``
                when a parse of a prefix needs bytes beyond it.
            OSError: from ``os.pread``.
        """
        if offset + length <= len(self.head):
            return self.head, offset
        if self.fd is None:
            raise ElfError(
                MissReason.UNSUPPORTED_ELF,
                f"needs bytes {offset}..{offset + length} beyond the {len(self.head)} bytes given",
            )
        if length > self.read_left:
            self.remember(MissReason.UNSUPPORTED_ELF, f"needs more than {MAX_READ_BYTES} bytes read")
            raise _StopSearch
        self.read_left -= length
        data = os.pread(self.fd, length, offset)
        if len(data) != length:
            raise ElfError(MissReason.MALFORMED_ELF, f"short read at offset {offset}: the file shrank")
        return data, 0

    def remember(self, reason: MissReason, message: str) -> None:
        """Keep the first problem met; raised if no build-id is found."""
        if self.problem is None:
            self.problem = (reason, message)

    def header_bytes(self, length: int) -> bytes:
        """The first ``length`` bytes when the head is shorter (a short file,
        or a parse of a short prefix)."""
        if not self.in_file(0, length):
            raise ElfError(
                MissReason.MALFORMED_ELF,
                f"file of {self.file_size()} bytes is shorter than the {length}-byte ELF header",
            )
        buf, pos = self.read(0, length)
        return buf[pos : pos + length]


class ElfNotes(_ElfBytes):
    """One search of an ELF image for its GNU build-id note.

    Construct with the image's first bytes and, to read beyond them, its fd:
    ``ElfNotes(head, fd, size, head_is_all)`` where ``head`` is the file's
    bytes from offset 0, ``fd`` an open file or None (then nothing beyond
    ``head`` is read), ``size`` the file size in bytes or None (``os.fstat``
    when needed), ``head_is_all`` whether ``head`` is the whole file.  Then
    :meth:`run` once.
    """

    __slots__ = ("lay",)

    def run(self) -> bytes | None:
        """The descriptor of the first GNU build-id note (``PT_NOTE`` segments
        first, then ``SHT_NOTE`` sections; 1..64 bytes), or ``None`` when the
        image is sound ELF without one.

        Raises:
            ElfError: with a :class:`MissReason` (not_elf, malformed_elf,
                unsupported_elf), as :func:`~buildidd.resolve.buildid.read_build_id_fd`.
            OSError: from ``os.pread`` or ``os.fstat``.
        """
        head = self.head
        if len(head) < 4 or head[:4] != _ELF_MAGIC:
            raise ElfError(MissReason.NOT_ELF, "no ELF magic")
        if len(head) < _EI_NIDENT:
            head = self.header_bytes(_EI_NIDENT)
        lay = _LAYOUTS.get((head[4], head[5]))
        if lay is None:
            raise ElfError(MissReason.UNSUPPORTED_ELF, f"EI_CLASS {head[4]}, EI_DATA {head[5]} not handled")
        self.lay = lay
        if len(head) < lay.ehdr_bytes:
            head = self.header_bytes(lay.ehdr_bytes)
        phoff, shoff, phentsize, phnum, shentsize, shnum = lay.ehdr.unpack_from(head, 0)

        try:
            if phnum == _PN_XNUM:
                # gABI "Extended numbering": the real count is sh_info of section 0.
                if shoff == 0:
                    raise ElfError(MissReason.MALFORMED_ELF, "e_phnum is PN_XNUM but there is no section 0")
                phnum = self.section0(shoff, shentsize)[3]
            if phnum:
                found = self.walk_segments(phoff, phentsize, phnum)
                if found is not None:
                    return found
            if shoff:
                found = self.walk_sections(shoff, shentsize, shnum)
                if found is not None:
                    return found
        except _StopSearch:
            pass
        if self.problem is not None:
            raise ElfError(*self.problem)
        return None

    def table(
        self, what: str, offset: int, entsize: int, want: int, count: int, cap: int
    ) -> tuple[bytes, int]:
        """``(buf, pos)`` of the first ``min(count, cap)`` entries of a header table.

        All ``count`` declared entries must lie in the file, each ``want``
        bytes long: ``e_phentsize``/``e_shentsize`` must be exact, as the
        kernel's ELF loader requires.
        """
        if entsize != want:
            raise ElfError(MissReason.MALFORMED_ELF, f"{what} entry size {entsize}, expected {want}")
        if not self.in_file(offset, entsize * count):
            raise ElfError(
                MissReason.MALFORMED_ELF, f"{count} {what}s at offset {offset} run past the end of file"
            )
        return self.read(offset, entsize * min(count, cap))

    def section0(self, shoff: int, shentsize: int) -> tuple[int, int, int, int, int]:
        """Section header 0: (sh_type, sh_offset, sh_size, sh_info, sh_addralign).
        Its sh_size and sh_info hold e_shnum and e_phnum when those overflow."""
        lay = self.lay
        buf, pos = self.table("section header", shoff, shentsize, lay.shdr_bytes, 1, 1)
        return lay.shdr.unpack_from(buf, pos)

    def walk_segments(self, phoff: int, phentsize: int, phnum: int) -> bytes | None:
        """Walk the ``PT_NOTE`` segments among the first :data:`MAX_PHDRS` program headers."""
        lay = self.lay
        n = min(phnum, MAX_PHDRS)
        buf, pos = self.table("program header", phoff, phentsize, lay.phdr_bytes, phnum, MAX_PHDRS)
        types = lay.types(False, n).unpack_from(buf, pos)
        i = 0
        for _ in range(types.count(_PT_NOTE)):
            i = types.index(_PT_NOTE, i)
            _, p_offset, p_filesz, p_align = lay.phdr.unpack_from(buf, pos + i * lay.phdr_bytes)
            i += 1
            if p_filesz:
                found = self.walk_region("PT_NOTE segment", p_offset, p_filesz, p_align)
                if found is not None:
                    return found
        if phnum > MAX_PHDRS:
            self.remember(MissReason.UNSUPPORTED_ELF, f"{phnum} program headers, only {MAX_PHDRS} read")
        return None

    def walk_sections(self, shoff: int, shentsize: int, shnum: int) -> bytes | None:
        """Walk the ``SHT_NOTE`` sections among the first :data:`MAX_SHDRS` section headers."""
        lay = self.lay
        if shnum == 0:
            # gABI "Extended numbering": the count is sh_size of section 0.
            shnum = self.section0(shoff, shentsize)[2]
            if shnum == 0:
                return None
        n = min(shnum, MAX_SHDRS)
        buf, pos = self.table("section header", shoff, shentsize, lay.shdr_bytes, shnum, MAX_SHDRS)
        types = lay.types(True, n).unpack_from(buf, pos)
        i = 0
        for _ in range(types.count(_SHT_NOTE)):
            i = types.index(_SHT_NOTE, i)
            _, sh_offset, sh_size, _, sh_addralign = lay.shdr.unpack_from(
                buf, pos + i * lay.shdr_bytes
            )
            i += 1
            if sh_size:
                found = self.walk_region("SHT_NOTE section", sh_offset, sh_size, sh_addralign)
                if found is not None:
                    return found
        if shnum > MAX_SHDRS:
            self.remember(MissReason.UNSUPPORTED_ELF, f"{shnum} section headers, only {MAX_SHDRS} read")
        return None

    def walk_region(self, what: str, offset: int, size: int, align: int) -> bytes | None:
        """Walk the notes of one segment or section: ``size`` bytes at file ``offset``.

        ``align`` is ``p_align``/``sh_addralign``: 8 selects 8-byte note
        padding, anything else 4 (the gABI allows 4 and 8; elfutils also
        reads 0, 1 and 2 as 4).  A region out of the file is remembered as
        ``malformed_elf`` and skipped, as the kernel skips it.  A region
        without the bytes of a build-id note's type word followed by
        ``"GNU\\0"`` cannot hold one and is not walked (a ``bytes.find``
        instead of a walk: most files put ``.note.gnu.property`` first).
        """
        head = self.head
        if offset + size <= len(head):
            buf, pos, walked = head, offset, size
        elif not self.in_file(offset, size):
            self.remember(
                MissReason.MALFORMED_ELF,
                f"{what} of {size} bytes at offset {offset} runs past the end of file",
            )
            return None
        else:
            walked = min(size, MAX_NOTE_REGION_BYTES)
            buf, pos = self.read(offset, walked)
        if walked < size:  # raised only if no build-id is found
            self.remember(MissReason.UNSUPPORTED_ELF, f"{what} of {size} bytes, only {walked} walked")
        if buf.find(self.lay.build_id_mark, pos, pos + walked) < 0:
            return None
        return self.walk_notes(what, buf, pos, walked, offset - pos, 8 if align == 8 else 4)

    def walk_notes(
        self, what: str, buf: bytes, start: int, size: int, delta: int, align: int
    ) -> bytes | None:
        """The first GNU build-id descriptor among the notes in ``buf[start:start + size]``.

        ``align`` (4 or 8) pads name and descriptor, counted from ``start``.
        ``delta`` turns a position in ``buf`` into a file offset (for
        messages).  A note that overruns the region ends the walk of it.
        """
        unpack_from = self.lay.nhdr.unpack_from
        mask = align - 1
        rel = 0  # offset of the current note in the region
        while size - rel >= NHDR_BYTES:
            if self.notes_left == 0:
                self.remember(MissReason.UNSUPPORTED_ELF, f"more than {MAX_NOTES} notes")
                raise _StopSearch
            self.notes_left -= 1
            namesz, descsz, n_type = unpack_from(buf, start + rel)
            name_end = rel + NHDR_BYTES + namesz
            desc_end = ((name_end + mask) & ~mask) + descsz
            if name_end > size or (descsz and desc_end > size):
                self.remember(
                    MissReason.MALFORMED_ELF,
                    f"note at offset {start + rel + delta} (namesz {namesz}, descsz {descsz}) "
                    f"overruns its {what} of {size} bytes",
                )
                return None
            if (
                n_type == NT_GNU_BUILD_ID
                and namesz == 4
                and buf[start + name_end - 4 : start + name_end] == GNU_OWNER
            ):
                if BUILD_ID_MIN_BYTES <= descsz <= BUILD_ID_MAX_BYTES:
                    return buf[start + desc_end - descsz : start + desc_end]
                self.remember(
                    MissReason.MALFORMED_ELF,
                    f"GNU build-id note at offset {start + rel + delta} has {descsz} bytes, "
                    f"expected {BUILD_ID_MIN_BYTES}..{BUILD_ID_MAX_BYTES}",
                )
            rel = (desc_end + mask) & ~mask
        return None

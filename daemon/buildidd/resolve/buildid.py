"""The BuildId value type and a bounded reader of the ELF GNU build-id note.

A GNU build-id is the descriptor of an ELF note with owner ``"GNU\\0"`` and
type ``NT_GNU_BUILD_ID`` (3), written by the linker (``ld --build-id``).  perf,
debuginfod and the kernel (``lib/buildid.c``, the ``build_id`` of a
``vm_area_struct``) all name a file by it.

This module holds the value type and the public readers; the bounded walk of
the ELF headers and notes (its caps, its rules for note alignment and for
problems) is :mod:`buildidd.resolve.elfnotes`.  A file without a build-id
raises :class:`~buildidd.errors.ElfError` whose ``reason`` is a
:class:`~buildidd.resolve.reasons.MissReason`.
"""

from __future__ import annotations

import os
import re
import struct
import sys
from dataclasses import dataclass

from buildidd.errors import ElfError
from buildidd.resolve.elfnotes import (
    BUILD_ID_MAX_BYTES,
    BUILD_ID_MIN_BYTES,
    GNU_OWNER,
    HEAD_READ_BYTES,
    MAX_NOTE_REGION_BYTES,
    MAX_NOTES,
    MAX_PHDRS,
    MAX_READ_BYTES,
    MAX_SHDRS,
    NHDR_BYTES,
    NT_GNU_BUILD_ID,
    ElfNotes,
)
from buildidd.resolve.reasons import MissReason

__all__ = [
    "BUILD_ID_MAX_BYTES",
    "BUILD_ID_MIN_BYTES",
    "BuildId",
    "HEAD_READ_BYTES",
    "MAX_NOTES",
    "MAX_NOTE_REGION_BYTES",
    "MAX_PHDRS",
    "MAX_READ_BYTES",
    "MAX_SHDRS",
    "build_id_from_notes",
    "parse_build_id",
    "read_build_id",
    "read_build_id_fd",
]

_HEX_RE = re.compile(r"(?:[0-9a-fA-F]{2})+")


# --- The value type ------------------------------------------------------------


@dataclass(frozen=True, slots=True, repr=False)
class BuildId:
    """A GNU build-id: the descriptor bytes of an ``NT_GNU_BUILD_ID`` note.

    Attributes:
        raw: the build-id, 1 to 64 bytes (:data:`BUILD_ID_MIN_BYTES`,
            :data:`BUILD_ID_MAX_BYTES`); 20 for ``--build-id=sha1`` (the
            default), 16 for ``md5``.

    Raises:
        TypeError: ``raw`` is not ``bytes``.
        ValueError: ``raw`` is empty or longer than 64 bytes.
    """

    raw: bytes

    def __post_init__(self) -> None:
        if type(self.raw) is not bytes:
            raise TypeError(f"BuildId.raw must be bytes, not {type(self.raw).__name__}")
        if not BUILD_ID_MIN_BYTES <= len(self.raw) <= BUILD_ID_MAX_BYTES:
            raise ValueError(
                f"a build-id is {BUILD_ID_MIN_BYTES}..{BUILD_ID_MAX_BYTES} bytes, "
                f"not {len(self.raw)}"
            )

    @property
    def hex(self) -> str:
        """The build-id as lower-case hex, two digits per byte (perf's ``sbuild_id``)."""
        return self.raw.hex()

    @classmethod
    def from_hex(cls, text: str) -> BuildId:
        """Parse hex text (either case, no prefix, no separators).

        Raises:
            ValueError: ``text`` is not an even number of hex digits, or gives
                a length outside 1..64 bytes.
        """
        if not isinstance(text, str) or _HEX_RE.fullmatch(text) is None:
            raise ValueError(f"not a build-id in hex: {text!r}")
        return cls(bytes.fromhex(text))

    def __str__(self) -> str:
        return self.raw.hex()

    def __repr__(self) -> str:
        return f"BuildId({self.raw.hex()!r})"


def _build_id(raw: bytes | None) -> BuildId | None:
    """A :class:`BuildId` of ``raw`` (whose length the walker has checked), or None."""
    if raw is None:
        return None
    bid = object.__new__(BuildId)
    object.__setattr__(bid, "raw", raw)
    return bid


def parse_build_id(data: bytes | memoryview, file_size: int | None = None) -> BuildId | None:
    """Build-id of the ELF image ``data`` (the file's bytes from offset 0).

    Args:
        data: the whole file, or only its first bytes when ``file_size`` is
            given (as the kernel once parsed only the first page).
        file_size: the file's real size in bytes, ``>= len(data)``; offsets
            are checked against it.  Default ``len(data)``.

    Returns:
        The first GNU build-id note's descriptor, or ``None`` if the image is
        valid ELF with no such note.

    Raises:
        ElfError: ``not_elf``, ``malformed_elf``, or ``unsupported_elf``
            (also when a needed region lies beyond ``data`` in the file).
        ValueError: ``file_size`` is smaller than ``len(data)``.
    """
    if file_size is None:
        file_size = len(data)
    elif file_size < len(data):
        raise ValueError(f"file_size {file_size} < len(data) {len(data)}")
    if type(data) is not bytes:
        data = bytes(data)  # one copy: the reader relies on bytes.find
    return _build_id(ElfNotes(data, None, file_size, file_size == len(data)).run())


def read_build_id_fd(fd: int) -> BuildId | None:
    """Build-id of the ELF file open on ``fd``.

    Reads with ``os.pread`` (the file offset is neither used nor moved), one
    :data:`HEAD_READ_BYTES` read first and more only for headers or notes
    beyond it; ``os.fstat`` gives the size when the head does not reach EOF.
    At most :data:`MAX_READ_BYTES` are read.

    Returns:
        The descriptor of the first GNU build-id note (``PT_NOTE`` segments
        first, then ``SHT_NOTE`` sections), or ``None`` when the file is valid
        ELF without one.

    Raises:
        ElfError: ``not_elf`` (no ELF magic; an empty file),
            ``malformed_elf`` (truncated header, a table, segment or note out
            of bounds or inconsistent, a build-id note of 0 or more than 64
            bytes), ``unsupported_elf`` (unknown EI_CLASS/EI_DATA, or a cap
            reached before a build-id was found).
        OSError: reading failed (``EISDIR``, ``EIO``, ``ESPIPE``...).
    """
    head = os.pread(fd, HEAD_READ_BYTES, 0)
    return _build_id(ElfNotes(head, fd, None, len(head) < HEAD_READ_BYTES).run())


def read_build_id(path: str | os.PathLike[str]) -> BuildId | None:
    """Build-id of the ELF file at ``path``: :func:`read_build_id_fd` on
    ``open(path, O_RDONLY | O_CLOEXEC)``.

    Raises:
        ElfError: as :func:`read_build_id_fd`.
        OSError: the file cannot be opened or read.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return read_build_id_fd(fd)
    finally:
        os.close(fd)


def build_id_from_notes(data: bytes | memoryview) -> BuildId | None:
    """The GNU build-id in a bare note section: notes with no ELF file around them.

    That is the form of /sys/kernel/notes (the running kernel's .notes) and
    /sys/module/NAME/notes/.note.gnu.build-id: Elf_Nhdr records in the host's
    byte order, name and descriptor padded to 4 bytes (ELF gABI note format).

    Returns:
        The first NT_GNU_BUILD_ID with owner "GNU", or None when there is none.
    Raises:
        ElfError(MissReason.MALFORMED_ELF): a note overruns the data, or the build-id
            length is outside 1..64 bytes.
    """
    order = "<" if sys.byteorder == "little" else ">"
    nhdr = struct.Struct(order + "III")
    size = min(len(data), MAX_NOTE_REGION_BYTES)
    off = 0
    for _ in range(MAX_NOTES):
        if size - off < NHDR_BYTES:
            return None
        namesz, descsz, n_type = nhdr.unpack_from(data, off)
        name_end = off + NHDR_BYTES + namesz
        desc_start = (name_end + 3) & ~3
        desc_end = desc_start + descsz
        if name_end > size or desc_end > size:
            raise ElfError(MissReason.MALFORMED_ELF, f"note at offset {off} overruns the {size}-byte note data")
        if n_type == NT_GNU_BUILD_ID and bytes(data[name_end - namesz:name_end]) == GNU_OWNER:
            if not BUILD_ID_MIN_BYTES <= descsz <= BUILD_ID_MAX_BYTES:
                raise ElfError(MissReason.MALFORMED_ELF, f"GNU build-id note of {descsz} bytes")
            return BuildId(bytes(data[desc_start:desc_end]))
        off = (desc_end + 3) & ~3
    return None

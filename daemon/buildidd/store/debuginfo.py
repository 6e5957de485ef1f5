"""A binary's separate debuginfo: found on the host, copied next to its ``elf``.

Looked for, in gdb's order (gdb "Separate Debug Files"), and kept as ``debug``:

1. by build-id: ``/usr/lib/debug/.build-id/xx/rest.debug`` (perf: util/build-id.c
   ``build_id_cache__find_debug``; paths ending in ``.ko`` are skipped, as perf does);
2. by path: ``/usr/lib/debug/PATH.debug``;
3. by the binary's ``.gnu_debuglink`` (a file name and the CRC-32 of that file,
   binutils' ``--add-gnu-debuglink``): ``/usr/lib/debug/DIR/NAME``, ``DIR/.debug/NAME``
   and ``DIR/NAME``, DIR the binary's directory; accepted only when the CRC agrees.

A candidate is read only if it is a regular file owned by root and not writable by
others (a user's file never becomes a system binary's debuginfo), opened without
following a last symlink and without blocking; one with a build-id note must carry
the entry's.  ``.gnu_debugdata`` (MiniDebugInfo) travels inside the binary itself and
shows in the entry's quality (store.quality).
"""

from __future__ import annotations

import os
import stat
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from buildidd.errors import ElfError, StoreError
from buildidd.resolve.buildid import read_build_id_fd
from buildidd.store.counters import Tally
from buildidd.store.install import CopyRequest, Installed, Installer
from buildidd.store.layout import BUILD_ID_DIR, DEBUG_NAME, ELF_NAME

DEBUG_SECTION_NAMES = frozenset({b".debug_info", b".zdebug_info", b".symtab"})
"""Sections that make a copy useful for symbols beyond its dynamic symbols (DWARF, the full symbol table)."""

_MAX_SHDRS = 4096
_MAX_SHSTRTAB_BYTES = 1 << 20


def has_debug_sections(fd: int) -> bool:
    """Whether the ELF file on fd has a section named in :data:`DEBUG_SECTION_NAMES` (ELF gABI section headers).

    Bounded as :func:`section_names`; anything malformed or out of bounds answers False.

    Raises:
        OSError: reading failed.
    """
    return not DEBUG_SECTION_NAMES.isdisjoint(section_names(fd))


def section_names(fd: int) -> frozenset[bytes]:
    """The section names of the ELF file on fd (ELF gABI section headers and ``e_shstrndx``).

    Bounded as :func:`sections`; anything malformed or out of bounds answers an empty set.

    Raises:
        OSError: reading failed.
    """
    found = sections(fd)
    return frozenset(name for name, _off, _size in found[1]) if found else frozenset()


def lacks_section(fd: int, name: bytes) -> bool:
    """Whether the ELF file on fd surely has no section called name: its whole section header table
    and every section's name could be read (:func:`sections` with ``complete``), and none is name.

    False when in doubt (not ELF, malformed, beyond the bounds, a name that cannot be read): a caller
    that skips a costlier parser on True never skips one that could have found the section.

    Raises:
        OSError: reading failed.
    """
    found = sections(fd, complete=True)
    return found is not None and all(sname != name for sname, _off, _size in found[1])


def sections(fd: int, *, complete: bool = False) -> tuple[str, list[tuple[bytes, int, int]]] | None:
    """(byte order for struct, [(name, sh_offset, sh_size)]) of the ELF file on fd; None when it is
    not ELF or its section headers are malformed or out of bounds.

    Bounded: at most :data:`_MAX_SHDRS` headers and 1 MiB of section names are read
    (positioned reads).  A section whose name cannot be read (out of the names read, or not
    NUL-terminated in them) is left out, or with complete, makes the answer None.

    Raises:
        OSError: reading failed.
    """
    found = _section_table(fd)
    if found is None or (complete and not found[2]):
        return None
    return found[0], found[1]


@dataclass(frozen=True)
class CopySections:
    """What the store reads from a stored copy's section headers, read once (:func:`copy_sections`).

    Attributes:
        names: the section names read; complete: every section's name could be read (so a name not in
        names is surely absent, as :func:`lacks_section` answers); debuglink: ``.gnu_debuglink``'s
        (file name, CRC-32), as :func:`read_debuglink` answers.
    """

    names: frozenset[bytes]
    complete: bool
    debuglink: tuple[str, int] | None

    @property
    def has_debug(self) -> bool:
        """:func:`has_debug_sections`' answer."""
        return not DEBUG_SECTION_NAMES.isdisjoint(self.names)

    def lacks(self, name: bytes) -> bool:
        """:func:`lacks_section`' answer."""
        return self.complete and name not in self.names


def copy_sections(fd: int) -> CopySections:
    """The section facts of the ELF file on fd from one read of its headers (bounded as :func:`sections`);
    a file that is not ELF, or malformed, has none (names empty, not complete, no debuglink).

    Raises:
        OSError: reading failed.
    """
    found = _section_table(fd)
    if found is None:
        return CopySections(frozenset(), False, None)
    order, table, complete = found
    return CopySections(frozenset(name for name, _o, _s in table), complete, _debuglink(fd, order, table))


def _section_table(fd: int) -> tuple[str, list[tuple[bytes, int, int]], bool] | None:
    """:func:`sections` without complete, and whether every section's name was read."""
    head = os.pread(fd, 64, 0)
    if len(head) < 52 or head[:4] != b"\x7fELF" or head[5] not in (1, 2) or head[4] not in (1, 2):
        return None
    order = "<" if head[5] == 1 else ">"
    is64 = head[4] == 2
    if is64 and len(head) < 64:
        return None
    shoff = struct.unpack_from(order + ("Q" if is64 else "I"), head, 0x28 if is64 else 0x20)[0]
    shentsize, shnum, shstrndx = struct.unpack_from(order + "HHH", head, 0x3A if is64 else 0x2E)
    if not 0 < shnum <= _MAX_SHDRS or shentsize < (64 if is64 else 40) or shstrndx >= shnum:
        return None
    size = os.fstat(fd).st_size
    if shoff + shnum * shentsize > size:
        return None
    table = os.pread(fd, shnum * shentsize, shoff)
    if len(table) < shnum * shentsize:
        return None
    where = order + ("QQ" if is64 else "II")
    at = 0x18 if is64 else 0x10
    str_off, str_size = struct.unpack_from(where, table, shstrndx * shentsize + at)
    if str_off + str_size > size:
        return None
    names = os.pread(fd, min(str_size, _MAX_SHSTRTAB_BYTES), str_off)
    out = []
    whole = True
    for i in range(shnum):
        name_off = struct.unpack_from(order + "I", table, i * shentsize)[0]
        end = names.find(b"\0", name_off) if name_off < len(names) else -1
        if end >= 0:
            off, sz = struct.unpack_from(where, table, i * shentsize + at)
            out.append((names[name_off:end], off, sz))
        else:
            whole = False
    return order, out, whole


def _section_bytes(fd: int, name: bytes, max_bytes: int,
                   found: tuple[str, list[tuple[bytes, int, int]]] | None) -> tuple[bytes, str] | None:
    """The first max_bytes of the first section called name (in found: sections(fd)), and the byte
    order; None when absent or out of the file."""
    if found is None:
        return None
    order, table = found
    for sname, off, sz in table:
        if sname == name:
            if off + sz > os.fstat(fd).st_size:
                return None
            return os.pread(fd, min(sz, max_bytes), off), order
    return None


class Debuginfo:
    """Adds ``debug`` files from a host debuginfo tree.

    Attributes:
        debug_root: where separate debuginfo is looked for, as
            ``debug_root/.build-id/xx/rest.debug``.
    """

    def __init__(self, debug_root: Path, installer: Installer, tally: Tally):
        self.debug_root = debug_root
        self.installer = installer
        self.tally = tally

    def source(self, bid: str) -> Path:
        """``debug_root/.build-id/xx/rest.debug`` for a lower-case hex build-id."""
        return self.debug_root / BUILD_ID_DIR / bid[:2] / f"{bid[2:]}.debug"

    def candidates(self, bid: str, path: str, elf: Path | None = None,
                   known: CopySections | None = None) -> list[tuple[Path, int | None]]:
        """Where the debuginfo of the binary at path may be, in gdb's order: ``(file, CRC-32)``,
        the CRC given for a ``.gnu_debuglink`` candidate (read from elf, the stored copy, or taken from
        known, its sections read already), else None.
        """
        out: list[tuple[Path, int | None]] = [(self.source(bid), None)]
        if not path.startswith("/") or "\0" in path:
            return out
        out.append((self.debug_root / (path.lstrip("/") + ".debug"), None))
        link = known.debuglink if known is not None else read_debuglink(elf) if elf is not None else None
        if link is not None:
            name, crc = link
            directory = os.path.dirname(path)
            out += [(self.debug_root / directory.lstrip("/") / name, crc), (Path(directory) / ".debug" / name, crc),
                    (Path(directory) / name, crc)]
        return out

    def add(self, entry_dir: Path, bid: str, path: str, done: Installed, known: CopySections | None = None) -> int:
        """Copy the first debuginfo found (:meth:`candidates`) to entry_dir/debug; bytes added (0: none).

        Failures are counted (``debuginfo_mismatch``, ``debuginfo_errors``) and
        logged; the entry is added without debuginfo.  Nothing is raised.

        Args:
            entry_dir: the entry's directory (exists, with its ``elf``).
            bid: the entry's build-id, lower-case hex.
            path: the original file's path: its ``.ko`` suffix, and its directory for the debuglink.
            done: what this add made so far; the debug file is added to it.
            known: the sections of entry_dir's elf, read already (:func:`copy_sections`); None: read here.
        """
        if path.endswith(".ko") or (entry_dir / DEBUG_NAME).exists():
            return 0
        for source, crc in self.candidates(bid, path, entry_dir / ELF_NAME, known):
            fd = _open_system_file(source)
            if fd is None:
                continue
            try:
                if crc is not None and _crc32(fd) != crc:
                    self.tally.count("debuginfo_mismatch")
                    self.tally.warn("%s: CRC-32 does not match the debuglink; not stored", source)
                    continue
                return self._install(fd, source, entry_dir, bid, done)
            finally:
                os.close(fd)
        return 0

    def _install(self, fd: int, source: Path, entry_dir: Path, bid: str, done: Installed) -> int:
        """Copy the debuginfo open on fd to entry_dir/debug when its build-id is bid; bytes (0: not)."""
        try:
            got = read_build_id_fd(fd)
        except (ElfError, OSError) as e:
            got = None
            self.tally.warn("%s: cannot read its build-id: %s", source, e)
        if got is None or got.hex != bid:
            self.tally.count("debuginfo_mismatch")
            self.tally.warn("%s: build-id %s, not %s; not stored", source, got.hex if got else None, bid)
            return 0
        return install_beside(self.installer, fd, entry_dir / DEBUG_NAME, bid, str(source), done)


#: Longest debuglink name taken (a file name: NAME_MAX).
DEBUGLINK_NAME_MAX = 255
#: Largest debuginfo file whose CRC-32 is computed (bytes).
DEBUGLINK_CRC_MAX_BYTES = 4 << 30


def install_beside(installer: Installer, fd: int, final: Path, bid: str, what: str, done: Installed) -> int:
    """Copy fd, a file kept beside an entry (its separate debuginfo, the kernel's vmlinux), to final,
    verified to carry build-id bid (hex) as Installer.install_copy does; its bytes, or 0 when it could
    not be stored: counted (``debuginfo_errors``) and warned, never raised, since the entry stands
    without it.  A stored one is counted in ``debuginfo_added``."""
    try:
        _, size = installer.install_copy(CopyRequest(fd, os.fstat(fd), final, bid, what=what), done)
    except (StoreError, OSError) as e:
        installer.tally.count("debuginfo_errors")
        installer.tally.warn("%s: %s not stored: %s", what, final.name, e)
        return 0
    installer.tally.count("debuginfo_added")
    return size


def read_debuglink(elf: Path) -> tuple[str, int] | None:
    """The ``.gnu_debuglink`` of the ELF file at elf (a store copy): (file name, CRC-32), or None.

    The section holds the name, NUL-terminated and padded to 4 bytes, then the CRC-32 in the
    file's byte order (binutils bfd/opncls.c bfd_create_gnu_debuglink_section).  Bounded reads;
    a name with a ``/`` or none is refused.
    """
    try:
        fd = os.open(elf, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        found = sections(fd)
        return _debuglink(fd, found[0], found[1]) if found is not None else None
    except OSError:
        return None
    finally:
        os.close(fd)


def _debuglink(fd: int, order: str, table: list[tuple[bytes, int, int]]) -> tuple[str, int] | None:
    """read_debuglink's answer from the file's section table (sections(fd)).  Raises OSError."""
    found = _section_bytes(fd, b".gnu_debuglink", DEBUGLINK_NAME_MAX + 8, (order, table))
    if found is None:
        return None
    data, order = found
    end = data.find(b"\0")
    if end <= 0 or end > DEBUGLINK_NAME_MAX or b"/" in data[:end]:
        return None
    crc_at = (end + 4) & ~3
    if crc_at + 4 > len(data):
        return None
    name = data[:end].decode("utf-8", "surrogateescape")
    return (name, struct.unpack_from(order + "I", data, crc_at)[0]) if name not in (".", "..") else None


def _open_system_file(path: Path) -> int | None:
    """A read descriptor of path when it is a regular file owned by root and not writable by others
    (opened O_NOFOLLOW | O_NONBLOCK: a FIFO or a symlink at the last component is never followed
    into); None otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid == 0 and not st.st_mode & 0o002 and \
                st.st_size <= DEBUGLINK_CRC_MAX_BYTES:
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _crc32(fd: int) -> int:
    """zlib's CRC-32 of the whole file on fd (gnu_debuglink_crc32 is the same polynomial)."""
    crc, offset = 0, 0
    while True:
        chunk = os.pread(fd, 1 << 20, offset)
        if not chunk:
            return crc & 0xFFFFFFFF
        crc = zlib.crc32(chunk, crc)
        offset += len(chunk)

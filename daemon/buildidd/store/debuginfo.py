"""A binary's separate debuginfo: found on the host by build-id, copied next to its ``elf``.

perf: util/build-id.c ``build_id_cache__find_debug`` looks for the same
build-id under ``/usr/lib/debug/.build-id/xx/rest.debug`` and skips paths
ending in ``.ko``; the store does the same and keeps the file as ``debug``.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from buildidd.errors import ElfError, StoreError
from buildidd.resolve.buildid import read_build_id_fd
from buildidd.store.counters import Tally
from buildidd.store.install import CopyRequest, Installed, Installer
from buildidd.store.layout import BUILD_ID_DIR, DEBUG_NAME

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

    Bounded: at most :data:`_MAX_SHDRS` headers and 1 MiB of section names are
    read (positioned reads); anything malformed or out of bounds answers an empty set.

    Raises:
        OSError: reading failed.
    """
    head = os.pread(fd, 64, 0)
    if len(head) < 52 or head[:4] != b"\x7fELF" or head[5] not in (1, 2) or head[4] not in (1, 2):
        return frozenset()
    order = "<" if head[5] == 1 else ">"
    is64 = head[4] == 2
    if is64 and len(head) < 64:
        return frozenset()
    shoff = struct.unpack_from(order + ("Q" if is64 else "I"), head, 0x28 if is64 else 0x20)[0]
    shentsize, shnum, shstrndx = struct.unpack_from(order + "HHH", head, 0x3A if is64 else 0x2E)
    if not 0 < shnum <= _MAX_SHDRS or shentsize < (64 if is64 else 40) or shstrndx >= shnum:
        return frozenset()
    size = os.fstat(fd).st_size
    if shoff + shnum * shentsize > size:
        return frozenset()
    table = os.pread(fd, shnum * shentsize, shoff)
    if len(table) < shnum * shentsize:
        return frozenset()
    strtab_hdr = shstrndx * shentsize
    str_off, str_size = struct.unpack_from(order + ("QQ" if is64 else "II"), table, strtab_hdr + (0x18 if is64 else 0x10))
    if str_off + str_size > size:
        return frozenset()
    names = os.pread(fd, min(str_size, _MAX_SHSTRTAB_BYTES), str_off)
    out = set()
    for i in range(shnum):
        name_off = struct.unpack_from(order + "I", table, i * shentsize)[0]
        end = names.find(b"\0", name_off) if name_off < len(names) else -1
        if end >= 0:
            out.add(names[name_off:end])
    return frozenset(out)


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

    def add(self, entry_dir: Path, bid: str, path: str, done: Installed) -> int:
        """Copy debug_root/.build-id/xx/rest.debug to entry_dir/debug; bytes added (0: none).

        perf: ``build_id_cache__find_debug`` (the same name under
        ``/usr/lib/debug``), skipped for names ending in ``.ko``.  Failures are
        counted (``debuginfo_mismatch``, ``debuginfo_errors``) and logged; the
        entry is added without debuginfo.  Nothing is raised.

        Args:
            entry_dir: the entry's directory (exists).
            bid: the entry's build-id, lower-case hex.
            path: the original file's path (only its ``.ko`` suffix matters).
            done: what this add made so far; the debug file is added to it.
        """
        if path.endswith(".ko") or (entry_dir / DEBUG_NAME).exists():
            return 0
        source = self.source(bid)
        try:
            fd = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return 0
        except OSError as e:
            self.tally.count("debuginfo_errors")
            self.tally.warn("%s: cannot open debuginfo: %s", source, e.strerror)
            return 0
        try:
            try:
                got = read_build_id_fd(fd)
            except (ElfError, OSError) as e:
                got = None
                self.tally.warn("%s: cannot read its build-id: %s", source, e)
            if got is None or got.hex != bid:
                self.tally.count("debuginfo_mismatch")
                self.tally.warn("%s: build-id %s, not %s; not stored", source, got.hex if got else None, bid)
                return 0
            try:
                _, size = self.installer.install_copy(
                    CopyRequest(fd, os.fstat(fd), entry_dir / DEBUG_NAME, bid, what=str(source)), done)
            except (StoreError, OSError) as e:
                self.tally.count("debuginfo_errors")
                self.tally.warn("%s: debuginfo not stored: %s", source, e)
                return 0
            self.tally.count("debuginfo_added")
            return size
        finally:
            os.close(fd)

"""Symbolize a file offset of a stored binary: function name and offset into it.

The binary is looked up in the build-id store by build-id (``Store.best``: of
the copies one build-id may have, the one from a root-owned system file
first); its symbols come from its own ``.symtab``, else from the store's best
debug copy (``Store.best(kind="debug")``: the host's separate debuginfo, or an
unstripped copy), else from ``.dynsym`` (ELF gABI,
"Symbol Table"; read with pyelftools).  Only function symbols (``STT_FUNC``,
``STT_GNU_IFUNC``) with a non-zero address are kept.

A mapping gives an address's *file offset*; symbols are *virtual addresses*.
The file offset is converted through the ``PT_LOAD`` segment holding it
(``vaddr = offset - p_offset + p_vaddr``), as perf does for a DSO whose
symbols need adjusting (tools/perf/util/symbol-elf.c, ``dso__load_sym``).

Each binary's table is loaded once and cached by build-id (bounded LRU);
a binary that cannot be read is cached as such too.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from elftools.common.exceptions import ELFError, ELFParseError
from elftools.elf.elffile import ELFFile

from buildidd.errors import AnalysisError
from buildidd.store import Store

#: Binaries whose tables are kept in memory at once.
CACHE_BINARIES = 64
#: Function symbols read per table at most (a hostile or huge binary stops there).
MAX_SYMBOLS = 4_000_000
_FUNC_TYPES = ("STT_FUNC", "STT_GNU_IFUNC")


@dataclass(frozen=True)
class Symbol:
    """A function containing an address.

    Attributes:
        name: the symbol's name as in the table (not demangled).
        offset: bytes from the symbol's start to the address.
        size: the symbol's size in bytes (0 when the table gives none).
        source: ``"symtab"``, ``"debuginfo"`` or ``"dynsym"``.
    """

    name: str
    offset: int
    size: int
    source: str


class SymbolTable:
    """The function symbols and PT_LOAD segments of one ELF file.

    Raises (constructor):
        AnalysisError: the file cannot be opened or is not a readable ELF file.
    """

    def __init__(self, binary: Path, debuginfo: Path | None = None):
        self.loads: list[tuple[int, int, int]] = []      # (p_offset, p_filesz, p_vaddr)
        self.addrs: list[int] = []
        self.syms: list[tuple[str, int]] = []            # (name, size), parallel to addrs
        self.source = "none"
        with _open_elf(binary) as (elf, _f):
            for seg in elf.iter_segments():
                if seg["p_type"] == "PT_LOAD":
                    self.loads.append((seg["p_offset"], seg["p_filesz"], seg["p_vaddr"]))
            found = _functions(elf, ".symtab")
            if found:
                self.source = "symtab"
            elif debuginfo is not None and debuginfo.is_file():
                with _open_elf(debuginfo) as (delf, _df):
                    found = _functions(delf, ".symtab")
                self.source = "debuginfo" if found else "none"
            if not found:
                found = _functions(elf, ".dynsym")
                self.source = "dynsym" if found else "none"
        found.sort()
        self.addrs = [a for a, _n, _s in found]
        self.syms = [(n, s) for _a, n, s in found]

    def vaddr_of(self, file_offset: int) -> int | None:
        """The virtual address a file offset is loaded at, or ``None`` if no PT_LOAD holds it."""
        for off, filesz, vaddr in self.loads:
            if off <= file_offset < off + filesz:
                return file_offset - off + vaddr
        return None

    def lookup(self, file_offset: int) -> Symbol | None:
        """The function holding a file offset (bytes), or ``None``.

        A symbol with a size holds [value, value + size); one without a size
        holds everything up to the next symbol.
        """
        vaddr = self.vaddr_of(file_offset)
        if vaddr is None:
            return None
        i = bisect_right(self.addrs, vaddr) - 1
        if i < 0:
            return None
        name, size = self.syms[i]
        start = self.addrs[i]
        if size and vaddr >= start + size:
            return None
        return Symbol(name, vaddr - start, size, self.source)


class _open_elf:
    """Context manager: (ELFFile, file) of a path, AnalysisError when it is not ELF."""

    def __init__(self, path: Path):
        self.path = path
        self.f = None

    def __enter__(self):
        try:
            self.f = open(self.path, "rb")
            return ELFFile(self.f), self.f
        except OSError as e:
            self.__exit__()
            raise AnalysisError(f"{self.path}: cannot open: {e.strerror}") from e
        except (ELFError, ELFParseError) as e:
            self.__exit__()
            raise AnalysisError(f"{self.path}: not a readable ELF file: {e}") from e

    def __exit__(self, *exc) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None


def _functions(elf: ELFFile, section_name: str) -> list[tuple[int, str, int]]:
    """(address, name, size) of the function symbols of one symbol table; [] if absent.

    Raises:
        AnalysisError: the table is malformed.
    """
    try:
        sec = elf.get_section_by_name(section_name)
        if sec is None or not hasattr(sec, "iter_symbols"):
            return []
        out = []
        for sym in sec.iter_symbols():
            if sym["st_info"]["type"] in _FUNC_TYPES and sym["st_value"] and sym.name:
                out.append((sym["st_value"], sym.name, sym["st_size"]))
                if len(out) >= MAX_SYMBOLS:
                    break
        return out
    except (ELFError, ELFParseError, ValueError, UnicodeDecodeError) as e:
        raise AnalysisError(f"malformed {section_name}: {e}") from e


class Symbolizer:
    """Symbols of stored binaries by build-id, each table loaded once (LRU of :data:`CACHE_BINARIES`).

    Attributes:
        errors: build-id → why its binary could not be symbolized (not in the
            store, not ELF ...), for the build-ids met so far.
    """

    def __init__(self, store: Store | None):
        self.store = store
        self.errors: dict[str, str] = {}
        self._tables: OrderedDict[str, SymbolTable | None] = OrderedDict()

    def table(self, build_id_hex: str) -> SymbolTable | None:
        """The symbol table of the stored binary with that build-id, or ``None`` (reason in :attr:`errors`)."""
        if build_id_hex in self._tables:
            self._tables.move_to_end(build_id_hex)
            return self._tables[build_id_hex]
        table = None
        try:
            path = self.store.best(build_id_hex, "elf") if self.store is not None else None
            if path is None:
                self.errors[build_id_hex] = "not_in_store"
            else:
                debug = self.store.best(build_id_hex, "debug")
                table = SymbolTable(path, debug if debug != path else None)
        except (AnalysisError, ValueError) as e:
            self.errors[build_id_hex] = str(e)
        self._tables[build_id_hex] = table
        if len(self._tables) > CACHE_BINARIES:
            self._tables.popitem(last=False)
        return table

    def symbolize(self, build_id_hex: str, file_offset: int) -> Symbol | None:
        """The function at file_offset (bytes) of the binary with that build-id, or ``None``."""
        table = self.table(build_id_hex)
        return table.lookup(file_offset) if table is not None else None

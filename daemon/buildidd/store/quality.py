"""What a stored copy is good for: the symbols an ELF file carries, named in one word.

Read from the section headers (:func:`buildidd.store.debuginfo.section_names`,
bounded), best first (:data:`QUALITIES`):

- ``dwarf``: ``.debug_info`` (or ``.zdebug_info``): lines, types, inlines;
- ``symtab``: the full symbol table, no DWARF;
- ``minidebuginfo``: ``.gnu_debugdata``, the xz-compressed symbol table of a
  stripped binary (gdb "MiniDebugInfo", Fedora's default);
- ``go_pclntab``: ``.gopclntab``, Go's own function and line table, which Go
  symbolizers read without DWARF;
- ``dynsym``: only the dynamic symbols (exported functions);
- ``none``: no symbol table at all (a stripped static binary).

An entry's quality is its best file's: the binary, or the separate debuginfo
beside it.  Shown by ``buildid-list``, the archive manifest, serve's
``X-Buildidd-Quality`` header and /metrics.
"""

from __future__ import annotations

import os

from buildidd.store.debuginfo import section_names

__all__ = ["QUALITIES", "best_quality", "elf_quality", "path_quality"]

QUALITIES = ("dwarf", "symtab", "minidebuginfo", "go_pclntab", "dynsym", "none")
"""Every quality, best first."""

_MARKS = (("dwarf", (b".debug_info", b".zdebug_info")), ("symtab", (b".symtab",)),
          ("minidebuginfo", (b".gnu_debugdata",)), ("go_pclntab", (b".gopclntab", b".data.rel.ro.gopclntab")),
          ("dynsym", (b".dynsym",)))


def elf_quality(fd: int) -> str:
    """The quality (one of :data:`QUALITIES`) of the ELF file on fd; ``none`` for a file without
    section headers or one that is not ELF.

    Raises:
        OSError: reading failed.
    """
    names = section_names(fd)
    for quality, sections in _MARKS:
        if not names.isdisjoint(sections):
            return quality
    return "none"


def path_quality(path: str | os.PathLike) -> str | None:
    """:func:`elf_quality` of the regular file at path (a store file: not followed if a symlink);
    None when it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return elf_quality(fd)
    except OSError:
        return None
    finally:
        os.close(fd)


def best_quality(*qualities: str | None) -> str | None:
    """The best of qualities (None ignored); None when all are None."""
    known = [q for q in qualities if q in QUALITIES]
    return min(known, key=QUALITIES.index) if known else None

"""The trees ``buildidd import`` lays out in its directory DIR (the analyst's store), for perf and gdb.

Layout installed (perf, tools/perf/util/build-id.c): ``DIR/<path>/<build-id>/elf``
(``debug``, ``probes``; ``kallsyms``, ``modules``, ``vmlinux`` for the kernel),
``DIR/.build-id/xx/rest -> ../../<path>/<build-id>`` so that
``perf --buildid-dir DIR report`` finds them, and
``DIR/.build-id/xx/rest.debug -> ../../<path>/<build-id>/debug``, or ``…/elf``
when no separate debuginfo is held (gdb finds a named executable's debuginfo
there with ``set debug-file-directory DIR``).

gdb's tree, for a core without its executable (gdb 13 looks up a core's
executable at ``DEBUG-FILE-DIRECTORY/.build-id/xx/rest``, a file, which perf's
layout makes a directory): ``DIR/.gdb/.build-id/xx/rest -> ../../../<path>/<build-id>/elf``
and ``rest.debug`` beside it (``debug``, else ``elf``), for GNU build-ids whose
entry holds an ``elf``; so ``gdb -iex 'set debug-file-directory DIR/.gdb' -c CORE``
needs nothing else.  An archive cannot name a file there: an entry's first
component is never hidden (manifest.check_entry).

File times: every installed file gets the member's mtime from the archive (the
store copy's on the host, which the store keeps from the file it copied), so
gdb does not find an executable newer than a core dumped on the host, and
``buildidd serve`` of the imported tree gives that time as Last-Modified.  An
mtime outside [0, 2**34) s is not applied (the file keeps the import's time).
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from buildidd.errors import ArchiveError
from buildidd.offline import manifest as mf
from buildidd.store import BUILD_ID_DIR, DEBUG_NAME, ELF_NAME
from buildidd.store.origin import KEY_GNU

__all__ = ["GDB_DIR", "STAGE_PREFIX", "install_links", "keep_time", "safe_dirs"]

GDB_DIR = ".gdb"
"""The directory under DIR holding gdb's ``.build-id`` tree (see the module docstring)."""

STAGE_PREFIX = ".buildidd-import-"
"""The name prefix of import's temporary files and directories in its targets."""

#: Member mtimes applied to installed files lie in [0, this) s since the epoch (the year 2514).
MTIME_LIMIT_S = 1 << 34


def keep_time(fd: int, mtime) -> None:
    """Give the open file fd the archive member's mtime (s since the epoch, int or float, from the tar
    header): atime and mtime both; nothing when mtime is not a number in [0, MTIME_LIMIT_S).

    Raises:
        OSError: futimens failed.
    """
    if isinstance(mtime, (int, float)) and 0 <= mtime < MTIME_LIMIT_S:
        ns = int(mtime * 1_000_000_000)
        os.utime(fd, ns=(ns, ns))


def safe_dirs(root: Path, parts: tuple[str, ...], *, create: bool) -> Path:
    """root/parts..., each component a real directory (never a symlink); made (0o755) when create.

    Raises:
        ArchiveError: ``target_symlink`` a component is a symlink or not a directory.
    """
    d = root
    for p in parts:
        d = d / p
        try:
            st = os.lstat(d)
        except FileNotFoundError:
            if not create:
                return root.joinpath(*parts)
            os.mkdir(d, 0o755)
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise ArchiveError("target_symlink", f"{d}: not a directory (a symlink?); refusing to write through it")
    return d


def _symlink_over(link: Path, target: str) -> None:
    tmp = link.with_name(f".{link.name}{STAGE_PREFIX}{secrets.token_hex(4)}")
    os.symlink(target, tmp)
    os.replace(tmp, link)


def install_links(debug_dir: Path, ref) -> None:
    """``.build-id/xx/rest`` (perf) and ``rest.debug`` for an installed entry, and gdb's tree
    (``.gdb/.build-id/xx/rest`` and ``rest.debug``; see the module docstring)."""
    heads = safe_dirs(debug_dir, (BUILD_ID_DIR, ref.build_id[:2]), create=True)
    link = heads / ref.build_id[2:]
    if not (os.path.islink(link) and os.path.isdir(link)):
        _symlink_over(link, mf.link_target(ref.entry))
    if ref.key != KEY_GNU:
        return                  # gdb looks up files by GNU build-id: an htlhash is none
    entry = debug_dir / ref.entry
    _link_debug(heads / (ref.build_id[2:] + ".debug"), entry, mf.link_target(ref.entry))
    if not (entry / ELF_NAME).is_file():
        return                  # a kernel's or a vDSO's entry: no core's executable
    gdb_heads = safe_dirs(debug_dir, (GDB_DIR, BUILD_ID_DIR, ref.build_id[:2]), create=True)
    target = "../" + mf.link_target(ref.entry)          # from .gdb/.build-id/xx/ up to DIR
    exe = gdb_heads / ref.build_id[2:]
    if not (os.path.islink(exe) and os.readlink(exe) == f"{target}/{ELF_NAME}"):
        _symlink_over(exe, f"{target}/{ELF_NAME}")
    _link_debug(gdb_heads / (ref.build_id[2:] + ".debug"), entry, target)


def _link_debug(dbg: Path, entry: Path, target: str) -> None:
    """dbg -> target/debug, else target/elf (entry's files), made or moved from elf to debug once a
    debug file is held; nothing when the entry has neither."""
    name = DEBUG_NAME if (entry / DEBUG_NAME).is_file() else ELF_NAME if (entry / ELF_NAME).is_file() else None
    if name is None:
        return
    want = f"{target}/{name}"
    current = os.readlink(dbg) if os.path.islink(dbg) else None
    if not os.path.exists(dbg) or (current == f"{target}/{ELF_NAME}" and current != want):
        _symlink_over(dbg, want)

"""What the debuginfod protocol serves from the build-id store (``/buildid/HEX/{executable,debuginfo,section/NAME,source/PATH}``, routed by :mod:`buildidd.offline.serve.buildid`).

What a client expects, from elfutils (debuginfod/debuginfod.cxx, the server;
debuginfod-client.c, the client; both 0.188, Debian 12) and the protocol's man
page debuginfod(8), "WEBAPI":

* ``/buildid/HEX/executable`` and ``/buildid/HEX/debuginfo``: the file's bytes,
  ``Content-Type: application/octet-stream``, ``Content-Length``,
  ``Last-Modified`` (the served file's mtime), ``X-DEBUGINFOD-SIZE`` (the
  whole file's size in bytes, also in a 206 answer) and ``X-DEBUGINFOD-FILE``
  (the file's basename).  HEAD answers the headers alone; ``Range`` is honoured
  (aiohttp's ``FileResponse``, which also sends with ``sendfile(2)``).
* ``/buildid/HEX/section/NAME``: the section's raw bytes (its ``sh_size`` bytes
  at ``sh_offset``, ELF gABI section header), looked up in the debuginfo first,
  then in the executable.  A client that gets a 503 fetches the whole file and
  extracts the section itself; a 404 it caches as "missing".  So: 404 only when
  no held file has the section (or it has no bytes, ``SHT_NOBITS``), 503 when
  the section is too large to extract here or the file cannot be parsed.
* ``/buildid/HEX/source/PATH``: 404 (the store holds no sources), 400 for a
  path with a ``..`` component or a NUL.
* The build-id: lower-case hex, even length, 2 to 126 characters; anything
  else is 400 (elfutils ≥ 0.188 answers 400 too).

404 and 500 are cached by clients for ``cache_miss_s`` (600 s by default,
debuginfod-client.c ``cache_miss_default_s``).  A file that is held but cannot
be opened or read right now (EACCES, EIO, a link whose target is unreadable)
is therefore answered 503 with ``Retry-After``, never 404 or 500, and logged.
(elfutils 0.188's client maps every HTTP error to ENOENT and caches even the
503; newer clients and the federating server tell it apart.)

The store is read only through :class:`buildidd.store.Store`'s public lookups
and perf's cache layout (``elf``, ``debug``, ``vmlinux`` in the entry directory
the ``.build-id/xx/rest`` link points to); nothing here writes to it.  Which
copy is served is the store's choice (:meth:`~buildidd.store.Store.best`: a
copy from a root-owned system file before one a user's file claimed, an
unstripped copy for ``debuginfo``).  A copy the store marked private (its
source was not readable by every user, or a memfd) is served only to a caller
with rights when the operator allows it (``Config.store_share_private``); see
:class:`Privacy` and :mod:`buildidd.offline.serve.rights`.  Every lookup
decides it from the entry's ``origin.json`` (``Store.is_private``) before any
held file is opened.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import stat
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from elftools.common.exceptions import ELFError, ELFParseError
from elftools.elf.elffile import ELFFile

from buildidd.offline.serve.send import OpenFd, SectionResponse, refuse_zero_suffix
from buildidd.store import DEBUG_NAME, ELF_NAME, KALLSYMS_NAME, VDSO_NAME, Store

log = logging.getLogger(__name__)

BUILD_ID_RE = re.compile(r"(?:[0-9a-f]{2}){1,63}")
"""A build-id as the protocol names it: lower-case hex, even length, 2 to 126 characters."""

STORE_MIN_BUILD_ID_HEX = 4
"""The store's layout (``.build-id/xx/rest``) holds build-ids of 2 bytes or more; shorter ones are never held."""

VMLINUX_NAME = "vmlinux"
"""The kernel image next to a kernel entry's kallsyms (buildidd's addition to perf's layout)."""

SECTION_MAX_BYTES = 64 << 20
"""A section larger than this is not extracted (503: the client fetches the file and extracts it)."""

SECTION_NAME_RE = re.compile(r"[\x21-\x7e]{1,255}")
"""A section name: 1 to 255 printable ASCII characters without spaces (no ``/``, checked apart)."""

SHT_NOBITS = "SHT_NOBITS"

ARTIFACTS = ("executable", "debuginfo", "section", "source")
"""The artifact types of the protocol, the ``artifact`` label of the lookup counters."""


WITHHELD_LOG_MAX = 4096
"""Build-ids whose private copy was withheld that :class:`Privacy` remembers as logged (then it logs no more)."""


class Unavailable(Exception):
    """A file is held but cannot be read right now: the answer is 503 (never 404/500), and it is logged."""


class Withheld(Exception):
    """A build-id is held, but its copy is private and not shared with this caller: the answer is 403 with
    the reason and the key that shares it (``store_share_private``) to a caller with rights, and to anyone
    else exactly the 404 of a build-id not held (:mod:`buildidd.offline.serve.rights`)."""


@dataclass(frozen=True)
class Held:
    """A file the store holds for a build-id.

    Attributes:
        path: the file in the store (``ROOT/<path>/<build-id>/elf``, ``…/debug``, ``…/vmlinux``).
        name: the basename clients see in ``X-DEBUGINFOD-FILE``: the original
            file's name (``true``), ``NAME.debug`` for its debuginfo.
        provenance: the entry's provenance (``Store.provenance``), sent as ``X-Buildidd-Provenance``.
        quality: what the entry is good for (``Store.quality``), sent as ``X-Buildidd-Quality``.
        key: what the entry is named by (``Store.key_kind``: ``gnu``, ``htlhash``), sent as
            ``X-Buildidd-Key`` when it is not a GNU build-id.
    """

    path: Path
    name: str
    provenance: str | None = None
    quality: str | None = None
    key: str | None = None


@dataclass
class Privacy:
    """Whether private store copies are served, and which withheld ones were logged.

    Attributes:
        share_private: serve copies the store marked private (``Config.store_share_private``); the server's
            policy applies to one caller through :meth:`for_caller`.
        withheld: ``(build-id, kind)`` pairs withheld so far, each logged once
            (at most :data:`WITHHELD_LOG_MAX`; beyond that they are withheld silently).
    """

    share_private: bool = False
    withheld: set = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def for_caller(self, entitled: bool) -> "Privacy":
        """This policy for one caller: private copies are shared only with a caller with rights (entitled);
        the log of withheld ones stays shared."""
        return self if entitled or not self.share_private else Privacy(False, self.withheld, self._lock)

    def allows(self, store: Store, build_id_hex: str, kind: str) -> bool:
        """Whether :meth:`Store.best` (build_id_hex, kind) may be served; logs a withheld one once.

        Raises:
            Unavailable: the store cannot be examined right now.
        """
        if self.share_private:
            return True
        try:
            private = store.is_private(build_id_hex, kind)
        except OSError as e:
            raise Unavailable(f"{build_id_hex}: {e.strerror}") from e
        if not private:
            return True
        with self._lock:
            first = (build_id_hex, kind) not in self.withheld and len(self.withheld) < WITHHELD_LOG_MAX
            if first:
                self.withheld.add((build_id_hex, kind))
        if first:
            log.info("withheld %s (%s): its copy is private (403 to callers with rights, unless "
                     "store_share_private; 404 to others)", build_id_hex, kind)
        return False


SHARE_NOTHING_PRIVATE = Privacy()
"""The default policy: private copies are never served."""


def check_build_id(text: str) -> str:
    """The build-id of a request path, validated.

    Raises:
        web.HTTPBadRequest: not lower-case hex of even length, 2 to 126 characters.
    """
    if not BUILD_ID_RE.fullmatch(text):
        raise web.HTTPBadRequest(text="build-id must be lower-case hex of even length, 2 to 126 characters\n")
    return text


def _lstat_held(path: Path) -> os.stat_result | None:
    """lstat a file the layout names: None when absent, Unavailable when it exists but cannot be examined."""
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return None
    except OSError as e:
        raise Unavailable(f"{path}: {e.strerror}") from e


def main_file(store: Store, build_id_hex: str) -> Path | None:
    """The entry's main file (``elf``, ``vdso`` or ``kallsyms``: ``Store.best(kind="elf")``, the trusted
    copy first) or None when the store does not hold build_id_hex.

    A ``.build-id`` link that exists but cannot be followed for another reason
    than its absence (EACCES, EIO, ELOOP), or whose directory cannot be listed,
    is "held but unreadable".

    Raises:
        Unavailable: the link or its target cannot be examined right now.
    """
    if len(build_id_hex) < STORE_MIN_BUILD_ID_HEX:
        return None
    try:
        path = store.best(build_id_hex, "elf")
    except OSError as e:
        raise Unavailable(f"{build_id_hex}: {e.strerror}") from e
    if path is not None:
        return path
    link = store.linkname(build_id_hex)
    if _lstat_held(link) is None:
        return None
    try:
        os.stat(link)
        names = os.listdir(link)   # an entry directory this server may not read is held, not absent
    except (FileNotFoundError, NotADirectoryError):
        return None  # a dangling link: the entry was removed
    except OSError as e:
        raise Unavailable(f"{link}: {e.strerror}") from e
    if any(n in names for n in (ELF_NAME, VDSO_NAME, KALLSYMS_NAME)):
        raise Unavailable(f"{link}: its main file cannot be examined")
    return None  # the link leads out of the store or to no main file: not an entry


def _original_name(main: Path) -> str:
    """The original file's basename from ``ROOT/<path>/<build-id>/<file>``."""
    return main.parent.parent.name


def find_executable(store: Store, build_id_hex: str, privacy: Privacy = SHARE_NOTHING_PRIVATE) -> Held | None:
    """What ``/buildid/HEX/executable`` serves: the binary (``elf``/``vdso``), or a kernel's ``vmlinux``.

    None when not held.

    Raises:
        Unavailable: held but cannot be examined right now.
        Withheld: held, but its copy is private and privacy does not share it.
    """
    main = main_file(store, build_id_hex)
    if main is None:
        return None
    if not privacy.allows(store, build_id_hex, "elf"):
        raise Withheld(build_id_hex)
    try:
        provenance, quality = store.provenance(build_id_hex), store.quality(build_id_hex)
        key = store.key_kind(build_id_hex)
    except OSError as e:
        raise Unavailable(f"{build_id_hex}: {e.strerror}") from e
    if main.name == KALLSYMS_NAME:
        vmlinux = main.parent / VMLINUX_NAME
        st = _lstat_held(vmlinux)
        return Held(vmlinux, VMLINUX_NAME, provenance, quality) if st is not None and stat.S_ISREG(st.st_mode) \
            else None
    return Held(main, _original_name(main), provenance, quality, key)


def find_debuginfo(store: Store, build_id_hex: str, privacy: Privacy = SHARE_NOTHING_PRIVATE) -> Held | None:
    """What ``/buildid/HEX/debuginfo`` serves: ``Store.best(kind="debug")`` (the host's ``debug`` file, else
    a copy with ``.debug_info``/``.symtab``), else the binary if it has ``.symtab``.

    gdb asks only for debuginfo; a binary that was not stripped is its own
    debuginfo (it has a symbol table, perhaps DWARF).  Nothing is served for
    a build-id whose executable is withheld (private).

    Raises:
        Unavailable: held but cannot be examined right now.
        Withheld: the executable is held but private (find_executable).
    """
    held = find_executable(store, build_id_hex, privacy)
    if held is None:
        return None
    try:
        best = store.best(build_id_hex, "debug")
    except OSError as e:
        raise Unavailable(f"{build_id_hex}: {e.strerror}") from e
    if best is not None and privacy.allows(store, build_id_hex, "debug"):
        return Held(best, held.name + ".debug" if best.name == DEBUG_NAME else held.name, held.provenance,
                    held.quality)
    debug = held.path.parent / DEBUG_NAME
    st = _lstat_held(debug)
    if st is not None and stat.S_ISREG(st.st_mode):
        return Held(debug, held.name + ".debug", held.provenance, held.quality)
    if has_symtab(held.path):
        return held
    return None


def _section_header(path: Path, name: str) -> tuple[int, int, str] | None:
    """(sh_offset, sh_size, sh_type) of the first section called name, or None.

    Raises:
        OSError: the file cannot be opened or read.
        ELFError, ELFParseError, ValueError, …: pyelftools' ways of saying "malformed".
    """
    with open(path, "rb") as f:
        elf = ELFFile(f)
        for section in elf.iter_sections():
            if section.name == name:
                return section["sh_offset"], section["sh_size"], section["sh_type"]
    return None


_ELF_PARSE_ERRORS = (ELFError, ELFParseError, ValueError, KeyError, IndexError, AssertionError, OverflowError)


@functools.lru_cache(maxsize=4096)
def _has_symtab_cached(path: str, _ino: int, _mtime_ns: int, _size: int) -> bool:
    try:
        header = _section_header(Path(path), ".symtab")
    except _ELF_PARSE_ERRORS:
        return False  # malformed section headers: no symbol table anyone can use
    return header is not None and header[2] != SHT_NOBITS


def has_symtab(path: Path) -> bool:
    """Whether the ELF file has a ``.symtab`` section with bytes (not stripped).

    Answers are cached by the file's identity (inode, mtime, size): store files
    do not change once written.

    Raises:
        Unavailable: the file cannot be opened or read.
    """
    try:
        st = os.stat(path)
        return _has_symtab_cached(os.fspath(path), st.st_ino, st.st_mtime_ns, st.st_size)
    except OSError as e:
        raise Unavailable(f"{path}: {e.strerror}") from e


@dataclass(frozen=True)
class Section:
    """Where a section's bytes lie: in held's file, size_bytes at offset (``sh_offset``, ``sh_size``)."""

    held: Held
    offset: int
    size_bytes: int


def find_section(held: list[Held], name: str) -> Section | None:
    """The first of the held files that has section name with bytes; its place in that file.

    Returns None when none has it (or only as ``SHT_NOBITS``).  Nothing of
    the section is read here: :func:`open_section` streams it.

    Raises:
        Unavailable: a file cannot be read, cannot be parsed, or the section
            exceeds :data:`SECTION_MAX_BYTES` (the client should extract it).
    """
    for h in held:
        try:
            header = _section_header(h.path, name)
        except OSError as e:
            raise Unavailable(f"{h.path}: {e.strerror}") from e
        except _ELF_PARSE_ERRORS as e:
            raise Unavailable(f"{h.path}: section headers cannot be parsed: {e}") from e
        if header is None or header[2] == SHT_NOBITS:
            continue
        offset, size, _type = header
        if size > SECTION_MAX_BYTES:
            raise Unavailable(f"{h.path}: section {name} is {size} bytes, over {SECTION_MAX_BYTES}: not extracted")
        return Section(h, offset, size)
    return None


def open_section(section: Section, name: str) -> SectionResponse:
    """Open the section's file (``O_NOFOLLOW``) and make its answer, streamed from the file.

    Blocking (open, fstat): call it in a thread.

    Raises:
        Unavailable: the file cannot be opened, is not a regular file, or ends before the section does.
    """
    path = section.held.path
    fd, st = _open_regular(path)
    try:
        if section.offset + section.size_bytes > st.st_size:
            raise Unavailable(f"{path}: section {name} extends past the end of the file")
        headers = file_headers(Held(path, name, section.held.provenance, section.held.quality), section.size_bytes)
        return SectionResponse(fd, section.offset, section.size_bytes, headers)
    except BaseException:
        os.close(fd)
        raise


def _open_regular(path: Path) -> tuple[int, os.stat_result]:
    """Open path (``O_NOFOLLOW``), a regular file: (fd, its fstat).  Raises Unavailable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as e:
        raise Unavailable(f"{path}: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Unavailable(f"{path}: not a regular file")
        return fd, st
    except BaseException:
        os.close(fd)
        raise


def file_headers(held: Held, size_bytes: int) -> dict[str, str]:
    """The debuginfod headers of a file answer (debuginfod.cxx ``add_mhd_response_header`` calls)."""
    headers = {"Content-Type": "application/octet-stream",
               "X-DEBUGINFOD-SIZE": str(size_bytes),
               "X-DEBUGINFOD-FILE": held.name}
    if held.provenance is not None:
        headers["X-Buildidd-Provenance"] = held.provenance   # buildidd's: Store.provenance of the entry
    if held.quality is not None:
        headers["X-Buildidd-Quality"] = held.quality         # buildidd's: Store.quality of the entry
    if held.key not in (None, "gnu"):
        headers["X-Buildidd-Key"] = held.key                 # buildidd's: the id asked for is an htlhash
    return headers


class HeldFileResponse(web.FileResponse):
    """aiohttp's FileResponse over a file opened beforehand, through ``/proc/self/fd/N``.

    FileResponse opens its path itself and answers 403/404 when that fails; here
    the file was opened (and checked) by :func:`open_held` first, so what is
    served is that inode even if renamed or unlinked since, and the fd is
    closed once the answer went out.
    """

    def __init__(self, fd: int, headers: dict[str, str]):
        super().__init__(f"/proc/self/fd/{fd}", headers=headers)
        self._held_fd = OpenFd(fd)
        weakref.finalize(self, self._held_fd.close)

    async def prepare(self, request: web.BaseRequest):
        if self.prepared:
            return None
        try:
            if self._held_fd.fd is not None:
                refuse_zero_suffix(request, os.fstat(self._held_fd.fd).st_size)
            return await super().prepare(request)
        finally:
            self._held_fd.close()


def open_held(held: Held) -> HeldFileResponse:
    """Open held (``O_NOFOLLOW``) and make its answer: GET or HEAD, Range, conditional requests, sendfile.

    Blocking (open, fstat): call it in a thread.

    Raises:
        Unavailable: the file cannot be opened right now, or is no longer a regular file.
    """
    fd, st = _open_regular(held.path)
    try:
        return HeldFileResponse(fd, file_headers(held, st.st_size))
    except BaseException:
        os.close(fd)
        raise


def check_source_path(path: str) -> str:
    """A source path of ``/buildid/HEX/source/PATH``.

    Raises:
        web.HTTPBadRequest: empty, a NUL, or a ``..`` component (``%2e%2e`` too:
            aiohttp has decoded the path already).
    """
    if not path or "\0" in path or ".." in path.split("/"):
        raise web.HTTPBadRequest(text="source path must not be empty or contain '..' components or NUL\n")
    return path


def check_section_name(name: str) -> str:
    """A section name of ``/buildid/HEX/section/NAME``.

    Raises:
        web.HTTPBadRequest: not 1 to 255 printable characters, or a ``/``.
    """
    if not SECTION_NAME_RE.fullmatch(name) or "/" in name:
        raise web.HTTPBadRequest(text="section name must be 1 to 255 printable characters without '/'\n")
    return name


def unavailable(e: Unavailable) -> web.HTTPServiceUnavailable:
    """The 503 answer for a held file that cannot be read now (the caller logs the reason, at a limited rate)."""
    return web.HTTPServiceUnavailable(text="held but not readable right now; try again later\n",
                                      headers={"Retry-After": "60"})


__all__ = ["ARTIFACTS", "BUILD_ID_RE", "Held", "Privacy", "Unavailable", "check_build_id", "check_section_name",
           "check_source_path", "find_debuginfo", "find_executable", "has_symtab", "main_file",
           "find_section", "open_held", "open_section", "refuse_zero_suffix", "unavailable"]

"""The build-id store: snapshots of mapped files, laid out as perf's build-id cache.

Pipeline stage: enrichment → session log **and store** → clients.  Enrichment
hands over an open fd of a file it has identified (its identity checked, its
build-id read); the store keeps a copy under that build-id so that the file can
be symbolized after it was replaced, deleted or the host is gone.  Session
retention (:func:`enforce_retention`) and the set of build-ids that retained
sessions still reference (:func:`session_build_ids`) live here too, because the
store's quota must never drop an entry a retained session needs.

Layout
======

The same tree ``perf buildid-cache -a FILE`` writes (Linux
``tools/perf/util/build-id.c``: ``build_id_cache__add``,
``build_id_cache__cachedir``, ``build_id_cache__linkname``,
``build_id_cache__basename``), so that ``perf --buildid-dir ROOT report``,
``perf buildid-cache -l`` and ``perf probe`` read it as their own.  Observed
with perf 6.1 (Debian linux-perf) on this project's test host::

    ROOT/                                     mode 0o755
      .build-id/c8/9156ebdabf859f4ee70cb0c303004dccf1ae51
            -> ../../usr/bin/true/c89156ebdabf859f4ee70cb0c303004dccf1ae51
      usr/bin/true/c89156ebdabf859f4ee70cb0c303004dccf1ae51/
        elf        the file
        debug      /usr/lib/debug/.build-id/c8/9156ebdabf859f4ee70cb0c303004dccf1ae51.debug,
                   when that exists (perf: build_id_cache__find_debug)
        probes     perf's SDT probe cache, empty when the file has no
                   .note.stapsdt (perf: build_id_cache__add_sdt_cache)
      [kernel.kallsyms]/4a5a9b0affb66c437abcd455d2738af879985fa9/
        kallsyms   /proc/kallsyms (perf record's cache of the kernel)
        modules    /proc/modules            (buildidd's addition, not perf's)
        vmlinux    the kernel image, when found (buildidd's addition)
      .build-id/4a/5a9b0affb66c437abcd455d2738af879985fa9
            -> ../../[kernel.kallsyms]/4a5a9b0affb66c437abcd455d2738af879985fa9

* The entry directory is ``ROOT`` + the file's absolute path + ``/`` + the
  build-id in lower-case hex; directories are made with mode 0o755.
* The link is ``ROOT/.build-id/`` + the first two hex digits + ``/`` + the
  rest, a *relative* symlink ``"../.."`` + path + ``/`` + build-id
  (``build_id_cache__add``: ``memcpy(tmp, "../..", 5)``).  A file is found by
  build-id through the link: ``ROOT/.build-id/xx/rest/elf`` (``…/debug``,
  ``…/kallsyms``, ``…/vdso``: ``__dso__build_id_filename``).
* ``probes`` is written for every regular file (not for kallsyms), byte for
  byte as perf writes it (:func:`sdt_probe_cache`).
* Build-ids of 2 to 64 bytes are stored; perf handles at most 20
  (``BUILD_ID_SIZE``) and lists (``-l``) only those of 8 to 20 bytes
  (build-id.c ``lsdir_bid_tail_filter``: ``SBUILD_ID_MIN_SIZE``, ``SBUILD_ID_SIZE``).
* perf finds the directory from ``perf --buildid-dir DIR`` or the config key
  ``buildid.dir``, default ``$HOME/.debug``.  perf 6.1 does not *read*
  ``PERF_BUILDID_DIR``: ``set_buildid_dir()`` (util/config.c) sets it for the
  commands perf runs.  (``PERF_BUILDID_DIR=/tmp/x perf buildid-cache -a`` writes
  to ``~/.debug``.)

Where this store differs from perf, on purpose:

* perf *hard-links* ``elf`` and ``debug`` to the original when both are on one
  file system, and copies with mode 0o755 otherwise (util/copyfile.c
  ``copyfile()``).  A hard link is not a snapshot (an in-place rewrite of the
  original changes it), so the store always copies: a reflink (``FICLONE``)
  where the file system shares extents, else ``copy_file_range``/``sendfile``/
  ``pread``.  The copy keeps the source's permission bits less set-user-ID,
  set-group-ID, sticky, and group/other write (``st_mode & 0o755``): a copy of
  a setuid binary in the store is not setuid.
* The entry's name is the path given by the caller (the kernel's ``d_path`` of
  the mapping), not a ``realpath()`` in the daemon's mount namespace.
* One entry per build-id: adding a build-id already present does nothing
  (perf makes a second directory whose link then points elsewhere).
* ``kallsyms`` is stored only for the running kernel's build-id (checked
  against ``/sys/kernel/notes``) and refused when its addresses are hidden
  (``kptr_restrict``).  Its mode is 0o755 like perf's (``copyfile()``).

Durability and atomicity: every file is written under a temporary name in its
final directory (``.NAME.buildidd-tmp-XXXX``, ``O_EXCL``), ``fsync``-ed,
checked, ``rename``-d into place, and the directory ``fsync``-ed; the link is
made last, as a symlink under a temporary name renamed over the final one.
So an entry is visible (:meth:`Store.contains`) only when complete, and no
file is ever half-written under its final name.  A crash can leave temporary
files (:meth:`Store.sweep_temps` removes them) and an entry directory without
a link (invisible; re-adding the build-id reuses it).

Recency: :meth:`Store.touch` sets the entry directory's mtime to now; an
entry's ``last_ref_ns`` is that mtime (ns since the epoch), which is also the
time it was added.  It needs no index file and survives restarts.

Concurrency: one :class:`Store` serializes its own mutations with a lock.
Two processes adding to one root (two daemons, or the daemon and ``perf``)
are not coordinated; the worst outcome is a second copy in an unlinked
directory.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import platform
import re
import secrets
import shutil
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from elftools.common.exceptions import ELFError, ELFParseError
from elftools.elf.elffile import ELFFile

from buildidd.resolve.buildid import BuildId, read_build_id_fd
from buildidd.errors import ElfError, StoreError
from buildidd.kernel.events import Identity
from buildidd.resolve.host import kernel_build_id
from buildidd.resolve.procfs import identity_of, mismatch
from buildidd.sessionlog.log import read_session

__all__ = [
    "AddResult",
    "BUILD_ID_DIR",
    "COPY_CHUNK_BYTES",
    "DEBUG_NAME",
    "ELF_NAME",
    "Entry",
    "KALLSYMS_DSO",
    "KALLSYMS_NAME",
    "MODULES_NAME",
    "PROBES_NAME",
    "Store",
    "VDSO_NAME",
    "VMLINUX_NAME",
    "enforce_retention",
    "sdt_probe_cache",
    "session_build_ids",
]

log = logging.getLogger(__name__)

# --- Layout constants (tools/perf/util/build-id.c, dso.h) ----------------------

BUILD_ID_DIR = ".build-id"
"""Directory of the links, ``ROOT/.build-id/xx/rest`` (``build_id_cache__linkname``)."""

ELF_NAME = "elf"
"""The file itself (``build_id_cache__basename``: neither kallsyms, vdso nor debug)."""

DEBUG_NAME = "debug"
"""Its separate debuginfo (``build_id_cache__basename`` with ``is_debug``)."""

PROBES_NAME = "probes"
"""perf's SDT probe cache (util/probe-file.c ``probe_cache__open``)."""

KALLSYMS_NAME = "kallsyms"
"""The kernel's /proc/kallsyms (``build_id_cache__basename`` with ``is_kallsyms``)."""

VDSO_NAME = "vdso"
"""A vDSO image (``build_id_cache__basename`` with ``is_vdso``); perf writes these, the store reads them."""

MODULES_NAME = "modules"
"""/proc/modules next to kallsyms: buildidd's addition (perf keeps one only with ``--kcore``)."""

VMLINUX_NAME = "vmlinux"
"""The kernel image with a matching build-id: buildidd's addition."""

KALLSYMS_DSO = "[kernel.kallsyms]"
"""perf's name of the kernel DSO (dso.h ``DSO__NAME_KALLSYMS``), the kernel entry's directory."""

MAIN_FILE_NAMES = (ELF_NAME, KALLSYMS_NAME, VDSO_NAME)
"""The file an entry is found by, in the order they are looked for."""

# --- Copying -------------------------------------------------------------------

COPY_CHUNK_BYTES = 1 << 20
"""Bytes per copy step when not reflinking; ``Store.throttle`` is called after each."""

FICLONE = 0x40049409
"""ioctl FICLONE = _IOW(0x94, 9, int): share the source's extents (include/uapi/linux/fs.h)."""

_DIR_MODE = 0o755
_PROBES_MODE = 0o644
_KALLSYMS_MODE = 0o755  # perf's copyfile() mode (util/copyfile.c)
_MODULES_MODE = 0o644
_MODE_MASK = 0o755      # permission bits a copy keeps from its source

_TEMP_INFIX = ".buildidd-tmp-"

#: errnos meaning "this way of copying does not work here, try the next".
_REFLINK_FALLBACK = frozenset({errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.EBADF,
                               errno.ENOSYS, errno.EPERM, errno.ETXTBSY})
_COPY_FALLBACK = frozenset({errno.EOPNOTSUPP, errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EBADF})

_SDT_SECTION_MAX_BYTES = 16 << 20
"""A .note.stapsdt longer than this is not scanned (the probes file stays empty)."""

_PROC_READ_MAX_BYTES = 256 << 20
"""Bytes read at most from a /proc file (kallsyms is ~10 MB with many modules)."""


def _hex(build_id_hex: str) -> str:
    """Validate and lower-case a build-id; the layout needs at least 2 bytes (``xx/rest``)."""
    text = BuildId.from_hex(build_id_hex).hex  # ValueError
    if len(text) < 4:
        raise ValueError(f"build-id {build_id_hex!r} too short for the .build-id/xx/rest layout")
    return text


def _relative(path: str) -> str:
    """The store-relative directory of an absolute file path: ``/usr/bin/true`` → ``usr/bin/true``.

    Empty and ``.`` components are dropped; ``..`` is refused (it would leave
    the entry's directory), and so is a first component ``.build-id``.
    """
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        raise ValueError(f"not an absolute path: {path!r}")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if not parts or ".." in parts or parts[0] == BUILD_ID_DIR:
        raise ValueError(f"path cannot be stored: {path!r}")
    return "/".join(parts)


def _fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_name(final: Path) -> Path:
    return final.with_name(f".{final.name}{_TEMP_INFIX}{secrets.token_hex(6)}")


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@dataclass(frozen=True)
class AddResult:
    """What an add did.

    Attributes:
        added: a new entry was made; ``False``: the build-id was present.
        path: the entry's main file (``elf``, or ``kallsyms`` for the kernel).
        reflinked: the main file was cloned (``FICLONE``), no data copied.
        bytes: bytes added to the store by this call: the files' sizes (elf or
            kallsyms, debug or vmlinux, modules, probes); 0 when nothing was added.
        debuginfo: a ``debug`` (or, for the kernel, ``vmlinux``) file was added.
    """

    added: bool
    path: Path | None
    reflinked: bool
    bytes: int
    debuginfo: bool


@dataclass(frozen=True)
class Entry:
    """One entry of the store, found through its ``.build-id`` link.

    Attributes:
        build_id_hex: lower-case hex.
        path: the original file's path (``/usr/bin/true``), or ``[kernel.kallsyms]``
            (perf's ``build_id_cache__origname``).
        directory: the entry's directory, ``ROOT/<path>/<build-id>``.
        size_bytes: sum of ``st_size`` of the regular files in ``directory``
            (elf, debug, probes; kallsyms, modules, vmlinux).  Apparent size:
            a reflinked copy is counted in full.
        last_ref_ns: ns since the epoch: the directory's mtime, set when the
            entry was added and by :meth:`Store.touch`.
    """

    build_id_hex: str
    path: str
    directory: Path
    size_bytes: int
    last_ref_ns: int


class _Installed:
    """Files and directories one add made, to be undone if a later step fails."""

    def __init__(self) -> None:
        self.files: list[Path] = []
        self.dirs: list[Path] = []


class Store:
    """A build-id keyed store of file snapshots in perf's build-id cache layout.

    Attributes:
        root: the store's directory.
        debug_root: where separate debuginfo is looked for, as
            ``debug_root/.build-id/xx/rest.debug``.
        quota_bytes: :meth:`enforce_quota`'s limit on :meth:`size_bytes`; ``None``: none.
        throttle: ``None``, or called as ``throttle(n)`` after each chunk of
            ``n`` bytes copied (at most :data:`COPY_CHUNK_BYTES`; not called for
            a reflink, which copies no data).  It may sleep to limit the copy
            rate; an exception it raises aborts the add (nothing is left behind).
        over_quota: after :meth:`enforce_quota`, ``True`` when the store still
            exceeds the quota because what is left is protected.
        counters: counts since construction, by name:
            ``added`` entries made; ``already_present`` adds of a present build-id;
            ``verify_failed`` copies whose build-id differed from the claimed one;
            ``identity_mismatch`` sources that were not (or stopped being) the
            identified file; ``copy_errors`` adds failed by an OS error (full disk,
            I/O); ``reflinks`` files cloned; ``bytes_copied`` bytes copied as data
            (not cloned); ``debuginfo_added`` debug (and vmlinux) files added;
            ``debuginfo_mismatch`` host debuginfo files with another build-id;
            ``debuginfo_errors`` debuginfo that could not be copied; ``kallsyms_added``;
            ``removed`` entries removed; ``removed_bytes``; ``log_suppressed``
            warnings not logged because of the rate limit.
    """

    #: Warnings logged per :data:`LOG_WINDOW_S`, at most; the rest are counted.
    LOG_BURST = 10
    LOG_WINDOW_S = 60.0

    def __init__(self, root: str | os.PathLike, *, quota_bytes: int | None = None,
                 debug_root: str | os.PathLike = "/usr/lib/debug"):
        """Open (and create, mode 0o755 less the umask, parents too) a store.

        Args:
            root: the store's directory (perf's ``buildid_dir``).
            quota_bytes: limit for :meth:`enforce_quota`, bytes; ``None``: none.
            debug_root: the host's debuginfo tree (``/usr/lib/debug``).

        Raises:
            StoreError: root cannot be created or is not a directory.
            ValueError: a negative quota.
        """
        if quota_bytes is not None and quota_bytes < 0:
            raise ValueError(f"quota_bytes must be >= 0, got {quota_bytes}")
        self.root = Path(os.path.abspath(root))
        self.debug_root = Path(debug_root)
        self.quota_bytes = quota_bytes
        self.throttle: Callable[[int], None] | None = None
        self.over_quota = False
        self.counters: dict[str, int] = dict.fromkeys((
            "added", "already_present", "verify_failed", "identity_mismatch", "copy_errors",
            "reflinks", "bytes_copied", "debuginfo_added", "debuginfo_mismatch", "debuginfo_errors",
            "kallsyms_added", "removed", "removed_bytes", "log_suppressed"), 0)
        self._lock = threading.RLock()
        self._log_window_start = 0.0
        self._log_count = 0
        try:
            os.makedirs(self.root, mode=_DIR_MODE, exist_ok=True)
        except OSError as e:
            raise StoreError(f"{self.root}: cannot create the store: {e.strerror}") from e
        if not self.root.is_dir():
            raise StoreError(f"{self.root}: not a directory")

    # -- lookups ------------------------------------------------------------------

    def linkname(self, build_id_hex: str) -> Path:
        """``ROOT/.build-id/xx/rest`` for a build-id, present or not (perf's ``build_id_cache__linkname``).

        Raises:
            ValueError: not a build-id of at least 2 bytes in hex.
        """
        bid = _hex(build_id_hex)
        return self.root / BUILD_ID_DIR / bid[:2] / bid[2:]

    def _entry_dir(self, bid: str) -> Path | None:
        """The directory the link of bid points to, if it is a directory inside the store."""
        link = self.root / BUILD_ID_DIR / bid[:2] / bid[2:]
        try:
            target = os.readlink(link)
        except OSError:
            return None
        directory = Path(os.path.normpath(os.path.join(link.parent, target)))
        root = os.path.normpath(self.root)
        if os.path.commonpath([root, directory]) != root or directory == Path(root):
            return None
        try:
            if not stat.S_ISDIR(os.stat(directory).st_mode):
                return None
        except OSError:
            return None
        return directory

    def _main_file(self, directory: Path) -> Path | None:
        for name in MAIN_FILE_NAMES:
            candidate = directory / name
            try:
                if stat.S_ISREG(os.lstat(candidate).st_mode):
                    return candidate
            except OSError:
                continue
        return None

    def path_of(self, build_id_hex: str) -> Path | None:
        """The entry's main file, without symlinks: ``ROOT/<path>/<build-id>/elf``
        (``kallsyms`` for a kernel, ``vdso`` for a vDSO perf stored), or ``None``.

        Raises:
            ValueError: not a build-id in hex.
        """
        directory = self._entry_dir(_hex(build_id_hex))
        return self._main_file(directory) if directory is not None else None

    def contains(self, build_id_hex: str) -> bool:
        """Whether the build-id's link resolves to an entry with its main file (see :meth:`path_of`)."""
        return self.path_of(build_id_hex) is not None

    # -- adding -------------------------------------------------------------------

    def add_from_fd(self, fd: int, path: str | os.PathLike, build_id_hex: str, *,
                    identity: Identity | None = None) -> AddResult:
        """Copy the open file fd into the store as ``path`` with build-id ``build_id_hex``.

        The file is read with positioned reads (or cloned), so fd's offset is
        untouched.  Steps: a temporary file in the entry directory (``O_EXCL``,
        permission bits of the source & 0o755); reflink, else copy in chunks of
        :data:`COPY_CHUNK_BYTES` calling :attr:`throttle`; ``fsync``; read the
        copy's build-id back and compare; when ``identity`` is given compare
        ``identity_of(fd)`` with it before and after copying (always: the
        source's ``fstat`` before and after); ``rename`` into place; ``fsync``
        the directory.  Then the separate debuginfo, when
        ``debug_root/.build-id/xx/rest.debug`` exists with the same build-id
        (perf skips it for paths ending in ``.ko``, and so does the store; a
        failure there is counted and logged, not raised); the ``probes`` file;
        and last the ``.build-id`` link.  Already present: nothing is copied
        (but a debuginfo file that appeared on the host since is added).

        Args:
            fd: an open, readable regular file.
            path: its absolute path, as the mapping names it; the entry's directory.
            build_id_hex: the build-id the caller read from fd.
            identity: the file the kernel mapped; ``None``: not checked.

        Returns:
            An :class:`AddResult`.

        Raises:
            StoreError: the copy's build-id differs (``verify_failed``), the file
                is not the identified one or changed while being copied
                (``identity_mismatch``), it is not a regular file, or an OS error
                such as ENOSPC (``copy_errors``).  Nothing of this add is left
                in the store, which stays usable.
            ValueError: path is not absolute (or has ``..``), build_id_hex is not hex.
        """
        bid = _hex(build_id_hex)
        path = os.fspath(path)
        rel = _relative(path)
        with self._lock:
            present = self._entry_dir(bid)
            if present is not None and self._main_file(present) is not None:
                self.counters["already_present"] += 1
                debug_bytes = 0
                if present.parent != self.root / KALLSYMS_DSO:
                    debug_bytes = self._add_debuginfo(present, bid, path, _Installed())
                return AddResult(False, self._main_file(present), False, debug_bytes, debug_bytes > 0)

            entry_dir = self.root / rel / bid
            done = _Installed()
            try:
                try:
                    before = os.fstat(fd)
                except OSError as e:
                    self.counters["copy_errors"] += 1
                    raise StoreError(f"{path}: cannot stat the source: {e.strerror}") from e
                if not stat.S_ISREG(before.st_mode):
                    self.counters["copy_errors"] += 1
                    raise StoreError(f"{path}: not a regular file")
                if identity is not None:
                    self._check_identity(fd, identity, path, "before copying")
                self._makedirs(entry_dir, done)
                reflinked, elf_bytes = self._install_copy(
                    fd, before, entry_dir / ELF_NAME, bid, done, what=path, identity=identity)
                debug_bytes = self._add_debuginfo(entry_dir, bid, path, done)
                probes_bytes = self._install_bytes(
                    entry_dir / PROBES_NAME, self._probes_text(entry_dir / ELF_NAME, path), _PROBES_MODE, done)
                self._publish(bid, f"../../{rel}/{bid}")
            except BaseException:
                self._undo(done)
                raise
            self.counters["added"] += 1
            return AddResult(True, entry_dir / ELF_NAME, reflinked,
                             elf_bytes + debug_bytes + probes_bytes, debug_bytes > 0)

    def add_kallsyms(self, kernel_build_id_hex: str, *,
                     kallsyms_path: str | os.PathLike = "/proc/kallsyms",
                     modules_path: str | os.PathLike = "/proc/modules",
                     notes_path: str | os.PathLike = "/sys/kernel/notes",
                     vmlinux_paths: Sequence[str | os.PathLike] | None = None) -> AddResult:
        """Snapshot the running kernel's symbols as ``ROOT/[kernel.kallsyms]/<build-id>/``.

        ``kallsyms`` is a copy of ``kallsyms_path``, mode 0o755, as ``perf
        record`` leaves it (``build_id_cache__add`` with ``is_kallsyms``:
        ``copyfile("/proc/kallsyms", …)``); the link is
        ``.build-id/xx/rest -> ../../[kernel.kallsyms]/<build-id>``.  The store
        adds ``modules`` (``modules_path``, when it exists: kernels without
        CONFIG_MODULES have none) and ``vmlinux``: the first of
        ``vmlinux_paths`` whose build-id is the kernel's, copied and verified
        like an elf.  Default candidates: perf's ``vmlinux_path__init`` list
        (``/boot/vmlinux``, ``/boot/vmlinux-R``, ``DEBUG/boot/vmlinux-R``,
        ``/lib/modules/R/build/vmlinux``, ``DEBUG/lib/modules/R/vmlinux``,
        ``DEBUG/boot/vmlinux-R.debug`` for release R and ``debug_root`` DEBUG),
        ``DEBUG/.build-id/xx/rest.debug``, then any ``/boot/vmlinux-*`` and
        ``DEBUG/boot/vmlinux-*``.

        Already present (the link resolves to a directory with ``kallsyms``):
        nothing is copied, but a vmlinux found since is added.

        Raises:
            StoreError: kernel_build_id_hex is not the running kernel's (read
                from ``notes_path``), kallsyms' addresses are hidden (all zero:
                ``kernel.kptr_restrict``), or an OS error (counted in ``copy_errors``).
            ValueError: not a build-id in hex.
        """
        bid = _hex(kernel_build_id_hex)
        running = kernel_build_id(str(notes_path))
        if running != bid:
            raise StoreError(f"kallsyms are the running kernel's ({running}), not {bid}'s")
        if vmlinux_paths is None:
            vmlinux_paths = self._vmlinux_candidates(bid)
        with self._lock:
            present = self._entry_dir(bid)
            if present is not None and (present / KALLSYMS_NAME).is_file():
                self.counters["already_present"] += 1
                vmlinux_bytes = 0
                if not (present / VMLINUX_NAME).exists():
                    vmlinux_bytes = self._add_vmlinux(present, bid, vmlinux_paths, _Installed())
                return AddResult(False, present / KALLSYMS_NAME, False, vmlinux_bytes, vmlinux_bytes > 0)

            entry_dir = self.root / KALLSYMS_DSO / bid
            done = _Installed()
            try:
                self._makedirs(entry_dir, done)
                total = self._install_stream(Path(kallsyms_path), entry_dir / KALLSYMS_NAME, _KALLSYMS_MODE,
                                             done, check=_check_kallsyms)
                if os.path.exists(modules_path):
                    total += self._install_stream(Path(modules_path), entry_dir / MODULES_NAME, _MODULES_MODE, done)
                vmlinux_bytes = self._add_vmlinux(entry_dir, bid, vmlinux_paths, done)
                self._publish(bid, f"../../{KALLSYMS_DSO}/{bid}")
            except BaseException:
                self._undo(done)
                raise
            self.counters["added"] += 1
            self.counters["kallsyms_added"] += 1
            return AddResult(True, entry_dir / KALLSYMS_NAME, False, total + vmlinux_bytes, vmlinux_bytes > 0)

    def _vmlinux_candidates(self, bid: str) -> list[str]:
        release = platform.release()
        debug = str(self.debug_root)
        fixed = [
            "/boot/vmlinux",
            f"/boot/vmlinux-{release}",
            f"{debug}/boot/vmlinux-{release}",
            f"/lib/modules/{release}/build/vmlinux",
            f"{debug}/lib/modules/{release}/vmlinux",
            f"{debug}/boot/vmlinux-{release}.debug",
            f"{debug}/{BUILD_ID_DIR}/{bid[:2]}/{bid[2:]}.debug",
        ]
        found = []
        for directory in ("/boot", f"{debug}/boot"):
            try:
                found += sorted(os.path.join(directory, n) for n in os.listdir(directory)
                                if n.startswith("vmlinux-"))
            except OSError:
                continue
        return list(dict.fromkeys(fixed + found))

    def _add_vmlinux(self, entry_dir: Path, bid: str, candidates: Iterable[str | os.PathLike],
                     done: _Installed) -> int:
        """Copy the first candidate with build-id bid to entry_dir/vmlinux; bytes added (0: none).

        Like debuginfo, a failure is counted (``debuginfo_errors``) and logged, not raised.
        """
        for candidate in candidates:
            try:
                fd = os.open(candidate, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                try:
                    got = read_build_id_fd(fd)
                except (ElfError, OSError):
                    continue
                if got is None or got.hex != bid:
                    continue
                try:
                    _, size = self._install_copy(fd, os.fstat(fd), entry_dir / VMLINUX_NAME, bid, done,
                                                 what=str(candidate))
                except (StoreError, OSError) as e:
                    self.counters["debuginfo_errors"] += 1
                    self._warn("%s: vmlinux not stored: %s", candidate, e)
                    return 0
                self.counters["debuginfo_added"] += 1
                return size
            finally:
                os.close(fd)
        return 0

    def _add_debuginfo(self, entry_dir: Path, bid: str, path: str, done: _Installed) -> int:
        """Copy debug_root/.build-id/xx/rest.debug to entry_dir/debug; bytes added (0: none).

        perf: ``build_id_cache__find_debug`` (the same name under
        ``/usr/lib/debug``), skipped for names ending in ``.ko``.  Failures are
        counted and logged; the entry is added without debuginfo.
        """
        if path.endswith(".ko") or (entry_dir / DEBUG_NAME).exists():
            return 0
        source = self.debug_root / BUILD_ID_DIR / bid[:2] / f"{bid[2:]}.debug"
        try:
            fd = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return 0
        except OSError as e:
            self.counters["debuginfo_errors"] += 1
            self._warn("%s: cannot open debuginfo: %s", source, e.strerror)
            return 0
        try:
            try:
                got = read_build_id_fd(fd)
            except (ElfError, OSError) as e:
                got = None
                self._warn("%s: cannot read its build-id: %s", source, e)
            if got is None or got.hex != bid:
                self.counters["debuginfo_mismatch"] += 1
                self._warn("%s: build-id %s, not %s; not stored", source, got.hex if got else None, bid)
                return 0
            try:
                _, size = self._install_copy(fd, os.fstat(fd), entry_dir / DEBUG_NAME, bid, done,
                                             what=str(source))
            except (StoreError, OSError) as e:
                self.counters["debuginfo_errors"] += 1
                self._warn("%s: debuginfo not stored: %s", source, e)
                return 0
            self.counters["debuginfo_added"] += 1
            return size
        finally:
            os.close(fd)

    def _probes_text(self, elf: Path, path: str) -> bytes:
        try:
            with open(elf, "rb") as f:
                return sdt_probe_cache(f, path)
        except OSError as e:
            raise StoreError(f"{elf}: cannot read for its SDT notes: {e.strerror}") from e

    # -- the steps ----------------------------------------------------------------

    def _check_identity(self, fd: int, want: Identity, path: str, when: str) -> None:
        try:
            got = identity_of(fd)
        except OSError as e:
            self.counters["copy_errors"] += 1
            raise StoreError(f"{path}: cannot stat the source: {e.strerror}") from e
        why = mismatch(want, got)
        if why is not None:
            self.counters["identity_mismatch"] += 1
            raise StoreError(f"{path}: not the identified file {when}: {why}")

    def _makedirs(self, directory: Path, done: _Installed) -> None:
        """mkdir -p (mode 0o755), remembering the directories made."""
        missing = []
        d = directory
        while not d.is_dir():
            missing.append(d)
            if d.parent == d:
                break
            d = d.parent
        for d in reversed(missing):
            try:
                os.mkdir(d, _DIR_MODE)
            except FileExistsError:
                if not d.is_dir():
                    self.counters["copy_errors"] += 1
                    raise StoreError(f"{d}: exists and is not a directory") from None
                continue
            except OSError as e:
                self.counters["copy_errors"] += 1
                raise StoreError(f"{d}: cannot create: {e.strerror}") from e
            done.dirs.append(d)

    def _install_copy(self, src_fd: int, before: os.stat_result, final: Path, bid: str, done: _Installed,
                      *, what: str, identity: Identity | None = None) -> tuple[bool, int]:
        """Copy src_fd to final through a temporary file, verified; (reflinked, bytes).

        Raises:
            StoreError: verify failure, the source changed, or an OS error.
        """
        size = before.st_size
        temp = _temp_name(final)
        try:
            dst = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, before.st_mode & _MODE_MASK)
        except OSError as e:
            self.counters["copy_errors"] += 1
            raise StoreError(f"{final}: cannot create a temporary file: {e.strerror}") from e
        try:
            try:
                os.fchmod(dst, before.st_mode & _MODE_MASK)  # not narrowed by the umask
                reflinked = self._copy_data(src_fd, dst, size, what)
                os.fsync(dst)
                after = os.fstat(src_fd)
                copied = os.fstat(dst).st_size
            except OSError as e:
                self.counters["copy_errors"] += 1
                raise StoreError(f"{what}: cannot copy into the store: {e.strerror}") from e
            if (after.st_size, after.st_mtime_ns, after.st_ino, after.st_dev) != (
                    before.st_size, before.st_mtime_ns, before.st_ino, before.st_dev) or copied != size:
                self.counters["identity_mismatch"] += 1
                raise StoreError(f"{what}: changed while being copied")
            if identity is not None:
                self._check_identity(src_fd, identity, what, "after copying")
            try:
                got = read_build_id_fd(dst)
            except (ElfError, OSError) as e:
                self.counters["verify_failed"] += 1
                raise StoreError(f"{what}: copy has no readable build-id: {e}") from e
            if got is None or got.hex != bid:
                self.counters["verify_failed"] += 1
                raise StoreError(f"{what}: copy has build-id {got.hex if got else None}, not {bid}")
            try:
                os.rename(temp, final)
                done.files.append(final)
                _fsync_dir(final.parent)
            except OSError as e:
                self.counters["copy_errors"] += 1
                raise StoreError(f"{final}: cannot rename into place: {e.strerror}") from e
        finally:
            os.close(dst)
            if final not in done.files:
                _unlink_quietly(temp)
        if reflinked:
            self.counters["reflinks"] += 1
        return reflinked, size

    def _copy_data(self, src: int, dst: int, size: int, what: str) -> bool:
        """Copy size bytes from offset 0 of src to dst; True when reflinked (FICLONE).

        Order: FICLONE (whole file, shares extents: btrfs, XFS, bcachefs);
        ``copy_file_range`` (in-kernel; may itself share extents or do
        server-side copy on NFS); ``sendfile``; ``pread``/``pwrite``.  A way
        that fails with an errno meaning "not here" (EXDEV, EOPNOTSUPP, EINVAL,
        …) is dropped for the rest of this file; ENOSPC and EIO are raised.
        """
        if size > 0:
            try:
                fcntl.ioctl(dst, FICLONE, src)
                return True
            except OSError as e:
                if e.errno not in _REFLINK_FALLBACK:
                    raise
        ways = [_copy_file_range, _sendfile, _pread_pwrite]
        offset = 0
        while offset < size:
            want = min(COPY_CHUNK_BYTES, size - offset)
            try:
                n = ways[0](src, dst, offset, want)
            except OSError as e:
                if e.errno in _COPY_FALLBACK and len(ways) > 1:
                    ways.pop(0)
                    continue
                raise
            if n == 0:
                if len(ways) > 1:  # copy_file_range answers 0 where it cannot copy (some file systems)
                    ways.pop(0)
                    continue
                self.counters["identity_mismatch"] += 1
                raise StoreError(f"{what}: ended at {offset} of {size} bytes while being copied")
            offset += n
            self.counters["bytes_copied"] += n
            if self.throttle is not None:
                self.throttle(n)
        return False

    def _install_stream(self, source: Path, final: Path, mode: int, done: _Installed,
                        *, check: Callable[[bytes], None] | None = None) -> int:
        """Copy a file read sequentially (a /proc file: st_size 0) to final; bytes written."""
        temp = _temp_name(final)
        total = 0
        try:
            with open(source, "rb", buffering=0) as src:
                dst = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
                try:
                    os.fchmod(dst, mode)
                    first = True
                    while True:
                        chunk = src.read(COPY_CHUNK_BYTES)
                        if not chunk:
                            break
                        if first and check is not None:
                            check(chunk)
                        first = False
                        _write_all(dst, chunk)
                        total += len(chunk)
                        if total > _PROC_READ_MAX_BYTES:
                            raise StoreError(f"{source}: longer than {_PROC_READ_MAX_BYTES} bytes")
                        self.counters["bytes_copied"] += len(chunk)
                        if self.throttle is not None:
                            self.throttle(len(chunk))
                    if first and check is not None:
                        check(b"")
                    os.fsync(dst)
                finally:
                    os.close(dst)
            os.rename(temp, final)
            done.files.append(final)
            _fsync_dir(final.parent)
        except OSError as e:
            self.counters["copy_errors"] += 1
            raise StoreError(f"{source}: cannot copy into the store: {e.strerror}") from e
        finally:
            if final not in done.files:
                _unlink_quietly(temp)
        return total

    def _install_bytes(self, final: Path, data: bytes, mode: int, done: _Installed) -> int:
        """Write data to final through a temporary file; bytes written."""
        temp = _temp_name(final)
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
            try:
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(temp, final)
            done.files.append(final)
            _fsync_dir(final.parent)
        except OSError as e:
            self.counters["copy_errors"] += 1
            raise StoreError(f"{final}: cannot write: {e.strerror}") from e
        finally:
            if final not in done.files:
                _unlink_quietly(temp)
        return len(data)

    def _publish(self, bid: str, target: str) -> None:
        """Make (or replace) ``.build-id/xx/rest -> target`` atomically; the entry becomes visible."""
        link = self.root / BUILD_ID_DIR / bid[:2] / bid[2:]
        self._makedirs(link.parent, _Installed())
        temp = _temp_name(link)
        try:
            os.symlink(target, temp)
            os.rename(temp, link)
            _fsync_dir(link.parent)
        except OSError as e:
            _unlink_quietly(temp)
            self.counters["copy_errors"] += 1
            raise StoreError(f"{link}: cannot link: {e.strerror}") from e

    def _undo(self, done: _Installed) -> None:
        """Remove what a failed add made: its files, then its directories (deepest first)."""
        for f in done.files:
            try:
                os.unlink(f)
            except OSError as e:
                if e.errno != errno.ENOENT:
                    self._warn("%s: cannot remove after a failed add: %s", f, e.strerror)
        for d in reversed(done.dirs):
            try:
                os.rmdir(d)
            except OSError:
                break

    # -- recency, listing, quota ------------------------------------------------

    def touch(self, build_id_hex: str) -> None:
        """Mark an entry referenced now: its directory's mtime (and atime) := now.

        Raises:
            StoreError: the build-id is not in the store, or utime failed.
            ValueError: not a build-id in hex.
        """
        bid = _hex(build_id_hex)
        directory = self._entry_dir(bid)
        if directory is None:
            raise StoreError(f"{bid}: not in the store")
        now_ns = time.time_ns()
        try:
            os.utime(directory, ns=(now_ns, now_ns))
        except OSError as e:
            raise StoreError(f"{directory}: cannot touch: {e.strerror}") from e

    def entries(self) -> list[Entry]:
        """Every entry reachable through a ``.build-id`` link, in build-id order.

        Links that dangle, point outside the store, or are old-style regular
        files (perf before 3.x kept the file itself in ``.build-id/xx/rest``) are
        left out.

        Raises:
            StoreError: the ``.build-id`` directory cannot be listed.
        """
        top = self.root / BUILD_ID_DIR
        try:
            heads = sorted(n for n in os.listdir(top) if len(n) == 2 and _is_hex(n))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise StoreError(f"{top}: cannot list: {e.strerror}") from e
        out = []
        for head in heads:
            try:
                tails = sorted(n for n in os.listdir(top / head) if _is_hex(n))
            except OSError:
                continue
            for tail in tails:
                bid = head + tail
                link = top / head / tail
                directory = self._entry_dir(bid)
                if directory is None:
                    continue
                try:
                    target = os.readlink(link)
                    mtime_ns = os.stat(directory).st_mtime_ns
                except OSError:
                    continue
                out.append(Entry(bid, _origname(target), directory, _files_size(directory), mtime_ns))
        return out

    def size_bytes(self) -> int:
        """Sum of the entries' ``size_bytes``."""
        return sum(e.size_bytes for e in self.entries())

    def remove(self, build_id_hex: str) -> int:
        """Remove an entry: its link first (it disappears at once), then its directory.

        Empty parent directories up to the root are removed too (perf's
        ``build_id_cache__remove_s`` leaves them).

        Returns:
            bytes freed (the entry's ``size_bytes``); 0 when it was absent.

        Raises:
            StoreError: the link or directory cannot be removed.
        """
        bid = _hex(build_id_hex)
        with self._lock:
            directory = self._entry_dir(bid)
            link = self.root / BUILD_ID_DIR / bid[:2] / bid[2:]
            if directory is None:
                return 0
            size = _files_size(directory)
            try:
                os.unlink(link)
                _fsync_dir(link.parent)
                shutil.rmtree(directory)
            except OSError as e:
                raise StoreError(f"{bid}: cannot remove: {e.strerror}") from e
            parent = directory.parent
            while parent != self.root and os.path.commonpath([self.root, parent]) == str(self.root):
                try:
                    os.rmdir(parent)
                except OSError:
                    break
                parent = parent.parent
            self.counters["removed"] += 1
            self.counters["removed_bytes"] += size
            return size

    def enforce_quota(self, protected: set[str]) -> list[str]:
        """Remove least recently referenced entries not in ``protected`` while over the quota.

        Order: ascending ``last_ref_ns``, then build-id.  A protected entry is
        never removed, even when that leaves the store over its quota:
        :attr:`over_quota` then says so.  No quota: nothing is removed.

        Args:
            protected: build-ids (hex, any case) that retained sessions reference.

        Returns:
            The build-ids removed, in removal order.

        Raises:
            TypeError: protected holds something other than str (bytes would
                silently protect nothing).
            StoreError: an entry cannot be removed (those removed before are
                in the exception's ``removed`` attribute).
        """
        keep = set()
        for b in protected:
            if not isinstance(b, str):
                raise TypeError(f"protected build-ids are hex str, got {type(b).__name__}")
            keep.add(b.lower())
        removed: list[str] = []
        with self._lock:
            if self.quota_bytes is None:
                self.over_quota = False
                return removed
            entries = self.entries()
            total = sum(e.size_bytes for e in entries)
            for e in sorted(entries, key=lambda e: (e.last_ref_ns, e.build_id_hex)):
                if total <= self.quota_bytes:
                    break
                if e.build_id_hex in keep:
                    continue
                try:
                    total -= self.remove(e.build_id_hex)
                except StoreError as err:
                    err.removed = removed
                    raise
                removed.append(e.build_id_hex)
            self.over_quota = total > self.quota_bytes
            if self.over_quota:
                self._warn("store %s: %d bytes over its quota of %d bytes, all of it protected",
                           self.root, total - self.quota_bytes, self.quota_bytes)
            return removed

    def sweep_temps(self) -> int:
        """Remove temporary files left by a crash (``.NAME.buildidd-tmp-XXXX``); how many.

        Walks the whole store: call it at start, before adding.
        """
        count = 0
        with self._lock:
            for dirpath, dirnames, filenames in os.walk(self.root):
                # A temporary link to an entry directory is listed in dirnames (os.walk does not follow it).
                for name in dirnames + filenames:
                    temp = os.path.join(dirpath, name)
                    is_temp = name.startswith(".") and _TEMP_INFIX in name
                    if not is_temp or (os.path.isdir(temp) and not os.path.islink(temp)):
                        continue
                    try:
                        os.unlink(temp)
                        count += 1
                    except OSError as e:
                        self._warn("%s: cannot remove: %s", temp, e.strerror)
        return count

    def _warn(self, msg: str, *args) -> None:
        """log.warning at most LOG_BURST times per LOG_WINDOW_S seconds; the rest are counted."""
        now = time.monotonic()
        if now - self._log_window_start >= self.LOG_WINDOW_S:
            self._log_window_start = now
            self._log_count = 0
        if self._log_count < self.LOG_BURST:
            self._log_count += 1
            log.warning(msg, *args)
        else:
            self.counters["log_suppressed"] += 1


# --- helpers for copying ---------------------------------------------------------


def _copy_file_range(src: int, dst: int, offset: int, count: int) -> int:
    return os.copy_file_range(src, dst, count, offset, offset)


def _sendfile(src: int, dst: int, offset: int, count: int) -> int:
    os.lseek(dst, offset, os.SEEK_SET)
    return os.sendfile(dst, src, offset, count)


def _pread_pwrite(src: int, dst: int, offset: int, count: int) -> int:
    data = os.pread(src, count, offset)
    done = 0
    while done < len(data):
        done += os.pwrite(dst, data[done:], offset + done)
    return len(data)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _check_kallsyms(head: bytes) -> None:
    """Refuse a kallsyms whose first address is zero: kptr_restrict hides them all."""
    first = head.split(b" ", 1)[0]
    if not first or not _is_hex(first.decode("ascii", "replace")) or int(first, 16) == 0:
        raise StoreError("kallsyms addresses are hidden (kernel.kptr_restrict) or the file is empty")


_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")


def _is_hex(text: str) -> bool:
    return bool(text) and all(c in _HEX_DIGITS for c in text)


def _origname(target: str) -> str:
    """The original path from a link target ``../..<path>/<build-id>`` (perf's ``build_id_cache__origname``)."""
    inner = target[len("../.."):] if target.startswith("../..") else target
    inner = inner.rsplit("/", 1)[0]
    if inner.startswith("/["):
        inner = inner[1:]  # a DSO name such as [kernel.kallsyms], not a path
    return inner


def _files_size(directory: Path) -> int:
    total = 0
    try:
        with os.scandir(directory) as it:
            for e in it:
                try:
                    if e.is_file(follow_symlinks=False):
                        total += e.stat(follow_symlinks=False).st_size
                except OSError:
                    continue
    except OSError:
        return 0
    return total


# --- perf's SDT probe cache ------------------------------------------------------

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
    section = _first_section(elf, ".note.stapsdt")
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


# --- session retention ------------------------------------------------------------


def session_build_ids(session_dir: str | os.PathLike) -> set[str]:
    """Every build-id a session references (lower-case hex).

    From ``mmap`` and ``exec`` records (``build_id``) and the ``session``
    record (``kernel_build_id`` and the values of ``module_build_ids``), so
    that the kernel's entry is protected as well.  Reads the whole session
    (closed segments are decompressed): callers should remember the answer
    for a closed session.

    Raises:
        SessionLogError: the session cannot be read.
    """
    ids: set[str] = set()

    def add(value) -> None:
        if isinstance(value, str) and value:
            ids.add(value.lower())

    for record in read_session(session_dir):
        kind = record.get("type")
        if kind in ("mmap", "exec"):
            add(record.get("build_id"))
        elif kind == "session":
            add(record.get("kernel_build_id"))
            modules = record.get("module_build_ids")
            if isinstance(modules, dict):
                for value in modules.values():
                    add(value)
    return ids


def _session_usage(directory: str) -> tuple[int, int]:
    """(bytes of the files under directory, newest mtime ns of it and its files)."""
    total = 0
    newest = os.stat(directory).st_mtime_ns
    for dirpath, _dirnames, filenames in os.walk(directory):
        for name in filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            total += st.st_size
            newest = max(newest, st.st_mtime_ns)
    return total, newest


def enforce_retention(session_root: str | os.PathLike, *, max_age_s: float | None,
                      max_total_bytes: int | None, keep: Iterable[str | os.PathLike],
                      now_s: float | None = None) -> list[Path]:
    """Delete whole session directories, oldest first, by age and by total size.

    A session is every subdirectory of session_root (not a symlink, not
    hidden).  Its age is ``now_s`` minus its last modification (the newest
    mtime of the directory and its files: when it was last written); its size
    the sum of its files' ``st_size``.  In order of last modification (then
    name), a session is deleted when it is older than ``max_age_s`` or the
    total of all sessions (kept ones included) exceeds ``max_total_bytes``.
    Sessions named in ``keep`` are never deleted.

    Args:
        session_root: the directory holding the sessions.
        max_age_s: seconds; ``None``: no age limit.
        max_total_bytes: bytes; ``None``: no size limit.
        keep: session directories (paths or names) never to delete, e.g. the current one.
        now_s: seconds since the epoch; default ``time.time()``.

    Returns:
        The directories deleted, oldest first.

    Raises:
        StoreError: session_root cannot be listed or a session cannot be
            deleted; the exception's ``removed`` attribute lists the
            directories deleted before.
    """
    root = Path(session_root)
    keep_names = {os.path.basename(os.path.normpath(os.fspath(k))) for k in keep}
    now = time.time() if now_s is None else now_s
    sessions = []
    try:
        with os.scandir(root) as it:
            candidates = [e for e in it if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)]
    except OSError as e:
        raise StoreError(f"{root}: cannot list sessions: {e.strerror}") from e
    for e in candidates:
        try:
            size, newest_ns = _session_usage(e.path)
        except OSError:
            continue  # vanished meanwhile
        sessions.append((newest_ns, e.name, Path(e.path), size))
    sessions.sort()
    total = sum(s[3] for s in sessions)
    removed: list[Path] = []
    for newest_ns, name, path, size in sessions:
        if name in keep_names:
            continue
        too_old = max_age_s is not None and now - newest_ns / 1e9 > max_age_s
        too_big = max_total_bytes is not None and total > max_total_bytes
        if not (too_old or too_big):
            break  # the rest are newer and the total only shrinks
        try:
            shutil.rmtree(path)
        except OSError as e:
            err = StoreError(f"{path}: cannot delete session: {e.strerror}")
            err.removed = removed
            raise err from e
        total -= size
        removed.append(path)
        log.info("deleted session %s (%d bytes, last written %.0f s ago)", path, size, now - newest_ns / 1e9)
    if removed:
        try:
            _fsync_dir(root)
        except OSError as e:
            log.warning("%s: fsync after deleting sessions: %s", root, e.strerror)
    return removed


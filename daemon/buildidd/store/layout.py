"""perf's build-id cache layout: names, links, entry directories, listing.

The same tree ``perf buildid-cache -a FILE`` writes (Linux
``tools/perf/util/build-id.c``: ``build_id_cache__add``,
``build_id_cache__cachedir``, ``build_id_cache__linkname``,
``build_id_cache__basename``), so that ``perf --buildid-dir ROOT report``,
``perf buildid-cache -l`` and ``perf probe`` read it as their own.  Observed
with perf 6.1 (Debian linux-perf) on this project's test host::

    ROOT/                                     (perf: mode 0o755; buildidd: 0o750)
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
  build-id in lower-case hex; perf makes directories with mode 0o755,
  buildidd with 0o750 root:group and its files 0o640 (:data:`DIR_MODE`, :data:`FILE_MODE`).
* buildidd adds ``origin.json`` and ``alt/<sha256>/`` to an entry (:mod:`buildidd.store.origin`);
  perf ignores both.
* A file without a GNU build-id has an entry of the same shape named by its htlhash (32 hex
  digits, resolve.fileid.file_id; ``origin.json`` says ``"key": "htlhash"``).  perf lists only
  entries whose file carries the GNU build-id they are named by, so it passes these over.
  ``ROOT/.go-build-id/<Go build ID, each / written .>`` links to the entry of a Go binary
  (:data:`GO_INDEX_DIR`, store.goindex); perf ignores it.
* The link is ``ROOT/.build-id/`` + the first two hex digits + ``/`` + the
  rest, a *relative* symlink ``"../.."`` + path + ``/`` + build-id
  (``build_id_cache__add``: ``memcpy(tmp, "../..", 5)``).  A file is found by
  build-id through the link: ``ROOT/.build-id/xx/rest/elf`` (``…/debug``,
  ``…/kallsyms``, ``…/vdso``: ``__dso__build_id_filename``).
* ``probes`` is written for every regular file (not for kallsyms), byte for
  byte as perf writes it (:func:`buildidd.store.sdt.sdt_probe_cache`).
* Build-ids of 2 to 64 bytes are stored; perf handles at most 20
  (``BUILD_ID_SIZE``) and lists (``-l``) only those of 8 to 20 bytes
  (build-id.c ``lsdir_bid_tail_filter``: ``SBUILD_ID_MIN_SIZE``, ``SBUILD_ID_SIZE``).
* perf finds the directory from ``perf --buildid-dir DIR`` or the config key
  ``buildid.dir``, default ``$HOME/.debug``.  perf 6.1 does not *read*
  ``PERF_BUILDID_DIR``: ``set_buildid_dir()`` (util/config.c) sets it for the
  commands perf runs.  (``PERF_BUILDID_DIR=/tmp/x perf buildid-cache -a`` writes
  to ``~/.debug``.)
* The entry's name is the path given by the caller (the kernel's ``d_path`` of
  the mapping), not a ``realpath()`` in the daemon's mount namespace.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from buildidd.errors import StoreError
from buildidd.resolve.buildid import BuildId

# --- Names (tools/perf/util/build-id.c, dso.h) ----------------------------------

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

DIR_MODE = 0o750
"""Mode of every directory the store makes, whatever the umask (perf uses 0o755: every user could
read every copy); owner root, group the control group (:class:`buildidd.store.Store`'s ``group``)."""

PRIVATE_DIR_MODE = 0o700
"""Mode of the directory of a private copy (see :mod:`buildidd.store.origin`): root only."""

FILE_MODE = 0o640
"""Mode of every file the store writes, whatever the umask and the source's mode (perf copies with 0o755)."""

TEMP_INFIX = ".buildidd-tmp-"
"""Marks a file under a temporary name, ``.NAME.buildidd-tmp-XXXX`` (swept after a crash)."""

_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")


def hex_build_id(build_id_hex: str) -> str:
    """Validate and lower-case a build-id; the layout needs at least 2 bytes (``xx/rest``).

    Raises:
        ValueError: not hex, or shorter than 2 bytes.
    """
    text = BuildId.from_hex(build_id_hex).hex  # ValueError
    if len(text) < 4:
        raise ValueError(f"build-id {build_id_hex!r} too short for the .build-id/xx/rest layout")
    return text


def relative(path: str) -> str:
    """The store-relative directory of an absolute file path: ``/usr/bin/true`` → ``usr/bin/true``.

    Empty and ``.`` components are dropped; ``..`` is refused (it would leave
    the entry's directory), and so is a first component ``.build-id``.

    Raises:
        ValueError: not an absolute path, or one that cannot be stored.
    """
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        raise ValueError(f"not an absolute path: {path!r}")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if not parts or ".." in parts or parts[0] == BUILD_ID_DIR:
        raise ValueError(f"path cannot be stored: {path!r}")
    return "/".join(parts)


def is_hex(text: str) -> bool:
    """Whether text is non-empty and only hex digits (either case)."""
    return bool(text) and all(c in _HEX_DIGITS for c in text)


def origname(target: str) -> str:
    """The original path from a link target ``../..<path>/<build-id>`` (perf's ``build_id_cache__origname``)."""
    inner = target[len("../.."):] if target.startswith("../..") else target
    inner = inner.rsplit("/", 1)[0]
    if inner.startswith("/["):
        inner = inner[1:]  # a DSO name such as [kernel.kallsyms], not a path
    return inner


GO_INDEX_DIR = ".go-build-id"
"""``ROOT/.go-build-id/<name>``: the index from a Go build ID to the entry of the file that carries it
(:func:`go_index_name`), a relative symlink to that entry's ``.build-id`` link; buildidd's addition."""

GO_BUILD_ID_NAME_MAX = 200
"""Longest Go build ID indexed (``go build`` writes 83 characters: four base64url parts joined by ``/``)."""

_GO_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_/")


def go_index_name(go_build_id: str) -> str:
    """The file name of a Go build ID in :data:`GO_INDEX_DIR`: its text with each ``/`` written ``.``.

    Go build IDs are base64url parts joined by ``/`` (cmd/go/internal/work buildid.go), so the
    name is reversible and can be no path.

    Raises:
        ValueError: empty, longer than :data:`GO_BUILD_ID_NAME_MAX`, or a character Go does not write.
    """
    if (not isinstance(go_build_id, str) or not 0 < len(go_build_id) <= GO_BUILD_ID_NAME_MAX
            or not set(go_build_id) <= _GO_CHARS or go_build_id.strip("/") != go_build_id or "//" in go_build_id):
        raise ValueError(f"not a Go build ID the store indexes: {go_build_id!r}")
    return go_build_id.replace("/", ".")


ALT_NAME = "alt"
"""``<entry>/alt/<sha256>/``: other contents claiming the entry's build-id (see :mod:`buildidd.store.origin`)."""

MAX_ALT_DIRS = 16
"""Alternative contents looked at per entry, at most (the store keeps no more: ``alt_limit``)."""


def dir_usage(directory: Path) -> tuple[int, int]:
    """(apparent bytes, disk bytes) of the regular files directly in directory (not followed).

    Apparent: sum of ``st_size``; disk: sum of ``st_blocks * 512`` (what the
    files take on the file system: a sparse file's holes take nothing).  (0, 0) if unreadable.
    """
    size = disk = 0
    try:
        with os.scandir(directory) as it:
            for e in it:
                try:
                    if e.is_file(follow_symlinks=False):
                        st = e.stat(follow_symlinks=False)
                        size += st.st_size
                        disk += st.st_blocks * 512
                except OSError:
                    continue
    except OSError:
        return 0, 0
    return size, disk


def alt_dirs(directory: Path) -> list[Path]:
    """The ``alt/<sha256>`` directories of an entry, in name order, at most :data:`MAX_ALT_DIRS`."""
    try:
        with os.scandir(directory / ALT_NAME) as it:
            names = sorted(e.name for e in it if len(e.name) == 64 and is_hex(e.name)
                           and e.is_dir(follow_symlinks=False))
    except OSError:
        return []
    return [directory / ALT_NAME / n for n in names[:MAX_ALT_DIRS]]


def entry_usage(directory: Path) -> tuple[int, int]:
    """(apparent, disk) bytes of an entry: its own files and those of its ``alt/*`` copies."""
    size, disk = dir_usage(directory)
    for alt in alt_dirs(directory):
        a, d = dir_usage(alt)
        size, disk = size + a, disk + d
    return size, disk


def files_size(directory: Path) -> int:
    """Apparent size (sum of ``st_size``) of an entry's files, its alternative copies included; 0 if unreadable."""
    return entry_usage(directory)[0]


def main_file(directory: str | os.PathLike) -> Path | None:
    """The entry's main file in directory (the first of :data:`MAIN_FILE_NAMES` that is a regular file)."""
    for name in MAIN_FILE_NAMES:
        candidate = os.path.join(directory, name)
        try:
            if stat.S_ISREG(os.lstat(candidate).st_mode):
                return Path(candidate)
        except OSError:
            continue
    return None


@dataclass(frozen=True)
class Entry:
    """One entry of the store, found through its ``.build-id`` link.

    Attributes:
        build_id_hex: lower-case hex.
        path: the original file's path (``/usr/bin/true``), or ``[kernel.kallsyms]``
            (perf's ``build_id_cache__origname``).
        directory: the entry's directory, ``ROOT/<path>/<build-id>``.
        size_bytes: sum of ``st_size`` of the regular files in ``directory``
            (elf, debug, probes, origin.json; kallsyms, modules, vmlinux) and
            in its ``alt/*`` directories.  Apparent size: a reflinked copy is
            counted in full, a sparse one with its holes.
        last_ref_ns: ns since the epoch: the directory's mtime, set when the
            entry was added and by :meth:`buildidd.store.Store.touch`.
        disk_bytes: the same files' ``st_blocks * 512``: what the quota counts.
    """

    build_id_hex: str
    path: str
    directory: Path
    size_bytes: int
    last_ref_ns: int
    disk_bytes: int = 0


class Layout:
    """The tree under one root: where an entry's link and directory are, and which exist.

    Reads only; the installer and the quota change the tree.  Build-ids given
    to the methods are already validated lower-case hex (:func:`hex_build_id`).

    Attributes:
        root: the store's directory, absolute.
    """

    def __init__(self, root: Path):
        self.root = root
        # The lookups of a sighting (link_target, entry_dir) work on strings: pathlib's
        # parsing was most of what they cost.
        self._root = os.path.normpath(root)
        self._inside = self._root.rstrip(os.sep) + os.sep

    def linkname(self, bid: str) -> Path:
        """``ROOT/.build-id/xx/rest`` for a build-id, present or not (perf's ``build_id_cache__linkname``)."""
        return self.root / BUILD_ID_DIR / bid[:2] / bid[2:]

    def link_target(self, bid: str) -> tuple[str, str] | None:
        """(the target of bid's link as read, the directory it names, normalized), when the link
        exists and names a path inside the store other than its root; whether that is a directory
        is not checked.  One readlink."""
        head = os.path.join(self._root, BUILD_ID_DIR, bid[:2])
        try:
            target = os.readlink(os.path.join(head, bid[2:]))
        except OSError:
            return None
        directory = os.path.normpath(os.path.join(head, target))
        if not directory.startswith(self._inside) or directory == self._root:
            return None
        return target, directory

    def entry_dir(self, bid: str) -> Path | None:
        """The directory the link of bid points to, if it is a directory inside the store."""
        found = self.link_target(bid)
        if found is None:
            return None
        try:
            if not stat.S_ISDIR(os.stat(found[1]).st_mode):
                return None
        except OSError:
            return None
        return Path(found[1])

    def go_link(self, go_build_id: str) -> Path:
        """``ROOT/.go-build-id/<name>`` for a Go build ID, present or not. Raises ValueError (see go_index_name)."""
        return self.root / GO_INDEX_DIR / go_index_name(go_build_id)

    def go_key(self, go_build_id: str) -> str | None:
        """The key (hex) of the entry the Go build ID's index link names, when that entry exists; else None.

        Raises:
            ValueError: not a Go build ID (see :func:`go_index_name`).
        """
        link = self.go_link(go_build_id)
        try:
            target = os.readlink(link)
        except OSError:
            return None
        parts = target.split("/")
        if len(parts) != 4 or parts[:2] != ["..", BUILD_ID_DIR] or len(parts[2]) != 2 or not is_hex(parts[2] + parts[3]):
            return None
        key = (parts[2] + parts[3]).lower()
        return key if self.entry_dir(key) is not None else None

    def path_of(self, bid: str) -> Path | None:
        """The entry's main file (see :func:`main_file`), or ``None`` when bid has no entry."""
        directory = self.entry_dir(bid)
        return main_file(directory) if directory is not None else None

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
            heads = sorted(n for n in os.listdir(top) if len(n) == 2 and is_hex(n))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise StoreError(f"{top}: cannot list: {e.strerror}") from e
        out = []
        for head in heads:
            try:
                tails = sorted(n for n in os.listdir(top / head) if is_hex(n))
            except OSError:
                continue
            for tail in tails:
                bid = head + tail
                directory = self.entry_dir(bid)
                if directory is None:
                    continue
                try:
                    target = os.readlink(top / head / tail)
                    mtime_ns = os.stat(directory).st_mtime_ns
                except OSError:
                    continue
                size, disk = entry_usage(directory)
                out.append(Entry(bid, origname(target), directory, size, mtime_ns, disk))
        return out

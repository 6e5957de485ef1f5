"""The store's read side: where an entry is, which copy to serve, whether it is private.

:class:`StoreLookups` is the half of :class:`buildidd.store.Store` that only
reads (the offline readers use nothing else): perf's names, the entry list,
and the choice among the copies one build-id may have (see
:mod:`buildidd.store.entries` and :mod:`buildidd.store.origin`).
"""

from __future__ import annotations

import os
from pathlib import Path

from buildidd.store.layout import DEBUG_NAME, ELF_NAME, KALLSYMS_NAME, Entry, Layout, alt_dirs, hex_build_id, \
    main_file
from buildidd.store.origin import KEY_GNU, KEYS, ORIGIN_NAME, Origin, read_origin, read_origin_stat
from buildidd.store.quality import best_quality, path_quality

KINDS = ("elf", "debug")
"""What :meth:`StoreLookups.best` is asked for: the file that ran, or the file with the most symbols."""

TRUSTED, UNTRUSTED, CONFLICT, UNKNOWN = "trusted", "untrusted", "conflict", "unknown"
PROVENANCES = (TRUSTED, UNTRUSTED, CONFLICT, UNKNOWN)
"""Where an entry's copies came from (:meth:`StoreLookups.provenance`), one word each:

``trusted``    one content, from a trusted system file (root-owned, not writable by others, under the
               system directories; :mod:`buildidd.store.origin`), or the kernel's own kallsyms
``untrusted``  one content, from any other file: owned by a user, outside the system directories,
               or writable by others; its build-id is only that file's claim
``conflict``   more than one content claims the build-id (``alt/<sha256>/``); the copy served and
               archived is the store's best (a trusted one when one was ever stored)
``unknown``    no origin recorded (an entry perf or an older buildidd made)
"""


class StoreLookups:
    """Read-only lookups of a store; the subclass sets ``_layout`` (a :class:`~buildidd.store.layout.Layout`)."""

    _layout: Layout

    def linkname(self, build_id_hex: str) -> Path:
        """``ROOT/.build-id/xx/rest`` for a build-id, present or not (perf's ``build_id_cache__linkname``).

        Raises:
            ValueError: not a build-id of at least 2 bytes in hex.
        """
        return self._layout.linkname(hex_build_id(build_id_hex))

    def path_of(self, build_id_hex: str) -> Path | None:
        """The entry's main file, without symlinks: ``ROOT/<path>/<build-id>/elf``
        (``kallsyms`` for a kernel, ``vdso`` for a vDSO perf stored), or ``None``.

        Raises:
            ValueError: not a build-id in hex.
        """
        return self._layout.path_of(hex_build_id(build_id_hex))

    def contains(self, build_id_hex: str) -> bool:
        """Whether the build-id's link resolves to an entry with its main file (see :meth:`path_of`)."""
        return self.path_of(build_id_hex) is not None

    def origin(self, build_id_hex: str) -> Origin | None:
        """The recorded origin of the entry's main copy (``origin.json``); ``None``: no entry, or
        one made without it (perf, an older buildidd, the kernel's).

        Raises:
            ValueError: not a build-id in hex.
        """
        directory = self._layout.entry_dir(hex_build_id(build_id_hex))
        return read_origin(directory) if directory is not None else None

    def origin_stamp(self, build_id_hex: str) -> tuple[str, int, int] | None:
        """What changes whenever the entry's main copy or its origin does: (the link's target, the
        inode and mtime in ns of its ``origin.json``), by one readlink and one stat (no parse), or
        ``None`` without an entry or an origin.  A removal, an eviction, a copy that replaced the
        main one or a new origin all change it (each writes a new file, renamed into place).

        Raises:
            ValueError: not a build-id in hex.
        """
        found = self._layout.link_target(hex_build_id(build_id_hex))
        if found is None:
            return None
        try:
            st = os.stat(os.path.join(found[1], ORIGIN_NAME))
        except OSError:
            return None
        return found[0], st.st_ino, st.st_mtime_ns

    def stamped_origin(self, build_id_hex: str) -> tuple[tuple[str, int, int], Origin] | None:
        """(:meth:`origin_stamp`, :meth:`origin`) of an entry that holds its main file (see
        :meth:`contains`), read together: one readlink, one lstat per main file name tried, and the
        ``origin.json`` opened once (read_origin_stat: its stamp from that descriptor, so the two
        agree).  ``None`` without such an entry, or without an origin.

        Raises:
            ValueError: not a build-id in hex.
        """
        found = self._layout.link_target(hex_build_id(build_id_hex))
        if found is None:
            return None
        target, directory = found
        read = read_origin_stat(directory) if main_file(directory) is not None else None
        if read is None:
            return None
        st, origin = read
        return (target, st.st_ino, st.st_mtime_ns), origin

    def _candidates(self, directory: Path) -> list[tuple[Path, Origin | None]]:
        """The entry's main copy, then its alternatives, best first (trusted, then public; main before alt)."""
        units = [(directory, read_origin(directory))] + [(a, read_origin(a)) for a in alt_dirs(directory)]
        order = {u: i for i, (u, _) in enumerate(units)}
        return sorted(units, key=lambda u: (u[1].rank() if u[1] is not None else 1, order[u[0]]))

    def best(self, build_id_hex: str, kind: str = "elf") -> Path | None:
        """The file to serve for a build-id: trusted copies before untrusted ones.

        ``kind="elf"``: the entry's main file (:meth:`path_of`), which is the
        trusted copy whenever one was ever stored (see :mod:`buildidd.store.entries`).
        ``kind="debug"``: the ``debug`` file copied from the host's debuginfo
        tree; else the best copy (main or ``alt/*``) that has ``.debug_info``
        or ``.symtab``; else ``None`` (a stripped copy never hides an unstripped one).

        Raises:
            ValueError: not a build-id in hex, or an unknown kind.
        """
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
        bid = hex_build_id(build_id_hex)
        if kind == "elf":
            return self._layout.path_of(bid)
        directory = self._layout.entry_dir(bid)
        if directory is None:
            return None
        if (directory / DEBUG_NAME).is_file():
            return directory / DEBUG_NAME
        for unit, origin in self._candidates(directory):
            if origin is not None and origin.has_debug and (unit / ELF_NAME).is_file():
                return unit / ELF_NAME
        return None

    def is_private(self, build_id_hex: str, kind: str = "elf") -> bool:
        """Whether the file :meth:`best` returns for (build_id_hex, kind) came from a private source.

        Private: its source was not readable by every user (its mode, or a
        directory on its path), or was a memfd (see :mod:`buildidd.store.origin`).
        Such files are not archived or served unless the operator allows it
        (``Config.store_share_private``).  A host debuginfo file, a kernel
        entry and an entry without ``origin.json`` are not private; no entry: ``False``.

        Raises:
            ValueError: not a build-id in hex, or an unknown kind.
        """
        path = self.best(build_id_hex, kind)
        if path is None or path.name != ELF_NAME:
            return False
        origin = read_origin(path.parent)
        return origin is not None and origin.private

    def quality(self, build_id_hex: str) -> str | None:
        """What the entry is good for (store.quality.QUALITIES): the best of its main copy and its
        debuginfo (:meth:`best` ``elf`` and ``debug``), ``symtab`` for the kernel's kallsyms; None when
        the store does not hold build_id_hex.

        Raises:
            ValueError: not a build-id in hex.
        """
        main = self.best(build_id_hex, "elf")
        if main is None:
            return None
        if main.name == KALLSYMS_NAME:
            return "symtab"          # the kernel's entry: /proc/kallsyms lists its symbols
        debug = self.best(build_id_hex, "debug")
        return best_quality(path_quality(main), path_quality(debug) if debug is not None else None)

    def provenance(self, build_id_hex: str) -> str | None:
        """The entry's provenance, one of :data:`PROVENANCES`; None when the store does not hold build_id_hex.

        Raises:
            ValueError: not a build-id in hex.
        """
        directory = self._layout.entry_dir(hex_build_id(build_id_hex))
        main = main_file(directory) if directory is not None else None
        if main is None:
            return None
        if alt_dirs(directory):
            return CONFLICT
        if main.name == KALLSYMS_NAME:
            return TRUSTED
        origin = read_origin(directory)
        if origin is None:
            return UNKNOWN
        return TRUSTED if origin.trusted else UNTRUSTED

    def key_kind(self, build_id_hex: str) -> str | None:
        """What the entry's name is (store.origin.KEYS): ``gnu`` (a GNU build-id; also for an entry
        without ``origin.json``: perf's, the kernel's) or ``htlhash`` (the file_id of a file without one);
        None when the store does not hold it.

        Raises:
            ValueError: not a build-id in hex.
        """
        directory = self._layout.entry_dir(hex_build_id(build_id_hex))
        if directory is None or main_file(directory) is None:
            return None
        origin = read_origin(directory)
        return origin.key if origin is not None and origin.key in KEYS else KEY_GNU

    def go_key(self, go_build_id: str) -> str | None:
        """The key (hex: a GNU build-id or an htlhash) of the entry whose copy carries this Go build ID
        (``.go-build-id/<name>``, the trusted copy's when one was stored), or None.

        Raises:
            ValueError: not a Go build ID the index can name (layout.go_index_name).
        """
        return self._layout.go_key(go_build_id)

    def entries(self) -> list[Entry]:
        """Every entry reachable through a ``.build-id`` link, in build-id order.

        Links that dangle, point outside the store, or are old-style regular
        files (perf before 3.x kept the file itself in ``.build-id/xx/rest``) are
        left out.

        Raises:
            StoreError: the ``.build-id`` directory cannot be listed.
        """
        return self._layout.entries()


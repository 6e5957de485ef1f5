"""A DSO name of its own for each version of one path in an injected profile.

perf keys a DSO by its name (tools/perf/util/dsos.c ``__dsos__find``: the
mapping record's filename; util/map.c ``map__new``), and its default sort
(comm,dso,sym) compares a symbol by address within a DSO, so two versions
of one path whose function sits at the same address fold into one line
shown with one version's symbol.  perf finds a DSO's file by the build-id
its MMAP2 carries (``.build-id/xx/rest`` in ``--buildid-dir``), whatever
the name.  So wherever the output holds more than one build-id for a path,
every version of it is named::

    PATH@BIDPREFIX            e.g. /usr/lib/libfoo.so.1@1a2b3c4d

BIDPREFIX is the start of the version's build-id (lower-case hex),
:data:`MIN_TAG_HEX` characters, more when two build-ids of the path share
that many (every version of a path gets the same length), the whole
build-id at most.  ``@`` joins them: no space or parenthesis, which
``perf script`` puts around the DSO and which its readers split on
(FlameGraph's stackcollapse-perf.pl reads ``(\\S+)``), no ``;`` (the frame
separator of folded stacks), no ``,`` (perf's list separator in ``--dsos``),
no ``:``.  perf report's DSO column shows the base name,
``libfoo.so.1@1a2b3c4d``.  A name the kernel gave as ``PATH (deleted)``
counts as PATH and is named ``PATH@BIDPREFIX (deleted)``.

A path with one build-id keeps its name.  A generated name is never one
the profile already uses for something else (a file someone named
``x@1a2b3c4d`` on the host): the prefix is lengthened, and past the whole
build-id ``~2``, ``~3``, ... is appended (at most one try per name in the
profile).  A name that would exceed :data:`MAX_NAME_BYTES` (perf reads
names into ``char[PATH_MAX]``) keeps the path's name, counted in
``too_long``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from buildidd.offline.perfdata import MAX_NAME_BYTES

#: Shortest build-id prefix in a version's name (hex characters).
MIN_TAG_HEX = 8
#: Joins a path and its version's build-id prefix.
SEPARATOR = b"@"
#: The suffix d_path gives an unlinked file (fs/d_path.c ``prepend_unreachable``... `` (deleted)``).
DELETED = b" (deleted)"


def path_of(name: bytes) -> tuple[bytes, bytes]:
    """A mapping record's filename as (path, suffix): the suffix is :data:`DELETED` or empty."""
    if name.endswith(DELETED):
        return name[:-len(DELETED)], DELETED
    return name, b""


@dataclass
class VersionNames:
    """The output name of each (filename, build-id) of a profile's user-space mappings.

    Fed with :meth:`see` for every mapping record (each name, and the build-id its output record carries or
    ``None``), then :meth:`assign` once; :meth:`name` answers in the rewrite.

    Attributes:
        paths_renamed: paths that hold more than one build-id, their versions named apart.
        names: (path, build-id hex) → the name given (bytes), for those paths.
        too_long: versions left under the path's name because PATH@BIDPREFIX would be too long.
    """

    paths_renamed: int = 0
    names: dict[tuple[bytes, str], bytes] = field(default_factory=dict)
    too_long: int = 0
    _bids: dict[bytes, set[str]] = field(default_factory=dict)      # path -> build-ids its records carry
    _taken: set[bytes] = field(default_factory=set)                  # every filename of the profile

    def see(self, name: bytes, build_id_hex: str | None) -> None:
        """One user-space mapping record: its filename, and the build-id its output record carries."""
        self._taken.add(name)
        if build_id_hex:
            self._bids.setdefault(path_of(name)[0], set()).add(build_id_hex)

    def assign(self) -> None:
        """Name the versions of every path that holds more than one build-id (in path order, so the names
        do not depend on the order of the records)."""
        for path in sorted(p for p, bids in self._bids.items() if len(bids) > 1):
            self.paths_renamed += 1
            bids = sorted(self._bids[path])
            width = max(MIN_TAG_HEX, *(_common(a, b) + 1 for a, b in zip(bids, bids[1:])))
            for bid in bids:
                name = self._free(path, bid, width)
                if name is None:
                    self.too_long += 1
                    continue
                self._taken.add(name)
                self.names[(path, bid)] = name
        self._bids.clear()

    def name(self, name: bytes, build_id_hex: str) -> bytes:
        """The output filename of a mapping record named name carrying build_id_hex (name itself when its path
        holds one build-id)."""
        path, suffix = path_of(name)
        given = self.names.get((path, build_id_hex))
        if given is None:
            return name
        return given + suffix if len(given) + len(suffix) <= MAX_NAME_BYTES else given

    def _free(self, path: bytes, bid: str, width: int) -> bytes | None:
        """PATH@PREFIX not yet used (see the module doc), or ``None`` when it would be too long."""
        if len(path) + len(SEPARATOR) + min(width, len(bid)) + len(DELETED) > MAX_NAME_BYTES:
            return None
        for n in range(min(width, len(bid)), len(bid) + 1):
            name = path + SEPARATOR + bid[:n].encode()
            if name not in self._taken and name + DELETED not in self._taken:
                return name
        full = path + SEPARATOR + bid.encode()
        for i in range(2, len(self._taken) + 3):
            name = full + b"~%d" % i
            if len(name) + len(DELETED) > MAX_NAME_BYTES:
                return None
            if name not in self._taken and name + DELETED not in self._taken:
                return name
        return None


def _common(a: str, b: str) -> int:
    """Length of the common prefix of a and b."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n

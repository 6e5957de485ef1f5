"""Several build-id stores read as one: the host's store and the analyst's imports.

An offline reader (resolve, which, buildid-list, sessions, serve) answers from
every store it was given, in order: each question about a build-id goes to the
first store that holds it (:meth:`StoreLookups.contains`), so one entry's facts
(its file, provenance, quality, privacy) all come from the same copy.  The
stores are only read; nothing here writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from buildidd.store.layout import Entry
from buildidd.store.lookups import KINDS, StoreLookups


class StoreChain:
    """Read-only lookups over stores, first holder first (the methods of :class:`StoreLookups`).

    Attributes:
        stores: the stores, in the order asked; at least one.
        root: the first store's directory (where a build-id no store holds would go: :meth:`linkname`).
    """

    def __init__(self, stores: Sequence[StoreLookups]):
        """Raises ValueError: no store given."""
        if not stores:
            raise ValueError("a StoreChain needs at least one store")
        self.stores = list(stores)
        self.root = Path(self.stores[0].root)

    def holder(self, build_id_hex: str) -> StoreLookups | None:
        """The first store holding build_id_hex (its ``.build-id`` link resolves to a main file), or None.

        Raises:
            ValueError: not a build-id in hex.
        """
        return next((s for s in self.stores if s.contains(build_id_hex)), None)

    def contains(self, build_id_hex: str) -> bool:
        """Whether a store holds build_id_hex."""
        return self.holder(build_id_hex) is not None

    def linkname(self, build_id_hex: str) -> Path:
        """The holder's ``.build-id/xx/rest``; the first store's when none holds it."""
        return (self.holder(build_id_hex) or self.stores[0]).linkname(build_id_hex)

    def path_of(self, build_id_hex: str) -> Path | None:
        """The holder's main file (:meth:`StoreLookups.path_of`), or None."""
        s = self.holder(build_id_hex)
        return s.path_of(build_id_hex) if s is not None else None

    def best(self, build_id_hex: str, kind: str = "elf") -> Path | None:
        """The holder's :meth:`StoreLookups.best`; for ``debug``, the first store with a debug file for
        it (one store may hold the binary and another its debuginfo).

        Raises:
            ValueError: not a build-id in hex, or an unknown kind.
        """
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
        if kind == "elf":
            return self.path_of(build_id_hex)
        return next((p for s in self.stores if (p := s.best(build_id_hex, kind)) is not None), None)

    def _ask(self, build_id_hex: str, fact: str, *args):
        s = self.holder(build_id_hex)
        return getattr(s, fact)(build_id_hex, *args) if s is not None else None

    def is_private(self, build_id_hex: str, kind: str = "elf") -> bool:
        """Whether the file :meth:`best` returns came from a private source (the store that gave it says)."""
        path = self.best(build_id_hex, kind)
        if path is None:
            return False
        owner = next((s for s in self.stores if s.best(build_id_hex, kind) == path), None)
        return owner is not None and owner.is_private(build_id_hex, kind)

    def origin(self, build_id_hex: str):
        """The holder's :meth:`StoreLookups.origin`, or None."""
        return self._ask(build_id_hex, "origin")

    def origin_stamp(self, build_id_hex: str):
        """The holder's :meth:`StoreLookups.origin_stamp`, or None."""
        return self._ask(build_id_hex, "origin_stamp")

    def stamped_origin(self, build_id_hex: str):
        """The holder's :meth:`StoreLookups.stamped_origin`, or None."""
        return self._ask(build_id_hex, "stamped_origin")

    def quality(self, build_id_hex: str) -> str | None:
        """The holder's :meth:`StoreLookups.quality`, or None."""
        return self._ask(build_id_hex, "quality")

    def provenance(self, build_id_hex: str) -> str | None:
        """The holder's :meth:`StoreLookups.provenance`, or None."""
        return self._ask(build_id_hex, "provenance")

    def key_kind(self, build_id_hex: str) -> str | None:
        """The holder's :meth:`StoreLookups.key_kind`, or None."""
        return self._ask(build_id_hex, "key_kind")

    def go_key(self, go_build_id: str) -> str | None:
        """The first store's answer to :meth:`StoreLookups.go_key` that is not None."""
        return next((k for s in self.stores if (k := s.go_key(go_build_id)) is not None), None)

    def entries(self) -> list[Entry]:
        """Every store's entries, in store order (a build-id two stores hold is listed twice).

        Raises:
            StoreError: a ``.build-id`` directory cannot be listed.
        """
        return [e for s in self.stores for e in s.entries()]

"""The index from a Go build ID to the entry of the file that carries it: ``ROOT/.go-build-id/<name>``.

Go binaries often have no GNU build-id (the Go linker writes one only when asked:
``-ldflags=-B``); they are stored under their htlhash, and this index finds them by
the Go build ID that ``go tool buildid`` prints (resolve.fileid.read_go_build_id).
Each link is relative, ``../.build-id/xx/rest``: it follows the entry's own link,
so an entry removed by the quota leaves a dangling index link, which
:meth:`buildidd.store.layout.Layout.go_key` answers as absent.  When two contents
claim one Go build ID, the index names a trusted copy before an untrusted one
(store.origin), else the first stored.
"""

from __future__ import annotations

from pathlib import Path

from buildidd.errors import StoreError
from buildidd.store.counters import Tally
from buildidd.store.install import Installer
from buildidd.store.layout import BUILD_ID_DIR, Layout
from buildidd.store.origin import Origin, read_origin


class GoIndex:
    """Writes ``.go-build-id`` links; the caller holds the store's lock."""

    def __init__(self, layout: Layout, installer: Installer, tally: Tally):
        self.layout = layout
        self.installer = installer
        self.tally = tally

    def index(self, entry_dir: Path, bid: str, origin: Origin | None = None) -> None:
        """Point ``.go-build-id/<name>`` at bid's link when the entry's main copy has a Go build ID
        (its ``origin.json``, or origin: what the caller just wrote there) and the index names no entry
        yet, or one whose main copy is not trusted while this one is.  A failure is counted
        (``copy_errors``) and logged, never raised: the entry stays, findable by its key."""
        new = origin if origin is not None else read_origin(entry_dir)
        if new is None or not new.go_build_id:
            return
        try:
            present = self.layout.go_key(new.go_build_id)
        except ValueError:
            return                          # not a Go build ID the index can name
        if present == bid:
            return
        if present is not None:
            old_dir = self.layout.entry_dir(present)
            old = read_origin(old_dir) if old_dir is not None else None
            if old is not None and (old.trusted or not new.trusted):
                return
        try:
            self._link(new.go_build_id, bid)
        except StoreError as e:
            self.tally.warn("Go build ID %s: cannot index: %s", new.go_build_id, e)

    def _link(self, go_build_id: str, bid: str) -> None:
        """Make (or replace) the link atomically (Installer.symlink). Raises StoreError."""
        self.installer.symlink(self.layout.go_link(go_build_id), f"../{BUILD_ID_DIR}/{bid[:2]}/{bid[2:]}")

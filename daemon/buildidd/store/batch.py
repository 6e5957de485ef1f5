"""A batch of new entries made durable together: two ``syncfs`` for the batch instead of five ``fsync`` per entry.

A single add (:mod:`buildidd.store.install`) makes each of a new entry's files durable
(``fsync`` of ``elf``, ``origin.json``, ``probes``), then its directory, and last its
link (``fsync`` of ``.build-id/xx``).  A burst of new programs (a build farm) pays that
for each.  Inside :meth:`buildidd.store.Store.batch`, a new entry is written the same
way but without those ``fsync`` calls, and its link is not made yet: the entry is
complete under its final names in a directory no link names (invisible to every reader,
:meth:`buildidd.store.Store.contains` is False).  When the batch ends (or holds
:data:`BATCH_MAX_ENTRIES`, or an add meets one of its build-ids), it is committed:

1. ``syncfs`` of the store's file system: every file, rename and directory of the
   batch is durable;
2. each entry's link, a symlink renamed into place (:meth:`Installer.symlink`), so an
   entry becomes visible only after all it names is durable, as for a single add;
3. ``syncfs`` again: the links are durable.

A crash (or kill -9) before step 2 leaves directories without links, invisible; a
later add of the same build-id writes over them.  A crash during step 2 leaves some
links, each to a whole entry.  A failure of step 1 (an I/O error) removes every entry
of the batch; a failure of a link removes that entry; both are named in
:attr:`Batch.failed`, so that the caller, which was told "added", can tell the ledger.

Only a new entry is batched.  Another content of a present build-id (``alt/``), a
promotion, or an origin rewritten in place changes what a link already names, and takes
the single add's path, with its ``fsync`` calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from buildidd.errors import StoreError
from buildidd.store.counters import Tally
from buildidd.store.install import Installed, Installer, syncfs
from buildidd.store.layout import Layout
from buildidd.store.origin import Origin
from buildidd.store.quota import Quota

BATCH_MAX_ENTRIES = 64
"""New entries a batch holds at most before it is committed (what a failed ``syncfs`` removes at most)."""


@dataclass(frozen=True)
class Pending:
    """A new entry written, not linked yet.

    Attributes:
        bid: its build-id (lower-case hex); target: its link's target (``../../<path>/<bid>``);
        entry_dir: its directory; done: what its add made (undone if the batch fails);
        origin: its main copy's origin (its payer is charged the entry's bytes).
    """

    bid: str
    target: str
    entry_dir: Path
    done: Installed
    origin: Origin


class Batch:
    """The new entries of one batch, written by the thread that opened it (thread: threading.get_ident()).

    Attributes:
        failed: build-id -> why, for each entry the batch added and then removed (a sync or link failure).
        committed: entries linked so far, all commits of this batch.
    """

    def __init__(self, thread: int, layout: Layout, installer: Installer, quota: Quota, tally: Tally):
        self.thread = thread
        self.layout = layout
        self.installer = installer
        self.quota = quota
        self.tally = tally
        self.failed: dict[str, str] = {}
        self.committed = 0
        self._pending: dict[str, Pending] = {}

    def __contains__(self, bid: str) -> bool:
        return bid in self._pending

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, entry: Pending) -> None:
        """Hold a written entry until the commit."""
        self._pending[entry.bid] = entry

    def commit(self, published: Callable[[Pending], None]) -> None:
        """Make the pending entries durable, then visible (module docstring); published(entry) for each one
        linked.  Failures are counted (``copy_errors``), named in :attr:`failed`, and not raised."""
        pending, self._pending = list(self._pending.values()), {}
        if not pending:
            return
        try:
            syncfs(self.layout.root)
        except OSError as e:
            self.tally.count("copy_errors")
            for entry in pending:
                self._drop(entry, f"{self.layout.root}: cannot sync a batch of new entries: {e.strerror}")
            return
        linked = []
        for entry in pending:
            try:
                self.installer.symlink(self.layout.linkname(entry.bid), entry.target, sync=False)
            except StoreError as e:
                self._drop(entry, str(e))
                continue
            linked.append(entry)
        try:
            syncfs(self.layout.root)
        except OSError as e:       # the entries are whole and linked; a crash now may lose their links
            self.tally.count("copy_errors")
            self.tally.warn("%s: cannot sync the links of a batch of new entries: %s", self.layout.root, e.strerror)
        self.committed += len(linked)
        for entry in linked:
            published(entry)

    def _drop(self, entry: Pending, why: str) -> None:
        """Remove an entry the commit could not make durable or visible; its bytes leave the totals."""
        self.quota.account_dir(entry.entry_dir, entry.origin.payer, -1)
        self.installer.undo(entry.done)
        self.failed[entry.bid] = why

"""A mapped file's entry: its copy, its origin, and what happens when two contents claim one build-id.

An entry is ``ROOT/<path>/<bid>/`` with ``elf``, ``origin.json`` (see
:mod:`buildidd.store.origin`), ``debug`` when the host has it, ``probes``;
then the ``.build-id`` link.  When a file claims a build-id the store holds
already (the link resolves):

* the same source (device, inode, size, mtime in ``origin.json``) or the same
  content (sha256): nothing is copied; a trusted or public source upgrades
  the recorded origin (``trusted`` is or-ed, ``private`` and-ed);
* other content (``conflicts``, logged): both are kept.  A trusted source
  whose entry's main copy is not trusted takes its place (``promoted``): the
  new entry is built aside under a temporary name, swapped in atomically
  (``renameat2(RENAME_EXCHANGE)`` or rename, then the link), and the old main
  copy moves to ``<new entry>/alt/<its sha256>/``.  Otherwise the new content
  goes to ``<entry>/alt/<sha256>/`` (``alts_added``), at most
  :data:`~buildidd.store.layout.MAX_ALT_DIRS` per entry.

So a copy from a user never replaces, nor is served instead of, one from a
root-owned system path, and a stripped copy never blocks an unstripped one
(:meth:`buildidd.store.Store.best` picks by kind).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

from buildidd.errors import StoreError, StoreRefusedError
from buildidd.fsio import fsync_dir
from buildidd.kernel.events import Identity
from buildidd.store.counters import Tally
from buildidd.store.debuginfo import CopySections, Debuginfo, copy_sections
from buildidd.store.goindex import GoIndex
from buildidd.store.install import AddResult, CopyRequest, Installed, Installer, temp_name
from buildidd.store.layout import (ALT_NAME, DIR_MODE, ELF_NAME, FILE_MODE, KALLSYMS_DSO, MAX_ALT_DIRS,
                                   PRIVATE_DIR_MODE, PROBES_NAME, Layout, alt_dirs, main_file)
from buildidd.store.origin import KEY_GNU, ORIGIN_NAME, Origin, origin_of_fd, read_origin, sha256_fd
from buildidd.resolve.fileid import file_id, read_go_build_id
from buildidd.store.quota import Quota
from buildidd.store.batch import BATCH_MAX_ENTRIES, Batch, Pending
from buildidd.store.sdt import probes_text

_RENAME_EXCHANGE = 2  # include/uapi/linux/fs.h
_AT_FDCWD = -100
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class AddRequest:
    """One file to add (validated by :meth:`buildidd.store.Store.add_from_fd`).

    Attributes:
        fd: the open source; path: its absolute path; rel: the path without its
        leading ``/``; bid: lower-case hex; identity: the mapped file, or None;
        origin: the source's facts (None: taken from fd and path here);
        key: what bid is (store.origin.KEYS): the GNU build-id, or the htlhash of a file without one.
    """

    fd: int
    path: str
    rel: str
    bid: str
    identity: Identity | None = None
    origin: Origin | None = None
    key: str = KEY_GNU


@dataclass(frozen=True)
class Limits:
    """file_max_bytes: sources larger than this are refused (``too_large``); None: no limit."""

    file_max_bytes: int | None = None


def dir_mode(origin: Origin) -> int:
    return PRIVATE_DIR_MODE if origin.private else DIR_MODE


def _exchange(a: Path, b: Path) -> None:
    """Swap two paths atomically (renameat2 RENAME_EXCHANGE). Raises OSError."""
    if _libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a))


class FileEntries:
    """Adds a mapped file's entry (or another content of a present build-id); the caller holds the store's lock."""

    def __init__(self, layout: Layout, installer: Installer, debuginfo: Debuginfo, tally: Tally, quota: Quota):
        self.layout = layout
        self.installer = installer
        self.debuginfo = debuginfo
        self.tally = tally
        self.quota = quota
        self.limits = Limits()
        self.go_index = GoIndex(layout, installer, tally)
        #: the open batch of new entries (store.batch), None when there is none
        self.batch: Batch | None = None

    def open_batch(self) -> Batch:
        """Open a batch for the calling thread's new entries (store.batch). Raises StoreError if one is open."""
        if self.batch is not None:
            raise StoreError("a batch of new entries is open already")
        self.batch = Batch(threading.get_ident(), self.layout, self.installer, self.quota, self.tally)
        return self.batch

    def close_batch(self) -> None:
        """Commit the open batch and close it."""
        try:
            self.commit_batch()
        finally:
            self.batch = None

    def commit_batch(self) -> None:
        """Make the open batch's entries durable and visible (Batch.commit)."""
        if self.batch is not None:
            self.batch.commit(lambda p: self._published(p.entry_dir, p.bid, p.origin))

    def _published(self, entry_dir: Path, bid: str, origin: Origin) -> None:
        """A new entry's link is made: its Go build ID indexed (origin: what its origin.json says), counted."""
        self.go_index.index(entry_dir, bid, origin)
        self.tally.count("added")
        self._count_origin(origin)

    def add(self, req: AddRequest) -> AddResult:
        """Add req's file (see :meth:`buildidd.store.Store.add_from_fd`)."""
        try:
            return self._add(req)
        finally:
            self.quota.forget(req.bid)      # its copies, and so its owner, may have changed

    def _add(self, req: AddRequest) -> AddResult:
        before = self._source_stat(req.fd, req.path)
        origin = req.origin if req.origin is not None else origin_of_fd(req.fd, req.path)
        origin = origin.replace(key=req.key)
        limit = self.limits.file_max_bytes
        if limit is not None and before.st_size > limit:
            self.tally.count("skipped_too_large")
            raise StoreRefusedError("too_large", f"{req.path}: {before.st_size} bytes, over the store's "
                                    f"limit of {limit} bytes per file")
        if self.batch is not None and req.bid in self.batch:
            self.commit_batch()             # its first copy is linked (or failed) before this one is judged
        present = self.layout.entry_dir(req.bid)
        if present is not None and main_file(present) is not None:
            return self._add_present(present, req, before, origin)
        batch = self.batch if self.batch is not None and self.batch.thread == threading.get_ident() else None
        entry_dir = self.layout.root / req.rel / req.bid
        target = f"../../{req.rel}/{req.bid}"
        self.quota.reserve(before.st_blocks * 512, origin.payer, req.bid)
        done = Installed()
        self.installer.deferred = batch is not None
        try:
            size = self._install_unit(entry_dir, req, before, origin, done)
            if batch is None:
                self.installer.publish(req.bid, target)
        except BaseException:
            self.installer.undo(done)
            raise
        finally:
            self.installer.deferred = False
        if batch is None:
            self._published(entry_dir, req.bid, size[3])
        else:
            batch.add(Pending(req.bid, target, entry_dir, done, size[3]))
            if len(batch) >= BATCH_MAX_ENTRIES:
                self.commit_batch()
        return AddResult(True, entry_dir / ELF_NAME, size[1], size[0], size[2] > 0)

    def _count_origin(self, origin: Origin) -> None:
        if origin.private:
            self.tally.count("private")
        if not origin.trusted:
            self.tally.count("untrusted")

    def _install_unit(self, unit: Path, req: AddRequest, before: os.stat_result, origin: Origin,
                      done: Installed, *, main: bool = True) -> tuple[int, bool, int, Origin]:
        """elf, origin.json (and for a main copy debug, probes) into unit; (bytes, reflinked, debug bytes,
        the origin written)."""
        if req.identity is not None:
            self.installer.check_identity(req.fd, req.identity, req.path, "before copying")
        self.installer.makedirs(unit, done, dir_mode(origin))
        elf = unit / ELF_NAME
        reflinked, elf_bytes = self.installer.install_copy(
            CopyRequest(req.fd, before, elf, req.bid, what=req.path, identity=req.identity, key=req.key), done,
            sync_dir=False)
        origin, known = self._describe(origin, elf, origin.sha256)
        total = elf_bytes + self.installer.install_bytes(unit / ORIGIN_NAME, origin.to_json(), FILE_MODE, done,
                                                         sync_dir=False)
        debug_bytes = 0
        if main:
            if req.key == KEY_GNU:      # the host's debuginfo is found by GNU build-id (and checked against it)
                debug_bytes = self.debuginfo.add(unit, req.bid, req.path, done, known)
            total += debug_bytes + self.installer.install_bytes(
                unit / PROBES_NAME, probes_text(elf, req.path, known), FILE_MODE, done, sync_dir=False)
        try:
            if not self.installer.deferred:     # a batch's syncfs makes it durable (store.batch)
                fsync_dir(unit)
        except OSError as e:
            self.tally.count("copy_errors")
            raise StoreError(f"{unit}: cannot sync: {e.strerror}") from e
        self.quota.account_dir(unit, origin.payer)
        return total, reflinked, debug_bytes, origin

    def _described(self, origin: Origin, elf: Path, sha: str = "", *, hashed: bool = False) -> Origin:
        """origin with the stored copy's has_debug, file_id (htlhash) and Go build ID, and its sha256: sha
        when known, computed when hashed.

        A main copy's sha256 is computed only when another content claims its
        build-id (:meth:`_add_present`): most build-ids never meet a second file.
        """
        return self._describe(origin, elf, sha, hashed=hashed)[0]

    def _describe(self, origin: Origin, elf: Path, sha: str = "", *,
                  hashed: bool = False) -> tuple[Origin, CopySections]:
        """:meth:`_described`, and the copy's sections read on the way (for its debuglink and probes)."""
        try:
            fd = os.open(elf, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise StoreError(f"{elf}: cannot reopen the copy: {e.strerror}") from e
        try:
            if hashed:
                sha = sha256_fd(fd, os.fstat(fd).st_size)
            known = copy_sections(fd)
            return origin.replace(sha256=sha, has_debug=known.has_debug, file_id=file_id(fd),
                                  go_build_id=read_go_build_id(fd) or ""), known
        except OSError as e:
            raise StoreError(f"{elf}: cannot read the copy: {e.strerror}") from e
        finally:
            os.close(fd)

    # -- a build-id the store has ---------------------------------------------------

    def _add_present(self, present: Path, req: AddRequest, before: os.stat_result, origin: Origin) -> AddResult:
        main = read_origin(present)
        units = [(present, main)] + [(a, read_origin(a)) for a in alt_dirs(present)]
        for unit, o in units:
            if o is not None and o.same_file(before):
                return self._present(present, req, unit, o, origin)
        try:
            sha = sha256_fd(req.fd, before.st_size)
        except OSError as e:
            self.tally.count("copy_errors")
            raise StoreError(f"{req.path}: cannot read the source: {e.strerror}") from e
        if main is None or not main.sha256:
            recorded = main is not None
            main = self._described(main or Origin(uid=-1, gid=-1, mode=0, path="", private=False),
                                   present / ELF_NAME, hashed=True)
            units[0] = (present, main)
            if recorded:  # keep it: the next claim needs no hashing
                self.installer.install_bytes(present / ORIGIN_NAME, main.to_json(), FILE_MODE, Installed())
        for unit, o in units:
            if o is not None and o.sha256 == sha:
                return self._present(present, req, unit, o, origin)
        self.tally.count("conflicts")
        self.tally.warn("build-id %s: %s (uid %d, %s) has other content than the stored %s (uid %d, %s); both kept",
                        req.bid, req.path, origin.uid, "trusted" if origin.trusted else "untrusted",
                        main.path, main.uid, "trusted" if main.trusted else "untrusted")
        if origin.trusted and not main.trusted:
            return self._promote(present, main, req, before, origin.replace(sha256=sha))
        if len(units) - 1 >= MAX_ALT_DIRS:
            self.tally.count("skipped_alt_limit")
            raise StoreRefusedError("alt_limit", f"build-id {req.bid}: {MAX_ALT_DIRS} other contents kept already")
        unit = present / ALT_NAME / sha
        self.quota.reserve(before.st_blocks * 512, origin.payer, req.bid)
        done = Installed()
        try:
            self.installer.makedirs(present / ALT_NAME, done)
            size = self._install_unit(unit, req, before, origin.replace(sha256=sha), done, main=False)
        except BaseException:
            self.installer.undo(done)
            raise
        self.tally.count("alts_added")
        self._count_origin(origin)
        return AddResult(True, unit / ELF_NAME, size[1], size[0], False)

    def _present(self, present: Path, req: AddRequest, unit: Path, stored: Origin, origin: Origin) -> AddResult:
        """The same content is stored in unit: maybe upgrade its origin; add host debuginfo that appeared."""
        self.tally.count("already_present")
        better = stored.replace(trusted=stored.trusted or origin.trusted, private=stored.private and origin.private)
        if not better.private:
            better = better.replace(private_by="", private_by_mode=-1)
        elif not better.private_by:
            better = better.replace(private_by=origin.private_by, private_by_mode=origin.private_by_mode)
        source = dict(dev=origin.dev, ino=origin.ino, size_bytes=origin.size_bytes, mtime_ns=origin.mtime_ns,
                      ctime_ns=origin.ctime_ns)
        if better == stored and (stored.uid, stored.gid, stored.mode, stored.path) == (
                origin.uid, origin.gid, origin.mode, origin.path):
            # The same content from another file with the same facts (a rebuild, a reinstall): the origin
            # names the newest, so that its next sighting is settled without a copy (SettledView.settled).
            better = stored.replace(**source)
        if better != stored:
            if origin.trusted and not stored.trusted:
                better = better.replace(uid=origin.uid, gid=origin.gid, mode=origin.mode, path=origin.path,
                                        charged_uid=origin.charged_uid, **source)
            # The unit's bytes move to the owner the new origin names (a trusted source takes a user's
            # copy of the same content over: the user's share no longer holds it).
            self.quota.account_dir(unit, stored.payer, -1)
            try:
                self.installer.install_bytes(unit / ORIGIN_NAME, better.to_json(), FILE_MODE, Installed())
            finally:
                now = read_origin(unit)
                self.quota.account_dir(unit, now.payer if now is not None else None)
            try:
                self.installer.own(unit, dir_mode(better))
            except OSError as e:
                raise StoreError(f"{unit}: cannot set its mode: {e.strerror}") from e
            if unit == present and better.trusted and not stored.trusted:
                self.go_index.index(present, req.bid)     # now trusted: the Go index may name it over a user's
        debug_bytes = 0
        if present.parent != self.layout.root / KALLSYMS_DSO and req.key == KEY_GNU:
            debug_bytes = self.debuginfo.add(present, req.bid, req.path, Installed())
        return AddResult(False, main_file(present), False, debug_bytes, debug_bytes > 0)

    def _promote(self, present: Path, old: Origin, req: AddRequest, before: os.stat_result,
                 origin: Origin) -> AddResult:
        """Make req's trusted copy the entry's main one; the old main copy (and its alts) go to its alt/."""
        final = self.layout.root / req.rel / req.bid
        self.quota.reserve(before.st_blocks * 512, origin.payer, req.bid)
        done = Installed()
        self.installer.makedirs(final.parent, done)
        aside = temp_name(final)
        try:
            size = self._install_unit(aside, req, before, origin, done)
        except BaseException:
            self.installer.undo(done)
            shutil.rmtree(aside, ignore_errors=True)
            raise
        try:
            if final.exists():
                _exchange(aside, final)           # aside now holds what was at final
                displaced = aside
            else:
                os.rename(aside, final)
                displaced = None
            self.installer.publish(req.bid, f"../../{req.rel}/{req.bid}")
            old_dir = displaced if present == final else present
            self.installer.makedirs(final / ALT_NAME, Installed())
            os.rename(old_dir, final / ALT_NAME / old.sha256)
            self._flatten_alts(final, final / ALT_NAME / old.sha256)
            if displaced is not None and present != final:
                shutil.rmtree(displaced, ignore_errors=True)   # a stale directory without a link
            fsync_dir(final.parent)
        except OSError as e:
            self.tally.count("copy_errors")
            raise StoreError(f"{final}: cannot promote the trusted copy: {e.strerror}") from e
        self.go_index.index(final, req.bid)
        self.tally.count("promoted")
        self.tally.count("added")
        return AddResult(True, final / ELF_NAME, size[1], size[0], size[2] > 0)

    def _flatten_alts(self, final: Path, demoted: Path) -> None:
        """Move the demoted copy's own alt/* up beside it, and keep only its elf and origin.json."""
        for alt in alt_dirs(demoted):
            target = final / ALT_NAME / alt.name
            if target.exists():
                shutil.rmtree(alt)
            else:
                os.rename(alt, target)
        shutil.rmtree(demoted / ALT_NAME, ignore_errors=True)
        self.installer.own(demoted, DIR_MODE if not (read_origin(demoted) or Origin(0, 0, 0, "")).private
                           else PRIVATE_DIR_MODE)

    def _source_stat(self, fd: int, path: str) -> os.stat_result:
        """fstat of the source, which must be a regular file (else StoreError, counted in ``copy_errors``)."""
        try:
            before = os.fstat(fd)
        except OSError as e:
            self.tally.count("copy_errors")
            raise StoreError(f"{path}: cannot stat the source: {e.strerror}") from e
        if not stat.S_ISREG(before.st_mode):
            self.tally.count("copy_errors")
            raise StoreError(f"{path}: not a regular file")
        return before

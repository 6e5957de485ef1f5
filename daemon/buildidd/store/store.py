"""The build-id store: snapshots of mapped files, laid out as perf's build-id cache.

Pipeline stage: enrichment → session log **and store** → clients.  Enrichment
hands over an open fd of a file it has identified (its identity checked, its
build-id read); the store keeps a copy under that build-id so that the file can
be symbolized after it was replaced, deleted or the host is gone.  A file
without a GNU build-id is kept the same way under its htlhash (``key="htlhash"``,
see :meth:`Store.add_from_fd`), and a Go binary is found by its Go build ID too
(:meth:`Store.go_key`).

:class:`Store` composes the parts, each in its module: the tree and its names
(layout), atomic verified copies (install), the host's debuginfo (debuginfo),
perf's SDT probe cache (sdt), the kernel's entry (kernel), and removal by
quota (quota).  What a retained session references is protected from the
quota by the caller (``capture.housekeeping``), which reads the session log.

Where this store differs from perf, on purpose (besides copying instead of
hard-linking: see install):

* One entry per build-id: adding a build-id already present does nothing
  (perf makes a second directory whose link then points elsewhere).
* ``kallsyms`` is stored only for the running kernel's build-id and refused
  when its addresses are hidden (see kernel).

Concurrency: one :class:`Store` serializes its own mutations with a lock.
Two processes adding to one root (two daemons, or the daemon and ``perf``)
are not coordinated; the worst outcome is a second copy in an unlinked
directory.
"""

from __future__ import annotations

import contextlib
import grp
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from buildidd.config import Config
from buildidd.errors import StoreError
from buildidd.kernel.events import Identity
from buildidd.store.batch import Batch
from buildidd.store.counters import Tally
from buildidd.store.debuginfo import Debuginfo
from buildidd.store.entries import AddRequest, FileEntries, Limits
from buildidd.store.install import AddResult, Installer
from buildidd.store.kernelfiles import KernelFiles, check_running
from buildidd.store.layout import DIR_MODE, Layout, hex_build_id, relative
from buildidd.store.lookups import KINDS, StoreLookups
from buildidd.store.origin import KEY_GNU, KEY_HTLHASH, KEYS, Origin
from buildidd.store.quota import Quota

def group_id(name: str | None) -> int:
    """The gid of group name; 0 (root's) when name is empty or no such group exists."""
    if not name:
        return 0
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        return 0

class Store(StoreLookups):
    """A build-id keyed store of file snapshots in perf's build-id cache layout.

    Attributes:
        root: the store's directory.
        debug_root: where separate debuginfo is looked for, as
            ``debug_root/.build-id/xx/rest.debug``.
        quota_bytes: :meth:`enforce_quota`'s limit on :meth:`size_bytes`; ``None``: none.
        throttle: ``None``, or called as ``throttle(n)`` after each chunk of
            ``n`` bytes copied (at most :data:`~buildidd.store.copydata.COPY_CHUNK_BYTES`;
            not called for a reflink, which copies no data).  It may sleep to
            limit the copy rate; an exception it raises aborts the add
            (nothing is left behind).
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
            warnings not logged because of the rate limit;
            ``conflicts`` files whose content differed from the stored copy of
            their build-id (both kept); ``promoted`` trusted copies that took
            the place of an untrusted main copy; ``alts_added`` other contents
            kept under ``alt/``; ``untrusted`` and ``private`` copies made
            from such sources (see :mod:`buildidd.store.origin`);
            ``skipped_too_large``, ``skipped_quota``, ``skipped_uid_share``,
            ``skipped_alt_limit`` files refused (:class:`~buildidd.errors.StoreRefusedError`);
            ``evicted`` entries removed to make room before a copy (:mod:`buildidd.store.eviction`),
            of which ``evicted_in_use`` were referenced by a session (no process mapped them) and
            ``evicted_for_root`` were users' (or of no single owner), evicted for a copy of root's.
    """

    def __init__(self, root: str | os.PathLike, *, quota_bytes: int | None = None,
                 debug_root: str | os.PathLike = "/usr/lib/debug", group: str | None = Config.control_group,
                 file_max_bytes: int | None = Config.store_file_max_bytes, uid_share: float = 1.0):
        """Open (and create, mode 0o750 root:group, parents 0o755) a store.

        Args:
            root: the store's directory (perf's ``buildid_dir``).
            quota_bytes: limit for :meth:`enforce_quota` and for each copy, disk bytes; ``None``: none.
            debug_root: the host's debuginfo tree (``/usr/lib/debug``).
            group: the group of every file and directory the store makes (``Config.control_group``);
                root's when empty or no such group exists.
            file_max_bytes: sources larger than this are refused (``too_large``); ``None``: no limit.
            uid_share: fraction of quota_bytes the copies of one owner other than root may take, in (0, 1].

        Raises:
            StoreError: root cannot be created or is not a directory.
            ValueError: a negative quota or file limit, a share outside (0, 1].
        """
        if quota_bytes is not None and quota_bytes < 0:
            raise ValueError(f"quota_bytes must be >= 0, got {quota_bytes}")
        if file_max_bytes is not None and file_max_bytes < 0:
            raise ValueError(f"file_max_bytes must be >= 0, got {file_max_bytes}")
        if not 0 < uid_share <= 1:
            raise ValueError(f"uid_share must be in (0, 1], got {uid_share}")
        self.root = Path(os.path.abspath(root))
        self.debug_root = Path(debug_root)
        self.gid = group_id(group)
        self._lock = threading.RLock()
        self._tally = Tally()
        self.counters = self._tally.counters
        self._layout = Layout(self.root)
        self._installer = Installer(self._layout, self._tally, self.gid)
        self._quota = Quota(self._layout, self._tally, self._lock, quota_bytes, uid_share)
        self._files = FileEntries(self._layout, self._installer,
                                  Debuginfo(self.debug_root, self._installer, self._tally), self._tally,
                                  self._quota)
        self._files.limits = Limits(file_max_bytes)
        self._kernel = KernelFiles(self._layout, self._installer, self._tally, self.debug_root)
        made = not os.path.isdir(self.root)
        try:
            os.makedirs(self.root, exist_ok=True)
            if made:
                self._installer.own(self.root, DIR_MODE)
        except OSError as e:
            raise StoreError(f"{self.root}: cannot create the store: {e.strerror}") from e
        if not self.root.is_dir():
            raise StoreError(f"{self.root}: not a directory")

    @classmethod
    def from_config(cls, cfg: Config, **overrides) -> Store:
        """The store cfg describes (store_root, store_quota_bytes, control_group, store_file_max_bytes,
        store_uid_share); keyword arguments override. Raises StoreError, ValueError."""
        kw = dict(quota_bytes=cfg.store_quota_bytes or None, group=cfg.control_group,
                  file_max_bytes=cfg.store_file_max_bytes or None, uid_share=cfg.store_uid_share)
        kw.update(overrides)
        return cls(cfg.store_root, **kw)

    # -- settings shared with the parts ----------------------------------------------

    @property
    def throttle(self) -> Callable[[int], None] | None:
        return self._installer.throttle

    @throttle.setter
    def throttle(self, value: Callable[[int], None] | None) -> None:
        self._installer.throttle = value

    @property
    def quota_bytes(self) -> int | None:
        return self._quota.quota_bytes

    @quota_bytes.setter
    def quota_bytes(self, value: int | None) -> None:
        self._quota.quota_bytes = value

    @property
    def over_quota(self) -> bool:
        return self._quota.over_quota

    # -- adding -------------------------------------------------------------------

    def add_from_fd(self, fd: int, path: str | os.PathLike, build_id_hex: str, *,
                    identity: Identity | None = None, origin: Origin | None = None,
                    key: str = KEY_GNU) -> AddResult:
        """Copy the open file fd into the store as ``path`` with build-id ``build_id_hex``.

        The file is read with positioned reads (or cloned), so fd's offset is
        untouched.  Steps: a temporary file in the entry directory (``O_EXCL``,
        permission bits of the source & 0o755); reflink, else copy in chunks of
        :data:`~buildidd.store.copydata.COPY_CHUNK_BYTES` calling :attr:`throttle`;
        ``fsync``; read the copy's build-id back and compare; when ``identity``
        is given compare ``identity_of(fd)`` with it before and after copying
        (always: the source's ``fstat`` before and after); ``rename`` into
        place; ``fsync`` the directory.  Then the separate debuginfo, when
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
            key: what build_id_hex is (store.origin.KEYS): ``gnu``, the GNU build-id read from fd; or
                ``htlhash``, fd's file_id (32 hex digits, resolve.fileid) for a file without a GNU
                build-id.  An htlhash entry has the same layout, trust, privacy, quota and
                archive rules; its ``origin.json`` says ``"key": "htlhash"``; the copy is verified
                by its htlhash (and must have no GNU build-id); no host debuginfo is looked for.
                Either kind's Go build ID, when the copy has one, is indexed (:meth:`go_key`).

        Returns:
            An :class:`~buildidd.store.install.AddResult`.

        Raises:
            StoreError: the copy's build-id differs (``verify_failed``), the file
                is not the identified one or changed while being copied
                (``identity_mismatch``), it is not a regular file, or an OS error
                such as ENOSPC (``copy_errors``).  Nothing of this add is left
                in the store, which stays usable.  :class:`~buildidd.errors.StoreRefusedError`
                (a subclass) for a limit, with its ``reason``.
            ValueError: path is not absolute (or has ``..``), build_id_hex is not hex.
        """
        bid = hex_build_id(build_id_hex)
        if key not in KEYS or (key == KEY_HTLHASH and len(bid) != 32):
            raise ValueError(f"{key!r} key {build_id_hex!r}: not one of {KEYS}, or an htlhash not of 32 hex digits")
        path = os.fspath(path)
        rel = relative(path)
        with self._lock:
            return self._files.add(AddRequest(fd, path, rel, bid, identity, origin, key))

    @contextlib.contextmanager
    def batch(self) -> Iterator[Batch]:
        """Group the calling thread's new entries: their files are written without ``fsync``, their links
        made when the block ends, after one ``syncfs`` (:mod:`buildidd.store.batch`: the crash order).

        Inside, :meth:`add_from_fd` of a new build-id returns ``added`` before the entry is visible
        (:meth:`contains` is False until the commit); an add of a build-id the batch holds commits the
        batch first.  At most :data:`~buildidd.store.batch.BATCH_MAX_ENTRIES` are held; more commit.
        When the block ends (even by an exception) the batch is committed; the entries it then had to
        remove are in the yielded :class:`~buildidd.store.batch.Batch`'s ``failed`` (build-id -> why).
        Adds from other threads take the single path meanwhile.

        Raises:
            StoreError: a batch is open already.
        """
        with self._lock:
            b = self._files.open_batch()
        try:
            yield b
        finally:
            with self._lock:
                self._files.close_batch()

    def add_kallsyms(self, kernel_build_id_hex: str, *,
                     kallsyms_path: str | os.PathLike = "/proc/kallsyms",
                     modules_path: str | os.PathLike = "/proc/modules",
                     notes_path: str | os.PathLike = "/sys/kernel/notes",
                     vmlinux_paths: Sequence[str | os.PathLike] | None = None) -> AddResult:
        """Snapshot the running kernel's symbols as ``ROOT/[kernel.kallsyms]/<build-id>/``.

        ``kallsyms`` is a copy of ``kallsyms_path``, mode 0o640 (0o755 as ``perf
        record`` leaves it); ``modules`` a copy of ``modules_path``, when it
        exists (kernels without CONFIG_MODULES have none); ``vmlinux`` the
        first of ``vmlinux_paths`` whose build-id is the kernel's, copied and
        verified like an elf (default: perf's candidates, see
        :meth:`buildidd.store.kernelfiles.KernelFiles.vmlinux_candidates`).

        Already present (the link resolves to a directory with ``kallsyms``):
        nothing is copied, but a vmlinux found since is added.

        Raises:
            StoreError: kernel_build_id_hex is not the running kernel's (read
                from ``notes_path``), kallsyms' addresses are hidden (all zero:
                ``kernel.kptr_restrict``), or an OS error (counted in ``copy_errors``).
            ValueError: not a build-id in hex.
        """
        bid = hex_build_id(kernel_build_id_hex)
        check_running(bid, notes_path)
        if vmlinux_paths is None:
            vmlinux_paths = self._kernel.vmlinux_candidates(bid)
        with self._lock:
            return self._kernel.add(bid, kallsyms_path, modules_path, vmlinux_paths)

    # -- recency, size, removal ----------------------------------------------------

    def touch(self, build_id_hex: str) -> None:
        """Mark an entry referenced now: its directory's mtime (and atime) := now.

        Raises:
            StoreError: the build-id is not in the store, or utime failed.
            ValueError: not a build-id in hex.
        """
        self._quota.touch(hex_build_id(build_id_hex))

    def size_bytes(self) -> int:
        """Sum of the entries' ``size_bytes`` (apparent); a running total, no walk after the first call."""
        return self._quota.size_bytes()

    def disk_bytes(self) -> int:
        """What the entries take on disk (``st_blocks * 512``), which the quota limits; a running total."""
        return self._quota.disk_bytes()

    def uid_bytes(self, uid: int) -> int:
        """Disk bytes of the copies whose source uid owned (root's are not counted: 0)."""
        return self._quota.uid_bytes(uid)

    def remove(self, build_id_hex: str) -> int:
        """Remove an entry: its link first (it disappears at once), then its directory.

        Empty parent directories up to the root are removed too (perf's
        ``build_id_cache__remove_s`` leaves them).

        Returns:
            bytes freed (the entry's ``size_bytes``); 0 when it was absent.

        Raises:
            StoreError: the link or directory cannot be removed.
            ValueError: not a build-id in hex.
        """
        return self._quota.remove(hex_build_id(build_id_hex))

    def enforce_quota(self, protected: set[str]) -> list[str]:
        """Remove least recently referenced entries not in ``protected`` while over the quota.

        See :meth:`buildidd.store.quota.Quota.enforce` (order, ``over_quota``, errors).

        Args:
            protected: build-ids (hex, any case) that retained sessions reference.

        Returns:
            The build-ids removed, in removal order.
        """
        return self._quota.enforce(protected)

    def sweep_temps(self) -> int:
        """Remove temporary files left by a crash (``.NAME.buildidd-tmp-XXXX``); how many.

        Walks the whole store: call it at start, before adding.
        """
        return self._quota.sweep_temps()

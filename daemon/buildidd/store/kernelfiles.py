"""The running kernel's entry: kallsyms, modules and vmlinux under ``[kernel.kallsyms]/<build-id>/``.

``kallsyms`` is a copy of /proc/kallsyms (util/build-id.c
``build_id_cache__add`` with ``is_kallsyms``: ``copyfile("/proc/kallsyms", …)``),
mode 0o640 root:group where perf leaves 0o755 (its addresses are the kernel's
layout, which kptr_restrict hides from other users); the link is
``.build-id/xx/rest -> ../../[kernel.kallsyms]/<build-id>``.  The store adds
``modules`` (/proc/modules) and ``vmlinux`` (the kernel image with the same
build-id), which perf does not keep.  kallsyms is stored only for the running
kernel's build-id (checked against ``/sys/kernel/notes``) and refused when its
addresses are hidden (``kptr_restrict``).
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterable, Sequence
from pathlib import Path

from buildidd.errors import ElfError, StoreError
from buildidd.resolve.buildid import read_build_id_fd
from buildidd.resolve.host import kernel_build_id
from buildidd.store.counters import Tally
from buildidd.store.debuginfo import install_beside
from buildidd.store.install import AddResult, Installed, Installer
from buildidd.store.layout import BUILD_ID_DIR, FILE_MODE, KALLSYMS_DSO, KALLSYMS_NAME, MODULES_NAME, VMLINUX_NAME, Layout, is_hex

_KALLSYMS_MODE = FILE_MODE
_MODULES_MODE = FILE_MODE


def check_running(bid: str, notes_path: str | os.PathLike) -> None:
    """Raise StoreError unless bid (lower-case hex) is the running kernel's build-id, read from notes_path."""
    running = kernel_build_id(str(notes_path))
    if running != bid:
        raise StoreError(f"kallsyms are the running kernel's ({running}), not {bid}'s")


def check_kallsyms(head: bytes) -> None:
    """Refuse a kallsyms whose first address is zero: kptr_restrict hides them all.

    Raises:
        StoreError: the first address is zero or not hex, or the file is empty.
    """
    first = head.split(b" ", 1)[0]
    if not first or not is_hex(first.decode("ascii", "replace")) or int(first, 16) == 0:
        raise StoreError("kallsyms addresses are hidden (kernel.kptr_restrict) or the file is empty")


class KernelFiles:
    """Adds the kernel's entry: kallsyms, modules, and the matching vmlinux when one is found.

    The caller holds the store's lock around :meth:`add`.
    """

    def __init__(self, layout: Layout, installer: Installer, tally: Tally, debug_root: Path):
        self.layout = layout
        self.installer = installer
        self.tally = tally
        self.debug_root = debug_root

    def vmlinux_candidates(self, bid: str) -> list[str]:
        """Where a vmlinux with build-id bid may be, in the order tried, without duplicates.

        perf's ``vmlinux_path__init`` list (``/boot/vmlinux``, ``/boot/vmlinux-R``,
        ``DEBUG/boot/vmlinux-R``, ``/lib/modules/R/build/vmlinux``,
        ``DEBUG/lib/modules/R/vmlinux``, ``DEBUG/boot/vmlinux-R.debug`` for
        release R and ``debug_root`` DEBUG), ``DEBUG/.build-id/xx/rest.debug``,
        then any ``/boot/vmlinux-*`` and ``DEBUG/boot/vmlinux-*``.
        """
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

    def add(self, bid: str, kallsyms_path: str | os.PathLike, modules_path: str | os.PathLike,
            vmlinux_paths: Sequence[str | os.PathLike]) -> AddResult:
        """Snapshot kallsyms (and modules, vmlinux) for the running kernel bid (already checked).

        Already present (the link resolves to a directory with ``kallsyms``):
        nothing is copied, but a vmlinux found since is added.

        Raises:
            StoreError: kallsyms' addresses are hidden, or an OS error; nothing
                of this add is left behind.
        """
        present = self.layout.entry_dir(bid)
        if present is not None and (present / KALLSYMS_NAME).is_file():
            self.tally.count("already_present")
            vmlinux_bytes = 0
            if not (present / VMLINUX_NAME).exists():
                vmlinux_bytes = self.add_vmlinux(present, bid, vmlinux_paths, Installed())
            return AddResult(False, present / KALLSYMS_NAME, False, vmlinux_bytes, vmlinux_bytes > 0)

        entry_dir = self.layout.root / KALLSYMS_DSO / bid
        done = Installed()
        try:
            self.installer.makedirs(entry_dir, done)
            total = self.installer.install_stream(Path(kallsyms_path), entry_dir / KALLSYMS_NAME, _KALLSYMS_MODE,
                                                  done, check=check_kallsyms)
            if os.path.exists(modules_path):
                total += self.installer.install_stream(Path(modules_path), entry_dir / MODULES_NAME,
                                                       _MODULES_MODE, done)
            vmlinux_bytes = self.add_vmlinux(entry_dir, bid, vmlinux_paths, done)
            self.installer.publish(bid, f"../../{KALLSYMS_DSO}/{bid}")
        except BaseException:
            self.installer.undo(done)
            raise
        self.tally.count("added")
        self.tally.count("kallsyms_added")
        return AddResult(True, entry_dir / KALLSYMS_NAME, False, total + vmlinux_bytes, vmlinux_bytes > 0)

    def add_vmlinux(self, entry_dir: Path, bid: str, candidates: Iterable[str | os.PathLike],
                    done: Installed) -> int:
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
                return install_beside(self.installer, fd, entry_dir / VMLINUX_NAME, bid, str(candidate), done)
            finally:
                os.close(fd)
        return 0

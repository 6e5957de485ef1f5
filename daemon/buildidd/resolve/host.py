"""Facts about the recording host for the session record: kernel build-ids, boot id.

Sources: /sys/kernel/notes (the running kernel's ELF notes, including its GNU
build-id, as perf reads it for [kernel.kallsyms]), /sys/module/*/notes/
.note.gnu.build-id (loaded modules), /proc/sys/kernel/random/boot_id.
"""

from __future__ import annotations

import glob
import os
import platform
import socket

from buildidd.resolve.buildid import build_id_from_notes
from buildidd.errors import ElfError

NOTES_READ_MAX = 1 << 16


def _read(path: str, limit: int = NOTES_READ_MAX) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError:
        return None


def kernel_build_id(path: str = "/sys/kernel/notes") -> str | None:
    """The running kernel's build-id (hex) from its notes, or None when it has none."""
    data = _read(path)
    if not data:
        return None
    try:
        bid = build_id_from_notes(data)
    except ElfError:
        return None
    return bid.hex if bid else None


def module_build_ids(root: str = "/sys/module") -> dict[str, str]:
    """Loaded module name → build-id hex (modules without notes are left out)."""
    out = {}
    for path in sorted(glob.glob(os.path.join(root, "*", "notes", ".note.gnu.build-id"))):
        bid = kernel_build_id(path)
        if bid:
            out[path.split(os.sep)[-3]] = bid
    return out


def boot_id() -> str | None:
    """/proc/sys/kernel/random/boot_id: a UUID that changes at every boot."""
    data = _read("/proc/sys/kernel/random/boot_id", 64)
    return data.decode().strip() if data else None


def describe() -> dict:
    """The host fields of the session record."""
    return {
        "host": socket.gethostname(),
        "kernel_release": platform.release(),
        "machine": platform.machine(),
        "kernel_build_id": kernel_build_id(),
        "module_build_ids": module_build_ids(),
        "boot_id": boot_id(),
    }

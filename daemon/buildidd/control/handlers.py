"""The control socket's commands, on top of a running Recorder.

Handlers run in the control server's thread.  They only read counters (plain
ints and dicts, read under the GIL), or ask the recorder's own thread to act
(rotate) and wait for it, so no recorder state is mutated from two threads.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from buildidd.resolve.buildid import read_build_id_fd
from buildidd.errors import ElfError
from buildidd.resolve import procfs
from buildidd.control.protocol import ControlError


def lookup(pid: int, addr: int) -> dict:
    """Which mapping of pid covers addr now: VMA, file offset, file and its build-id.

    Reads /proc/PID/maps and the mapping's own inode through
    /proc/PID/map_files (so a deleted or replaced file still answers).

    Raises:
        ControlError("not_found"): no such process, or no mapping at addr.
    """
    try:
        maps = procfs.read_maps(pid)
    except OSError as e:
        raise ControlError("not_found", f"process {pid}: {e.strerror}") from e
    m = next((m for m in maps if m.start <= addr < m.end), None)
    if m is None:
        raise ControlError("not_found", f"process {pid} has no mapping at {addr:#x}")
    out = {"pid": pid, "addr": addr, "start": m.start, "end": m.end, "perms": m.perms,
           "file_offset": m.offset + (addr - m.start), "path": m.path or None, "deleted": m.deleted,
           "dev": m.dev, "ino": m.ino, "build_id": None, "error": None}
    if not m.ino:
        out["error"] = "anonymous"
        return out
    try:
        fd = procfs.open_map_file(pid, m.start, m.end)
    except OSError as e:
        out["error"] = f"map_files: {e.strerror}"
        return out
    try:
        bid = read_build_id_fd(fd)
        out["build_id"] = bid.hex if bid else None
        out["error"] = None if bid else "no_build_id"
    except ElfError as e:
        out["error"] = e.reason
    except OSError as e:
        out["error"] = f"io_error: {e.strerror}"
    finally:
        os.close(fd)
    return out


def _int_arg(args: dict, name: str) -> int:
    v = args.get(name)
    if isinstance(v, str):
        try:
            v = int(v, 0)
        except ValueError:
            pass
    if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
        return v
    raise ControlError("bad_request", f"argument {name!r} must be a non-negative integer")


def make_handlers(recorder, extra_status: Callable[[], dict] | None = None) -> dict[str, Callable[[dict], Any]]:
    """The command table: status, rotate, lookup, ping."""

    def status(_args):
        out = recorder.status()
        if extra_status is not None:
            out.update(extra_status())
        return out

    def rotate(_args):
        if not recorder.request_rotate(timeout_s=5.0):
            raise ControlError("timeout", "the recorder did not rotate within 5 s")
        return {"rotated": True, "segment": recorder.current_segment()}

    def do_lookup(args):
        return lookup(_int_arg(args, "pid"), _int_arg(args, "addr"))

    return {"status": status, "rotate": rotate, "lookup": do_lookup, "ping": lambda _a: "pong"}

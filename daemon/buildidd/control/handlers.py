"""The control socket's commands, on top of a running Recorder.

Handlers run on the control server's worker threads and get the caller's
credentials (:class:`~.connection.Peer`).  They only read counters (plain
ints and dicts, read under the GIL), or ask the recorder's own thread to act
(rotate) and wait for it, so no recorder state is mutated from two threads.

``lookup`` answers only what ``/proc/PID/maps`` would show the caller:
root, or a caller whose uid is the target's real, effective and saved uid
while the target is dumpable (the kernel's ``ptrace_may_access`` with
PTRACE_MODE_READ_FSCREDS, fs/proc/base.c ``proc_maps_open``; a non-dumpable
process's /proc/PID is owned by root, ``task_dump_owner``).  The check and the
reads go through one ``/proc/PID`` directory descriptor, which stops working
if the process exits, so a pid reused meanwhile is never answered for.

``status`` is served from a copy at most :data:`STATUS_MAX_AGE_S` old: the
recorder's status includes the store's size, which the store computes by a
walk of every entry today; a client asking in a loop costs at most one walk
per interval.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable

from buildidd.resolve.buildid import read_build_id_fd
from buildidd.errors import ElfError
from buildidd.resolve import procfs
from buildidd.control import protocol
from buildidd.control.connection import Peer
from buildidd.control.protocol import ControlError

#: Seconds a status answer is reused.
STATUS_MAX_AGE_S = 1.0


def _status_uids(dir_fd: int) -> tuple[int, ...]:
    """Real, effective, saved and fs uid from ``status`` under an open /proc/PID (``Uid:`` line)."""
    fd = os.open("status", os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        text = os.read(fd, 64 * 1024).decode("ascii", "replace")
    finally:
        os.close(fd)
    for line in text.splitlines():
        if line.startswith("Uid:"):
            return tuple(int(f) for f in line.split()[1:] if f.isdigit())
    return ()


def check_may_read_maps(pid: int, peer: Peer) -> int:
    """Whether ``peer`` may read pid's mappings, as /proc/PID/maps decides; returns /proc/PID opened.

    Args:
        pid: the target (tgid, in our pid namespace).
        peer: the caller (SO_PEERCRED).

    Returns:
        a descriptor of ``/proc/PID`` (O_DIRECTORY); the caller closes it and
        calls :func:`still_alive` after reading, to rule out pid reuse.

    Raises:
        ControlError: ``not_found`` (no such process), ``not_permitted``
            (another user's process, or one that is not dumpable).
    """
    try:
        dir_fd = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise ControlError("not_found", f"process {pid}: {e.strerror}") from e
    if peer.uid == 0:
        return dir_fd
    try:
        owner = os.fstat(dir_fd).st_uid  # euid when dumpable, else root (task_dump_owner)
        uids = _status_uids(dir_fd)
    except OSError as e:
        os.close(dir_fd)
        raise ControlError("not_found", f"process {pid}: {e.strerror}") from e
    if owner != peer.uid or not uids or any(u != peer.uid for u in uids[:3]):
        os.close(dir_fd)
        raise ControlError(protocol.NOT_PERMITTED, f"permission denied: process {pid} does not belong to "
                           f"uid {peer.uid} (lookup is allowed to root and to the process's own user, "
                           "as /proc/PID/maps is)")
    return dir_fd


def still_alive(dir_fd: int, pid: int) -> None:
    """Raise ControlError ``not_found`` when the process of the open /proc/PID has exited
    (its pid may have been reused by another process while we read)."""
    try:
        fd = os.open("stat", os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        raise ControlError("not_found", f"process {pid} exited during the lookup") from e
    os.close(fd)


def lookup(pid: int, addr: int, peer: Peer = Peer(0, 0, 0)) -> dict:
    """Which mapping of pid covers addr now: VMA, file offset, file and its build-id.

    Reads /proc/PID/maps and the mapping's own inode through
    /proc/PID/map_files (so a deleted or replaced file still answers), after
    :func:`check_may_read_maps` for ``peer`` (default: root).

    Raises:
        ControlError: ``not_found`` (no such process, or no mapping at
            addr), ``not_permitted`` (see :func:`check_may_read_maps`).
    """
    dir_fd = check_may_read_maps(pid, peer)
    try:
        out = _lookup_checked(pid, addr)
        still_alive(dir_fd, pid)
    finally:
        os.close(dir_fd)
    return out


def _lookup_checked(pid: int, addr: int) -> dict:
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

    cache: dict[str, Any] = {"at": -1e9, "value": None}
    cache_lock = threading.Lock()

    def status(_args, _peer):
        with cache_lock:  # concurrent callers share one computation
            now = time.monotonic()
            if now - cache["at"] >= STATUS_MAX_AGE_S:
                out = recorder.status()
                if extra_status is not None:
                    out.update(extra_status())
                cache["value"], cache["at"] = out, now
            return cache["value"]

    def rotate(_args, _peer):
        closed = recorder.current_segment()
        if not recorder.request_rotate(timeout_s=5.0):
            raise ControlError("timeout", "the recorder did not rotate within 5 s")
        with cache_lock:
            cache["at"] = -1e9  # the next status shows the new segment
        return {"rotated": True, "closed": closed, "segment": recorder.current_segment() or recorder.next_segment()}

    def do_lookup(args, peer):
        return lookup(_int_arg(args, "pid"), _int_arg(args, "addr"), peer)

    return {"status": status, "rotate": rotate, "lookup": do_lookup, "ping": lambda _a, _p: "pong"}

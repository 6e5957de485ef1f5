"""Who is on the other end of a unix socket: SO_PEERCRED and the peer's supplementary groups.

Shared by the control socket (:mod:`buildidd.control.server`) and ``buildidd
serve``'s unix-socket listener (:mod:`buildidd.offline.serve_access`); imports
no stage.
"""

from __future__ import annotations

import socket
import struct

__all__ = ["peer_credentials", "proc_supplementary_groups", "in_group"]

_UCRED = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}, socket(7)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process that connected sock, as of its connect().

    Source: SO_PEERCRED, ``struct ucred`` (socket(7), unix(7)); pid is the tgid
    in the reader's pid namespace, 0 when the peer's is not visible from it.
    Raises OSError.
    """
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return _UCRED.unpack(raw)


def proc_supplementary_groups(pid: int, uid: int) -> frozenset[int]:
    """The supplementary group ids of pid from ``/proc/PID/status`` ("Groups:").

    The pid of an SO_PEERCRED answer may have exited and been reused by the
    time we look, so the answer is only trusted when the process's effective
    uid ("Uid:" line, second field) still equals uid; otherwise, and when the
    file cannot be read, the empty set (the peer then gets no group-based access).
    """
    if pid <= 0:
        return frozenset()
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            text = f.read(64 * 1024).decode("ascii", "replace")
    except OSError:
        return frozenset()
    groups: frozenset[int] | None = None
    euid: int | None = None
    for line in text.splitlines():
        if line.startswith("Uid:"):
            fields = line.split()
            euid = int(fields[2]) if len(fields) > 2 and fields[2].isdigit() else None
        elif line.startswith("Groups:"):
            groups = frozenset(int(g) for g in line.split()[1:] if g.isdigit())
    if euid != uid or groups is None:
        return frozenset()
    return groups


def in_group(creds: tuple[int, int, int], gid: int) -> bool:
    """Whether the peer ``creds`` = ``(pid, uid, gid)`` (SO_PEERCRED) is root or a member of gid
    (its primary group, or a supplementary one per :func:`proc_supplementary_groups`).  gid 0 admits root only."""
    pid, uid, peer_gid = creds
    if uid == 0:
        return True
    if gid == 0:
        return False
    return peer_gid == gid or gid in proc_supplementary_groups(pid, uid)

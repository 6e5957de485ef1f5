"""Who is on the other end of a socket: SO_PEERCRED and the peer's groups; a local TCP peer's uid.

Shared by the control socket (:mod:`buildidd.control.server`) and ``buildidd
serve`` (:mod:`buildidd.offline.serve.guard`, :mod:`buildidd.offline.serve.sessions`);
imports no stage.
"""

from __future__ import annotations

import os
import pwd
import socket
import struct

__all__ = ["peer_credentials", "proc_supplementary_groups", "in_group", "tcp_peer_uid"]

_UCRED = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}, socket(7)

# sock_diag(7), include/uapi/linux/inet_diag.h
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG = struct.Struct("=IHHII")          # struct nlmsghdr: len, type, flags, seq, pid
_REQ_HEAD = struct.Struct("=BBBBI")       # struct inet_diag_req_v2: family, protocol, ext, pad, states
_SOCKID = struct.Struct("!HH16s16s")      # struct inet_diag_sockid: sport, dport (be16), src[4], dst[4] (be32)
_SOCKID_TAIL = struct.Struct("=III")      # if, cookie[2] (INET_DIAG_NOCOOKIE: all ones)
_DIAG_MSG_UID_OFFSET = _NLMSG.size + 4 + _SOCKID.size + _SOCKID_TAIL.size + 12   # inet_diag_msg.idiag_uid


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
    """Whether the peer ``creds`` = ``(pid, uid, gid)`` (SO_PEERCRED) is root or a member of gid: its
    primary group, or a supplementary one of the process (:func:`proc_supplementary_groups`); when the
    process's /proc entry cannot be read at all (``ProtectProc=invisible`` hides other users' processes),
    the user's groups in the user database (``os.getgrouplist``).  gid 0 admits root only."""
    pid, uid, peer_gid = creds
    if uid == 0:
        return True
    if gid == 0:
        return False
    if peer_gid == gid or gid in proc_supplementary_groups(pid, uid):
        return True
    if pid > 0 and os.path.exists(f"/proc/{pid}/status"):
        return False          # the process was seen, without the group
    try:
        return gid in os.getgrouplist(pwd.getpwuid(uid).pw_name, peer_gid)
    except (KeyError, OSError):
        return False


def tcp_peer_uid(local: tuple, peer: tuple) -> int | None:
    """The uid that owns the TCP socket at peer ``(host, port)`` connected to local ``(host, port)``, when
    that socket is on this host (a loopback peer); None when the kernel knows no such socket.

    Source: sock_diag(7) (``SOCK_DIAG_BY_FAMILY``, one exact ``inet_diag_sockid``: the peer's
    end as source), ``inet_diag_msg.idiag_uid`` (the socket's ``sk_uid``: its creator's).  Raises OSError.
    """
    family = socket.AF_INET6 if ":" in str(peer[0]) else socket.AF_INET

    def addr(host) -> bytes:
        return socket.inet_pton(family, str(host).split("%")[0]).ljust(16, b"\0")

    body = _REQ_HEAD.pack(family, socket.IPPROTO_TCP, 0, 0, 0xffffffff) + \
        _SOCKID.pack(peer[1], local[1], addr(peer[0]), addr(local[0])) + _SOCKID_TAIL.pack(0, 0xffffffff, 0xffffffff)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(1.0)
        nl.send(_NLMSG.pack(_NLMSG.size + len(body), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0) + body)
        data = nl.recv(8192)
    if len(data) < _DIAG_MSG_UID_OFFSET + 4 or struct.unpack_from("=H", data, 4)[0] != _SOCK_DIAG_BY_FAMILY:
        return None   # NLMSG_ERROR: no such socket here
    return struct.unpack_from("=I", data, _DIAG_MSG_UID_OFFSET)[0]

"""The control socket server: a Unix stream socket served by its own thread.

A :mod:`selectors` loop in a dedicated thread accepts connections, checks each
peer's credentials (SO_PEERCRED), reads request lines into a buffer capped at
:data:`~.protocol.MAX_REQUEST_BYTES`, calls the command's handler and writes the
response without ever blocking.  A stuck, slow or hostile client therefore
costs the rest of the daemon nothing but a file descriptor, and only until its
timeout.

The accept loop, the socket file and the peer checks are here; reading,
answering and timeouts of each connection are :mod:`.connection`.

Per connection, in order:

1. peer not admitted (see :func:`admitted`) → ``permission_denied``, closed;
2. ``max_clients`` connections open (for a uid other than root:
   ``max_clients - root_slots``, so a slot is always free for root), or the
   peer's uid already has ``max_clients_per_uid`` open (root: no such limit)
   → ``busy``, closed;
3. requests are handled one at a time, on worker threads (root's requests and
   the others' on separate pools, :mod:`.connection`), never on this thread:
   while one is handled or its response is being written no further request
   is read (back-pressure, so the output buffer holds at most one response of
   at most :data:`~.protocol.MAX_RESPONSE_BYTES`); handlers get the peer's
   credentials (:class:`~.connection.Peer`);
4. the client must make progress at least every ``client_timeout_s``: complete
   a request line, or accept some response bytes.  Idle with nothing pending →
   ``timeout`` error, closed; a response it does not read → dropped (no message,
   it is not reading);
5. a line longer than MAX_REQUEST_BYTES → ``too_large``, closed;
6. after the peer shuts down its writing side (EOF), the requests already
   received are still answered (a final line without ``"\\n"`` counts as a
   request), then the connection is closed.
"""


from __future__ import annotations

import errno
import grp
import logging
import os
import selectors
import socket
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from buildidd.control import protocol
from buildidd.control.connection import Conn, Connections, Handler, Peer
from buildidd.peercred import peer_credentials, proc_supplementary_groups

__all__ = ["ControlServer", "Handler", "Peer", "ServerOptions", "peer_credentials", "proc_supplementary_groups"]

log = logging.getLogger(__name__)

_ACCEPTS_PER_WAKEUP = 64      # bound the accept loop so open clients are not starved
_LISTEN_BACKLOG = 128         # pending connects; refused ones leave it at once, so it drains fast


@dataclass(frozen=True)
class ServerOptions:
    """Who may use the control socket, and the server's limits.

    Attributes:
        mode: permission bits of the socket file (connect() needs write access).
        group: group the socket file is chowned to, and whose members (by
            effective gid or supplementary group) are admitted.  None, or a name
            that does not exist, keeps the creator's group and admits no group.
        allowed_uids: effective uids admitted besides root (uid 0).
        allowed_gids: effective or supplementary gids admitted.
        client_timeout_s: seconds a client may go without making progress
            (completing a request line or accepting response bytes).
        max_clients: connections served at once; further ones get ``busy``.
        max_clients_per_uid: connections of one uid other than root served at
            once; further ones of that uid get ``busy``.
        root_slots: of ``max_clients``, connections only root may take (at
            most ``max_clients - 1``: others always get one).
        max_response_bytes: largest response line in bytes; a larger result is
            answered with ``too_large``.  With one response in flight per
            connection this also caps each connection's output buffer.

    Raises:
        ValueError: client_timeout_s not positive, max_clients or
            max_clients_per_uid below 1, root_slots negative.
    """

    mode: int = 0o660
    group: str | None = "buildidd"
    allowed_uids: frozenset[int] = frozenset()
    allowed_gids: frozenset[int] = frozenset()
    client_timeout_s: float = 5.0
    max_clients: int = 16
    max_clients_per_uid: int = 4
    root_slots: int = 2
    max_response_bytes: int = protocol.MAX_RESPONSE_BYTES

    def __post_init__(self) -> None:
        if self.client_timeout_s <= 0:
            raise ValueError("client_timeout_s must be positive")
        if self.max_clients < 1:
            raise ValueError("max_clients must be at least 1")
        if self.max_clients_per_uid < 1 or self.root_slots < 0:
            raise ValueError("max_clients_per_uid must be at least 1 and root_slots not negative")
        # Accept any iterable of ids (a set, a list); keep them frozen.
        object.__setattr__(self, "allowed_uids", frozenset(self.allowed_uids or ()))
        object.__setattr__(self, "allowed_gids", frozenset(self.allowed_gids or ()))


def admitted(options: ServerOptions, socket_gid: int | None, creds: tuple[int, int, int]) -> bool:
    """Whether the peer ``creds`` = ``(pid, uid, gid)`` (SO_PEERCRED) may use
    the socket: root, an allowed uid, or a member (effective or supplementary)
    of an allowed gid or of the socket's group ``socket_gid``."""
    pid, uid, gid = creds
    if uid == 0 or uid in options.allowed_uids:
        return True
    gids = set(options.allowed_gids)
    if socket_gid is not None:
        gids.add(socket_gid)
    if not gids:
        return False
    if gid in gids:
        return True
    return not gids.isdisjoint(proc_supplementary_groups(pid, uid))


def _check_stale(path: str) -> None:
    """Raise FileExistsError unless ``path`` is absent or a socket nobody listens on."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise FileExistsError(errno.EEXIST, "exists and is not a socket", path)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        log.info("replacing stale control socket %s", path)
        return
    except OSError as e:  # e.g. a timeout: a live server with a full backlog
        raise FileExistsError(errno.EADDRINUSE, f"control socket in use ({e})", path) from e
    finally:
        probe.close()
    raise FileExistsError(errno.EADDRINUSE, "a control server already listens on", path)


def _apply_group(path: str, group: str | None) -> int | None:
    """chown path to ``group``; its gid, or None when not applied."""
    if group is None:
        return None
    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        log.warning("group %r does not exist; control socket keeps the group of uid %d "
                    "and admits root and explicitly allowed ids only", group, os.geteuid())
        return None
    try:
        os.chown(path, -1, gid)  # owner stays the creator: root for the daemon
    except PermissionError as e:
        log.warning("cannot chown control socket to group %r: %s", group, e)
        return None
    return gid


class ControlServer:
    """Serves command handlers on a Unix stream socket from its own thread.

    Args:
        path: filesystem path of the socket (≤ 107 bytes, the sun_path limit).
        handlers: command name → handler.  A handler gets the request's args
            (a dict, ``{}`` when absent) and returns a JSON-serialisable result;
            it runs in the server thread, so it must be quick and must not
            block.  Raising :class:`~.protocol.ControlError` sends that code and
            message; any other exception sends ``internal`` and is logged.
        options: who is admitted and the limits (:class:`ServerOptions`).

    Attributes:
        stats: counters, written by the server thread only (read them as a
            snapshot): ``connections`` (accepted, refused ones included),
            ``requests`` (lines processed, malformed ones included), ``errors``
            (error responses sent, by code), ``refused`` (closed with ``busy``
            or ``permission_denied``), ``dropped`` (closed without a response
            because they did not read theirs).
        gid: the socket file's group id when ``group`` was applied, else None.
    """

    def __init__(self, path: str, handlers: dict[str, Handler], options: ServerOptions = ServerOptions()):
        self.path = path
        self.options = options
        self.gid: int | None = None
        self._served = Connections(handlers, options.client_timeout_s, options.max_response_bytes)
        self.stats: dict[str, Any] = self._served.stats
        self._conns: dict[int, Conn] = self._served.conns  # fd → connection
        self._listener: socket.socket | None = None
        self._inode: tuple[int, int] | None = None  # (st_dev, st_ino) of our socket file
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._sel: selectors.BaseSelector | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None


    # ---- lifecycle (caller's thread) ---------------------------------------------------------

    def start(self) -> None:
        """Create, secure and bind the socket, then start the server thread.

        The socket is bound under a temporary name, chmod'ed and chown'ed, and
        only then renamed to ``path``, so it is never reachable with looser
        permissions.  A socket file left at ``path`` by a dead server is
        replaced; a live one (connect() succeeds) is not.

        Raises:
            FileExistsError: path exists and is not a socket, or a server answers on it.
            OSError: the directory, bind, chmod or rename failed.
        """
        if self._thread is not None:
            raise RuntimeError("ControlServer already started")
        parent = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(parent):
            os.makedirs(parent, exist_ok=True)
            os.chmod(parent, 0o755)
        _check_stale(self.path)
        tmp = os.path.join(parent, f".ctl-{os.getpid()}-{id(self) & 0xffffff:x}")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if os.path.lexists(tmp):
                os.unlink(tmp)
            listener.bind(tmp)
            try:
                os.chmod(tmp, self.options.mode)
                self.gid = _apply_group(tmp, self.options.group)
                listener.listen(_LISTEN_BACKLOG)
                listener.setblocking(False)
                os.rename(tmp, self.path)
            except BaseException:
                os.unlink(tmp)
                raise
        except BaseException:
            listener.close()
            raise
        st = os.stat(self.path)
        self._inode = (st.st_dev, st.st_ino)
        self._listener = listener
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = self._served.sel = selectors.DefaultSelector()
        self._sel.register(listener, selectors.EVENT_READ, "listener")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._served.wake = self._wake
        self._thread = threading.Thread(target=self._run, name="buildidd-control", daemon=True)
        self._thread.start()
        group = (f"{self.options.group} (gid {self.gid})" if self.gid is not None else f"gid {st.st_gid}"
                 + (f", not {self.options.group!r}" if self.options.group else ""))
        log.info("control socket listening on %s (mode %o, group %s)", self.path, self.options.mode, group)

    def _wake(self) -> None:
        """Wake the server thread (any thread): an answer is ready, or stop."""
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass  # the pipe is full: the thread is awake anyway

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (waiting up to timeout_s seconds), close every
        connection and the listener, and remove the socket file if it is still ours."""
        if self._thread is None:
            return
        self._stopping.set()
        self._wake()
        self._thread.join(timeout_s)
        self._served.shutdown()
        if self._thread.is_alive():
            log.error("control server thread did not stop within %.1f s", timeout_s)
            return  # it still owns the sockets; closing them under it would be worse
        for conn in list(self._conns.values()):
            self._served.close(conn)
        self._sel.close()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()
        try:
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self._inode:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        self._thread = None

    def __enter__(self) -> "ControlServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- server thread --------------------------------------------------------------------------

    def _run(self) -> None:
        served = self._served
        while not self._stopping.is_set():
            now = time.monotonic()
            timeout = 1.0
            for conn in self._conns.values():
                timeout = min(timeout, conn.deadline - now)
            for key, mask in self._sel.select(max(timeout, 0.0)):
                if key.data == "listener":
                    self._accept()
                elif key.data == "wake":
                    try:
                        self._wake_r.recv(4096)
                    except BlockingIOError:
                        pass
                    served.finish_answers()
                else:
                    self._guarded(served.service, key.data, mask)
            now = time.monotonic()
            for conn in [c for c in self._conns.values() if c.deadline <= now]:
                self._guarded(served.expire, conn)

    def _guarded(self, fn: Callable[..., None], conn: Conn, *args: Any) -> None:
        """fn(conn, *args); a bug met while serving one client closes that client, not the server."""
        try:
            fn(conn, *args)
        except Exception:
            log.exception("control server: error serving pid %d; closing it", conn.pid)
            self._served.close(conn)

    def _accept(self) -> None:
        served = self._served
        for _ in range(_ACCEPTS_PER_WAKEUP):
            try:
                sock, _addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and friends: leave it in the backlog
                log.warning("control socket accept failed: %s", e)
                return
            self.stats["connections"] += 1
            sock.setblocking(False)
            try:
                creds = peer_credentials(sock)
            except OSError as e:
                log.warning("SO_PEERCRED failed: %s", e)
                served.refuse(sock, protocol.PERMISSION_DENIED, "peer credentials unavailable")
                continue
            pid, uid, gid = creds
            if not admitted(self.options, self.gid, creds):
                log.info("control socket: refused pid %d uid %d gid %d", pid, uid, gid)
                served.refuse(sock, protocol.PERMISSION_DENIED, f"uid {uid} gid {gid} not allowed")
                continue
            refusal = self._over_limit(uid)
            if refusal is not None:
                log.info("control socket: busy for pid %d uid %d: %s", pid, uid, refusal)
                served.refuse(sock, protocol.BUSY, refusal)
                continue
            served.add(sock, creds)

    def _over_limit(self, uid: int) -> str | None:
        """Why a new connection of ``uid`` is refused as busy, or None."""
        opts = self.options
        total = len(self._conns)
        if uid == 0:
            return None if total < opts.max_clients else f"already serving {opts.max_clients} clients"
        reserved = min(opts.root_slots, opts.max_clients - 1)
        if total >= opts.max_clients - reserved:
            return f"already serving {total} clients ({reserved} slots kept for root)"
        mine = sum(1 for c in self._conns.values() if c.uid == uid)
        if mine >= opts.max_clients_per_uid:
            return f"uid {uid} already has {mine} connections (limit {opts.max_clients_per_uid})"
        return None

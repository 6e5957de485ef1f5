"""The control socket server: a Unix stream socket served by its own thread.

A :mod:`selectors` loop in a dedicated thread accepts connections, checks each
peer's credentials (SO_PEERCRED), reads request lines into a buffer capped at
:data:`~.protocol.MAX_REQUEST_BYTES`, calls the command's handler and writes the
response without ever blocking.  A stuck, slow or hostile client therefore
costs the rest of the daemon nothing but a file descriptor, and only until its
timeout.

Per connection, in order:

1. more than ``max_clients`` connections open → ``busy``, closed;
2. peer not admitted (see :meth:`ControlServer._admitted`) → ``permission_denied``, closed;
3. requests are handled one at a time: while a response is being written no
   further request is read (back-pressure, so the output buffer holds at most
   one response of at most :data:`~.protocol.MAX_RESPONSE_BYTES`);
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
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from buildidd.control import protocol
from buildidd.control.protocol import ControlError

log = logging.getLogger(__name__)

_UCRED = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}, socket(7)
_ACCEPTS_PER_WAKEUP = 64      # bound the accept loop so open clients are not starved
_RECV_CHUNK_BYTES = 64 * 1024

Handler = Callable[[dict[str, Any]], Any]


class _Conn:
    """One client connection's state (owned by the server thread)."""

    __slots__ = ("sock", "pid", "uid", "gid", "inbuf", "out", "deadline", "eof", "closing")

    def __init__(self, sock: socket.socket, pid: int, uid: int, gid: int, deadline: float):
        self.sock = sock
        self.pid = pid            # tgid of the peer at connect(), in our pid namespace (0: not visible)
        self.uid = uid            # effective uid at connect()
        self.gid = gid            # effective gid at connect()
        self.inbuf = bytearray()  # received bytes not yet consumed; ≤ MAX_REQUEST_BYTES + 1 without a "\n"
        self.out = memoryview(b"")  # response bytes not yet sent
        self.deadline = deadline  # time.monotonic() seconds by which the client must make progress
        self.eof = False          # peer shut down its writing side
        self.closing = False      # close once `out` is sent; read nothing more


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


class ControlServer:
    """Serves command handlers on a Unix stream socket from its own thread.

    Args:
        path: filesystem path of the socket (≤ 107 bytes, the sun_path limit).
        handlers: command name → handler.  A handler gets the request's args
            (a dict, ``{}`` when absent) and returns a JSON-serialisable result;
            it runs in the server thread, so it must be quick and must not
            block.  Raising :class:`~.protocol.ControlError` sends that code and
            message; any other exception sends ``internal`` and is logged.
        mode: permission bits of the socket file (connect() needs write access).
        group: group the socket file is chowned to, and whose members (by
            effective gid or supplementary group) are admitted.  None, or a name
            that does not exist, keeps the creator's group and admits no group.
        allowed_uids: effective uids admitted besides root (uid 0).
        allowed_gids: effective or supplementary gids admitted.
        client_timeout_s: seconds a client may go without making progress
            (completing a request line or accepting response bytes).
        max_clients: connections served at once; further ones get ``busy``.
        max_response_bytes: largest response line in bytes; a larger result is
            answered with ``too_large``.  With one response in flight per
            connection this also caps each connection's output buffer.

    Attributes:
        stats: counters, written by the server thread only (read them as a
            snapshot): ``connections`` (accepted, refused ones included),
            ``requests`` (lines processed, malformed ones included), ``errors``
            (error responses sent, by code), ``refused`` (closed with ``busy``
            or ``permission_denied``), ``dropped`` (closed without a response
            because they did not read theirs).
        gid: the socket file's group id when ``group`` was applied, else None.
    """

    def __init__(self, path: str, handlers: dict[str, Handler], *, mode: int = 0o660,
                 group: str | None = "buildidd", allowed_uids: set[int] | None = None,
                 allowed_gids: set[int] | None = None, client_timeout_s: float = 5.0,
                 max_clients: int = 16, max_response_bytes: int = protocol.MAX_RESPONSE_BYTES):
        if client_timeout_s <= 0:
            raise ValueError("client_timeout_s must be positive")
        if max_clients < 1:
            raise ValueError("max_clients must be at least 1")
        self.path = path
        self.handlers = dict(handlers)
        self.mode = mode
        self.group = group
        self.allowed_uids = frozenset(allowed_uids or ())
        self.allowed_gids = frozenset(allowed_gids or ())
        self.client_timeout_s = client_timeout_s
        self.max_clients = max_clients
        self.max_response_bytes = max_response_bytes
        self.gid: int | None = None
        self.stats: dict[str, Any] = {"connections": 0, "requests": 0, "errors": {},
                                      "refused": 0, "dropped": 0}
        self._listener: socket.socket | None = None
        self._inode: tuple[int, int] | None = None  # (st_dev, st_ino) of our socket file
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._sel: selectors.BaseSelector | None = None
        self._conns: dict[int, _Conn] = {}  # fd → connection
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
        self._check_stale(self.path)
        tmp = os.path.join(parent, f".ctl-{os.getpid()}-{id(self) & 0xffffff:x}")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if os.path.lexists(tmp):
                os.unlink(tmp)
            listener.bind(tmp)
            try:
                os.chmod(tmp, self.mode)
                self.gid = self._apply_group(tmp)
                listener.listen(self.max_clients)
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
        self._sel = selectors.DefaultSelector()
        self._sel.register(listener, selectors.EVENT_READ, "listener")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._run, name="buildidd-control", daemon=True)
        self._thread.start()
        log.info("control socket listening on %s (mode %o, gid %s)", self.path, self.mode, self.gid)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (waiting up to timeout_s seconds), close every
        connection and the listener, and remove the socket file if it is still ours."""
        if self._thread is None:
            return
        self._stopping.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass  # the pipe is full: the thread is awake anyway
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("control server thread did not stop within %.1f s", timeout_s)
            return  # it still owns the sockets; closing them under it would be worse
        for conn in list(self._conns.values()):
            self._close(conn)
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

    @staticmethod
    def _check_stale(path: str) -> None:
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

    def _apply_group(self, path: str) -> int | None:
        """chown path to self.group; its gid, or None when not applied."""
        if self.group is None:
            return None
        try:
            gid = grp.getgrnam(self.group).gr_gid
        except KeyError:
            log.warning("group %r does not exist; control socket keeps the group of uid %d "
                        "and admits root and explicitly allowed ids only", self.group, os.geteuid())
            return None
        try:
            os.chown(path, -1, gid)  # owner stays the creator: root for the daemon
        except PermissionError as e:
            log.warning("cannot chown control socket to group %r: %s", self.group, e)
            return None
        return gid

    # ---- server thread --------------------------------------------------------------------------

    def _run(self) -> None:
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
                        self._wake_r.recv(64)
                    except BlockingIOError:
                        pass
                else:
                    self._guarded(self._service, key.data, mask)
            now = time.monotonic()
            for conn in [c for c in self._conns.values() if c.deadline <= now]:
                self._guarded(self._expire, conn)

    def _guarded(self, fn: Callable[..., None], conn: _Conn, *args: Any) -> None:
        """fn(conn, *args); a bug met while serving one client closes that client, not the server."""
        try:
            fn(conn, *args)
        except Exception:
            log.exception("control server: error serving pid %d; closing it", conn.pid)
            self._close(conn)

    def _service(self, conn: _Conn, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            self._flush(conn)
        if mask & selectors.EVENT_READ and conn.sock.fileno() >= 0:
            self._read(conn)
        if conn.sock.fileno() >= 0:
            self._advance(conn)

    def _accept(self) -> None:
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
                pid, uid, gid = peer_credentials(sock)
            except OSError as e:
                log.warning("SO_PEERCRED failed: %s", e)
                self._refuse(sock, protocol.PERMISSION_DENIED, "peer credentials unavailable")
                continue
            if not self._admitted(pid, uid, gid):
                log.info("control socket: refused pid %d uid %d gid %d", pid, uid, gid)
                self._refuse(sock, protocol.PERMISSION_DENIED, f"uid {uid} gid {gid} not allowed")
                continue
            if len(self._conns) >= self.max_clients:
                self._refuse(sock, protocol.BUSY, f"already serving {self.max_clients} clients")
                continue
            conn = _Conn(sock, pid, uid, gid, time.monotonic() + self.client_timeout_s)
            self._conns[sock.fileno()] = conn
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _admitted(self, pid: int, uid: int, gid: int) -> bool:
        """Root, an allowed uid, or a member (effective or supplementary) of an
        allowed gid or of the socket's group."""
        if uid == 0 or uid in self.allowed_uids:
            return True
        gids = set(self.allowed_gids)
        if self.gid is not None:
            gids.add(self.gid)
        if not gids:
            return False
        if gid in gids:
            return True
        return not gids.isdisjoint(proc_supplementary_groups(pid, uid))

    def _refuse(self, sock: socket.socket, code: str, message: str) -> None:
        """One non-blocking attempt to send the error, then close (never registered)."""
        self.stats["refused"] += 1
        self._count_error(code)
        try:
            sock.send(protocol.encode_error(code, message))
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the peer is gone or not reading; the close says enough
        sock.close()

    def _read(self, conn: _Conn) -> None:
        # _advance consumed every complete line before reading was enabled, so
        # inbuf is a partial line of ≤ MAX_REQUEST_BYTES and the read keeps it
        # at ≤ MAX_REQUEST_BYTES + 1: enough to see either its "\n" or that it is too long.
        want = min(_RECV_CHUNK_BYTES, protocol.MAX_REQUEST_BYTES + 1 - len(conn.inbuf))
        try:
            data = conn.sock.recv(max(want, 1))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            log.debug("control client pid %d: recv failed: %s", conn.pid, e)
            self._close(conn)
            return
        if data:
            conn.inbuf += data
        else:
            conn.eof = True

    def _advance(self, conn: _Conn) -> None:
        """Answer buffered requests one at a time, then set what to wait for."""
        while not conn.out and not conn.closing:
            i = conn.inbuf.find(b"\n")
            if i >= 0:
                line = bytes(conn.inbuf[:i])
                del conn.inbuf[:i + 1]
            elif len(conn.inbuf) > protocol.MAX_REQUEST_BYTES:
                self._send_error(conn, protocol.TOO_LARGE,
                                 f"request line exceeds {protocol.MAX_REQUEST_BYTES} bytes")
                conn.closing = True
                break
            elif conn.eof and conn.inbuf:
                line = bytes(conn.inbuf)
                conn.inbuf.clear()
            elif conn.eof:
                conn.closing = True
                break
            else:
                break
            self._queue(conn, self._answer(line))
            conn.deadline = time.monotonic() + self.client_timeout_s
        if conn.closing and not conn.out:
            self._close(conn)
            return
        events = selectors.EVENT_WRITE if conn.out else 0
        if not conn.out and not conn.eof and not conn.closing:
            events |= selectors.EVENT_READ
        if events:
            self._sel.modify(conn.sock, events, conn)
        else:  # cannot happen: closing/eof without output was closed above
            self._close(conn)

    def _answer(self, line: bytes) -> bytes:
        """The response line for one request line."""
        self.stats["requests"] += 1
        try:
            cmd, args = protocol.decode_request(line)
            handler = self.handlers.get(cmd)
            if handler is None:
                raise ControlError(protocol.UNKNOWN_COMMAND, f"unknown command {cmd!r}")
            try:
                result = handler(args)
            except ControlError:
                raise
            except Exception as e:
                log.exception("control command %r failed", cmd)
                raise ControlError(protocol.INTERNAL, f"{cmd}: {type(e).__name__}: {e}"[:500]) from e
            try:
                out = protocol.encode_response(result)
            except (TypeError, ValueError) as e:
                log.error("control command %r returned a result JSON cannot hold: %s", cmd, e)
                raise ControlError(protocol.INTERNAL, f"{cmd}: result not JSON-serialisable") from e
            if len(out) > self.max_response_bytes:
                raise ControlError(protocol.TOO_LARGE, f"{cmd}: response of {len(out)} bytes "
                                   f"exceeds {self.max_response_bytes}")
            return out
        except ControlError as e:
            self._count_error(e.code)
            return protocol.encode_error(e.code, e.message)

    def _send_error(self, conn: _Conn, code: str, message: str) -> None:
        self._count_error(code)
        self._queue(conn, protocol.encode_error(code, message))

    def _count_error(self, code: str) -> None:
        errors = self.stats["errors"]
        errors[code] = errors.get(code, 0) + 1

    def _queue(self, conn: _Conn, data: bytes) -> None:
        conn.out = memoryview(bytes(conn.out) + data) if conn.out else memoryview(data)
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        """Send what the socket takes now; progress pushes the deadline."""
        if not conn.out:
            return
        try:
            n = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:  # EPIPE, ECONNRESET: the peer left
            log.debug("control client pid %d: send failed: %s", conn.pid, e)
            conn.out = memoryview(b"")
            conn.closing = True
            return
        conn.out = conn.out[n:]
        if n:
            conn.deadline = time.monotonic() + self.client_timeout_s

    def _expire(self, conn: _Conn) -> None:
        if conn.out:
            self.stats["dropped"] += 1
            log.info("control client pid %d uid %d dropped: %d response bytes unread for %.1f s",
                     conn.pid, conn.uid, len(conn.out), self.client_timeout_s)
            self._close(conn)
            return
        self._send_error(conn, protocol.TIMEOUT,
                         f"no complete request within {self.client_timeout_s:g} s")
        conn.closing = True
        conn.deadline = time.monotonic() + self.client_timeout_s  # grace to read the error
        if conn.sock.fileno() >= 0:
            self._advance(conn)

    def _close(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        if fd < 0:
            return
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass  # never registered
        self._conns.pop(fd, None)
        conn.sock.close()

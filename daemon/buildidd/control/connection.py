"""The control server's connections: reading requests, answering, timeouts.

Everything here runs on the server thread (:mod:`.server`) and never blocks:
each connection reads request lines into a buffer capped at
:data:`~.protocol.MAX_REQUEST_BYTES`, answers one request at a time (no
further request is read while one is handled or its response is being
written, so the output buffer holds at most one response of at most
``max_response_bytes``), and must make progress at least every
``client_timeout_s`` seconds (a request being handled stops that clock).

Handlers run off the server thread, on worker pools: one for root's requests
and one for everybody else's, so neither a slow handler (``rotate`` waits for
the recording thread) nor a crowd of unprivileged clients delays root's
``status``.  A finished request comes back to the server thread through a
queue and a wake-up of its selector.
"""

from __future__ import annotations

import inspect
import logging
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from buildidd.control import protocol
from buildidd.control.protocol import ControlError

__all__ = ["Conn", "Connections", "Handler", "Peer"]

log = logging.getLogger(__name__)

_RECV_CHUNK_BYTES = 64 * 1024

#: Worker threads answering root's requests, and everybody else's.
ROOT_WORKERS = 2
USER_WORKERS = 2


@dataclass(frozen=True)
class Peer:
    """Who sent a request: SO_PEERCRED of its connection (``struct ucred``, socket(7)), as of connect().

    Attributes:
        pid: the client's tgid in the server's pid namespace; 0 when not visible from it.
        uid: its effective uid.
        gid: its effective gid.
    """

    pid: int
    uid: int
    gid: int


#: A command handler: ``handler(args, peer)``, the request's args (a dict,
#: ``{}`` when absent) and the caller's :class:`Peer` → a JSON-serialisable
#: result.  A callable of one parameter is called as ``handler(args)``.
Handler = Callable[[dict[str, Any], Peer], Any]


def _with_peer(handler: Callable[..., Any]) -> Handler:
    """``handler`` as a two-argument :data:`Handler` (one-argument ones ignore the peer)."""
    try:
        params = [p for p in inspect.signature(handler).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    except (TypeError, ValueError):
        return handler
    if len(params) == 1 and params[0].kind != params[0].VAR_POSITIONAL:
        return lambda args, _peer: handler(args)
    return handler


class _Pools:
    """The worker pools, made at first use: root's and everybody else's."""

    def __init__(self) -> None:
        self._pools: dict[bool, ThreadPoolExecutor] = {}

    def for_uid(self, uid: int) -> ThreadPoolExecutor:
        root = uid == 0
        pool = self._pools.get(root)
        if pool is None:
            pool = self._pools[root] = ThreadPoolExecutor(
                ROOT_WORKERS if root else USER_WORKERS,
                thread_name_prefix="buildidd-control-" + ("root" if root else "user"))
        return pool

    def shutdown(self) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        self._pools.clear()


class Conn:
    """One client connection's state (owned by the server thread)."""

    __slots__ = ("sock", "pid", "uid", "gid", "inbuf", "out", "deadline", "eof", "closing", "busy")

    def __init__(self, sock: socket.socket, creds: tuple[int, int, int], deadline: float):
        self.sock = sock
        # creds: SO_PEERCRED at connect(): pid (tgid in our pid namespace, 0:
        # not visible), effective uid, effective gid.
        self.pid, self.uid, self.gid = creds
        self.inbuf = bytearray()  # received bytes not yet consumed; ≤ MAX_REQUEST_BYTES + 1 without a "\n"
        self.out = memoryview(b"")  # response bytes not yet sent
        self.deadline = deadline  # time.monotonic() seconds by which the client must make progress
        self.eof = False          # peer shut down its writing side
        self.closing = False      # close once `out` is sent; read nothing more
        self.busy = False         # a request of this connection is on a worker

    @property
    def peer(self) -> Peer:
        """The connection's credentials as a :class:`Peer`."""
        return Peer(self.pid, self.uid, self.gid)


class Connections:
    """The open connections of one server, and how each is served.

    Args:
        handlers: command name → :data:`Handler`; a handler runs on the server
            thread, so it must be quick and must not block.  Raising
            :class:`~.protocol.ControlError` sends that code and message; any
            other exception sends ``internal`` and is logged.
        client_timeout_s: seconds a client may go without making progress.
        max_response_bytes: largest response line; a larger result is
            answered with ``too_large``.

    Attributes:
        sel: the server's selector, set when it starts; connections are
            registered in it.
        conns: fd → :class:`Conn`, the connections open now.
        stats: the counters of :class:`~.server.ControlServer` (``requests``,
            ``errors`` by code, ``refused``, ``dropped``); server thread only.
    """

    def __init__(self, handlers: dict[str, Handler], client_timeout_s: float, max_response_bytes: int):
        self.handlers = {cmd: _with_peer(fn) for cmd, fn in handlers.items()}
        self.client_timeout_s = client_timeout_s
        self.max_response_bytes = max_response_bytes
        self.sel: selectors.BaseSelector | None = None
        #: called (from a worker) to wake the server thread when an answer is ready
        self.wake: Callable[[], None] = lambda: None
        self.conns: dict[int, Conn] = {}
        self.stats: dict[str, Any] = {"connections": 0, "requests": 0, "errors": {},
                                      "refused": 0, "dropped": 0}
        self._stats_lock = threading.Lock()  # workers count too
        self._done: queue.SimpleQueue[tuple[Conn, bytes]] = queue.SimpleQueue()
        self._pools = _Pools()

    def finish_answers(self) -> None:
        """On the server thread: send the answers the workers finished."""
        while True:
            try:
                conn, data = self._done.get_nowait()
            except queue.Empty:
                return
            conn.busy = False
            if conn.sock.fileno() < 0:
                continue  # closed meanwhile
            self.sel.register(conn.sock, selectors.EVENT_READ, conn)
            self._queue(conn, data)
            conn.deadline = time.monotonic() + self.client_timeout_s
            if conn.sock.fileno() >= 0:
                self._advance(conn)

    def shutdown(self) -> None:
        """Stop the worker pools (a handler still running finishes on its own)."""
        self._pools.shutdown()

    def _submit(self, conn: Conn, line: bytes) -> None:
        """Answer ``line`` on a worker: root's pool for uid 0, the users' pool otherwise."""
        pool = self._pools.for_uid(conn.uid)
        conn.busy = True
        conn.deadline = float("inf")  # a request being handled is not the client's delay
        peer = conn.peer

        def work() -> None:
            try:
                data = self._answer(line, peer)
            except BaseException as e:  # noqa: BLE001 - the connection must get an answer
                log.exception("control request failed outside its handler")
                data = protocol.encode_error(protocol.INTERNAL, f"{type(e).__name__}")
            self._done.put((conn, data))
            self.wake()

        pool.submit(work)

    def add(self, sock: socket.socket, creds: tuple[int, int, int]) -> None:
        """Serve the accepted, admitted ``sock`` (non-blocking) of peer ``creds``."""
        conn = Conn(sock, creds, time.monotonic() + self.client_timeout_s)
        self.conns[sock.fileno()] = conn
        self.sel.register(sock, selectors.EVENT_READ, conn)

    def refuse(self, sock: socket.socket, code: str, message: str) -> None:
        """One non-blocking attempt to send the error, then close (never registered)."""
        self.stats["refused"] += 1
        self._count_error(code)
        try:
            sock.send(protocol.encode_error(code, message))
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the peer is gone or not reading; the close says enough
        sock.close()

    def service(self, conn: Conn, mask: int) -> None:
        """Act on the selector's ``mask`` for ``conn``: send, receive, answer."""
        if mask & selectors.EVENT_WRITE:
            self._flush(conn)
        if mask & selectors.EVENT_READ and conn.sock.fileno() >= 0:
            self._read(conn)
        if conn.sock.fileno() >= 0:
            self._advance(conn)

    def expire(self, conn: Conn) -> None:
        """``conn`` missed its deadline: drop it if it does not read its
        response, else send ``timeout`` and close after a grace period."""
        if conn.out:
            self.stats["dropped"] += 1
            log.info("control client pid %d uid %d dropped: %d response bytes unread for %.1f s",
                     conn.pid, conn.uid, len(conn.out), self.client_timeout_s)
            self.close(conn)
            return
        self._send_error(conn, protocol.TIMEOUT,
                         f"no complete request within {self.client_timeout_s:g} s")
        conn.closing = True
        conn.deadline = time.monotonic() + self.client_timeout_s  # grace to read the error
        if conn.sock.fileno() >= 0:
            self._advance(conn)

    def close(self, conn: Conn) -> None:
        """Unregister and close ``conn`` (nothing when already closed)."""
        fd = conn.sock.fileno()
        if fd < 0:
            return
        try:
            self.sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass  # never registered
        self.conns.pop(fd, None)
        conn.sock.close()

    def _read(self, conn: Conn) -> None:
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
            self.close(conn)
            return
        if data:
            conn.inbuf += data
        else:
            conn.eof = True

    def _advance(self, conn: Conn) -> None:
        """Answer buffered requests one at a time, then set what to wait for."""
        while not conn.out and not conn.closing and not conn.busy:
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
            self._submit(conn, line)
        if conn.closing and not conn.out:
            self.close(conn)
            return
        events = selectors.EVENT_WRITE if conn.out else 0
        if not conn.out and not conn.eof and not conn.closing and not conn.busy:
            events |= selectors.EVENT_READ
        if events:
            self.sel.modify(conn.sock, events, conn)
        elif conn.busy:  # wait for the worker's answer, watching nothing meanwhile
            self._pause(conn)
        else:  # cannot happen: closing/eof without output was closed above
            self.close(conn)

    def _pause(self, conn: Conn) -> None:
        """Stop watching ``conn`` while its request is on a worker (its answer re-arms it)."""
        try:
            self.sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.deadline = float("inf")

    def _answer(self, line: bytes, peer: Peer) -> bytes:
        """The response line for one request line of ``peer`` (runs on a worker)."""
        with self._stats_lock:
            self.stats["requests"] += 1
        try:
            cmd, args = protocol.decode_request(line)
            handler = self.handlers.get(cmd)
            if handler is None:
                raise ControlError(protocol.UNKNOWN_COMMAND, f"unknown command {cmd!r}")
            try:
                result = handler(args, peer)
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

    def _send_error(self, conn: Conn, code: str, message: str) -> None:
        self._count_error(code)
        self._queue(conn, protocol.encode_error(code, message))

    def _count_error(self, code: str) -> None:
        with self._stats_lock:
            errors = self.stats["errors"]
            errors[code] = errors.get(code, 0) + 1

    def _queue(self, conn: Conn, data: bytes) -> None:
        conn.out = memoryview(bytes(conn.out) + data) if conn.out else memoryview(data)
        self._flush(conn)

    def _flush(self, conn: Conn) -> None:
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

"""What keeps ``buildidd serve`` answering while some clients attack it: caps, deadlines, refusals counted.

Every resource a request can hold has a bound, and every refusal is counted
in ``/metrics`` (``buildidd_serve_refused_total{reason=…}``), never logged
one line per event:

* **descriptors and connections**: at start the soft RLIMIT_NOFILE is raised
  to the hard one (systemd's ``LimitNOFILE``), and at most
  ``(soft - FD_RESERVE) // FDS_PER_CONNECTION`` connections are kept (a
  connection's socket, and the file it is being sent).  When that many are
  open, the oldest connection with no request in progress (a client still
  sending its headers, an idle keep-alive) is closed for the new one
  (``evicted_idle``); when every one is busy, the new one is closed
  (``connections``).  So a flood of slow-header connections cannot lock out
  a client that sends its request at once, token or not.
* **answers in progress** ("streams"): at most ``max_streams_per_peer`` per
  peer and ``max_streams`` in all; beyond, 503 with ``Retry-After``
  (``streams_peer``, ``streams_total``).  A peer is a uid for a local one (on
  the unix socket, SO_PEERCRED; over loopback TCP, the uid owning the
  client's socket, asked of sock_diag), else the IP address: one local user
  holding its share does not lock out another.
* **sending**: an answer whose client takes no byte for ``send_timeout_s``
  is cut (``send_timeout``).  Progress is what the client took: the bytes it
  acknowledged (TCP_INFO ``tcpi_bytes_acked``) over TCP, the socket's unsent
  bytes (SIOCOUTQ) changing on a unix socket, and what went through aiohttp's
  writer; it is looked at every :data:`POLL_S`.  An archive streamed while it
  is built is written from its builder thread, each chunk waiting at most
  ``send_timeout_s`` for the client (then the client is cut and the spool
  completed).
* **threads**: lookups run on the loop's default executor, archive builds on
  :data:`ARCHIVE_WORKERS` threads of their own, so neither can starve the other.
* **accept() failing** (EMFILE, ENFILE, ENOBUFS, ENOMEM): asyncio stops
  accepting for a second and retries; counted (``accept_errors``), logged at a
  limited rate instead of one traceback each.  aiohttp's own error lines (a
  malformed request, mostly) are counted too (``bad_requests``) and pass at
  the same limited rate, without their traceback (:meth:`Guard.log_filter`).
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import ipaddress
import logging
import resource
import socket
import struct
from collections import Counter
from dataclasses import dataclass

from aiohttp import web

from buildidd.offline.serve.metrics import METRICS_KEY, ServeMetrics
from buildidd.peercred import peer_credentials, tcp_peer_uid

log = logging.getLogger(__name__)

FD_RESERVE = 64
"""Descriptors kept out of the connection cap: listeners, the loop, logs, executor threads' files, the spool."""

FDS_PER_CONNECTION = 2
"""Descriptors a connection may hold: its socket and the file being sent."""

FD_LIMIT_CEILING = 1 << 20
"""The soft RLIMIT_NOFILE is raised to the hard limit, but not beyond this."""

POLL_S = 1.0
"""Seconds between two looks at a slow answer's progress (less when send_timeout_s is shorter)."""

_TCP_INFO_BYTES_ACKED = struct.Struct("=Q")
_TCP_INFO_BYTES_ACKED_OFFSET = 120   # struct tcp_info (include/uapi/linux/tcp.h): tcpi_bytes_acked, Linux 4.1+
_SIOCOUTQ = 0x5411                   # TIOCOUTQ / SIOCOUTQ (include/uapi/asm-generic/ioctls.h, sockios.h)

ARCHIVE_WORKERS = 2
"""Threads that build archives (one per archive being built; more wait their turn)."""

RETRY_AFTER_S = 5
"""``Retry-After`` of a 503 for a cap reached."""

REFUSAL_REASONS = ("connections", "evicted_idle", "streams_peer", "streams_total", "send_timeout",
                   "accept_errors", "bad_requests", "sessions_forbidden", "metrics_forbidden")
"""The ``reason`` label values of ``buildidd_serve_refused_total``."""

_ACCEPT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


@dataclass(frozen=True)
class GuardLimits:
    """The caps and deadlines of :class:`Guard`.

    Attributes:
        max_connections: connections kept at most; 0: from RLIMIT_NOFILE (see the module docstring).
        max_streams: answers in progress at most, all peers together.
        max_streams_per_peer: answers in progress at most for one peer.
        send_timeout_s: seconds an answer's client may take no byte of it before it is cut;
            also the longest one chunk of a streamed archive waits for its client.
    """

    max_connections: int = 0
    max_streams: int = 64
    max_streams_per_peer: int = 16
    send_timeout_s: float = 30.0


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (at most FD_LIMIT_CEILING); the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard if hard != resource.RLIM_INFINITY else FD_LIMIT_CEILING, FD_LIMIT_CEILING)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:
            log.warning("cannot raise RLIMIT_NOFILE from %d to %d: %s", soft, want, e)
    return soft if soft != resource.RLIM_INFINITY else FD_LIMIT_CEILING


def connection_cap(fd_limit: int, configured: int = 0) -> int:
    """Connections to keep at most with fd_limit descriptors: (fd_limit - FD_RESERVE) // FDS_PER_CONNECTION,
    at least 8, and no more than configured when that is set (> 0)."""
    cap = max(8, (fd_limit - FD_RESERVE) // FDS_PER_CONNECTION)
    return min(cap, configured) if configured > 0 else cap


@dataclass
class Conn:
    """One open connection: its peer key, when it opened (loop time, s), its requests in progress,
    and for the unix-socket listener its SO_PEERCRED ``(pid, uid, gid)``."""

    peer: str
    since: float
    busy: int = 0
    creds: tuple[int, int, int] | None = None


def _progress(request: web.BaseRequest) -> tuple[int, int]:
    """What the client has taken so far, as a value that changes when it takes bytes (see the module docstring)."""
    written = getattr(request.writer, "output_size", 0) or 0
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return written, -1
    try:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
            return written, _TCP_INFO_BYTES_ACKED.unpack_from(info, _TCP_INFO_BYTES_ACKED_OFFSET)[0]
        return written, struct.unpack("i", fcntl.ioctl(sock.fileno(), _SIOCOUTQ, b"\0" * 4))[0]
    except (OSError, struct.error):
        return written, -1


def _peer_of(transport) -> tuple[str, tuple[int, int, int] | None]:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family == socket.AF_UNIX:
        try:
            creds = peer_credentials(sock)
        except OSError:
            return "unix:?", None
        return f"uid:{creds[1]}", creds
    peer = transport.get_extra_info("peername")
    if not isinstance(peer, tuple) or not peer:
        return "?", None
    try:
        if ipaddress.ip_address(str(peer[0]).split("%")[0]).is_loopback:
            uid = tcp_peer_uid(transport.get_extra_info("sockname"), peer)
            if uid is not None:
                return f"uid:{uid}", None
    except (OSError, ValueError):
        pass
    return str(peer[0]), None


class Cut(web.StreamResponse):
    """What a handler returns once its client was cut or went away: aiohttp's own sending of it fails as a
    closed connection (no log line, counted in the access log by its status)."""

    def __init__(self, status: int):
        super().__init__(status=status)

    async def prepare(self, request):
        raise ConnectionResetError("the client was cut or went away")


class Guard:
    """The connection table and stream counts of one server (event-loop thread only).

    Args:
        limits: the caps and deadlines.
        metrics: where refusals are counted.
        fd_limit: the soft RLIMIT_NOFILE in force (see :func:`raise_fd_limit`).
    """

    def __init__(self, limits: GuardLimits, metrics: ServeMetrics, fd_limit: int):
        self.limits = limits
        self.metrics = metrics
        self.cap = connection_cap(fd_limit, limits.max_connections)
        self.conns: dict[object, Conn] = {}
        self.streams = 0
        self.by_peer: Counter[str] = Counter()

    def attach(self, server: web.Server) -> None:
        """Watch server's connections (aiohttp calls ``Server.connection_made/lost`` from each handler)."""
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler, transport) -> None:
            made(handler, transport)
            self._admit(handler, transport)

        def connection_lost(handler, exc=None) -> None:
            self.conns.pop(handler, None)
            lost(handler, exc)

        server.connection_made = connection_made
        server.connection_lost = connection_lost

    def _admit(self, handler, transport) -> None:
        peer, creds = _peer_of(transport)
        if len(self.conns) >= self.cap:
            victim = next((h for h, c in self.conns.items() if c.busy == 0), None)
            if victim is None:
                self.metrics.refuse("connections")
                handler.force_close()
                return
            self.metrics.refuse("evicted_idle")
            del self.conns[victim]
            victim.force_close()
        self.conns[handler] = Conn(peer, asyncio.get_running_loop().time(), creds=creds)

    def conn(self, request: web.BaseRequest) -> Conn | None:
        """The connection a request came on (None if it was closed or never admitted)."""
        return self.conns.get(request.protocol)

    def open_connections(self) -> int:
        return len(self.conns)

    async def send(self, request: web.BaseRequest, resp: web.StreamResponse) -> web.StreamResponse:
        """Prepare (send) resp while its client keeps taking bytes: resp once sent; when the client took
        nothing for send_timeout_s, it is cut and the answer is one aiohttp drops as a closed connection."""
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(resp.prepare(request))
        poll = max(0.05, min(POLL_S, self.limits.send_timeout_s / 4))
        last, since = None, loop.time()
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=poll)
                if done:
                    try:
                        task.result()
                    except ConnectionError:
                        return Cut(resp.status)    # the client went away
                    return resp
                now, seen = loop.time(), _progress(request)
                if seen != last:
                    last, since = seen, now
                elif now - since >= self.limits.send_timeout_s:
                    break
        except asyncio.CancelledError:
            task.cancel()
            raise
        task.cancel()
        await asyncio.wait({task})
        self.cut(request)
        return Cut(resp.status)

    def cut(self, request: web.BaseRequest) -> None:
        """Count a client that did not read in time and close its connection."""
        self.metrics.refuse("send_timeout")
        if request.transport is not None:
            request.transport.abort()

    def take(self, request: web.BaseRequest) -> tuple[Conn | None, str]:
        """Count an answer in progress; 503 when its peer or the server is at its cap."""
        conn = self.conn(request)
        peer = conn.peer if conn is not None else str(request.remote)
        if self.streams >= self.limits.max_streams:
            self.metrics.refuse("streams_total")
            raise web.HTTPServiceUnavailable(text="too many answers in progress; try again\n",
                                             headers={"Retry-After": str(RETRY_AFTER_S)})
        if self.by_peer[peer] >= self.limits.max_streams_per_peer:
            self.metrics.refuse("streams_peer")
            raise web.HTTPServiceUnavailable(text="too many answers in progress for you; try again\n",
                                             headers={"Retry-After": str(RETRY_AFTER_S)})
        self.streams += 1
        self.by_peer[peer] += 1
        if conn is not None:
            conn.busy += 1
        return conn, peer

    def give_back(self, conn: Conn | None, peer: str) -> None:
        self.streams -= 1
        self.by_peer[peer] -= 1
        if self.by_peer[peer] <= 0:
            del self.by_peer[peer]
        if conn is not None:
            conn.busy -= 1

    def log_filter(self, record: logging.LogRecord) -> bool:
        """A filter for aiohttp's server logger: each line counted (``bad_requests``), passed at the rate of
        :meth:`ServeMetrics.warn` and without its traceback unless the logger is at DEBUG level."""
        self.metrics.refuse("bad_requests")
        if not self.metrics.allow_log():
            return False
        if not logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            record.exc_info, record.exc_text = None, None
        return True

    def exception_handler(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        """The loop's exception handler: accept() out of descriptors or memory is counted, not logged each time."""
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in _ACCEPT_ERRNOS:
            self.metrics.refuse("accept_errors")
            self.metrics.warn(log, "accept() failed: %s (connections open: %d, cap %d)", exc.strerror,
                              len(self.conns), self.cap)
            return
        loop.default_exception_handler(context)


GUARD_KEY: web.AppKey[Guard] = web.AppKey("buildidd_serve_guard", Guard)


@web.middleware
async def guard_middleware(request: web.Request, handler):
    """Count the answer against its peer's and the server's caps; send it within its deadline."""
    guard = request.app[GUARD_KEY]
    conn, peer = guard.take(request)
    try:
        resp = await handler(request)
        if isinstance(resp, web.StreamResponse) and not resp.prepared and not isinstance(resp, Cut):
            return await guard.send(request, resp)
        return resp
    finally:
        guard.give_back(conn, peer)


def make_guard(app: web.Application, limits: GuardLimits, fd_limit: int | None = None) -> Guard:
    """The Guard of app (stored under GUARD_KEY), counting into its METRICS_KEY; fd_limit None: the current soft limit."""
    if fd_limit is None:
        fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if fd_limit == resource.RLIM_INFINITY:
            fd_limit = FD_LIMIT_CEILING
    guard = Guard(limits, app[METRICS_KEY], fd_limit)
    app[GUARD_KEY] = guard
    return guard

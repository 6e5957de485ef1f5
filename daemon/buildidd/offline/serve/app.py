"""``buildidd serve``: the build-id store over HTTP, speaking the debuginfod protocol; sessions; metrics.

A read-only server on aiohttp (asyncio: one slow client holds one connection,
never the others; files go out with ``sendfile(2)``, byte ranges included)::

    GET|HEAD /buildid/HEX/executable        the binary            (serve.debuginfod)
    GET|HEAD /buildid/HEX/debuginfo         its debuginfo, else the binary if not stripped
    GET|HEAD /buildid/HEX/section/NAME      a section's raw bytes
    GET|HEAD /buildid/HEX/source/PATH       404: no sources are held
    GET|HEAD /go-buildid/GOID/executable    the binary whose Go build ID is GOID (the store's index)
    GET      /sessions                      the session root's sessions, JSON (serve.sessions)
    GET|HEAD /sessions/NAME/archive         a session's archive (tar + zstd), Range-able once built
    GET      /metadata?key=file|glob&value=V the build-ids a path had, from the sessions (serve.metadata)
    GET      /metrics                       Prometheus text (serve.metrics), to callers with rights

Access: on a loopback address (``ipaddress``' ``is_loopback``: 127.0.0.0/8 and
::1) anyone who can connect gets the build-id lookups; on any other address a
bearer token is required (``Authorization: Bearer TOKEN``, compared in
constant time with ``hmac.compare_digest``), and a token given on loopback is
required there too (``/metrics`` excepted when ``metrics_public``).  TLS is
used when a certificate and key are given.  The session logs (``/sessions*``,
``/metadata``), /metrics, and whether a build-id is held but private go only
to a caller with rights: the token, or a peer of the unix-socket listener
(``unix_socket``) whose SO_PEERCRED is root or a member of the control group
(:mod:`buildidd.offline.serve.rights`); loopback TCP cannot tell local users
apart.

Slow and flooding clients (:mod:`buildidd.offline.serve.guard`): connections
are capped below the descriptor limit (the idlest closed first), answers in
progress per peer and in all, a client that takes no byte for
``send_timeout_s`` is cut, archive builds have threads of their own, and a
connection that has not completed a request within ``idle_timeout_s`` (also
the keep-alive idle time) is closed (aiohttp's keep-alive timer runs from the
connection's start).  Refusals are counted in /metrics.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import os
import signal
import stat
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from buildidd.errors import ServeError
from buildidd.offline.serve import buildid, debuginfod, metadata, metrics, rights, sessions
from buildidd.offline.serve.guard import GUARD_KEY, GuardLimits, guard_middleware, make_guard, raise_fd_limit
from buildidd.offline.serve.metrics import METRICS_KEY, MetricsAccessLogger, ServeMetrics, StatusFn
from buildidd.store import Store, StoreChain

log = logging.getLogger(__name__)

DEFAULT_LISTEN = "127.0.0.1:8002"
"""The default address (8002: the port debuginfod(8) listens on by default)."""

TOKEN_MAX_BYTES = 4096
"""A token file longer than this is refused (it is read whole)."""

OPTIONS_KEY: web.AppKey["ServeOptions"] = web.AppKey("buildidd_serve_options")


@dataclass(frozen=True)
class ServeOptions:
    """Everything ``buildidd serve`` is told.

    Attributes:
        host: the address to listen on, an IP literal.
        port: TCP port; 0 picks a free one (logged, and given to ``on_listening``).
        store_root: the build-id store (read only).
        more_store_roots: stores read after it for build-id lookups (a StoreChain: the analyst's imports).
        session_root: the session directories served under ``/sessions``; "" for none.
        token: the bearer token clients must send; None for none (loopback only).
        tls_cert, tls_key: PEM files; both or neither.
        idle_timeout_s: seconds a connection may take to send a request, and stay idle between requests.
        spool_dir: where archives are built before and while they are sent; None: a private temporary directory.
        status_fn: returns the recording daemon's status for ``/metrics``; None: not asked.
        share_private: serve store copies marked private (``Config.store_share_private``) to callers with
            rights; else 403 to them (and to anyone else always what an absent build-id gets: see :mod:`.rights`).
        limits: caps and deadlines against slow and flooding clients (:mod:`.guard`).
        unix_socket: also listen on this unix socket (mode 0666: its peers are told apart by SO_PEERCRED); "" none.
        group_gid: the control group's gid: its members (and root) have rights over the unix socket.
        metrics_public: ``/metrics`` answers every caller, token or not (``Config.serve_metrics_public``).
    """

    host: str
    port: int
    store_root: str
    session_root: str = ""
    more_store_roots: tuple[str, ...] = ()
    token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    idle_timeout_s: float = 15.0
    spool_dir: str | None = None
    status_fn: StatusFn | None = None
    share_private: bool = False
    limits: GuardLimits = GuardLimits()
    unix_socket: str = ""
    group_gid: int = 0
    metrics_public: bool = False


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` → (host, port); the host must be an IP literal.

    Raises:
        ServeError: malformed, a host name instead of an address, or a port outside 0..65535.
    """
    host, sep, port = text.rpartition(":")
    if not sep:
        raise ServeError(f"--listen {text!r}: expected HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        ipaddress.ip_address(host)
        number = int(port)
    except ValueError as e:
        raise ServeError(f"--listen {text!r}: expected an IP address and a port number") from e
    if not 0 <= number <= 65535:
        raise ServeError(f"--listen {text!r}: port out of range")
    return host, number


def is_loopback(host: str) -> bool:
    """Whether host (an IP literal) is a loopback address: 127.0.0.0/8 or ::1."""
    return ipaddress.ip_address(host).is_loopback


def read_token(path: str) -> str:
    """The bearer token in a file (surrounding white space stripped).

    Raises:
        ServeError: unreadable, empty, over TOKEN_MAX_BYTES, or not printable ASCII.
    """
    try:
        with open(path, "rb") as f:
            data = f.read(TOKEN_MAX_BYTES + 1)
    except OSError as e:
        raise ServeError(f"token file {path}: {e.strerror}") from e
    if len(data) > TOKEN_MAX_BYTES:
        raise ServeError(f"token file {path}: longer than {TOKEN_MAX_BYTES} bytes")
    token = data.strip()
    if not token or any(b < 0x21 or b > 0x7e for b in token):
        raise ServeError(f"token file {path}: the token must be non-empty printable ASCII without spaces")
    return token.decode("ascii")


def check_options(opts: ServeOptions) -> None:
    """Refuse what must not run: no token off loopback, half a TLS pair, no store.

    Raises:
        ServeError: with the reason.
    """
    if not is_loopback(opts.host) and opts.token is None:
        raise ServeError(f"listening on {opts.host} (not loopback) requires --token-file")
    if (opts.tls_cert is None) != (opts.tls_key is None):
        raise ServeError("--tls-cert and --tls-key go together")
    if not Path(opts.store_root).is_dir():
        raise ServeError(f"no build-id store at {opts.store_root}")


@web.middleware
async def _auth(request: web.Request, handler):
    """The token, when the server has one: a request bearing it is marked (rights.TOKEN_CHECKED); any other
    is 401, but for ``/metrics`` when metrics_public opens it."""
    opts = request.app[OPTIONS_KEY]
    if opts.token is not None:
        given = request.headers.get("Authorization", "")
        scheme, _, value = given.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), opts.token.encode()):
            request[rights.TOKEN_CHECKED] = True
        elif not (opts.metrics_public and rights.is_metrics(request)):
            raise web.HTTPUnauthorized(text="bearer token required\n", headers={"WWW-Authenticate": "Bearer"})
    return await handler(request)


def make_app(opts: ServeOptions, store: Store | None = None, fd_limit: int | None = None) -> web.Application:
    """The aiohttp application of :func:`run` (tests may serve it themselves).

    Raises:
        StoreError: the store cannot be opened.
    """
    app = web.Application(middlewares=[_auth, guard_middleware], client_max_size=1024)
    app[OPTIONS_KEY] = opts
    app[METRICS_KEY] = ServeMetrics()
    app[rights.ACCESS_KEY] = rights.Access(opts.group_gid, opts.metrics_public)
    make_guard(app, opts.limits, fd_limit)
    if store is None:
        store = Store(opts.store_root)
        if opts.more_store_roots:
            store = StoreChain([store, *(Store(r) for r in opts.more_store_roots)])
    buildid.add_routes(app, store, debuginfod.Privacy(opts.share_private))
    metrics.add_routes(app, opts.status_fn, lambda: _gauges(app), rights.check_metrics)
    if opts.session_root:
        sessions.add_routes(app, sessions.SessionsOptions(
            opts.session_root, opts.store_root, opts.spool_dir, opts.share_private))
        metadata.add_routes(app)
    return app


def _gauges(app: web.Application) -> dict[str, int]:
    guard = app[GUARD_KEY]
    return {"buildidd_serve_connections": guard.open_connections(), "buildidd_serve_connections_max": guard.cap,
            "buildidd_serve_streams": guard.streams}


def _ssl_context(opts: ServeOptions) -> ssl.SSLContext | None:
    if opts.tls_cert is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(opts.tls_cert, opts.tls_key)
    except (OSError, ssl.SSLError) as e:
        raise ServeError(f"TLS certificate {opts.tls_cert} / key {opts.tls_key}: {e}") from e
    return ctx


async def serve(opts: ServeOptions, on_listening: Callable[[str, int], None] | None = None,
                stop: asyncio.Event | None = None) -> None:
    """Serve until stop is set (or SIGTERM/SIGINT when stop is None).

    Args:
        opts: what to serve, where, how.
        on_listening: called with (host, port) once the socket listens (port resolved when 0).
        stop: set it to shut down; None: install SIGTERM and SIGINT handlers that set one.

    Raises:
        ServeError: the options are refused, or the address cannot be bound.
    """
    check_options(opts)
    ssl_ctx = _ssl_context(opts)
    app = make_app(opts, fd_limit=raise_fd_limit())
    runner = web.AppRunner(app, access_log_class=MetricsAccessLogger, keepalive_timeout=opts.idle_timeout_s,
                           handle_signals=False, shutdown_timeout=5.0)
    await runner.setup()
    app[GUARD_KEY].attach(runner.server)
    asyncio.get_running_loop().set_exception_handler(app[GUARD_KEY].exception_handler)
    server_log = logging.getLogger("aiohttp.server")
    server_log.addFilter(app[GUARD_KEY].log_filter)
    try:
        site = web.TCPSite(runner, opts.host, opts.port, ssl_context=ssl_ctx, reuse_address=True)
        try:
            await site.start()
        except OSError as e:
            raise ServeError(f"cannot listen on {opts.host}:{opts.port}: {e.strerror}") from e
        if opts.unix_socket:
            await _listen_unix(runner, opts.unix_socket)
        port = runner.addresses[0][1]
        scheme = "https" if ssl_ctx else "http"
        shown = f"[{opts.host}]" if ":" in opts.host else opts.host
        log.info("serving %s on %s://%s:%d/ (token %s; /metrics %s)", opts.store_root, scheme, shown, port,
                 "required" if opts.token else "not required",
                 "public" if opts.metrics_public else "to callers with rights")
        if on_listening is not None:
            on_listening(opts.host, port)
        if stop is None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("stopping")
    finally:
        server_log.removeFilter(app[GUARD_KEY].log_filter)
        await runner.cleanup()


async def _listen_unix(runner: web.AppRunner, path: str) -> None:
    """Listen on the unix socket path too (a stale socket there is replaced; anything else is refused).

    Raises:
        ServeError: path exists and is not a socket, or cannot be bound.
    """
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
        else:
            raise ServeError(f"--unix-socket {path}: exists and is not a socket")
    except FileNotFoundError:
        pass
    except OSError as e:
        raise ServeError(f"--unix-socket {path}: {e.strerror}") from e
    try:
        await web.UnixSite(runner, path).start()
        os.chmod(path, 0o666)   # anyone may connect: what each peer gets is decided by its SO_PEERCRED
    except OSError as e:
        raise ServeError(f"cannot listen on {path}: {e.strerror}") from e
    log.info("also serving on unix socket %s", path)


def run(opts: ServeOptions, on_listening: Callable[[str, int], None] | None = None) -> None:
    """Blocking :func:`serve` until SIGTERM or SIGINT.

    Raises:
        ServeError: see :func:`serve`.
    """
    asyncio.run(serve(opts, on_listening))

"""``/metrics`` of buildidd-push.service: the push status as Prometheus text, on loopback or a unix socket.

The numbers are those of :meth:`Pusher.status <buildidd.fleet.push.Pusher.status>` (``status.json``),
taken at each scrape: the backlog (binaries, segments, sessions and their bytes) left by the last pass,
the age of the oldest unpushed item, the cumulative counters the ledger keeps (bytes sent, objects,
errors by cause: bucket.CAUSES) and the service's consecutive failures and next wait.  The text is
written by ``prometheus_client`` as ``buildidd serve``'s ``/metrics`` is (offline.serve.metrics):
metric families from one snapshot, ``generate_latest``, format 0.0.4.

Where it listens is ``Config.push_metrics_listen``: ``127.0.0.1:PORT``, ``[::1]:PORT`` (loopback
only: the numbers name the bucket's state, not for the network) or ``unix:PATH`` (a socket made 0600:
root's, as the state directory is).  The server is the standard library's, one thread per request, in
daemon threads beside the push loop.
"""

from __future__ import annotations

import http.server
import ipaddress
import logging
import os
import socket
import socketserver
import stat
import threading
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from buildidd.errors import PushError
from buildidd.offline.serve.metrics import CONTENT_TYPE

__all__ = ["render", "MetricsServer", "parse_listen"]

log = logging.getLogger(__name__)

StatusFn = Callable[[], dict]
"""Returns the push status (Pusher.status() with the service's part); must not raise."""

#: Backlog kinds (status ``backlog`` keys) and their bytes' keys.
_BACKLOG = (("entries", "entry_bytes"), ("segments", "segment_bytes"), ("sessions", None))


def render(status: dict) -> str:
    """The Prometheus text (format 0.0.4) of a push status (see the module docstring)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Scrape(status))
    return generate_latest(registry).decode()


class _Scrape:
    """One scrape's families for prometheus_client's registry (its Collector protocol: ``collect``)."""

    def __init__(self, status: dict):
        self.status = status

    def collect(self) -> Iterator[Metric]:
        s = self.status
        backlog = s.get("backlog") or {}
        items = GaugeMetricFamily("buildidd_push_backlog", "Items not pushed at the end of the last pass, by kind "
                                  "(entries: store entries; segments: closed session segments; sessions).",
                                  labels=("kind",))
        sizes = GaugeMetricFamily("buildidd_push_backlog_bytes", "Bytes not pushed at the end of the last pass, "
                                  "by kind.", labels=("kind",))
        for kind, bytes_key in _BACKLOG:
            items.add_metric([kind], _num(backlog.get(kind)))
            if bytes_key:
                sizes.add_metric([kind], _num(backlog.get(bytes_key)))
        yield items
        yield sizes
        yield GaugeMetricFamily("buildidd_push_backlog_known", "1 once a pass has measured the backlog.",
                                value=0 if s.get("backlog") is None else 1)
        yield GaugeMetricFamily("buildidd_push_oldest_unpushed_age_seconds", "Age of the oldest store entry or "
                                "segment not pushed (0: none).", value=_num(s.get("oldest_unpushed_age_s")))
        totals = s.get("totals") or {}
        yield _counter("buildidd_push_sent_bytes_total", "Body bytes uploaded to the bucket.",
                       totals.get("sent_bytes"))
        yield _counter("buildidd_push_objects_total", "Objects written to the bucket.", totals.get("objects"))
        outcomes = CounterMetricFamily("buildidd_push_entries_total", "Store entries pushed, by outcome.",
                                       labels=("outcome",))
        for outcome in ("uploaded", "present", "debuginfo_added", "conflicts_kept_aside"):
            outcomes.add_metric([outcome], _num(totals.get(outcome)))
        yield outcomes
        errors = CounterMetricFamily("buildidd_push_errors_total", "Failed requests (or unreadable local files), "
                                     "by cause (unreachable, timeout, credentials, denied, full, throttled, server, "
                                     "client, source, config).", labels=("cause",))
        for name, n in sorted(totals.items()):
            if name.startswith("errors_"):
                errors.add_metric([name[len("errors_"):]], _num(n))
        yield errors
        service = s.get("service") or {}
        yield GaugeMetricFamily("buildidd_push_consecutive_failures", "Passes in a row that ended on a failure.",
                                value=_num(service.get("consecutive_failures")))
        yield GaugeMetricFamily("buildidd_push_next_pass_seconds", "Wait before the next pass (backoff with jitter "
                                "after failures).", value=_num(service.get("next_pass_in_s")))
        last = s.get("last_pass") or {}
        yield GaugeMetricFamily("buildidd_push_last_pass_failed", "1 when the last pass ended on a failure.",
                                value=1 if last.get("error") else 0)


def _num(value) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _counter(name: str, help_text: str, value) -> CounterMetricFamily:
    return CounterMetricFamily(name, help_text, value=_num(value))


def parse_listen(listen: str) -> tuple[int, object]:
    """``(address family, address)`` of a push_metrics_listen value.

    Raises:
        PushError: ``config``: not ``unix:PATH`` (absolute) nor a loopback ``HOST:PORT``.
    """
    if listen.startswith("unix:"):
        path = listen[len("unix:"):]
        if not path.startswith("/"):
            raise PushError("config", f"push_metrics_listen {listen!r}: unix:PATH needs an absolute path")
        return socket.AF_UNIX, path
    host, sep, port = listen.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        addr = ipaddress.ip_address(host)
        number = int(port)
    except ValueError:
        addr, number = None, -1
    if not sep or addr is None or not addr.is_loopback or not 0 <= number <= 65535:
        raise PushError("config", f"push_metrics_listen {listen!r}: give 127.0.0.1:PORT, [::1]:PORT or unix:PATH "
                                  "(loopback only)")
    return (socket.AF_INET6 if addr.version == 6 else socket.AF_INET), (str(addr), number)


class _Handler(http.server.BaseHTTPRequestHandler):
    """GET /metrics; anything else 404."""

    server_version = "buildidd-push"
    status_fn: StatusFn

    def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
        if self.path.split("?", 1)[0] != "/metrics":
            self.send_error(404)
            return
        body = render(self.server.status_fn()).encode()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def address_string(self) -> str:
        return str(self.client_address or "unix")

    def log_message(self, fmt: str, *args) -> None:
        log.debug("metrics: " + fmt, *args)


class _TCPServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True


class _TCP6Server(_TCPServer):
    address_family = socket.AF_INET6


class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class MetricsServer:
    """``/metrics`` served in a daemon thread until :meth:`close`.

    Args:
        listen: ``Config.push_metrics_listen`` (parse_listen).
        status_fn: the status at each scrape.

    Raises:
        PushError: ``config``: a malformed address, or it cannot be bound (in use, no permission).
    """

    def __init__(self, listen: str, status_fn: StatusFn):
        family, address = parse_listen(listen)
        try:
            if family == socket.AF_UNIX:
                try:
                    if stat.S_ISSOCK(os.lstat(address).st_mode):
                        os.unlink(address)       # a socket a killed service left (another file is an error)
                except FileNotFoundError:
                    pass
                old = os.umask(0o177)
                try:
                    self.server = _UnixServer(address, _Handler)
                finally:
                    os.umask(old)
            else:
                self.server = (_TCP6Server if family == socket.AF_INET6 else _TCPServer)(address, _Handler)
        except OSError as e:
            raise PushError("config", f"push_metrics_listen {listen!r}: {e.strerror or e}") from e
        self.server.status_fn = status_fn
        self.address = self.server.server_address
        self._thread = threading.Thread(target=self.server.serve_forever, name="push-metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and close the socket (a unix socket's file is removed)."""
        self.server.shutdown()
        self.server.server_close()
        if isinstance(self.address, str):
            try:
                os.unlink(self.address)
            except OSError:
                pass

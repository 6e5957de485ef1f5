"""``/metrics`` of ``buildidd serve``: its counters and the recording daemon's status, as Prometheus text.

Counters are kept in memory from the server's start (:class:`ServeMetrics`); the daemon's status is
asked for at each scrape through a callable the caller supplies (the CLI gives one that asks the control
socket: offline never imports control).  The text is written by ``prometheus_client`` (the Prometheus
project's own Python client): at each scrape a collector turns a snapshot of the counters into metric
families and ``generate_latest`` writes them in the text format 0.0.4 (escaping, number formatting, HELP
and TYPE lines are the library's).  Who may read ``/metrics`` is :mod:`.rights`' decision.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from buildidd.errors import BuildiddError

log = logging.getLogger(__name__)

StatusFn = Callable[[], dict]
"""Returns the recording daemon's status (the control socket's ``status`` answer).

Raises OSError when no daemon answers, BuildiddError when it answers badly.
"""

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
"""The Prometheus text format 0.0.4, what :meth:`ServeMetrics.render` writes."""

#: HELP of the server's own gauges (app._gauges); a gauge not listed gets its name.
GAUGE_HELP = {
    "buildidd_serve_connections": "Connections open now.",
    "buildidd_serve_connections_max": "Connections open at most (the cap; more are refused, counted connections).",
    "buildidd_serve_streams": "Answers being sent now (files and archives).",
}

STATUS_MAX_SERIES = 2000
"""Numbers taken from one status answer at most (a bound on the scrape's size)."""

_NAME_BAD = re.compile(r"[^a-zA-Z0-9_.]")


class ServeMetrics:
    """The server's counters; thread-safe (archives are written in worker threads).

    Attributes (all monotonic counters since the server started):
        requests: (route, status code) → answers sent.
        sent_bytes: route → body bytes sent (a HEAD sends none).
        lookups: (artifact, result) → build-id lookups; result is ``hit``
            (a file or section was sent), ``miss`` (404: a private one withheld from a caller
            without rights too), ``unavailable`` (503) or ``withheld`` (403: private, to a caller with rights).
        refused: reason → connections, requests or answers refused or cut
            (``guard.REFUSAL_REASONS``).
        log_suppressed: warnings not logged because :meth:`warn`'s rate was reached.
    """

    #: Warnings :meth:`warn` logs per LOG_WINDOW_S at most; the rest are counted (``log_suppressed``).
    LOG_BURST = 10
    LOG_WINDOW_S = 60.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()
        self.sent_bytes: Counter[str] = Counter()
        self.lookups: Counter[tuple[str, str]] = Counter()
        self.served_quality: Counter[tuple[str, str]] = Counter()    # (artifact, store.quality) of hits
        self.refused: Counter[str] = Counter()
        self.log_suppressed = 0
        self._log_window = (0.0, 0)

    def refuse(self, reason: str) -> None:
        """Count one refusal (a connection closed, a 503 for a cap, a client cut) by reason."""
        with self._lock:
            self.refused[reason] += 1

    def allow_log(self) -> bool:
        """Whether one more warning may be logged now (at most LOG_BURST per LOG_WINDOW_S); counts the rest."""
        now = time.monotonic()
        with self._lock:
            start, n = self._log_window
            if now - start >= self.LOG_WINDOW_S:
                start, n = now, 0
            self._log_window = (start, n + 1)
            if n >= self.LOG_BURST:
                self.log_suppressed += 1
                return False
        return True

    def warn(self, logger: logging.Logger, msg: str, *args) -> None:
        """logger.warning at most LOG_BURST times per LOG_WINDOW_S seconds; the rest counted in log_suppressed."""
        if self.allow_log():
            logger.warning(msg, *args)

    def answered(self, route: str, status: int, body_bytes: int) -> None:
        """Count one answer of route (its pattern, e.g. ``/buildid/{build_id}/{artifact}``)."""
        with self._lock:
            self.requests[(route, status)] += 1
            self.sent_bytes[route] += max(0, body_bytes)

    def lookup(self, artifact: str, result: str) -> None:
        """Count one build-id lookup: artifact in debuginfod.ARTIFACTS, result hit/miss/unavailable."""
        with self._lock:
            self.lookups[(artifact, result)] += 1

    def served(self, artifact: str, quality: str | None) -> None:
        """Count one file sent for artifact by the quality of its entry (store.quality.QUALITIES; ``unknown``)."""
        with self._lock:
            self.served_quality[(artifact, quality or "unknown")] += 1

    def render(self, status: dict | None, status_error: str | None, gauges: dict[str, int] | None = None) -> str:
        """The Prometheus text (format 0.0.4) of the counters, plus the daemon's status.

        Args:
            status: the daemon's status answer, or None when there is no daemon to ask.
            status_error: why the daemon did not answer (``buildidd_daemon_up 0``), or None.
            gauges: ``{name: value}`` of the server's own gauges (open connections, answers in progress, caps).
        """
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Scrape(self._families(), gauges or {}, status, status_error))
        return generate_latest(registry).decode()

    def _families(self) -> list[Metric]:
        """The counters as metric families, from one snapshot taken under the lock."""
        with self._lock:
            requests = sorted(self.requests.items())
            sent = sorted(self.sent_bytes.items())
            lookups = sorted(self.lookups.items())
            qualities = sorted(self.served_quality.items())
            refused = sorted(self.refused.items())
            suppressed = self.log_suppressed
        return [
            _counter("buildidd_serve_requests_total", "HTTP answers sent, by route pattern and status code.",
                     ("route", "status"), (((r, str(st)), n) for (r, st), n in requests)),
            _counter("buildidd_serve_sent_bytes_total", "Body bytes sent, by route pattern.",
                     ("route",), (((r,), n) for r, n in sent)),
            _counter("buildidd_serve_lookups_total", "Build-id lookups by artifact type and result (hit: sent, "
                     "miss: 404, unavailable: held but unreadable, 503; withheld: private, 403 to a caller with "
                     "rights; a caller without them gets a miss).", ("artifact", "result"), lookups),
            _counter("buildidd_serve_served_by_quality_total", "Files sent, by artifact and what the entry is good "
                     "for (dwarf, symtab, minidebuginfo, go_pclntab, dynsym, none).", ("artifact", "quality"),
                     qualities),
            _counter("buildidd_serve_refused_total", "Connections closed, requests refused (503) and clients cut, "
                     "by reason.", ("reason",), (((r,), n) for r, n in refused)),
            _counter("buildidd_serve_log_suppressed_total", "Warnings not logged (rate limit); see the counters.",
                     (), [((), suppressed)]),
        ]


def _counter(name: str, help_text: str, labels: tuple[str, ...], samples) -> CounterMetricFamily:
    """A counter family; name ends in ``_total`` (the library writes the family without it in TYPE and the
    sample with it); samples are (label values, count) pairs."""
    family = CounterMetricFamily(name, help_text, labels=labels)
    for values, n in samples:
        family.add_metric(list(values), n)
    return family


class _Scrape:
    """One scrape's metric families for prometheus_client's registry (its Collector protocol: ``collect``)."""

    def __init__(self, counters: list[Metric], gauges: dict[str, int], status: dict | None, status_error: str | None):
        self.counters, self.gauges, self.status, self.status_error = counters, gauges, status, status_error

    def collect(self) -> Iterator[Metric]:
        yield from self.counters
        for name, value in sorted(self.gauges.items()):
            yield GaugeMetricFamily(name, GAUGE_HELP.get(name, name), value=value)
        if self.status is not None or self.status_error is not None:
            yield GaugeMetricFamily("buildidd_daemon_up", "1 when the recording daemon answered its control socket.",
                                    value=0 if self.status is None else 1)
        if self.status is not None:
            family = GaugeMetricFamily("buildidd_daemon_status", "Numbers of the recording daemon's status answer, "
                                       "by key path (see buildidd status --json).", labels=("key",))
            for key, value in flatten_numbers(self.status):
                family.add_metric([key], value)
            yield family


def flatten_numbers(value: Any, prefix: str = "") -> list[tuple[str, float]]:
    """The numbers of a JSON value with their key paths (``events.mmap``), at most STATUS_MAX_SERIES.

    Booleans count as 0/1; strings, nulls and lists' non-number items are left out.
    Key characters other than ``[a-zA-Z0-9_.]`` become ``_``.
    """
    out: list[tuple[str, float]] = []
    stack: list[tuple[str, Any]] = [(prefix, value)]
    while stack and len(out) < STATUS_MAX_SERIES:
        path, v = stack.pop()
        if isinstance(v, bool):
            out.append((path, 1.0 if v else 0.0))
        elif isinstance(v, (int, float)):
            out.append((path, float(v)))
        elif isinstance(v, dict):
            for k, item in v.items():
                key = _NAME_BAD.sub("_", str(k))
                stack.append((f"{path}.{key}" if path else key, item))
        elif isinstance(v, list):
            for i, item in enumerate(v):
                stack.append((f"{path}.{i}", item))
    return sorted(out)


def daemon_status(status_fn: StatusFn | None) -> tuple[dict | None, str | None]:
    """(status, None) from status_fn, (None, why) when the daemon did not answer, (None, None) without one."""
    if status_fn is None:
        return None, None
    try:
        status = status_fn()
    except (OSError, BuildiddError) as e:
        return None, str(e) or type(e).__name__
    return (status, None) if isinstance(status, dict) else (None, "status answer is not an object")


class MetricsAccessLogger(AbstractAccessLogger):
    """aiohttp's access log hook, called once each answer is sent: counts it, logs it at debug level.

    The :class:`ServeMetrics` is the application's ``METRICS_KEY`` item.
    """

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        routed = isinstance(request, web.Request) and getattr(request, "_match_info", None) is not None
        metrics = request.app.get(METRICS_KEY) if routed else None   # a malformed request was never routed
        route = _route_of(request)
        body_bytes = sent_body_bytes(request, response)
        if metrics is not None:
            metrics.answered(route, response.status, body_bytes)
        self.logger.debug("%s %s %s %d %d bytes %.3f s", request.remote, request.method, request.path,
                          response.status, body_bytes, time)


def sent_body_bytes(request: web.BaseRequest, response: web.StreamResponse) -> int:
    """Body bytes of an answer: what went through the writer, or for a file sent with sendfile(2)
    (which bypasses the writer) its Content-Length (so a transfer the client cut counts in full)."""
    if isinstance(response, web.FileResponse) and request.method != "HEAD" and response.status in (200, 206):
        return response.content_length or 0
    return response.body_length


def _route_of(request: web.BaseRequest) -> str:
    match_info = getattr(request, "_match_info", None)   # the property asserts when the request was never routed
    route = getattr(match_info, "route", None)
    resource = getattr(route, "resource", None)
    return resource.canonical if resource is not None else "(no route)"


METRICS_KEY: web.AppKey[ServeMetrics] = web.AppKey("buildidd_serve_metrics", ServeMetrics)
"""The application's :class:`ServeMetrics`."""


STATUS_FN_KEY: web.AppKey = web.AppKey("buildidd_serve_status_fn")


GAUGES_KEY: web.AppKey = web.AppKey("buildidd_serve_gauges")


CHECK_KEY: web.AppKey = web.AppKey("buildidd_serve_metrics_check")


def add_routes(app: web.Application, status_fn: "StatusFn | None",
               gauges: "Callable[[], dict[str, int]]", check: "Callable[[web.Request], None]") -> None:
    """``/metrics`` on app.  status_fn asks the recording daemon for its status (None: the
    default); gauges gives the server's own gauges (metric name → value) at each scrape;
    check decides who may read them (raises an HTTP error for a caller who may not:
    :func:`buildidd.offline.serve.rights.check_metrics`)."""
    app[STATUS_FN_KEY] = status_fn
    app[GAUGES_KEY] = gauges
    app[CHECK_KEY] = check
    app.router.add_get("/metrics", handle_metrics, allow_head=False)


async def handle_metrics(request: web.Request) -> web.Response:
    """``/metrics``: the counters and the daemon's status (asked in a thread), to whom check allows."""
    request.app[CHECK_KEY](request)
    loop = asyncio.get_running_loop()
    status, why = await loop.run_in_executor(None, daemon_status, request.app[STATUS_FN_KEY])
    if why is not None:
        log.debug("daemon status unavailable: %s", why)
    text = request.app[METRICS_KEY].render(status, why, request.app[GAUGES_KEY]())
    return web.Response(body=text.encode(), headers={"Content-Type": CONTENT_TYPE})

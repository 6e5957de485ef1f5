"""buildidd-push.service's loop: a quick pass every ``push_wake_s``, a full one every ``push_interval_s``,
backoff with jitter after failures, and a stop within ``push_stop_budget_s``.

A quick pass (Pusher.run_pass(full=False)) looks only at the store's
``.build-id/XX`` directories that changed (one stat each) and at the sessions'
closed segments, so a new binary or segment goes up within about push_wake_s
of reaching the store; a full pass goes over every entry (what a quick one
cannot see: a main copy replaced, a debuginfo added).  The first pass, and the
first after a failed one, is full.

After a pass that ended on a failure concerning every request (the bucket
unreachable, slow, refusing credentials, full), the next one waits
``backoff_s(n)``: 1 s, 2 s, 4 s ... doubled per consecutive failure up to
``push_retry_max_s``, each times a random factor in [0.5, 1] ("full jitter"
halved, so that a fleet whose bucket came back does not return in step).
SIGTERM (or SIGINT) starts no new upload, lets those in progress run for up to
``push_stop_budget_s``, writes the status with what is left (the backlog:
pushed by the next start, since the store and sessions are the queue) and returns.
With ``push_metrics_listen`` set, the same status is served as Prometheus text
(fleet.metrics) while the loop runs.
"""

from __future__ import annotations

import logging
import random
import signal
import threading
import time

from buildidd.fleet.metrics import MetricsServer
from buildidd.fleet.push import Pusher

__all__ = ["backoff_s", "run_service"]

log = logging.getLogger(__name__)


def backoff_s(failures: int, max_s: float, rng: random.Random | None = None) -> float:
    """Seconds to wait after ``failures`` consecutive failed passes (>= 1): min(max_s, 2**(failures-1))
    times a random factor in [0.5, 1]."""
    base = min(max_s, 2.0 ** min(failures - 1, 30))
    return base * (rng or random).uniform(0.5, 1.0)


def run_service(pusher: Pusher, stop: threading.Event | None = None) -> int:
    """Pass after pass until stop is set (by SIGTERM/SIGINT when stop is None: handlers are installed).

    Returns:
        0 (a stop is not a failure; failures are counted in the status).
    """
    cfg = pusher.cfg
    if stop is None:
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda _n, _f: stop.set())
    state: dict = {}
    metrics = MetricsServer(cfg.push_metrics_listen, lambda: {**pusher.status(), "service": dict(state)}) \
        if cfg.push_metrics_listen else None
    try:
        return _loop(pusher, stop, state)
    finally:
        if metrics is not None:
            metrics.close()


def _loop(pusher: Pusher, stop: threading.Event, state: dict) -> int:
    """The passes of :func:`run_service`; state is the service's part of the status (kept current)."""
    cfg = pusher.cfg
    failures, next_full = 0, 0.0
    log.info("push: to bucket %s prefix %r as host %s, new entries every %.1f s, all every %.0f s",
             cfg.push_bucket, cfg.push_prefix, pusher.keys.host, cfg.push_wake_s, cfg.push_interval_s)
    while not stop.is_set():
        full = failures > 0 or time.monotonic() >= next_full
        if full:
            next_full = time.monotonic() + cfg.push_interval_s
        report = pusher.run_pass(stop.is_set, full=full)
        failures = failures + 1 if report.failed else 0
        delay = backoff_s(failures, cfg.push_retry_max_s) if failures else cfg.push_wake_s
        state.update(consecutive_failures=failures, next_pass_in_s=round(delay, 3), stopping=stop.is_set())
        pusher.write_status({"service": dict(state)})
        if report.counts.get("sent_bytes") or report.failed:
            log.info("push: pass: %s%s", dict(report.counts), f"; {report.error}" if report.error else "")
        stop.wait(delay)
    left = pusher.last.backlog if pusher.last is not None else {}
    pusher.write_status({"service": {"consecutive_failures": failures, "stopped": True, "left": left}})
    log.info("push: stopped; left for the next start: %s", left)
    return 0

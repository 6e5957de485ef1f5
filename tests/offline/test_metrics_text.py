"""serve's /metrics text, read back by prometheus_client's parser: every counter with its labels and value,
hostile label values (quotes, backslashes, newlines from a route or a status key) kept intact, and the
daemon's status numbers as gauges."""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

from buildidd.offline.serve.metrics import STATUS_MAX_SERIES, ServeMetrics

from offline.promtext import samples

HOSTILE = 'a"b\\c\nd'


def _families(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_every_counter_reads_back_with_its_type_help_and_labels():
    m = ServeMetrics()
    for _ in range(3):
        m.answered("/buildid/{build_id}/{artifact}", 200, 1000)
    m.answered(HOSTILE, 404, 0)
    m.lookup("executable", "hit")
    m.lookup("debuginfo", "miss")
    m.served("executable", None)
    m.refuse("metrics_forbidden")
    text = m.render(None, None, {"buildidd_serve_connections": 2, "buildidd_serve_connections_max": 1024})
    fams = _families(text)
    assert {n: f.type for n, f in fams.items()} == {
        "buildidd_serve_requests": "counter", "buildidd_serve_sent_bytes": "counter",
        "buildidd_serve_lookups": "counter", "buildidd_serve_served_by_quality": "counter",
        "buildidd_serve_refused": "counter", "buildidd_serve_log_suppressed": "counter",
        "buildidd_serve_connections": "gauge", "buildidd_serve_connections_max": "gauge"}
    assert all(f.documentation for f in fams.values())
    got = samples(text)
    assert got == {
        ("buildidd_serve_requests_total", frozenset({"route": "/buildid/{build_id}/{artifact}", "status": "200"}.items())): 3,
        ("buildidd_serve_requests_total", frozenset({"route": HOSTILE, "status": "404"}.items())): 1,
        ("buildidd_serve_sent_bytes_total", frozenset({"route": "/buildid/{build_id}/{artifact}"}.items())): 3000,
        ("buildidd_serve_sent_bytes_total", frozenset({"route": HOSTILE}.items())): 0,
        ("buildidd_serve_lookups_total", frozenset({"artifact": "executable", "result": "hit"}.items())): 1,
        ("buildidd_serve_lookups_total", frozenset({"artifact": "debuginfo", "result": "miss"}.items())): 1,
        ("buildidd_serve_served_by_quality_total", frozenset({"artifact": "executable", "quality": "unknown"}.items())): 1,
        ("buildidd_serve_refused_total", frozenset({"reason": "metrics_forbidden"}.items())): 1,
        ("buildidd_serve_log_suppressed_total", frozenset()): 0,
        ("buildidd_serve_connections", frozenset()): 2,
        ("buildidd_serve_connections_max", frozenset()): 1024,
    }
    assert "buildidd_daemon_up" not in text            # no daemon to ask: not reported at all


def test_the_daemons_status_numbers_become_gauges_by_key_path():
    status = {"events": {"mmap": 42, "odd key\"x": 1}, "lost": [3, "n/a"], "uptime_s": 12.5, "ready": True,
              "session": "s1", "nothing": None, "inf": math.inf, "nan": math.nan}
    got = samples(ServeMetrics().render(status, None))
    daemon = {dict(labels).get("key"): v for (name, labels), v in got.items() if name.startswith("buildidd_daemon")}
    nan = daemon.pop("nan")
    assert math.isnan(nan)
    assert daemon == {None: 1, "events.mmap": 42, "events.odd_key_x": 1, "lost.0": 3, "uptime_s": 12.5,
                      "ready": 1, "inf": math.inf}
    down = samples(ServeMetrics().render(None, "no daemon"))
    assert down[("buildidd_daemon_up", frozenset())] == 0
    assert not any(name == "buildidd_daemon_status" for name, _ in down)


def test_a_huge_status_answer_is_cut_to_the_series_cap():
    status = {f"k{i}": i for i in range(STATUS_MAX_SERIES * 3)}
    got = samples(ServeMetrics().render(status, None))
    assert sum(1 for name, _ in got if name == "buildidd_daemon_status") == STATUS_MAX_SERIES

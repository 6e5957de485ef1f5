"""buildidd-push.service against a real S3 server that is slow, refuses the credentials, or is full.

Each fault: the service runs (its ``/metrics`` on a loopback port, parsed back with
prometheus_client's parser), passes fail and are counted by cause, the waits between them
back off with jitter, nothing is marked pushed, and once the fault is mended the backlog
drains and every object in the bucket is the host's file.  Refused credentials are real
(weed's S3 identities without the pusher's key); slow and full come from a loopback proxy
in front of weed (tests/fleet/proxy.py): weed cannot be made to crawl, and a weed made full for
real (a small volume size limit or a bucket quota) was not tried: the proxy answers what S3 answers.
Also: a debuginfo that reaches the store after its executable was pushed goes up too.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import boto3
import pytest
from prometheus_client.parser import text_string_to_metric_families

from buildidd.cli.ctl import push_line
from buildidd.fleet.fetch import Target, fetch_session
from buildidd.fleet.bucket import Bucket, BucketOptions
from buildidd.fleet.service import run_service
from conftest import free_port, readelf_build_id
from fleet.conftest import S3_CONFIG
from fleet.proxy import Proxy
from fleet.world import Host, build

PREFIX = "debuginfod"
RETRY_MAX_S = 2.0


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """The samples of /metrics, by (name, sorted label pairs), parsed by prometheus_client."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def bucket_keys(weed, prefix: str) -> dict[str, int]:
    s3 = boto3.client("s3", endpoint_url=weed.endpoint, region_name="us-east-1")
    return {o["Key"]: o["Size"] for o in s3.list_objects_v2(Bucket="fleet-test", Prefix=prefix).get("Contents", [])}


class Service:
    """run_service in a thread, its status.json watched: every (consecutive failures, next wait) it wrote."""

    def __init__(self, host: Host, endpoint: str, **cfg):
        self.port = free_port()
        self.pusher = host.pusher(push_endpoint_url=endpoint, push_metrics_listen=f"127.0.0.1:{self.port}",
                                  push_interval_s=60.0, push_retry_max_s=RETRY_MAX_S, push_timeout_s=1.0, **cfg)
        self.status_path = Path(host.cfg.push_state_dir) / "status.json"
        self.stop = threading.Event()
        self.waits: list[tuple[int, float]] = []
        self.thread = threading.Thread(target=run_service, args=(self.pusher, self.stop), daemon=True)
        self.thread.start()

    def status(self) -> dict:
        try:
            s = json.loads(self.status_path.read_text())
        except (OSError, ValueError):
            return {}
        svc = s.get("service") or {}
        if "next_pass_in_s" in svc and (not self.waits or self.waits[-1] != (svc["consecutive_failures"],
                                                                                svc["next_pass_in_s"])):
            self.waits.append((svc["consecutive_failures"], svc["next_pass_in_s"]))
        return s

    def until(self, what, timeout_s: float, why: str) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            s = self.status()
            if s and what(s):
                return s
            time.sleep(0.05)
        raise AssertionError(f"{why}: not within {timeout_s} s: {self.status()}")

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()
        self.pusher.close()


@pytest.fixture
def host(tmp_path, weed, public_tmp_factory):
    """Two small programs (not under the system directories: pushed to hosts/HOST/) and a closed session."""
    h = Host(tmp_path / "h", "host-f", weed.endpoint)
    src = public_tmp_factory()
    for name in ("one", "two"):
        h.add(name, build(src, name))
    h.session()
    return h


def fault_then_mend(host: Host, weed, endpoint: str, cause: str, mend, **cfg) -> None:
    """The fault is on: passes fail with cause, counted, backoff with jitter, backlog kept; then mend():
    the backlog drains and the bucket holds every file."""
    svc = Service(host, endpoint, **cfg)
    try:
        failing = svc.until(lambda s: (s.get("service") or {}).get("consecutive_failures", 0) >= 2, 40,
                            "two failed passes")
        assert failing["backlog"]["entries"] == 2 and failing["backlog"]["segments"] > 0
        m = scrape(svc.port)
        assert m[("buildidd_push_errors_total", (("cause", cause),))] >= 2, m
        assert m[("buildidd_push_backlog", (("kind", "entries"),))] == 2
        assert m[("buildidd_push_backlog_bytes", (("kind", "segments"),))] > 0
        assert m[("buildidd_push_oldest_unpushed_age_seconds", ())] > 0
        assert m[("buildidd_push_consecutive_failures", ())] >= 2
        line = push_line(failing)                                               # buildidd status's push line
        assert re.search(rf"^push +backlog 2 binaries \(\d+ bytes\), [1-9]\d* segments .*errors by cause .*"
                         rf"{cause} [1-9]", line), line
        assert not failing["totals"].get("objects") and not failing["totals"].get("uploaded")   # nothing went
        mend()
        svc.until(lambda s: s["backlog"]["entries"] == 0 and s["backlog"]["segments"] == 0
                  and s["service"]["consecutive_failures"] == 0, 30, "the backlog drained")
        m = scrape(svc.port)
        assert m[("buildidd_push_backlog", (("kind", "entries"),))] == 0
        assert m[("buildidd_push_oldest_unpushed_age_seconds", ())] == 0
        assert m[("buildidd_push_sent_bytes_total", ())] > 0
        assert m[("buildidd_push_entries_total", (("outcome", "uploaded"),))] == 2
        assert m[("buildidd_push_errors_total", (("cause", cause),))] >= 2           # the counts stay
    finally:
        svc.close()
    s3 = boto3.client("s3", endpoint_url=weed.endpoint, region_name="us-east-1")
    for label, (path, bid) in host.bids.items():
        key = f"{PREFIX}/hosts/{host.name}/buildid/{bid}/executable"
        assert s3.get_object(Bucket="fleet-test", Key=key)["Body"].read() == Path(path).read_bytes(), label
    # the waits after failures: 1 s then 2 s (push_retry_max_s), each times a factor in [0.5, 1]
    backoffs = [(n, w) for n, w in svc.waits if n > 0]
    assert backoffs, svc.waits
    for n, wait in backoffs:
        base = min(RETRY_MAX_S, 2.0 ** (n - 1))
        assert 0.5 * base <= wait <= base, (n, wait)
    assert len({w for _n, w in backoffs}) == len(backoffs)                          # jitter: no two alike


def test_slow_bucket(host, weed):
    proxy = Proxy(("127.0.0.1", weed.ports["s3.port"]))
    proxy.mode = "slow"
    try:
        fault_then_mend(host, weed, proxy.endpoint, "timeout", lambda: setattr(proxy, "mode", "pass"))
    finally:
        proxy.close()


def test_full_bucket(host, weed):
    proxy = Proxy(("127.0.0.1", weed.ports["s3.port"]))
    proxy.mode = "full"
    try:
        fault_then_mend(host, weed, proxy.endpoint, "full", lambda: setattr(proxy, "mode", "pass"))
        assert proxy.answered_full >= 2
    finally:
        proxy.close()


def test_refused_credentials(host, weed):
    """weed restarted with identities that do not hold the pusher's key (a rotated or wrong key); mended by
    restarting it with the key."""
    wrong = json.loads(json.dumps(S3_CONFIG))
    wrong["identities"][1]["credentials"][0]["accessKey"] = "another-key"
    weed.stop()
    weed.config_path.write_text(json.dumps(wrong))
    weed.start()

    def mend():
        weed.stop()
        weed.config_path.write_text(json.dumps(S3_CONFIG))
        weed.start()

    fault_then_mend(host, weed, weed.endpoint, "credentials", mend)


def test_debuginfo_that_comes_later_is_pushed_and_pulled(tmp_path, weed, public_tmp_factory):
    """A stripped binary pushed without debuginfo; then its debuginfo is installed in the host's debug tree and
    the store takes it (the binary added again): the next pass uploads it, and fleet pull brings it."""
    h = Host(tmp_path / "h", "host-late", weed.endpoint)
    src = public_tmp_factory()
    binary = build(src, "late")
    bid = readelf_build_id(binary)
    kept = tmp_path / "late.debug"
    subprocess.run(["objcopy", "--only-keep-debug", str(binary), str(kept)], check=True)
    subprocess.run(["strip", "-s", str(binary)], check=True)
    h.add("late", binary)
    h.session()
    first = h.pusher().run_pass()
    assert not first.failed and first.counts["uploaded"] == 1, first.counts
    exe_key, debug_key = (f"{PREFIX}/hosts/host-late/buildid/{bid}/{k}" for k in ("executable", "debuginfo"))
    assert exe_key in bucket_keys(weed, PREFIX) and debug_key not in bucket_keys(weed, PREFIX)
    installed = h.base / "usr-lib-debug" / ".build-id" / bid[:2] / f"{bid[2:]}.debug"
    installed.parent.mkdir(parents=True)
    installed.write_bytes(kept.read_bytes())
    h.add("late", binary)                                  # the store sees the file again: takes the debuginfo
    second = h.pusher().run_pass()
    assert not second.failed and second.counts["debuginfo_added"] == 1, second.counts
    s3 = boto3.client("s3", endpoint_url=weed.endpoint, region_name="us-east-1")
    assert s3.get_object(Bucket="fleet-test", Key=debug_key)["Body"].read() == kept.read_bytes()
    assert h.pusher().run_pass().counts["objects"] == 0    # once: not again
    bucket = Bucket(BucketOptions("fleet-test", weed.endpoint))
    r = fetch_session(bucket, PREFIX, "host-late", "20261122T000000Z-4242",
                      Target(str(tmp_path / "analyst-debug"), str(tmp_path / "analyst-sessions")))
    assert r.installed == [bid]
    pulled = list((tmp_path / "analyst-debug").glob(f"**/{bid}/debug"))
    assert len(pulled) == 1 and pulled[0].read_bytes() == kept.read_bytes()


def test_metrics_on_a_unix_socket_root_only_and_loopback_only(tmp_path):
    """push_metrics_listen = unix:PATH: a 0600 socket answering /metrics; a non-loopback address is refused."""
    import http.client
    import os
    from buildidd.errors import PushError
    from buildidd.fleet.metrics import MetricsServer
    path = tmp_path / "push-metrics.sock"
    server = MetricsServer(f"unix:{path}", lambda: {"backlog": {"entries": 3, "entry_bytes": 300},
                                                    "totals": {"errors_full": 2, "sent_bytes": 10}})
    try:
        assert os.stat(path).st_mode & 0o777 == 0o600
        conn = http.client.HTTPConnection("localhost")
        conn.sock = socket.socket(socket.AF_UNIX)
        conn.sock.connect(str(path))
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        m = {(s.name, tuple(sorted(s.labels.items()))): s.value
             for f in text_string_to_metric_families(text) for s in f.samples}
        assert m[("buildidd_push_backlog", (("kind", "entries"),))] == 3
        assert m[("buildidd_push_errors_total", (("cause", "full"),))] == 2
    finally:
        server.close()
    assert not path.exists()
    for bad in ("0.0.0.0:9100", "10.1.2.3:9100", "localhost:9100", "unix:relative.sock", "127.0.0.1:99999"):
        with pytest.raises(PushError, match="push_metrics_listen"):
            MetricsServer(bad, dict)

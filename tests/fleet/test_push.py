"""buildidd push against a real S3 server (SeaweedFS ``weed mini`` on loopback).

Real stores built from gcc binaries through the Store API, real sessions, the real
``debuginfod-find`` reading the bucket's HTTP front, a second host on the same machine,
and the server stopped in the middle of a push.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import threading
import time
from pathlib import Path

import boto3
import pytest

from buildidd.fleet.service import backoff_s
from conftest import need, split_debuginfo
from fleet.world import Host, build, remove, system_dir

PREFIX = "debuginfod"


def s3(weed):
    return boto3.client("s3", endpoint_url=weed.endpoint, region_name="us-east-1")


def keys(weed, prefix: str = "") -> dict[str, int]:
    out = {}
    for page in s3(weed).get_paginator("list_objects_v2").paginate(Bucket="fleet-test", Prefix=prefix):
        out.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
    return out


def body(weed, key: str) -> bytes:
    return s3(weed).get_object(Bucket="fleet-test", Key=key)["Body"].read()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def count_requests(pusher) -> dict[str, int]:
    """Counts of the S3 operations pusher's client makes from now on, by operation name."""
    seen: dict[str, int] = {}

    def hook(model, **_kw):
        seen[model.name] = seen.get(model.name, 0) + 1

    pusher.bucket._s3.meta.events.register("before-call.s3", hook)
    return seen


@pytest.fixture
def sysdir():
    need(os.geteuid() == 0, "trusted store entries need root-owned files under /usr/lib")
    d = system_dir()
    yield d
    remove(d)


@pytest.fixture
def host_a(tmp_path, weed, sysdir, public_tmp_factory):
    """Host A: trusted full (its own debuginfo), split (host debuginfo) and stripped binaries; an untrusted one
    (root's, outside the system directories) and a private one (in a 0700 directory); a closed session."""
    h = Host(tmp_path / "a", "host-a", weed.endpoint)
    full = build(sysdir, "full")
    split = build(sysdir, "split")
    split_debuginfo(split, h.base / "usr-lib-debug")
    stripped = build(sysdir, "stripped", "-s")
    untrusted = build(public_tmp_factory(), "untrusted")
    private_dir = tmp_path / "private"
    private_dir.mkdir(mode=0o700)
    private = build(private_dir, "private")
    for label, path in (("full", full), ("split", split), ("stripped", stripped), ("untrusted", untrusted),
                        ("private", private)):
        h.add(label, path)
    h.files = {"full": full, "split": split, "stripped": stripped, "untrusted": untrusted}
    h.session()
    return h


def test_push_lays_out_debuginfod_url_space_with_metadata(host_a, weed, tmp_path):
    pusher = host_a.pusher()
    report = pusher.run_pass()
    assert not report.failed, report.error
    b = {k: v[1] for k, v in host_a.bids.items()}
    held = keys(weed)
    for label in ("full", "split", "stripped"):
        assert f"{PREFIX}/buildid/{b[label]}/executable" in held, label
    assert f"{PREFIX}/buildid/{b['full']}/debuginfo" in held            # unstripped: its own debuginfo
    assert f"{PREFIX}/buildid/{b['split']}/debuginfo" in held           # the host's separate debuginfo
    assert f"{PREFIX}/buildid/{b['stripped']}/debuginfo" not in held
    # untrusted: this host's tree only; private: nowhere
    assert f"{PREFIX}/hosts/host-a/buildid/{b['untrusted']}/executable" in held
    assert not any(b["untrusted"] in k for k in held if "/hosts/" not in k)
    assert not any(b["private"] in k for k in held)
    assert report.counts["skipped_private"] == 1
    head = s3(weed).head_object(Bucket="fleet-test", Key=f"{PREFIX}/buildid/{b['full']}/executable")
    meta = head["Metadata"]
    assert meta["provenance"] == "trusted" and meta["key-kind"] == "gnu" and meta["first-host"] == "host-a"
    assert meta["quality"] in ("dwarf", "symtab") and meta["first-seen"].endswith("Z")
    assert meta["sha256"] == sha(host_a.files["full"].read_bytes()) and meta["debuginfo"] == "self"
    assert s3(weed).head_object(Bucket="fleet-test", Key=f"{PREFIX}/hosts/host-a/buildid/{b['untrusted']}/"
                                "executable")["Metadata"]["provenance"] == "untrusted"
    # the bytes of an unstripped binary went up once: its executable is a server-side copy
    assert report.counts["copies"] == 2                  # full and untrusted, both unstripped
    # the session: every closed segment, the manifest, the marker
    session = Path(host_a.cfg.session_root) / "20261122T000000Z-4242"
    pushed = {k.rsplit("/", 1)[1] for k in held if k.startswith(f"{PREFIX}/sessions/host-a/{session.name}/")}
    local = {p.name for p in session.iterdir() if p.name.startswith("segment-")}
    assert len(local) > 2 and local <= pushed and {"manifest.json", ".closed"} <= pushed
    manifest = json.loads(body(weed, f"{PREFIX}/sessions/host-a/{session.name}/manifest.json"))
    listed = {r["build_id"]: r for r in manifest["build_ids"]}
    assert listed[b["private"]]["reason"] == "private" and listed[b["full"]]["provenance"] == "trusted"
    assert len(manifest["segments"]) == len(local)
    for name in local:
        assert body(weed, f"{PREFIX}/sessions/host-a/{session.name}/{name}") == (session / name).read_bytes()
    status = json.loads((Path(host_a.cfg.push_state_dir) / "status.json").read_text())
    assert status["backlog"]["entries"] == 0 and status["backlog"]["segments"] == 0
    assert status["totals"]["uploaded"] == 4 and status["oldest_unpushed_age_s"] is None


def test_debuginfod_find_reads_the_bucket(host_a, weed, tmp_path):
    assert not host_a.pusher().run_pass().failed
    env = {**os.environ, "DEBUGINFOD_URLS": f"{weed.endpoint}/fleet-test/{PREFIX}",
           "DEBUGINFOD_CACHE_PATH": str(tmp_path / "client-cache"), "DEBUGINFOD_TIMEOUT": "10"}
    for label, kind, want in (("full", "executable", host_a.files["full"]),
                              ("split", "executable", host_a.files["split"]),
                              ("split", "debuginfo", host_a.base / "usr-lib-debug" / ".build-id" /
                               host_a.bids["split"][1][:2] / (host_a.bids["split"][1][2:] + ".debug"))):
        r = subprocess.run(["debuginfod-find", kind, host_a.bids[label][1]], env=env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, (label, kind, r.stderr)
        assert Path(r.stdout.strip()).read_bytes() == want.read_bytes(), (label, kind)
    r = subprocess.run(["debuginfod-find", "executable", host_a.bids["private"][1]], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0


def test_second_push_uploads_nothing_and_a_second_host_checks_each_build_id_once(host_a, weed, tmp_path):
    first = host_a.pusher()
    assert not first.run_pass().failed
    first.close()
    again = host_a.pusher()                              # a new process: the ledger, not memory, remembers
    ops = count_requests(again)
    report = again.run_pass()
    assert not report.failed and report.counts["sent_bytes"] == 0 and report.counts["objects"] == 0
    assert ops == {}, ops                                # not even an existence check
    # host B runs the same trusted programs: one HEAD per build-id, no upload of them
    hb = Host(tmp_path / "b", "host-b", weed.endpoint)
    for label in ("full", "split", "stripped"):
        hb.add(label, host_a.files[label])
    b = hb.pusher()
    ops = count_requests(b)
    report = b.run_pass()
    assert not report.failed and report.counts["present"] == 3 and report.counts["uploaded"] == 0
    assert ops.get("HeadObject") == 3 and "PutObject" not in ops and "CreateMultipartUpload" not in ops, ops
    assert b.run_pass().counts["present"] == 0 and ops.get("HeadObject") == 3


def test_a_forged_file_under_a_trusted_build_id_is_kept_aside(host_a, weed, tmp_path, public_tmp_factory):
    assert not host_a.pusher().run_pass().failed
    victim = host_a.bids["full"][1]
    canonical = f"{PREFIX}/buildid/{victim}/executable"
    original = body(weed, canonical)
    # host C: a root-owned file under /usr/lib (so the store trusts it) that claims the same build-id
    forge_dir = system_dir()
    try:
        forged = build(forge_dir, "forged", f"-Wl,--build-id=0x{victim}")
        hc = Host(tmp_path / "c", "host-c", weed.endpoint)
        hc.add("forged", forged)
        forged_sha = sha(forged.read_bytes())
        report = hc.pusher().run_pass()
    finally:
        remove(forge_dir)
    assert not report.failed and report.counts["conflicts_kept_aside"] == 1
    assert body(weed, canonical) == original and body(weed, f"{PREFIX}/buildid/{victim}/debuginfo") == original
    aside = [k for k in keys(weed, f"{PREFIX}/conflicts/{victim}/")]
    assert aside == [f"{PREFIX}/conflicts/{victim}/{forged_sha}/executable"]
    # an untrusted forgery of it (host D) goes to its own tree only
    hd = Host(tmp_path / "d", "host-d", weed.endpoint)
    untrusted = build(public_tmp_factory(), "forged2", f"-Wl,--build-id=0x{victim}")
    hd.add("forged2", untrusted)
    assert hd.store.provenance(victim) == "untrusted"
    assert not hd.pusher().run_pass().failed
    assert body(weed, canonical) == original
    assert body(weed, f"{PREFIX}/hosts/host-d/buildid/{victim}/executable") == untrusted.read_bytes()


def test_server_stopped_mid_push_loses_nothing(tmp_path, weed, sysdir):
    """Large binaries (multipart, in 5 MiB parts) pushed at a limited rate; the server stops mid-way: the
    pass ends (unreachable), nothing unfinished is marked pushed; after a restart the next pass completes
    and every object is whole."""
    h = Host(tmp_path / "big", "host-big", weed.endpoint, push_rate_bytes_per_s=12 << 20, push_concurrency=2,
             push_timeout_s=2.0)
    files = [build(sysdir, f"big{i}", pad_bytes=(7 + i) << 20) for i in range(4)]
    for i, f in enumerate(files):
        h.add(f"big{i}", f)
    h.session()
    pusher = h.pusher()
    done = {}
    t = threading.Thread(target=lambda: done.setdefault("report", pusher.run_pass()))
    t.start()
    time.sleep(1.5)
    weed.stop()
    t.join(timeout=120)
    assert not t.is_alive()
    report = done["report"]
    assert report.failed and report.counts["errors_unreachable"] + report.counts["errors_timeout"] >= 1
    assert report.backlog["entries"] >= 1 and report.oldest_unpushed_ns is not None
    status = json.loads((Path(h.cfg.push_state_dir) / "status.json").read_text())
    assert status["backlog"]["entries"] >= 1 and status["oldest_unpushed_age_s"] >= 0
    weed.start()
    report = h.pusher().run_pass()
    assert not report.failed, report.error
    # a multipart upload the stop left (when it fell inside one) is aborted, not leaked: asserted below
    assert report.backlog == {"entries": 0, "entry_bytes": 0, "segments": 0, "segment_bytes": 0, "sessions": 0}
    for label, (path, bid) in h.bids.items():
        data = body(weed, f"{PREFIX}/buildid/{bid}/executable")
        assert data == Path(path).read_bytes(), label
    assert not s3(weed).list_multipart_uploads(Bucket="fleet-test").get("Uploads")


def test_backoff_grows_with_jitter_to_its_ceiling():
    import random
    rng = random.Random(7)
    assert all(0.5 <= backoff_s(1, 300, rng) <= 1.0 for _ in range(50))
    assert all(4.0 <= backoff_s(4, 300, rng) <= 8.0 for _ in range(50))
    values = {round(backoff_s(30, 300, rng), 3) for _ in range(50)}
    assert all(150 <= v <= 300 for v in values) and len(values) > 10


def test_refused_credentials_end_the_pass_and_are_counted(host_a, weed, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "not-a-key-of-this-bucket")
    report = host_a.pusher().run_pass()
    # a refused key: InvalidAccessKeyId on a PUT; a HEAD's 403 has no body to say why (counted "denied")
    assert report.failed and report.counts["errors_credentials"] + report.counts["errors_denied"] >= 1
    assert report.counts["uploaded"] == 0
    assert report.backlog["entries"] == 4 and keys(weed) == {}
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "buildidd-test")
    report = host_a.pusher().run_pass()
    assert not report.failed and report.counts["uploaded"] == 4 and report.backlog["entries"] == 0


def test_service_pushes_then_stops_on_sigterm_within_its_budget(host_a, weed, tmp_path):
    """`buildidd push --service` (what buildidd-push.service runs): pushes, then SIGTERM ends it with status 0
    and a status that says it stopped and what was left."""
    import signal
    import sys
    cfg = host_a.cfg
    conf = tmp_path / "push.toml"
    conf.write_text("\n".join(f'{k} = "{getattr(cfg, k)}"' for k in (
        "store_root", "session_root", "push_bucket", "push_endpoint_url", "push_prefix", "push_host",
        "push_state_dir")) + '\npush_interval_s = "1s"\npush_stop_budget_s = "5s"\n')
    proc = subprocess.Popen([sys.executable, "-m", "buildidd.cli", "push", "--service", "--config", str(conf)],
                            stderr=subprocess.PIPE, text=True)
    status_path = Path(cfg.push_state_dir) / "status.json"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if status_path.exists() and json.loads(status_path.read_text()).get("totals", {}).get("uploaded") == 4:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    assert proc.wait(timeout=30) == 0, proc.stderr.read()
    assert time.monotonic() - t0 < 10
    status = json.loads(status_path.read_text())
    assert status["totals"]["uploaded"] == 4 and status["service"]["stopped"] is True
    assert status["service"]["left"]["entries"] == 0
    r = subprocess.run([sys.executable, "-m", "buildidd.cli", "push", "--status", "--config", str(conf)],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "backlog: 0 binaries" in r.stdout, r.stdout + r.stderr


def test_buildidd_status_reads_the_push_status_without_importing_an_s3_client(tmp_path):
    """`buildidd status` shows the push line from status.json (fleet.status): boto3 is the push's, not status's."""
    import sys
    from buildidd.fleet.status import write_status
    write_status(tmp_path, {"backlog": {"entries": 2}, "totals": {"errors_network": 1}})
    code = ("import sys; from buildidd.cli.ctl import _push_status, push_line; "
            f"print(push_line(_push_status({str(tmp_path)!r}))); print('boto3' in sys.modules, 'botocore' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    line, imported = r.stdout.splitlines()
    assert line.startswith("push      backlog 2 binaries") and "network 1" in line, line
    assert imported == "False False"

"""The fleet's read side against a real S3 server: a gone host's session and binaries pulled for the analyst.

Host A pushes its store and a closed session, then disappears (its store, sessions and
push state deleted).  ``buildidd fleet sessions`` lists it from the bucket, ``buildidd
fleet pull`` installs it into a fresh session root and analyst's store, and ``buildidd
which`` / the Store API find the binaries offline.  A forged object in A's own tree is
refused by its build-id check, and nothing is installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import boto3

from buildidd.store import Store
from fleet.test_push import PREFIX, host_a, sysdir  # noqa: F401  (fixtures)
from fleet.world import build, remove

BUILDIDD = str(Path(sys.executable).parent / "buildidd")
SESSION = "20261122T000000Z-4242"


def empty_config() -> str:
    """An empty config file (the analyst's machine: no buildidd configuration of its own)."""
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"buildidd-fleet-empty-{os.getpid()}.toml"
    path.write_text("")
    return str(path)


def cli(weed, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([BUILDIDD, *argv[:2], "--bucket", "fleet-test", "--endpoint-url", weed.endpoint,
                           "--prefix", PREFIX, "--config", empty_config(), *argv[2:]],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ))


def push_and_forget(host) -> dict[str, str]:
    report = host.pusher().run_pass()
    assert not report.failed, report.error
    bids = {label: bid for label, (_path, bid) in host.bids.items()}
    remove(Path(host.cfg.store_root), Path(host.cfg.session_root), Path(host.cfg.push_state_dir))
    return bids


def test_a_gone_hosts_session_is_pulled_with_its_binaries(host_a, weed, tmp_path):
    bids = push_and_forget(host_a)
    listed = cli(weed, "fleet", "sessions", "--json")
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)["sessions"] == [{"host": "host-a", "name": SESSION, "closed": True}]
    roots = ["--session-root", str(tmp_path / "analyst-sessions"), "--debug-dir", str(tmp_path / "analyst-debug")]
    r = cli(weed, "fleet", "pull", f"host-a/{SESSION}", "--json", *roots)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out["installed"]) == {bids[k] for k in ("full", "split", "stripped", "untrusted")}
    assert bids["private"] in out["missing"] and out["untrusted"] == [bids["untrusted"]]
    session = tmp_path / "analyst-sessions" / SESSION
    assert (session / ".closed").is_file() and len(list(session.glob("segment-*"))) > 2
    analyst = Store(str(tmp_path / "analyst-debug"))
    for label in ("full", "split", "stripped"):
        assert analyst.contains(bids[label]), label
    split_entry = next((tmp_path / "analyst-debug").glob(f"**/{bids['split']}/debug"))
    assert split_entry.is_file()                                  # the host's separate debuginfo came too
    marks = list((tmp_path / "analyst-debug").glob(f"**/{bids['untrusted']}/provenance"))
    assert [m.read_text() for m in marks] == ["untrusted\n"]
    which = subprocess.run([BUILDIDD, "which", "--json", *roots, "--config", empty_config(),
                            str(host_a.files["full"])], capture_output=True, text=True, timeout=60)
    assert which.returncode == 0, which.stderr
    found = json.loads(which.stdout)["results"]
    assert [(w["buildid"], w["host"], w["held"]) for w in found] == [(bids["full"], "host-a", True)]
    again = cli(weed, "fleet", "pull", f"host-a/{SESSION}", "--json", *roots)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["installed"] == []            # all present: nothing twice


def test_a_forged_object_in_the_bucket_is_refused_and_nothing_installed(host_a, weed, tmp_path,
                                                                          public_tmp_factory):
    bids = push_and_forget(host_a)
    forged = build(public_tmp_factory(), "forged")
    key = f"{PREFIX}/hosts/host-a/buildid/{bids['untrusted']}/executable"
    s3 = boto3.client("s3", endpoint_url=weed.endpoint, region_name="us-east-1")
    s3.put_object(Bucket="fleet-test", Key=key, Body=forged.read_bytes())
    roots = ["--session-root", str(tmp_path / "s"), "--debug-dir", str(tmp_path / "d")]
    r = cli(weed, "fleet", "pull", f"host-a/{SESSION}", *roots)
    assert r.returncode != 0 and "build_id" in r.stderr.lower().replace("-", "_"), r.stderr
    assert not (tmp_path / "s" / SESSION).exists()
    assert not any((tmp_path / "d").rglob("elf")) if (tmp_path / "d").exists() else True
    bad = cli(weed, "fleet", "pull", "../x/y", *roots)
    assert bad.returncode != 0

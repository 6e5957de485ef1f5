"""The fleet's read side against a real S3 server: a gone host's session and binaries pulled for the analyst.

Host A pushes its store and a closed session, then disappears (its store, sessions and
push state deleted).  ``buildidd fleet sessions`` lists it from the bucket, ``buildidd
fleet pull`` installs it into a fresh session root and analyst's store, and ``buildidd
which`` / the Store API find the binaries offline.  A forged object in A's own tree is
refused by its build-id check, and nothing is installed.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
from pathlib import Path

import boto3

from buildidd.store import Store
from conftest import as_user
from fleet.test_push import PREFIX, host_a, sysdir  # noqa: F401  (fixtures)
from fleet.world import build, remove

BUILDIDD = str(Path(sys.executable).parent / "buildidd")
SESSION = "20261122T000000Z-4242"


def empty_config() -> str:
    """An empty config file (the analyst's machine: no buildidd configuration of its own)."""
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"buildidd-fleet-empty-{os.getpid()}.toml"
    if not path.exists():
        path.write_text("")
        path.chmod(0o644)
        atexit.register(path.unlink, missing_ok=True)
    return str(path)


def cli(weed, *argv: str, user=None) -> subprocess.CompletedProcess:
    """buildidd VERB SUBVERB with the bucket's options and an empty config: as root, or as user (as_user)."""
    args = [*argv[:2], "--bucket", "fleet-test", "--endpoint-url", weed.endpoint, "--prefix", PREFIX,
            "--config", empty_config(), *argv[2:]]
    if user is not None:
        return as_user(user, [sys.executable, "-m", "buildidd.cli", *args], timeout=120)
    return subprocess.run([BUILDIDD, *args], capture_output=True, text=True, timeout=120)


def push_and_forget(host) -> dict[str, str]:
    report = host.pusher().run_pass()
    assert not report.failed, report.error
    bids = {label: bid for label, (_path, bid) in host.bids.items()}
    remove(Path(host.cfg.store_root), Path(host.cfg.session_root), Path(host.cfg.push_state_dir))
    return bids


def test_a_gone_hosts_session_is_pulled_with_its_binaries(host_a, weed, attacker, public_tmp_factory):
    """An unprivileged analyst (the test's unprivileged user) pulls host A's session after A is gone."""
    bids = push_and_forget(host_a)
    home = public_tmp_factory()
    os.chown(home, attacker[0], attacker[1])
    listed = cli(weed, "fleet", "sessions", "--json", user=attacker)
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)["sessions"] == [{"host": "host-a", "name": SESSION, "closed": True}]
    roots = ["--session-root", str(home / "analyst-sessions"), "--debug-dir", str(home / "analyst-debug")]
    r = cli(weed, "fleet", "pull", f"host-a/{SESSION}", "--json", *roots, user=attacker)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out["installed"]) == {bids[k] for k in ("full", "split", "stripped", "untrusted")}
    assert bids["private"] in out["missing"] and out["untrusted"] == [bids["untrusted"]]
    session = home / "analyst-sessions" / SESSION
    assert (session / ".closed").is_file() and len(list(session.glob("segment-*"))) > 2
    assert os.stat(session / ".closed").st_uid == attacker[0]
    analyst = Store(str(home / "analyst-debug"))
    for label in ("full", "split", "stripped"):
        assert analyst.contains(bids[label]), label
    split_entry = next((home / "analyst-debug").glob(f"**/{bids['split']}/debug"))
    assert split_entry.is_file()                                  # the host's separate debuginfo came too
    marks = list((home / "analyst-debug").glob(f"**/{bids['untrusted']}/provenance"))
    assert [m.read_text() for m in marks] == ["untrusted\n"]
    which = as_user(attacker, [sys.executable, "-m", "buildidd.cli", "which", "--json", *roots, "--config",
                               empty_config(), str(host_a.files["full"])], timeout=60)
    assert which.returncode == 0, which.stderr
    found = json.loads(which.stdout)["results"]
    assert [(w["buildid"], w["host"], w["held"]) for w in found] == [(bids["full"], "host-a", True)]
    again = cli(weed, "fleet", "pull", f"host-a/{SESSION}", "--json", *roots, user=attacker)
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
    assert not list((tmp_path / "d").rglob("elf"))                # rglob of an absent directory: nothing
    bad = cli(weed, "fleet", "pull", "../x/y", *roots)              # a host name that would leave the prefix
    assert bad.returncode != 0 and "host name '..'" in bad.stderr and "internal error" not in bad.stderr

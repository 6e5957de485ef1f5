"""Every mapped file, whatever its key: a real ``buildidd run`` keeps binaries without a GNU build-id
under their htlhash, puts the htlhash on every mapping record, and ``buildidd serve`` gives each
mapping's bytes out (urllib, and the real elfutils debuginfod-find).

The programs: a root-owned one linked with ``-Wl,--build-id=none``, one with a GNU build-id (the kernel
reads it at the mapping: its htlhash comes from the hand-over, as a ``file_id`` record), and a real
unprivileged user's (conftest ``attacker``) two build-id-less programs, one public, one in a 0700
directory: the user's copies are untrusted, the private one stays private (403 unless shared).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from buildidd.offline.resolutions import LateResolutions
from buildidd.store import Store
from conftest import ServeProcess, as_user, gcc

from integration.test_keep_binaries import daemon  # noqa: F401  (the fixture)

SRC = '#include <stdio.h>\n#include <unistd.h>\nint main(void) { usleep(200000); puts("%s"); return 0; }\n'


def htlhash(path: Path) -> str:
    data = path.read_bytes()
    h = hashlib.sha256(data[:4096])
    h.update(data[-4096:])
    h.update(len(data).to_bytes(8, "big"))
    return h.hexdigest()[:32]


def _fetch(url: str, token: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""


def _mapping_keys(session_dir: Path) -> list[dict]:
    """The session's mmap and exec records, completed by the offline reader (late answers, file_id records)."""
    from buildidd.sessionlog import read_session
    late = LateResolutions.scan(session_dir)
    return [late.complete(r) for r in read_session(session_dir) if r.get("type") in ("mmap", "exec")]


@pytest.fixture
def recorded(daemon, attacker, public_tmp_factory, tmp_path):  # noqa: F811
    uid, gid, _ = attacker
    work = public_tmp_factory("buildidd-htlhash-")
    bins = {"nobid": gcc(SRC % "root, no build-id", work / "nobid", "-Wl,--build-id=none"),
            "withbid": gcc(SRC % "root, a build-id", work / "withbid", "-Wl,--build-id=sha1")}
    user = work / "user"
    user.mkdir()
    private = user / "private"
    private.mkdir(mode=0o700)
    bins["user"] = gcc(SRC % "user, no build-id", user / "prog", "-Wl,--build-id=none")
    bins["private"] = gcc(SRC % "private, no build-id", private / "prog", "-Wl,--build-id=none", "-DPRIV=1")
    for p in (user, private, bins["user"], bins["private"]):
        os.chown(p, uid, gid)
    store_root = tmp_path / "store"
    d = daemon(store_root)
    for name in ("nobid", "withbid"):
        subprocess.run([str(bins[name])], check=True, capture_output=True, timeout=30)
    r = as_user(attacker, ["sh", "-c", f"{bins['user']} && {bins['private']}"], timeout=30)
    assert r.returncode == 0, r.stderr
    records = d.stop()
    return {"bins": bins, "store_root": store_root, "session": d.session_dir, "records": records,
            "tmp": tmp_path}


def test_files_without_a_build_id_are_stored_served_and_every_mapping_carries_its_htlhash(recorded):
    bins, session = recorded["bins"], recorded["session"]
    store = Store(recorded["store_root"])
    keys = {name: htlhash(p) for name, p in bins.items()}
    maps = _mapping_keys(session)
    for name, path in bins.items():
        mine = [r for r in maps if r.get("path") == str(path)]
        assert mine, (name, "not recorded")
        assert all(r.get("file_id") == keys[name] for r in mine), (name, mine)
        if name == "withbid":
            assert all(r["build_id"] for r in mine)
            assert any(r.get("type") == "file_id" and r.get("file_id") == keys[name] for r in recorded["records"]), \
                "the kernel-read build-id's htlhash comes as a file_id record"
        else:
            assert all(r["build_id"] is None and r["error"] == "no_build_id" for r in mine), mine
    for name in ("nobid", "user", "private"):
        assert store.key_kind(keys[name]) == "htlhash", name
        assert store.best(keys[name]).read_bytes() == bins[name].read_bytes(), name
    assert store.origin(keys["nobid"]).trusted is False          # /tmp is no system directory
    assert store.provenance(keys["user"]) == "untrusted" and not store.origin(keys["user"]).private
    assert store.origin(keys["private"]).private and store.is_private(keys["private"])
    assert store.contains(next(r["build_id"] for r in maps if r.get("path") == str(bins["withbid"])))

    serve = ServeProcess(recorded["store_root"], recorded["tmp"] / "serve.log")
    try:
        for name in ("nobid", "user"):
            status, body = _fetch(f"{serve.url}/buildid/{keys[name]}/executable")
            assert status == 200 and body == bins[name].read_bytes(), name
        # private stays private: to a caller without rights, answered as an unknown build-id
        assert _fetch(f"{serve.url}/buildid/{keys['private']}/executable")[0] == 404
        env = dict(os.environ, DEBUGINFOD_URLS=serve.url, DEBUGINFOD_CACHE_PATH=str(recorded["tmp"] / "dcache"))
        r = subprocess.run(["debuginfod-find", "executable", keys["nobid"]], env=env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert Path(r.stdout.strip()).read_bytes() == bins["nobid"].read_bytes()
    finally:
        serve.stop()


def test_every_executable_mapping_of_the_session_resolves_to_stored_bytes_through_serve(recorded):
    """The issue's goal: each mmap/exec record's key (its GNU build-id, else its htlhash) is served (private
    copies shared for this count, to a token holder), its bytes those the store verified."""
    maps = _mapping_keys(recorded["session"])
    cfg = recorded["tmp"] / "share.toml"
    cfg.write_text("store_share_private = true\n")
    (recorded["tmp"] / "token").write_text("htlhash-token\n")
    serve = ServeProcess(recorded["store_root"], recorded["tmp"] / "serve-all.log", "--config", str(cfg),
                         "--token-file", str(recorded["tmp"] / "token"))
    by_key: dict[str, int] = {}
    unkeyed = []
    for r in maps:
        key = r.get("build_id") or r.get("file_id")
        if key:
            by_key[key] = by_key.get(key, 0) + 1
        else:
            unkeyed.append(r)
    try:
        status = {key: _fetch(f"{serve.url}/buildid/{key}/executable", "htlhash-token")[0] for key in by_key}
    finally:
        serve.stop()
    served = sum(n for key, n in by_key.items() if status[key] == 200)
    missing = {key: status[key] for key in by_key if status[key] != 200}
    print(f"\nmappings {len(maps)}, keyed {len(maps) - len(unkeyed)}, served {served} "
          f"({100.0 * served / len(maps):.2f}%), distinct files {len(by_key)}")
    assert not unkeyed, [(r.get("path"), r.get("error")) for r in unkeyed[:10]]
    assert not missing, missing
    assert served == len(maps)


def test_a_restart_keys_a_settled_system_binary_from_the_htlhash_its_copy_recorded(daemon, tmp_path):  # noqa: F811
    """/usr/bin/true (a trusted system binary, its build-id read by the kernel): the first session's
    hand-over copies it and records its htlhash in origin.json; after a restart the store is settled
    for it, and its mappings get that htlhash without the file being read again."""
    true = Path(os.path.realpath("/usr/bin/true"))
    store_root = tmp_path / "store"
    want = htlhash(true)
    for run in (1, 2):
        d = daemon(store_root)
        subprocess.run([str(true)], check=True, timeout=30)
        subprocess.run(["/bin/sh", "-c", f"exec {true}"], check=True, timeout=30)
        d.stop()
        mine = [r for r in _mapping_keys(d.session_dir) if r.get("path") == str(true)]
        assert mine and all(r.get("file_id") == want for r in mine), (run, mine)
        origin = Store(store_root).origin(mine[0]["build_id"])
        assert origin.trusted and origin.file_id == want and origin.key == "gnu", origin

"""The offline readers and the store's hardening: the trusted copy of a build-id is the one served, archived and
symbolized; a private copy is neither served nor archived unless ``store_share_private`` says so.

Real parts: gcc binaries, a forgery owned by a real unprivileged user (the ``attacker`` fixture) claiming the
build-id of a root-owned binary under /usr/lib, ``buildidd serve`` and ``buildidd archive`` as subprocesses.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest
import zstandard

from buildidd.offline.archive import write_archive
from buildidd.offline.symbols import Symbolizer
from buildidd.sessionlog import SessionWriter
from buildidd.store import Store
from conftest import ServeProcess, gcc, readelf_build_id, store_add
from offline.promtext import value
from offline.test_serve import request

FORGED_BID = "f0e1" * 10
SRC = "int bidd_%s_fn(int x) { return x * %d; }\nint main(void) { return bidd_%s_fn(1) == 0; }\n"
SESSION_NAME = "20261123T000000Z-77"


def _exe(path: Path, name: str, *flags: str) -> Path:
    out = gcc(SRC % (name, len(name), name), path, *flags)
    os.chmod(out, 0o755)
    return out


@pytest.fixture(scope="module")
def trust_world(tmp_path_factory, public_tmp_factory, attacker):
    """A store where FORGED_BID has an attacker's copy (stored first) and a root-owned one under /usr/lib,
    plus ``public`` (a world-readable binary) and ``private`` (one in a 0700 directory); a session naming all."""
    tmp = tmp_path_factory.mktemp("trust")
    system = Path(tempfile.mkdtemp(prefix="buildidd-test-", dir="/usr/lib"))
    os.chmod(system, 0o755)
    public = public_tmp_factory("buildidd-trust-")
    try:
        forged = _exe(public / "tool", "forged", f"-Wl,--build-id=0x{FORGED_BID}")
        os.chown(forged, attacker[0], attacker[1])
        real = _exe(system / "tool", "real", f"-Wl,--build-id=0x{FORGED_BID}")
        plain = _exe(public / "plain", "plain")
        private_dir = tmp / "home"
        private_dir.mkdir(mode=0o700)
        secret = _exe(private_dir / "secret", "secret")
        store = Store(tmp / "store", debug_root=tmp / "no-debug")
        store_add(store, forged)                       # the forgery is met first
        store_add(store, real)
        bids = {"forged": FORGED_BID, "public": store_add(store, plain), "private": store_add(store, secret)}
        assert store.is_private(bids["private"]) and not store.is_private(bids["public"])
        assert store.origin(FORGED_BID).trusted
        session = tmp / "sessions" / SESSION_NAME
        w = SessionWriter(session, compress=True)
        w.write({"type": "session", "time_ns": 1, "host": "h", "boot_id": "b", "kernel_release": "6",
                 "kernel_build_id": None, "module_build_ids": {}, "boot_to_wall_offset_ns": 0})
        for i, (path, bid) in enumerate(((real, FORGED_BID), (plain, bids["public"]), (secret, bids["private"]))):
            w.write({"type": "mmap", "time_ns": 10 + i, "pid": 5, "tid": 5, "comm": "x", "start": 0x400000 + i * 0x10000,
                     "len": 4096, "pgoff": 0, "path": str(path), "build_id": bid, "error": None})
        w.write({"type": "end", "time_ns": 100})
        w.close()
        config = tmp / "share.toml"
        config.write_text("store_share_private = true\n")
        yield {"tmp": tmp, "store": store, "bids": bids, "session": session, "share_config": config,
               "files": {"forged": forged, "real": real, "public": plain, "private": secret}}
    finally:
        shutil.rmtree(system)


def _serve(world, name: str, *extra: str) -> ServeProcess:
    return ServeProcess(world["tmp"] / "store", world["tmp"] / f"{name}.log", *extra)


def test_serve_sends_the_trusted_copy_never_the_forgery(trust_world):
    serve = _serve(trust_world, "serve-trust")
    try:
        real, forged = trust_world["files"]["real"].read_bytes(), trust_world["files"]["forged"].read_bytes()
        for artifact in ("executable", "debuginfo"):
            status, _, body = request(serve.url, "GET", f"/buildid/{FORGED_BID}/{artifact}")
            assert status == 200 and body == real and body != forged, artifact
        status, _, text = request(serve.url, "GET", f"/buildid/{FORGED_BID}/section/.text")
        assert status == 200 and text in real and text not in forged
    finally:
        serve.stop()


def test_symbolizer_reads_the_trusted_copy(trust_world):
    table = Symbolizer(trust_world["store"]).table(FORGED_BID)
    assert table is not None
    assert "bidd_real_fn" in [n for n, _ in table.syms] and "bidd_forged_fn" not in [n for n, _ in table.syms]


def test_private_entry_is_403_with_its_reason_to_token_holders_logged_once_shared_only_with_them(trust_world,
                                                                                                  tmp_path):
    """A held but private entry: a token holder is told why, and which key shares it (403); the real elfutils
    0.188 client caches every failure alike (404, 403, 503, a dropped connection), so the answer is for people
    and logs.  Shared (store_share_private), it goes to a token holder, and still not to a caller without
    rights, who gets what an absent build-id gets (tests/offline/test_serve_private.py: byte for byte)."""
    private, public = trust_world["bids"]["private"], trust_world["bids"]["public"]
    token = tmp_path / "token"
    token.write_text("trust-token\n")
    auth = {"Authorization": "Bearer trust-token"}
    serve = _serve(trust_world, "serve-private", "--token-file", str(token))
    try:
        for _ in range(3):
            for artifact in ("executable", "debuginfo", "section/.text"):
                status, headers, body = request(serve.url, "GET", f"/buildid/{private}/{artifact}", auth)
                assert status == 403 and headers.get("x-buildidd-withheld") == "private", (artifact, status)
                assert b"store_share_private" in body
        assert request(serve.url, "GET", f"/buildid/{public}/executable", auth)[0] == 200
        assert request(serve.url, "GET", f"/buildid/{'ab' * 20}/executable", auth)[0] == 404     # not held at all
        headers_file = tmp_path / "headers"
        headers_file.write_text("Authorization: Bearer trust-token\n")
        env = {**os.environ, "DEBUGINFOD_URLS": serve.url, "DEBUGINFOD_CACHE_PATH": str(tmp_path / "cache"),
               "DEBUGINFOD_HEADERS_FILE": str(headers_file)}
        r = subprocess.run(["debuginfod-find", "executable", private], env=env, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode != 0 and not r.stdout.strip(), r
        _, metrics, text = request(serve.url, "GET", "/metrics", auth)
        assert value(text, "buildidd_serve_lookups_total", artifact="executable", result="withheld") == 4, text[:2000]
    finally:
        log = serve.stop()
    assert log.count(f"withheld {private} (elf): its copy is private") == 1, log
    shared = _serve(trust_world, "serve-shared", "--config", str(trust_world["share_config"]),
                    "--token-file", str(token))
    shared_open = _serve(trust_world, "serve-shared-open", "--config", str(trust_world["share_config"]))
    try:
        status, _, body = request(shared.url, "GET", f"/buildid/{private}/executable", auth)
        assert status == 200 and body == trust_world["files"]["private"].read_bytes()
        status, _, body = request(shared_open.url, "GET", f"/buildid/{private}/executable")     # loopback, no token
        assert (status, body) == (404, b"not held\n")
    finally:
        shared.stop()
        shared_open.stop()


def _archive_members(data: bytes) -> dict[str, bytes]:
    raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)).read()
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
        return {m.name: (tar.extractfile(m).read() if m.isfile() else b"") for m in tar.getmembers()}


def test_archive_holds_the_trusted_copy_and_no_private_one(trust_world):
    out = io.BytesIO()
    m = write_archive(trust_world["session"], trust_world["store"], out)
    refs = {r.build_id: r for r in m.build_ids}
    private = trust_world["bids"]["private"]
    assert refs[private].status == "missing" and refs[private].reason == "private" and refs[private].files == []
    assert refs[FORGED_BID].status == "archived" and refs[trust_world["bids"]["public"]].status == "archived"
    members = _archive_members(out.getvalue())
    elfs = {name: data for name, data in members.items() if name.endswith("/elf")}
    assert trust_world["files"]["real"].read_bytes() in elfs.values()
    assert trust_world["files"]["forged"].read_bytes() not in members.values()
    assert trust_world["files"]["private"].read_bytes() not in members.values()
    assert not any(private in name for name in members)


def test_archive_cli_shares_private_copies_when_the_config_says_so(trust_world, tmp_path):
    out = tmp_path / "a.tar.zst"
    r = subprocess.run([sys.executable, "-m", "buildidd.cli", "archive", str(trust_world["session"]), "-o", str(out),
                        "--store-root", str(trust_world["tmp"] / "store"), "--config",
                        str(trust_world["share_config"])], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    members = _archive_members(out.read_bytes())
    assert trust_world["files"]["private"].read_bytes() in members.values()
    assert trust_world["files"]["forged"].read_bytes() not in members.values()
    assert "0 missing" in r.stdout


def test_provenance_is_visible_end_to_end(trust_world, attacker, tmp_path, public_tmp_factory):
    """Attack 6: a user's file claiming /usr/bin/nl's build-id (no trusted copy ever stored) was served 200 and
    archived ``archived`` with no sign of where it came from.  Now its provenance (untrusted) is in buildid-list,
    the manifest, an X-Buildidd-Provenance header, and import marks, skips or refuses it."""
    from buildidd.errors import ArchiveError
    from buildidd.offline.importer import PROVENANCE_NAME, import_archive

    nl_bid = readelf_build_id("/usr/bin/nl")
    forged = _exe(public_tmp_factory("buildidd-prov-") / "nl", "fakenl", f"-Wl,--build-id=0x{nl_bid}")
    os.chown(forged, attacker[0], attacker[1])
    store = Store(tmp_path / "store", debug_root=tmp_path / "no-debug")
    store_add(store, forged, "/usr/bin/nl")                 # it even names the system path
    true_bid = store_add(store, Path("/usr/bin/true"))
    assert store.provenance(nl_bid) == "untrusted" and store.provenance(true_bid) == "trusted"
    assert trust_world["store"].provenance(FORGED_BID) == "conflict"
    sessions = tmp_path / "sessions"
    w = SessionWriter(sessions / SESSION_NAME, compress=True)
    w.write({"type": "session", "time_ns": 1, "host": "h", "boot_id": "b", "kernel_release": "6",
             "kernel_build_id": None, "module_build_ids": {}, "boot_to_wall_offset_ns": 0})
    for i, (path, bid) in enumerate((("/usr/bin/nl", nl_bid), ("/usr/bin/true", true_bid))):
        w.write({"type": "mmap", "time_ns": 10 + i, "pid": 5, "tid": 5, "comm": "x", "start": 0x400000,
                 "len": 4096, "pgoff": 0, "path": path, "build_id": bid, "error": None})
    w.write({"type": "end", "time_ns": 100})
    w.close()

    listed = subprocess.run([sys.executable, "-m", "buildidd.cli", "buildid-list", str(sessions / SESSION_NAME),
                             "--store-root", str(tmp_path / "store"), "--provenance"],
                            capture_output=True, text=True, timeout=60)
    assert f"{nl_bid} /usr/bin/nl untrusted" in listed.stdout and f"{true_bid} /usr/bin/true trusted" in listed.stdout

    serve = ServeProcess(tmp_path / "store", tmp_path / "serve.log")
    conflict = _serve(trust_world, "serve-provenance")
    try:
        for artifact in ("executable", "debuginfo", "section/.text"):
            status, headers, _ = request(serve.url, "GET", f"/buildid/{nl_bid}/{artifact}")
            assert status == 200 and headers["x-buildidd-provenance"] == "untrusted", artifact
        assert request(serve.url, "GET", f"/buildid/{true_bid}/executable")[1]["x-buildidd-provenance"] == "trusted"
        assert request(conflict.url, "GET", f"/buildid/{FORGED_BID}/executable")[1]["x-buildidd-provenance"] \
            == "conflict"
    finally:
        serve.stop()
        conflict.stop()

    archive = tmp_path / "a.tar.zst"
    with open(archive, "wb") as f:
        m = write_archive(sessions / SESSION_NAME, store, f)
    assert {r.build_id: r.provenance for r in m.build_ids} == {nl_bid: "untrusted", true_bid: "trusted"}
    with pytest.raises(ArchiveError) as e:
        import_archive(archive, debug_dir=tmp_path / "refused", session_root=tmp_path / "s1", untrusted="refuse")
    assert e.value.reason == "untrusted" and nl_bid in str(e.value)
    skipped = import_archive(archive, debug_dir=tmp_path / "skipped", session_root=tmp_path / "s2", untrusted="skip")
    assert skipped.untrusted == [nl_bid] and skipped.installed == [true_bid]
    assert not (tmp_path / "skipped" / ".build-id" / nl_bid[:2] / nl_bid[2:]).exists()
    marked = import_archive(archive, debug_dir=tmp_path / "marked", session_root=tmp_path / "s3")
    assert sorted(marked.installed) == sorted([nl_bid, true_bid]) and marked.untrusted == [nl_bid]
    entry = tmp_path / "marked" / ".build-id" / nl_bid[:2] / nl_bid[2:]
    assert (entry / PROVENANCE_NAME).read_text() == "untrusted\n"
    true_entry = tmp_path / "marked" / ".build-id" / true_bid[:2] / true_bid[2:]
    assert not (true_entry / PROVENANCE_NAME).exists()


def test_archive_import_and_pull_name_each_build_id_left_out_and_how_to_include_it(trust_world, tmp_path):
    """A private binary left out of an archive is named, with its path, its reason and the option that
    includes it, by archive and by import; --share-private includes it."""
    private = trust_world["bids"]["private"]
    secret = str(trust_world["files"]["private"])
    out = tmp_path / "a.tar.zst"
    base = [sys.executable, "-m", "buildidd.cli"]
    r = subprocess.run([*base, "archive", str(trust_world["session"]), "-o", str(out),
                        "--store-root", str(trust_world["tmp"] / "store")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "1 missing (1 private)" in r.stdout, r.stdout
    assert "left out, private (1): " in r.stdout and "--share-private" in r.stdout, r.stdout
    assert f"made 1 file of root private, e.g. {secret}" in r.stdout and private not in r.stdout, r.stdout
    r = subprocess.run([*base, "import", str(out), "--debug-dir", str(tmp_path / "debug"), "--list-left-out",
                        "--session-root", str(tmp_path / "sessions")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "1 missing (1 private)" in r.stdout and f"      {private}  {secret}" in r.stdout.splitlines(), r.stdout
    shared = tmp_path / "shared.tar.zst"
    r = subprocess.run([*base, "archive", str(trust_world["session"]), "-o", str(shared), "--share-private",
                        "--store-root", str(trust_world["tmp"] / "store")], capture_output=True, text=True)
    assert r.returncode == 0 and "0 missing" in r.stdout and "left out" not in r.stdout, r.stdout
    assert trust_world["files"]["private"].read_bytes() in _archive_members(shared.read_bytes()).values()


def test_each_entrys_quality_is_in_buildid_list_the_manifest_serves_headers_and_metrics(trust_world):
    """What a copy is good for (store.quality): gcc without -g leaves a symbol table (symtab)."""
    public = trust_world["bids"]["public"]
    m = write_archive(trust_world["session"], trust_world["store"], io.BytesIO())
    refs = {r.build_id: r for r in m.build_ids}
    assert refs[public].quality == "symtab" and refs[trust_world["bids"]["private"]].quality == "symtab"
    listed = subprocess.run([sys.executable, "-m", "buildidd.cli", "buildid-list", str(trust_world["session"]),
                             "--json", "--store-root", str(trust_world["tmp"] / "store")],
                            capture_output=True, text=True)
    assert listed.returncode == 0, listed.stderr
    rows = {r["build_id"]: r for r in map(json.loads, listed.stdout.splitlines()) if r["build_id"]}
    assert rows[public]["quality"] == "symtab"
    text = subprocess.run([sys.executable, "-m", "buildidd.cli", "buildid-list", str(trust_world["session"]),
                           "--quality", "--store-root", str(trust_world["tmp"] / "store")],
                          capture_output=True, text=True)
    assert f"{public} {trust_world['files']['public']} symtab" in text.stdout.splitlines(), text.stdout
    public_metrics = trust_world["tmp"] / "public-metrics.toml"
    public_metrics.write_text("serve_metrics_public = true\n")
    serve = _serve(trust_world, "serve-quality", "--config", str(public_metrics))
    try:
        status, headers, _ = request(serve.url, "GET", f"/buildid/{public}/executable")
        assert status == 200 and headers["x-buildidd-quality"] == "symtab"
        _, _, metrics = request(serve.url, "GET", "/metrics")
        assert value(metrics, "buildidd_serve_served_by_quality_total", artifact="executable", quality="symtab") == 1
    finally:
        serve.stop()

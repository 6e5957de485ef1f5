"""Offline, files without a GNU build-id: the readers give every mapping of a file identity its htlhash
(``file_id`` records), retention protects htlhash entries, an archive carries them (manifest ``key``)
and import installs them checked by their htlhash; the real elfutils debuginfod federates ``buildidd
serve`` for them."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
import zstandard

from buildidd.errors import ArchiveError
from buildidd.offline.archive import write_archive
from buildidd.offline.importer import import_archive
from buildidd.offline.resolutions import LateResolutions
from buildidd.offline.sessions import session_facts
from buildidd.resolve.fileid import file_id
from buildidd.sessionlog import SessionWriter, session_build_ids
from buildidd.store import Store
from conftest import ServeProcess, gcc, readelf_build_id, store_add

SRC = '#include <stdio.h>\nint main(void) { puts("%s"); return 0; }\n'
IDENT = {"dev": 2049, "ino": 77, "ino_generation": 0, "size": 1234, "mtime_ns": 5}


def _fid(path: Path) -> str:
    from store.test_htlhash import fid_of
    return fid_of(path)


def _mmap(t: int, path: str, ident: dict, build_id: str | None, **extra) -> dict:
    return {"type": "mmap", "time_ns": t, "pid": 10, "tid": 10, "comm": "x", "start": 0x400000, "len": 4096,
            "pgoff": 0, "path": path, **ident, "build_id": build_id,
            "build_id_source": "kernel" if build_id else "path", "error": None if build_id else "no_build_id",
            **extra}


@pytest.fixture(scope="module")
def world(tmp_path_factory, public_tmp_factory):
    tmp = tmp_path_factory.mktemp("htlhash-offline")
    bins = public_tmp_factory("buildidd-htlhash-bins-")
    nobid = gcc(SRC % "no build-id", bins / "nobid", "-Wl,--build-id=none")
    withbid = gcc(SRC % "a build-id", bins / "withbid", "-Wl,--build-id=sha1")
    store = Store(tmp / "store")
    key = _fid(nobid)
    fd = os.open(nobid, os.O_RDONLY)
    try:
        store.add_from_fd(fd, str(nobid), key, key="htlhash")
    finally:
        os.close(fd)
    bid = store_add(store, withbid)
    other = dict(IDENT, ino=78)
    session = tmp / "sessions" / "20261126T000000Z-1"
    w = SessionWriter(session, compress=False)
    w.write({"type": "session", "time_ns": 1, "host": "h", "boot_id": "b", "boot_to_wall_offset_ns": 0})
    w.write(_mmap(2, str(withbid), IDENT, bid))                                  # before its file_id record
    w.write(_mmap(3, str(nobid), other, None, file_id=key))                      # read in user space: keyed
    w.write({"type": "file_id", "time_ns": 4, **IDENT, "build_id": bid, "file_id": _fid(withbid)})
    w.write(_mmap(5, str(withbid), IDENT, bid))                                  # after it
    w.write(_mmap(6, "/other", dict(IDENT, ino=79), bid))                        # another identity
    w.write({"type": "end", "time_ns": 7})
    w.close()
    return {"tmp": tmp, "store": store, "session": session, "key": key, "bid": bid, "nobid": nobid,
            "withbid": withbid}


def test_readers_give_each_mapping_of_an_identity_its_file_id(world):
    from buildidd.sessionlog import read_session
    late = LateResolutions.scan(world["session"])
    maps = [late.complete(r) for r in read_session(world["session"]) if r["type"] == "mmap"]
    assert [m.get("file_id") for m in maps] == [_fid(world["withbid"]), world["key"], _fid(world["withbid"]), None]
    assert late.keyed == 2 and late.completed == 0
    # a record whose build-id differs from the file_id record's is not given its htlhash
    assert "file_id" not in late.complete(_mmap(9, "/x", IDENT, "ab" * 20))


def test_retention_and_the_manifest_name_the_htlhash_entry(world):
    assert {world["key"], world["bid"]} <= session_build_ids(world["session"])
    uses = session_facts(world["session"]).uses
    assert uses[world["key"]].paths == [str(world["nobid"])]


def test_archive_carries_the_htlhash_entry_and_import_installs_it_checked(world, tmp_path):
    out = io.BytesIO()
    manifest = write_archive(world["session"], world["store"], out)
    refs = {r.build_id: r for r in manifest.build_ids}
    assert refs[world["key"]].key == "htlhash" and refs[world["key"]].status == "archived"
    assert refs[world["bid"]].key == "gnu"
    archive = tmp_path / "a.tar.zst"
    archive.write_bytes(out.getvalue())
    r = import_archive(archive, debug_dir=tmp_path / "t" / "debug", session_root=tmp_path / "t" / "sessions")
    key = world["key"]
    assert key in r.installed
    link = tmp_path / "t" / "debug" / ".build-id" / key[:2] / key[2:]
    assert (link / "elf").read_bytes() == world["nobid"].read_bytes()
    assert not os.path.lexists(str(link) + ".debug")          # gdb's rest.debug names GNU build-ids only
    # a manifest that files the htlhash entry as a GNU build-id (or the reverse) is refused, nothing written
    raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(out.getvalue()), read_across_frames=True).read()
    with tarfile.open(fileobj=io.BytesIO(raw)) as tf:
        members = [(ti, tf.extractfile(ti).read() if ti.isreg() else None) for ti in tf]
    for target, key_kind, reason in ((key, "gnu", "build_id_mismatch"), (world["bid"], "htlhash", "bad_manifest")):
        m = json.loads(members[0][1])
        for ref in m["build_ids"]:
            if ref["build_id"] == target:
                ref["key"] = key_kind
        body = json.dumps(m).encode()
        ti = tarfile.TarInfo("manifest.json")
        ti.size, ti.mode = len(body), 0o644
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
            tf.addfile(ti, io.BytesIO(body))
            for mti, mbody in members[1:]:
                tf.addfile(mti, io.BytesIO(mbody) if mbody is not None else None)
        bad = tmp_path / f"bad-{key_kind}.tar.zst"
        bad.write_bytes(zstandard.ZstdCompressor().compress(buf.getvalue()))
        with pytest.raises(ArchiveError) as e:
            import_archive(bad, debug_dir=tmp_path / key_kind / "debug", session_root=tmp_path / key_kind / "s")
        assert e.value.reason == reason, e.value
        assert not (tmp_path / key_kind / "debug" / ".build-id").exists()


@pytest.mark.skipif(shutil.which("debuginfod") is None or shutil.which("debuginfod-find") is None,
                    reason="elfutils debuginfod not installed")
def test_debuginfod_find_fetches_by_htlhash_from_serve_and_through_a_federating_debuginfod(world, tmp_path):
    """debuginfod-find (elfutils 0.188) takes any even-length hex id: a 32-hex htlhash is asked for as is."""
    from conftest import free_port
    from integration.test_federation import wait_listening
    serve = ServeProcess(world["store"].root, tmp_path / "serve.log")
    port = free_port()
    log = tmp_path / "debuginfod.log"
    env = dict(os.environ, DEBUGINFOD_URLS=serve.url, DEBUGINFOD_CACHE_PATH=str(tmp_path / "fed-cache"))
    with open(log, "w") as f:
        fed = subprocess.Popen(["debuginfod", "-p", str(port), "-d", str(tmp_path / "fed.db")], stdout=f,
                               stderr=subprocess.STDOUT, env=env)
    try:
        wait_listening(port, fed, log)
        for url in (serve.url, f"http://127.0.0.1:{port}"):
            cenv = dict(os.environ, DEBUGINFOD_URLS=url, DEBUGINFOD_CACHE_PATH=str(tmp_path / f"c{len(url)}"))
            r = subprocess.run(["debuginfod-find", "executable", world["key"]], env=cenv, capture_output=True,
                               text=True, timeout=120)
            assert r.returncode == 0, (url, r.stderr)
            assert Path(r.stdout.strip()).read_bytes() == world["nobid"].read_bytes(), url
            r = subprocess.run(["debuginfod-find", "executable", "cd" * 16], env=cenv, capture_output=True,
                               text=True, timeout=120)
            assert r.returncode != 0 and r.stdout == ""
    finally:
        fed.kill()
        fed.wait()
        serve.stop()
    assert readelf_build_id(world["nobid"]) is None


def test_serve_finds_a_go_binary_by_its_go_build_id(tmp_path, public_tmp_factory):
    from store.test_htlhash import go_build
    from buildidd.resolve.fileid import read_go_build_id
    import urllib.error
    import urllib.request
    go = go_build(public_tmp_factory("buildidd-go-"), "gobin")
    store = Store(tmp_path / "store")
    fd = os.open(go, os.O_RDONLY)
    try:
        go_id, key = read_go_build_id(fd), file_id(fd)
        store.add_from_fd(fd, str(go), key, key="htlhash")
    finally:
        os.close(fd)
    assert readelf_build_id(go) is None and go_id.count("/") >= 1
    serve = ServeProcess(store.root, tmp_path / "serve.log")
    try:
        with urllib.request.urlopen(f"{serve.url}/go-buildid/{go_id}/executable", timeout=30) as r:
            assert r.read() == go.read_bytes()
        with urllib.request.urlopen(f"{serve.url}/buildid/{key}/executable", timeout=30) as r:
            assert r.read() == go.read_bytes() and r.headers["X-Buildidd-Key"] == "htlhash"
            assert r.headers["X-Buildidd-Quality"] == store.quality(key) == "dwarf"   # go build keeps DWARF
        for bad, code in ((go_id[:-1] + ("A" if go_id[-1] != "A" else "B"), 404), ("a..b/c", 400)):
            try:
                urllib.request.urlopen(f"{serve.url}/go-buildid/{bad}/executable", timeout=30)
                raise AssertionError(f"{bad} answered")
            except urllib.error.HTTPError as e:
                assert e.code == code, (bad, e.code)
    finally:
        serve.stop()


def test_buildid_list_json_gives_each_dso_its_htlhash_and_the_stored_facts(world):
    import sys
    r = subprocess.run([sys.executable, "-m", "buildidd.cli", "buildid-list", str(world["session"]), "--json",
                        "--store-root", str(world["store"].root), "--session-root", str(world["session"].parent)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rows = {row["path"]: row for row in map(json.loads, r.stdout.splitlines())}
    nobid, withbid = rows[str(world["nobid"])], rows[str(world["withbid"])]
    assert nobid["build_id"] is None and nobid["file_id"] == world["key"] and nobid["provenance"] == "untrusted"
    assert withbid["build_id"] == world["bid"] and withbid["file_id"] == _fid(world["withbid"])
    assert "file_id" not in rows["/other"]


def test_the_file_id_line_the_recorder_writes_is_what_the_reader_joins():
    from buildidd.kernel.events import Identity
    from buildidd.resolve.filekeys import FileKey
    from buildidd.sessionlog.records import file_id_line
    ident = Identity(dev=2049, ino=77, generation=3, size=1234, mtime_ns=5, ctime_ns=0)
    line = json.loads(file_id_line(42, FileKey(ident, "ab" * 20, "cd" * 16)))
    assert line == {"type": "file_id", "time_ns": 42, "dev": 2049, "ino": 77, "ino_generation": 3, "size": 1234,
                    "mtime_ns": 5, "build_id": "ab" * 20, "file_id": "cd" * 16}
    go = json.loads(file_id_line(43, FileKey(ident, None, "ef" * 16, 'a/b"c')))
    assert go["build_id"] is None and go["go_build_id"] == 'a/b"c'
    late = LateResolutions()
    late.add_key(line)
    rec = _mmap(1, "/x", dict(IDENT, ino_generation=3), "ab" * 20)
    assert late.complete(rec)["file_id"] == "cd" * 16
    late.add_key(dict(line, file_id="not hex"))
    assert late.dropped == 1

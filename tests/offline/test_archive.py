"""``buildidd archive`` and ``sessions``: what an archive holds, checked with tar, perf and a real upstream."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile

import pytest
import zstandard

from buildidd.offline.archive import write_archive
from buildidd.offline.manifest import Manifest
from buildidd.offline.sessions import list_sessions, session_facts
from buildidd.sessionlog import list_segments, seal_unclosed_sessions
from buildidd.store import Store
from conftest import ServeProcess, free_port, store_add
from offline.archive_world import SESSION_NAME, make_world

BUILDIDD = [sys.executable, "-m", "buildidd.cli"]


@pytest.fixture(scope="module")
def world(tmp_path_factory, public_tmp_factory):
    return make_world(tmp_path_factory.mktemp("archive"), public_tmp_factory("buildidd-archive-bins-"))


def members(data: bytes) -> list[tarfile.TarInfo]:
    raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True).read()
    with tarfile.open(fileobj=io.BytesIO(raw)) as tf:
        return [(ti, tf.extractfile(ti).read() if ti.isreg() else None) for ti in tf]


def archive_bytes(world, store="default", **kw) -> tuple[bytes, Manifest]:
    out = io.BytesIO()
    m = write_archive(world["session"], world["store"] if store == "default" else store, out, **kw)
    return out.getvalue(), m


def test_sessions_lists_host_time_range_records_build_ids_lost(world):
    (info,) = list_sessions(world["session"].parent)
    assert info.name == SESSION_NAME and info.host == "prod-1" and info.boot_id == "b00t"
    assert sum(info.records.values()) == world["records"] and info.records["mmap"] == world["records"] - 3
    assert info.first_time_ns == 1_000 and info.last_time_ns == 9_000_002
    assert info.wall_ns(1_000) == 1_700_000_000 * 10**9 + 1_000
    assert info.build_ids == 3 + (1 if world["kbid"] else 0)
    assert info.lost == 5 and info.closed
    segs = list_segments(world["session"])
    assert len(segs) > 1 and info.size_bytes == sum(s.stat().st_size for s in segs)


def test_archive_holds_manifest_first_then_segments_and_store_entries(world, tmp_path):
    data, m = archive_bytes(world)
    got = members(data)
    assert got[0][0].name == "manifest.json"
    assert json.loads(got[0][1])["format"] == "buildidd-archive"
    by_name = {ti.name: body for ti, body in got}
    for seg in list_segments(world["session"]):                 # the segments, byte for byte
        assert by_name[f"session/{SESSION_NAME}/{seg.name}"] == seg.read_bytes()
    bids = world["bids"]
    status = {r.build_id: r for r in m.build_ids}
    assert status[bids["full"]].status == "archived" and status[bids["split"]].status == "archived"
    assert status[bids["full"]].paths == [str(world["files"]["full"])]
    assert status[bids["gone"]].status == "missing" and status[bids["gone"]].reason == "not_in_store"
    split_entry = status[bids["split"]].entry
    assert by_name[f"cache/{split_entry}/debug"] == world["debug"].read_bytes()
    assert by_name[f"cache/{split_entry}/elf"] == world["files"]["split"].read_bytes()
    if world["kbid"]:
        k = status[world["kbid"]]
        assert k.kind == "kernel" and {f.name for f in k.files} >= {"kallsyms"}
    assert {"path": "/memfd:jit", "error": "not_elf", "records": 1} in m.unresolved
    # The real tar and perf read it: extracted, cache/ is a build-id cache perf lists.
    path = tmp_path / "a.tar.zst"
    path.write_bytes(data)
    listing = subprocess.run(["tar", "--zstd", "-tf", str(path)], capture_output=True, text=True, check=True).stdout
    assert listing.splitlines()[0] == "manifest.json"
    subprocess.run(["tar", "--zstd", "-xf", str(path), "-C", str(tmp_path)], check=True)
    if shutil.which("perf"):
        out = subprocess.run(["perf", "--buildid-dir", str(tmp_path / "cache"), "buildid-cache", "-l"],
                             capture_output=True, text=True).stdout
        assert bids["full"] in out and bids["split"] in out and bids["gone"] not in out


def test_without_a_store_everything_is_missing_with_the_reason(world):
    data, m = archive_bytes(world, store=None)
    assert {r.status for r in m.build_ids} == {"missing"} and {r.reason for r in m.build_ids} == {"no_store"}
    assert not [ti for ti, _ in members(data) if ti.name.startswith("cache/")]


def test_session_facts_keep_paths_per_build_id(world):
    facts = session_facts(world["session"])
    assert facts.uses[world["bids"]["split"]].paths == [str(world["files"]["split"])]
    assert facts.uses[world["bids"]["split"]].records == sum(1 for i in range(world["records"] - 4) if i % 3 == 1)


def test_exclude_upstream_leaves_out_what_a_buildidd_serve_serves(world, tmp_path):
    upstream_store = Store(tmp_path / "upstream")
    store_add(upstream_store, world["files"]["full"])
    serve = ServeProcess(tmp_path / "upstream", tmp_path / "serve.log")
    try:
        data, m = archive_bytes(world, exclude_upstream=serve.url)
    finally:
        serve.stop()
    status = {r.build_id: r for r in m.build_ids}
    assert status[world["bids"]["full"]].status == "upstream"
    assert status[world["bids"]["split"]].status == "archived"
    assert m.upstream["reachable"] and m.upstream["excluded"] == 1
    names = [ti.name for ti, _ in members(data)]
    assert not any(world["bids"]["full"] in n for n in names)      # neither the elf nor its link
    assert any(world["bids"]["split"] in n for n in names)


@pytest.mark.skipif(shutil.which("debuginfod") is None, reason="elfutils debuginfod not installed")
def test_exclude_upstream_through_elfutils_debuginfod_which_answers_head_with_400(world, tmp_path):
    """The real elfutils debuginfod (0.188 answers HEAD with 400) federating a buildidd serve."""
    upstream_store = Store(tmp_path / "upstream")
    store_add(upstream_store, world["files"]["full"])
    serve = ServeProcess(tmp_path / "upstream", tmp_path / "serve.log")
    port = free_port()
    env = dict(os.environ, DEBUGINFOD_URLS=serve.url, DEBUGINFOD_CACHE_PATH=str(tmp_path / "fed-cache"))
    with open(tmp_path / "debuginfod.log", "w") as log:
        fed = subprocess.Popen(["debuginfod", "-p", str(port), "-d", str(tmp_path / "fed.sqlite")], env=env,
                               stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        import http.client
        import time
        deadline = time.monotonic() + 30
        while True:                                             # wait until it listens
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("HEAD", f"/buildid/{world['bids']['full']}/executable")
                head_status = conn.getresponse().status
                conn.close()
                break
            except OSError:
                assert time.monotonic() < deadline, (tmp_path / "debuginfod.log").read_text()
                time.sleep(0.2)
        data, m = archive_bytes(world, exclude_upstream=url)
    finally:
        fed.terminate()
        fed.wait(timeout=30)
        serve.stop()
    status = {r.build_id: r.status for r in m.build_ids}
    assert status[world["bids"]["full"]] == "upstream", (head_status, m.upstream)
    assert status[world["bids"]["split"]] == "archived"


def test_unreachable_upstream_excludes_nothing_and_says_so(world, caplog):
    url = f"http://127.0.0.1:{free_port()}"                  # nothing listens there
    with caplog.at_level(logging.WARNING):
        _data, m = archive_bytes(world, exclude_upstream=url)
    assert m.upstream["reachable"] is False and "Connection" in m.upstream["error"]
    assert not [r for r in m.build_ids if r.status == "upstream"]
    assert any("unreachable" in r.getMessage() for r in caplog.records)


def test_cli_sessions_archive_import(world, tmp_path):
    root = str(world["session"].parent)
    r = subprocess.run([*BUILDIDD, "sessions", "--session-root", root, "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[0])["name"] == SESSION_NAME
    out = tmp_path / "s.tar.zst"
    r = subprocess.run([*BUILDIDD, "archive", "latest", "-o", str(out), "--session-root", root,
                        "--store-root", str(world["store"].root)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "archived" in r.stdout and out.stat().st_size > 0
    assert not [p for p in tmp_path.iterdir() if ".part-" in p.name]     # no temporary left
    r = subprocess.run([*BUILDIDD, "import", str(out), "--debug-dir", str(tmp_path / "dbg"),
                        "--session-root", str(tmp_path / "sess"), "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert set(rep["installed"]) >= {world["bids"]["full"], world["bids"]["split"]}
    assert rep["missing"] == [world["bids"]["gone"]] and rep["session_new"]
    r = subprocess.run([*BUILDIDD, "archive", "nonexistent", "-o", str(out), "--session-root", root],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "nonexistent" in r.stderr


def test_sessions_show_how_each_was_closed(world, tmp_path):
    """A session the daemon closed (end record, marker) is ``clean``; one a crash left open is ``open`` until the
    next start seals it (the real sealing), then ``sealed``; the text listing and --json both say so."""
    root = tmp_path / "sessions"
    shutil.copytree(world["session"], root / SESSION_NAME)
    crashed = root / "20261124T000000Z-99"
    crashed.mkdir()
    lines = [{"type": "session", "time_ns": 5, "host": "h"},
             {"type": "exec", "time_ns": 6, "pid": 1, "tid": 1, "comm": "x", "filename": "/bin/true"}]
    (crashed / "segment-000000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"type": "mm')

    def listed() -> dict[str, tuple]:
        r = subprocess.run([*BUILDIDD, "sessions", "--session-root", str(root), "--json"], capture_output=True,
                           text=True)
        assert r.returncode == 0, r.stderr
        text = subprocess.run([*BUILDIDD, "sessions", "--session-root", str(root)], capture_output=True,
                              text=True).stdout.splitlines()
        columns = {line.split()[0]: line.split()[-1] for line in text[1:]}
        return {j["name"]: (j["closed"], j["clean"], j["sealed"], columns[j["name"]])
                for j in map(json.loads, r.stdout.splitlines())}

    assert listed() == {SESSION_NAME: (True, True, False, "clean"), crashed.name: (False, None, False, "open")}
    (report,) = seal_unclosed_sessions(root)
    assert report.sealed
    assert listed()[crashed.name] == (True, False, True, "sealed")
    (info,) = [i for i in list_sessions(root) if i.name == crashed.name]
    assert info.closed and info.clean is False and info.sealed and info.records["end"] == 1

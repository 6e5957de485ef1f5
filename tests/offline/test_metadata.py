"""Which build-ids a path had: debuginfod's /metadata answer, from the recorded sessions (serve and CLI)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from buildidd.errors import UsageError
from buildidd.offline import metadata as md
from buildidd.sessionlog import SessionWriter
from conftest import ServeProcess
from offline.test_serve import request

TOOL = "/opt/app/tool"
#: The tool's three versions (build-ids) in the order a session met them, and a library beside it.
V1, V2, V3, LIB = "a1" * 20, "b2" * 20, "c3" * 20, "d4" * 20
OFFSET_NS = 1_764_000_000 * 10**9       # wall = boot + offset: 2025-11-24T16:00:00Z at time_ns 0


def _session(root, name: str, host: str, sightings: list[tuple[int, str, str]]) -> None:
    w = SessionWriter(root / name, compress=True)
    w.write({"type": "session", "time_ns": 1, "host": host, "boot_id": "b", "kernel_release": "6",
             "kernel_build_id": None, "module_build_ids": {}, "boot_to_wall_offset_ns": OFFSET_NS})
    for t_s, path, bid in sightings:
        w.write({"type": "mmap", "time_ns": t_s * 10**9, "pid": 5, "tid": 5, "comm": "x", "start": 0x400000,
                 "len": 4096, "pgoff": 0, "path": path, "build_id": bid, "error": None})
    w.write({"type": "mmap", "time_ns": 99 * 10**9, "pid": 5, "tid": 5, "comm": "x", "start": 0x500000,
             "len": 4096, "pgoff": 0, "path": TOOL, "build_id": None, "error": "file_replaced"})
    w.write({"type": "end", "time_ns": 100 * 10**9})
    w.close()


@pytest.fixture
def sessions(tmp_path):
    root = tmp_path / "sessions"
    # The tool changed twice during one session (v1, v2, v3), and v1 ran again the next day elsewhere.
    _session(root, "20251124T160000Z-1", "host-a", [(10, TOOL, V1), (20, TOOL, V1), (30, TOOL, V2),
                                                     (40, "/opt/app/libx.so", LIB), (50, TOOL, V3)])
    _session(root, "20251125T160000Z-2", "host-b", [(60, TOOL, V1)])
    return root


def test_a_path_that_changed_twice_has_its_three_build_ids_with_first_and_last_seen(sessions):
    answer = md.metadata(sessions, "file", TOOL, held={V2}.__contains__)
    assert set(answer) == {"results", "complete"} and answer["complete"] is True
    # One result per (build-id, path), over every session: v1's sightings on both hosts are one.
    assert sorted(r["buildid"] for r in answer["results"]) == sorted([V1, V2, V3])
    for r in answer["results"]:
        assert r["type"] == "executable" and r["file"] == TOOL        # debuginfod's field names
    v1 = next(r for r in answer["results"] if r["buildid"] == V1)
    assert v1["first_seen"] == "2025-11-24T16:00:10Z" and v1["last_seen"] == "2025-11-24T16:01:00Z"
    assert v1["host"] == "host-a"                       # where it was first seen
    assert [r["held"] for r in answer["results"] if r["buildid"] == V2] == [True]
    assert all(r["held"] is False for r in answer["results"] if r["buildid"] != V2)


def test_a_glob_crosses_slashes_and_bad_queries_are_usage_errors(sessions, monkeypatch):
    files = {r["file"] for r in md.metadata(sessions, "glob", "/opt/*")["results"]}
    assert files == {TOOL, "/opt/app/libx.so"}
    assert md.metadata(sessions, "file", "/opt/app")["results"] == []
    for key, value in (("path", TOOL), ("file", ""), ("glob", "x" * 5000)):
        with pytest.raises(UsageError):
            md.metadata(sessions, key, value)
    monkeypatch.setattr(md, "MAX_RESULTS", 2)
    cut = md.metadata(sessions, "glob", "*")
    assert len(cut["results"]) == 2 and cut["complete"] is False


def test_serve_answers_metadata_to_callers_with_rights_only(sessions, tmp_path):
    (tmp_path / "store").mkdir()
    token = tmp_path / "token"
    token.write_text("metadata-token\n")
    with_token = ServeProcess(tmp_path / "store", tmp_path / "serve-token.log", "--token-file", str(token),
                              session_root=sessions)
    open_serve = ServeProcess(tmp_path / "store", tmp_path / "serve-open.log", session_root=sessions)
    try:
        auth = {"Authorization": "Bearer metadata-token"}
        status, headers, body = request(with_token.url, "GET", f"/metadata?key=file&value={TOOL}", auth)
        assert status == 200 and headers["content-type"].startswith("application/json")
        answer = json.loads(body)
        assert answer["complete"] is True and {r["buildid"] for r in answer["results"]} == {V1, V2, V3}
        assert request(with_token.url, "GET", "/metadata?key=nope&value=x", auth)[0] == 400
        # Paths a host ran are its exec history: a loopback TCP caller without the token gets none.
        assert request(open_serve.url, "GET", f"/metadata?key=file&value={TOOL}")[0] == 403
    finally:
        with_token.stop()
        open_serve.stop()


def test_which_prints_each_build_id_a_path_had(sessions, tmp_path):
    base = [sys.executable, "-m", "buildidd.cli", "which", "--session-root", str(sessions),
            "--store-root", str(tmp_path / "no-store")]
    r = subprocess.run([*base, TOOL], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert {line.split()[0] for line in lines} == {V1, V2, V3} and all(TOOL in line for line in lines)
    r = subprocess.run([*base, "--json", "--glob", "/opt/app/lib*"], capture_output=True, text=True)
    assert r.returncode == 0 and [x["buildid"] for x in json.loads(r.stdout)["results"]] == [LIB]
    r = subprocess.run([*base, "/nowhere"], capture_output=True, text=True)
    assert r.returncode == 1 and r.stdout == "" and "no build-id recorded for /nowhere" in r.stderr
    assert "--glob" in r.stderr and len(r.stderr.splitlines()) == 1


def test_which_on_a_bare_file_name_names_the_recorded_paths_ending_in_it(sessions, tmp_path):
    """Issue 43: ``which python3.11`` said "no build-id recorded" with exit 0 and no word of --glob."""
    base = [sys.executable, "-m", "buildidd.cli", "which", "--session-root", str(sessions),
            "--store-root", str(tmp_path / "no-store")]
    name = os.path.basename(TOOL)
    r = subprocess.run([*base, name], capture_output=True, text=True)
    assert r.returncode == 1 and r.stdout == "", r
    assert r.stderr == (f"buildidd: no build-id recorded for {name} in the sessions under {sessions}; {name} is a "
                        f"file name and which takes the full path: recorded paths ending in it: {TOOL} "
                        f"(buildidd which --glob '*/{name}' gives their build-ids)\n"), r.stderr
    r = subprocess.run([*base, "--glob", f"*/{name}"], capture_output=True, text=True)
    assert r.returncode == 0 and {line.split()[0] for line in r.stdout.splitlines()} == {V1, V2, V3}
    r = subprocess.run([*base, "no-such-tool"], capture_output=True, text=True)
    assert r.returncode == 1 and "no recorded path ends in it either (buildidd which --glob '*/no-such-tool')" \
        in r.stderr
    r = subprocess.run([*base, "--json", "no-such-tool"], capture_output=True, text=True)
    assert r.returncode == 1 and json.loads(r.stdout)["results"] == []


def test_a_file_without_a_gnu_build_id_is_given_by_its_htlhash(tmp_path):
    root = tmp_path / "sessions"
    w = SessionWriter(root / "20251124T160000Z-3", compress=True)
    w.write({"type": "session", "time_ns": 1, "host": "h", "boot_to_wall_offset_ns": OFFSET_NS})
    fid = "0f" * 16
    w.write({"type": "mmap", "time_ns": 5 * 10**9, "pid": 5, "tid": 5, "comm": "x", "start": 0x400000,
             "len": 4096, "pgoff": 0, "path": "/opt/go/app", "build_id": None, "error": "no_build_id",
             "go_build_id": "abc/def", "file_id": fid})
    w.write({"type": "mmap", "time_ns": 6 * 10**9, "pid": 5, "tid": 5, "comm": "x", "start": 0x500000,
             "len": 4096, "pgoff": 0, "path": "/opt/go/lib.so", "build_id": "10" * 16, "error": None})
    w.close()
    results = md.metadata(root, "glob", "/opt/go/*")["results"]
    assert [(r["file"], r["buildid"], r.get("key")) for r in results] == [
        ("/opt/go/app", fid, "htlhash"), ("/opt/go/lib.so", "10" * 16, None)]   # a 16-byte GNU build-id is one

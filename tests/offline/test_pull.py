"""``buildidd pull`` from a ``buildidd serve`` subprocess: import, resume with Range, verification after resuming."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from buildidd.sessionlog import read_session
from conftest import ServeProcess
from offline.archive_world import SESSION_NAME, make_world
from offline.promtext import samples


@pytest.fixture(scope="module")
def served(tmp_path_factory, public_tmp_factory):
    tmp = tmp_path_factory.mktemp("pull")
    world = make_world(tmp, public_tmp_factory("buildidd-pull-bins-"), records=3000)
    token = tmp / "token"
    token.write_text("pull-token\n")
    serve = ServeProcess(tmp / "store", tmp / "serve.log", "--token-file", str(token),
                         session_root=tmp / "sessions")
    yield {**world, "serve": serve, "token": token}
    serve.stop()


def pull(served, dest: Path, *extra: str, url: str | None = None, token: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "buildidd.cli", "pull", url or served["serve"].url, *extra,
           "--debug-dir", str(dest / "debug"), "--session-root", str(dest / "sessions"),
           "--work-dir", str(dest / "work"), "--timeout", "20"]
    if token:
        cmd += ["--token-file", str(served["token"])]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def get(served, path: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", served["serve"].port, timeout=60)
    try:
        conn.request("GET", path, headers={"Authorization": "Bearer pull-token", **(headers or {})})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def archive_requests(served) -> dict[str, int]:
    """status → count of /sessions/{name}/archive answers, from /metrics."""
    _, _, body = get(served, "/metrics")
    return {dict(labels)["status"]: int(n) for (name, labels), n in samples(body).items()
            if name == "buildidd_serve_requests_total" and dict(labels)["route"] == "/sessions/{name}/archive"}


def check_imported(served, dest: Path) -> None:
    session = dest / "sessions" / SESSION_NAME
    assert list(read_session(session)) == list(read_session(served["session"]))
    bid = served["bids"]["full"]
    elf = dest / "debug" / ".build-id" / bid[:2] / bid[2:] / "elf"
    assert elf.read_bytes() == served["files"]["full"].read_bytes()
    assert list((dest / "work").iterdir()) == []          # nothing left behind once imported


def test_sessions_lists_names_without_server_paths(served):
    status, h, body = get(served, "/sessions")
    items = json.loads(body)
    assert status == 200 and h["content-type"].startswith("application/json")
    assert [i["name"] for i in items] == [SESSION_NAME] and "path" not in items[0]
    assert items[0]["host"] == "prod-1"


def test_pull_imports_the_session_and_its_binaries(served, tmp_path):
    r = pull(served, tmp_path, SESSION_NAME)
    assert r.returncode == 0, r.stderr
    assert f"{SESSION_NAME}: imported" in r.stdout and "resumed" not in r.stdout
    # What the archive left out is counted by reason and named, with the way to include it.
    assert "1 missing (1 not_in_store)" in r.stdout, r.stdout
    assert "left out, not_in_store (1): " in r.stdout, r.stdout
    gone = served["files"]["gone"]
    assert f"    {gone.parent}: 1 file, e.g. {gone}" in r.stdout.splitlines(), r.stdout
    check_imported(served, tmp_path)


def test_pull_needs_the_token_and_an_existing_session(served, tmp_path):
    r = pull(served, tmp_path, token=False)
    assert r.returncode == 4 and "401" in r.stderr and "bearer token required" in r.stderr, r.stderr
    assert "give pull --token-file FILE" in r.stderr, r.stderr
    r = pull(served, tmp_path, "no-such-session")
    assert r.returncode == 1 and "no session 'no-such-session'" in r.stderr


def full_archive(served) -> tuple[bytes, str]:
    status, h, body = get(served, f"/sessions/{SESSION_NAME}/archive")
    assert status == 200
    return body, h["etag"]


def test_pull_resumes_a_kept_partial_file_with_range(served, tmp_path):
    data, etag = full_archive(served)
    status, h, body = get(served, f"/sessions/{SESSION_NAME}/archive", {"Range": "bytes=100-", "If-Range": etag})
    assert status == 206 and body == data[100:] and h["etag"] == etag
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / f"{SESSION_NAME}.tar.zst.part").write_bytes(data[:len(data) // 2])
    (tmp_path / "work" / f"{SESSION_NAME}.tar.zst.etag").write_text(etag)
    before = archive_requests(served)
    r = pull(served, tmp_path, "latest")
    assert r.returncode == 0, r.stderr
    assert "resumed" in r.stdout
    after = archive_requests(served)
    assert after.get("206", 0) == before.get("206", 0) + 1 and after.get("200", 0) == before.get("200", 0)
    check_imported(served, tmp_path)


def test_a_stale_partial_file_is_replaced_whole(served, tmp_path):
    data, _ = full_archive(served)
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / f"{SESSION_NAME}.tar.zst.part").write_bytes(data[:1000])
    (tmp_path / "work" / f"{SESSION_NAME}.tar.zst.etag").write_text('"an-older-archive"')
    r = pull(served, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "resumed" not in r.stdout
    check_imported(served, tmp_path)


def test_a_corrupt_resumed_archive_fails_verification_and_is_fetched_whole(served, tmp_path):
    data, etag = full_archive(served)
    prefix = bytearray(data[:len(data) // 2])
    for i in range(len(prefix) // 3, len(prefix) // 3 + 64):
        prefix[i] ^= 0xFF
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / f"{SESSION_NAME}.tar.zst.part").write_bytes(bytes(prefix))
    (tmp_path / "work" / f"{SESSION_NAME}.tar.zst.etag").write_text(etag)
    before = archive_requests(served)
    r = pull(served, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "failed verification" in r.stderr
    after = archive_requests(served)
    assert after.get("206", 0) == before.get("206", 0) + 1 and after.get("200", 0) == before.get("200", 0) + 1
    check_imported(served, tmp_path)


class CuttingProxy:
    """A loopback TCP proxy that closes the first archive response after `cut` bytes; the rest pass whole."""

    def __init__(self, upstream_port: int, cut: int):
        self.upstream_port = upstream_port
        self.cut = cut
        self.cuts = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
        request = client.recv(65536)
        upstream.sendall(request)
        limit = None
        if b"/archive " in request.split(b"\r\n", 1)[0] and self.cuts == 0:
            self.cuts += 1
            limit = self.cut
        threading.Thread(target=self._pump, args=(client, upstream, None), daemon=True).start()
        self._pump(upstream, client, limit)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, limit: int | None) -> None:
        sent = 0
        try:
            while data := src.recv(65536):
                if limit is not None and sent + len(data) > limit:
                    dst.sendall(data[:limit - sent])
                    break
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self.sock.close()


def test_a_transfer_cut_midway_resumes_in_the_same_run(served, tmp_path):
    data, _ = full_archive(served)
    proxy = CuttingProxy(served["serve"].port, cut=len(data) // 3)
    try:
        before = archive_requests(served)
        r = pull(served, tmp_path, url=f"http://127.0.0.1:{proxy.port}")
    finally:
        proxy.close()
    assert proxy.cuts == 1
    assert r.returncode == 0, r.stderr
    assert "resuming from byte" in r.stderr and "resumed" in r.stdout
    after = archive_requests(served)
    assert after.get("206", 0) == before.get("206", 0) + 1
    check_imported(served, tmp_path)
    assert os.path.isdir(tmp_path / "sessions" / SESSION_NAME)

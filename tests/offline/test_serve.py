"""``buildidd serve`` as a subprocess, asked by the real ``debuginfod-find`` and by plain HTTP clients."""

from __future__ import annotations

import email.utils
import http.client
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

from buildidd.store import Store
from conftest import ServeProcess, gcc, readelf_build_id, store_add
from offline.promtext import samples, value

pytestmark = pytest.mark.skipif(shutil.which("debuginfod-find") is None, reason="debuginfod-find not installed")

SRC = """
#include <stdio.h>
int counter;                       /* .bss: SHT_NOBITS */
const char tag[] = "%s";
int main(void) { counter++; puts(tag); return 0; }
"""


@pytest.fixture(scope="module")
def world(tmp_path_factory, public_tmp_factory):
    """A store holding: a binary with .symtab, a stripped one, and a stripped one with separate debuginfo
    (built in a directory every user can traverse: not private, so served)."""
    tmp = tmp_path_factory.mktemp("serve")
    bins = public_tmp_factory("buildidd-serve-bins-")
    full = gcc(SRC % "full", bins / "full", "-g")
    stripped = gcc(SRC % "stripped", bins / "stripped", "-s")
    split = gcc(SRC % "split", bins / "split", "-g")
    bid_split = readelf_build_id(split)
    debug_root = tmp / "usr-lib-debug"
    debug_file = debug_root / ".build-id" / bid_split[:2] / (bid_split[2:] + ".debug")
    debug_file.parent.mkdir(parents=True)
    subprocess.run(["objcopy", "--only-keep-debug", str(split), str(debug_file)], check=True)
    subprocess.run(["strip", "-s", str(split)], check=True)
    store = Store(tmp / "store", debug_root=debug_root)
    bids = {name: store_add(store, path) for name, path in
            (("full", full), ("stripped", stripped), ("split", split))}
    assert (store.path_of(bids["split"]).parent / "debug").is_file()
    public_metrics = tmp / "public-metrics.toml"
    public_metrics.write_text("serve_metrics_public = true\n")      # a Prometheus scraper without the token
    serve = ServeProcess(tmp / "store", tmp / "serve.log", "--config", str(public_metrics))
    yield {"tmp": tmp, "serve": serve, "bids": bids, "files": {"full": full, "stripped": stripped, "split": split},
           "debug": debug_file, "store": store, "public_metrics": public_metrics}
    serve.stop()


def find(world, kind: str, bid: str, **env) -> subprocess.CompletedProcess:
    cache = tempfile.mkdtemp(dir=world["tmp"], prefix="client-cache-")
    e = dict(os.environ, DEBUGINFOD_URLS=world["serve"].url, DEBUGINFOD_CACHE_PATH=cache, **env)
    return subprocess.run(["debuginfod-find", kind, bid], capture_output=True, text=True, env=e, timeout=60)


def request(url_base: str, method: str, path: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    host, port = url_base.split("//")[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str):
        super().__init__("localhost", timeout=30)
        self.unix_path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(self.unix_path)


def request_unix(sock_path, method: str, path: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    """:func:`request` over serve's unix socket (``--unix-socket``), as this process's user."""
    conn = _UnixConnection(str(sock_path))
    try:
        conn.request(method, path, headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def raw_request(url_base: str, request_line: str) -> int:
    """Send request_line exactly as given (no client-side path normalization); the status code."""
    host, port = url_base.split("//")[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(f"{request_line}\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1])


def test_debuginfod_find_gets_the_original_bytes(world):
    for name in ("full", "stripped", "split"):
        r = find(world, "executable", world["bids"][name])
        assert r.returncode == 0, r.stderr
        assert Path(r.stdout.strip()).read_bytes() == world["files"][name].read_bytes()


def test_debuginfo_is_the_debug_file_else_an_unstripped_binary_else_404(world):
    r = find(world, "debuginfo", world["bids"]["split"])
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).read_bytes() == world["debug"].read_bytes()
    r = find(world, "debuginfo", world["bids"]["full"])
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).read_bytes() == world["files"]["full"].read_bytes()
    r = find(world, "debuginfo", world["bids"]["stripped"])
    assert r.returncode != 0 and r.stdout == ""
    status, _, _ = request(world["serve"].url, "GET", f"/buildid/{world['bids']['stripped']}/debuginfo")
    assert status == 404


def test_head_sends_debuginfod_headers_and_no_body(world):
    bid = world["bids"]["full"]
    size = world["files"]["full"].stat().st_size
    status, h, body = request(world["serve"].url, "HEAD", f"/buildid/{bid}/executable")
    assert status == 200 and body == b""
    assert h["content-length"] == str(size) and h["x-debuginfod-size"] == str(size)
    assert h["x-debuginfod-file"] == "full"
    stored = world["store"].path_of(bid)
    last_modified = email.utils.parsedate_to_datetime(h["last-modified"]).timestamp()
    assert 0 <= last_modified - stored.stat().st_mtime < 1     # whole seconds (aiohttp rounds up)
    status, h, _ = request(world["serve"].url, "HEAD", f"/buildid/{world['bids']['split']}/debuginfo")
    assert status == 200 and h["x-debuginfod-file"] == "split.debug"
    assert h["x-debuginfod-size"] == str(world["debug"].stat().st_size)


def test_byte_ranges(world):
    bid = world["bids"]["full"]
    data = world["files"]["full"].read_bytes()
    status, h, body = request(world["serve"].url, "GET", f"/buildid/{bid}/executable", {"Range": "bytes=100-199"})
    assert status == 206 and body == data[100:200]
    assert h["content-range"] == f"bytes 100-199/{len(data)}" and h["x-debuginfod-size"] == str(len(data))
    status, _, body = request(world["serve"].url, "GET", f"/buildid/{bid}/executable", {"Range": "bytes=-16"})
    assert status == 206 and body == data[-16:]
    status, _, _ = request(world["serve"].url, "GET", f"/buildid/{bid}/executable",
                           {"Range": f"bytes={len(data) + 10}-"})
    assert status == 416


def test_section_is_the_raw_bytes_objcopy_dumps(world, tmp_path):
    bid = world["bids"]["full"]
    out = tmp_path / "rodata"
    subprocess.run(["objcopy", "--dump-section", f".rodata={out}", str(world["files"]["full"]), str(tmp_path / "x")],
                   check=True)
    status, h, body = request(world["serve"].url, "GET", f"/buildid/{bid}/section/.rodata")
    assert status == 200 and body == out.read_bytes() and b"full" in body
    assert h["x-debuginfod-size"] == str(len(body))
    # from the separate debuginfo first: .debug_info is only there (the binary is stripped)
    status, _, body = request(world["serve"].url, "GET", f"/buildid/{world['bids']['split']}/section/.debug_info")
    dumped = tmp_path / "debug_info"
    subprocess.run(["objcopy", "--dump-section", f".debug_info={dumped}", str(world["debug"]), str(tmp_path / "y")],
                   check=True)
    assert status == 200 and body == dumped.read_bytes()
    for name in (".no_such_section", ".bss"):   # absent; SHT_NOBITS has no bytes
        assert request(world["serve"].url, "GET", f"/buildid/{bid}/section/{name}")[0] == 404


def test_bad_build_ids_are_400_and_absent_ones_404(world):
    url = world["serve"].url
    bid = world["bids"]["full"]
    for bad in (bid.upper(), bid[:-1], "zz" + bid[2:], "a", "ab" * 64, "%00" + bid, bid + "%20"):
        assert request(url, "GET", f"/buildid/{bad}/executable")[0] == 400, bad
    assert request(url, "GET", "/buildid//executable")[0] == 400
    assert request(url, "GET", f"/buildid/{bid}/nonsense")[0] == 400
    assert request(url, "GET", "/buildid/" + "ab" * 63 + "/executable")[0] == 404   # 126 characters: valid
    assert request(url, "GET", "/buildid/ab/executable")[0] == 404                  # 1 byte: valid, never held
    assert request(url, "GET", "/buildid/" + "00" * 20 + "/executable")[0] == 404


def test_dotdot_paths_are_refused(world):
    url = world["serve"].url
    bid = world["bids"]["full"]
    assert request(url, "GET", f"/buildid/{bid}/source/usr/src/x.c")[0] == 404      # sources are never held
    for path in (f"/buildid/{bid}/source/../../../../etc/passwd",
                 f"/buildid/{bid}/source/a/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
                 f"/buildid/{bid}/source/a/..%2f..%2fetc/passwd",
                 "/buildid/../../../etc/passwd",
                 f"/buildid/{bid}/section/..%2f..%2fetc%2fpasswd",
                 "/sessions/..%2f..%2fetc/archive",
                 "/../../../../etc/passwd"):
        status = raw_request(url, f"GET {path} HTTP/1.1")
        assert status in (400, 403, 404), (path, status)   # 403: session logs need rights first
    status, _, body = request(url, "GET", f"/buildid/{bid}/source/a/%2e%2e/%2e%2e/etc/passwd")
    assert status == 400 and b"root:" not in body


def test_metrics_count_requests_bytes_hits_and_misses(world):
    url = world["serve"].url
    bid = world["bids"]["stripped"]
    request(url, "GET", f"/buildid/{bid}/executable")
    request(url, "GET", "/buildid/" + "11" * 20 + "/executable")
    status, h, body = request(url, "GET", "/metrics")
    assert status == 200 and h["content-type"].startswith("text/plain; version=0.0.4")
    got = samples(body)                                     # prometheus_client's parser reads it all
    route = "/buildid/{build_id}/{artifact}"
    assert got[("buildidd_serve_lookups_total", frozenset({"artifact": "executable", "result": "hit"}.items()))] >= 1
    assert got[("buildidd_serve_lookups_total", frozenset({"artifact": "executable", "result": "miss"}.items()))] >= 1
    assert got[("buildidd_serve_requests_total", frozenset({"route": route, "status": "200"}.items()))] >= 1
    assert got[("buildidd_serve_sent_bytes_total", frozenset({"route": route}.items()))] \
        >= world["files"]["stripped"].stat().st_size
    assert not any(name.startswith("buildidd_daemon_") for name, _ in got)     # --socket '': no daemon asked


def test_slow_client_does_not_block_others_and_is_cut_off(world, tmp_path):
    bid = world["bids"]["full"]
    serve = ServeProcess(world["tmp"] / "store", tmp_path / "serve.log", "--idle-timeout", "2")
    try:
        host, port = serve.url.split("//")[1].rsplit(":", 1)
        stalled = [socket.create_connection((host, int(port)), timeout=30) for _ in range(8)]
        for s in stalled:
            s.sendall(f"GET /buildid/{bid}/execu".encode())      # half a request line, then nothing
        for _ in range(3):
            status, _, body = request(serve.url, "GET", f"/buildid/{bid}/executable")
            assert status == 200 and body == world["files"]["full"].read_bytes()
        for s in stalled:     # the server closes them (idle timeout); recv returns b"" (or a 4xx) before ours
            data = s.recv(4096)
            assert data == b"" or data.startswith(b"HTTP/1.1 4"), data[:80]
            s.close()
    finally:
        serve.stop()


@pytest.fixture
def nobody_world(world):
    """A second serve running as nobody in the store's group (as a serve that is not root would run) over
    a copy of the store (0750/0640 root:group) in which one file is unreadable to it."""
    base = Path(tempfile.mkdtemp(prefix="buildidd-serve-nobody-"))
    try:
        os.chmod(base, 0o755)
        shutil.copytree(world["tmp"] / "store", base / "store", symlinks=True)
        gid = world["store"].gid
        for d, dirs, files in os.walk(base / "store"):     # copytree keeps modes (0750/0640), not the group
            for name in [d, *(os.path.join(d, n) for n in dirs + files)]:
                os.chown(name, 0, gid, follow_symlinks=False)
        store = Store(base / "store")
        os.chmod(store.path_of(world["bids"]["full"]), 0o000)
        loop = store.linkname(world["bids"]["stripped"])
        loop.unlink()
        loop.symlink_to(loop.name)                   # ELOOP: the link is there, its target cannot be reached
        serve = ServeProcess(base / "store", base / "serve.log", user=65534, group=gid)   # a member of the group
        yield serve
        log = serve.stop()
        assert "503" in log
    finally:
        shutil.rmtree(base)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a server as another user")
def test_held_but_unreadable_is_503_never_404(world, nobody_world):
    url = nobody_world.url
    for artifact in ("executable", "debuginfo"):
        status, h, _ = request(url, "GET", f"/buildid/{world['bids']['full']}/{artifact}")
        assert status == 503 and "retry-after" in h, artifact
    assert request(url, "GET", f"/buildid/{world['bids']['full']}/section/.text")[0] == 503
    assert request(url, "GET", f"/buildid/{world['bids']['stripped']}/executable")[0] == 503
    assert request(url, "GET", f"/buildid/{world['bids']['split']}/executable")[0] == 200   # the others still served
    # (elfutils 0.188's client caches any HTTP error as "missing", 503 included: measured; newer
    # clients tell 503 apart.  The server's part is to never say 404 for a held file.)


def test_token_is_required_when_given(world, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    serve = ServeProcess(world["tmp"] / "store", tmp_path / "serve.log", "--token-file", str(token))
    try:
        path = f"/buildid/{world['bids']['full']}/executable"
        assert request(serve.url, "GET", path)[0] == 401
        assert request(serve.url, "GET", path, {"Authorization": "Bearer wrong"})[0] == 401
        assert request(serve.url, "GET", path, {"Authorization": "Bearer s3cret-token-and-more"})[0] == 401
        assert request(serve.url, "GET", "/metrics")[0] == 401
        status, _, body = request(serve.url, "GET", path, {"Authorization": "Bearer s3cret-token"})
        assert status == 200 and body == world["files"]["full"].read_bytes()
        headers = tmp_path / "headers"
        headers.write_text("Authorization: Bearer s3cret-token\n")
        r = find({**world, "serve": serve}, "executable", world["bids"]["full"], DEBUGINFOD_HEADERS_FILE=str(headers))
        assert r.returncode == 0, r.stderr
        assert Path(r.stdout.strip()).read_bytes() == world["files"]["full"].read_bytes()
    finally:
        serve.stop()


def test_off_loopback_without_token_refuses_to_start(world, tmp_path):
    """Only 127.0.0.0/8 and ::1 count as loopback; any other address needs --token-file (checked before binding)."""
    for listen in ("0.0.0.0:0", "192.0.2.1:8002", "[::]:0"):
        r = subprocess.run([os.sys.executable, "-m", "buildidd.cli", "serve", "--listen", listen,
                            "--store-root", str(world["tmp"] / "store"), "--socket", ""],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "requires --token-file" in r.stderr, (listen, r.stderr)
    r = subprocess.run([os.sys.executable, "-m", "buildidd.cli", "serve", "--listen", "localhost:8002",
                        "--store-root", str(world["tmp"] / "store")], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "IP address" in r.stderr


def test_tls(world, tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    serve = ServeProcess(world["tmp"] / "store", tmp_path / "serve.log", "--tls-cert", str(cert), "--tls-key", str(key))
    try:
        assert serve.url.startswith("https://")
        import ssl
        ctx = ssl.create_default_context(cafile=str(cert))
        conn = http.client.HTTPSConnection("127.0.0.1", serve.port, context=ctx, timeout=30)
        conn.request("GET", f"/buildid/{world['bids']['full']}/executable")
        r = conn.getresponse()
        assert r.status == 200 and r.read() == world["files"]["full"].read_bytes()
        conn.close()
    finally:
        serve.stop()


def test_metrics_carry_the_recording_daemons_status(world, tmp_path):
    from buildidd.control import ControlServer, ServerOptions

    sockdir = tempfile.mkdtemp(prefix="bsrv-", dir="/tmp")   # sun_path holds 107 bytes
    path = os.path.join(sockdir, "ctl.sock")
    status = {"events": {"mmap": 42, "exec": 7}, "lost": {}, "uptime_s": 12.5, "session": "s1", "ready": True}
    ctl = ControlServer(path, {"status": lambda args: status}, ServerOptions(group=None))
    ctl.start()
    serve = ServeProcess(world["tmp"] / "store", tmp_path / "serve.log", "--socket", path,
                         "--config", str(world["public_metrics"]))
    try:
        body = request(serve.url, "GET", "/metrics")[2]
        assert value(body, "buildidd_daemon_up") == 1
        assert value(body, "buildidd_daemon_status", key="events.mmap") == 42
        assert value(body, "buildidd_daemon_status", key="uptime_s") == 12.5
        assert value(body, "buildidd_daemon_status", key="ready") == 1
        assert value(body, "buildidd_daemon_status", key="session") is None        # strings are left out
        ctl.stop()
        body = request(serve.url, "GET", "/metrics")[2]
        assert value(body, "buildidd_daemon_up") == 0
        assert not any(name == "buildidd_daemon_status" for name, _ in samples(body))
    finally:
        ctl.stop()
        serve.stop()
        shutil.rmtree(sockdir, ignore_errors=True)

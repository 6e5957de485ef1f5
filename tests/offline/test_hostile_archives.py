"""``import`` and ``pull`` against hostile archives and a real malicious HTTP server on 127.0.0.1.

Attacks of issue 33: sparse tar members (GNU and the three pax formats, built
by GNU tar) whose holes expanded past every limit; an endless body; a body
trickling a byte every 2 s; a redirect that carried the bearer token to
another origin, or from https to plain http.  Figures are printed (``pytest -s``).
"""

from __future__ import annotations

import http.server
import io
import json
import shutil
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zstandard

from buildidd.errors import ArchiveError
from buildidd.offline.archive import write_archive
from buildidd.offline.importer import import_archive
from offline.archive_world import make_world

SESSION = "20261126T000000Z-3333"
TOKEN = "hostile-archive-token"
HOLE_BYTES = 1 << 30


@pytest.fixture(scope="module")
def world(tmp_path_factory, public_tmp_factory):
    w = make_world(tmp_path_factory.mktemp("hostile-archives"), public_tmp_factory("buildidd-harch-bins-"),
                   records=30)
    out = io.BytesIO()
    w["manifest"] = write_archive(w["session"], w["store"], out)
    w["archive"] = out.getvalue()
    return w


def _sparse_archive(world, tmp: Path, tar_format: list[str]) -> Path:
    """manifest.json (the real one), then the first listed ELF member as a file with a 1 GiB hole, tarred by GNU tar
    with --sparse and the given format options, compressed with zstd."""
    raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(world["archive"]), read_across_frames=True).read()
    import tarfile
    with tarfile.open(fileobj=io.BytesIO(raw)) as tf:
        names = tf.getnames()
        manifest = tf.extractfile("manifest.json").read()
    elf = next(n for n in names if n.endswith("/elf"))
    m = json.loads(manifest)
    for ref in m["build_ids"]:      # the manifest agrees with the member's expanded size, as the attacker made it
        for f in ref.get("files", []):
            if f"cache/{ref['entry']}/{f['name']}" == elf:
                f["size_bytes"] = HOLE_BYTES
    root = tmp / "tree"
    (root / elf).parent.mkdir(parents=True)
    (root / "manifest.json").write_text(json.dumps(m))
    with open(root / elf, "wb") as f:
        f.write(b"\x7fELF")
        f.truncate(HOLE_BYTES)
        f.seek(HOLE_BYTES - 4)
        f.write(b"tail")
    tar = tmp / "sparse.tar"
    subprocess.run(["tar", "-C", str(root), "--sparse", *tar_format, "-cf", str(tar), "manifest.json", elf],
                   check=True, timeout=60)
    out = tmp / "sparse.tar.zst"
    out.write_bytes(zstandard.ZstdCompressor().compress(tar.read_bytes()))
    return out


def _tree_bytes(d: Path) -> int:
    return sum(p.lstat().st_blocks * 512 for p in d.rglob("*")) if d.exists() else 0


@pytest.mark.parametrize("tar_format", [["--format=gnu"], ["--format=pax", "--sparse-version=0.0"],
                                        ["--format=pax", "--sparse-version=0.1"],
                                        ["--format=pax", "--sparse-version=1.0"]],
                         ids=["gnu", "pax-0.0", "pax-0.1", "pax-1.0"])
def test_sparse_members_are_refused(world, tmp_path, tar_format):
    """Attack 2: a sparse member with a 1 GiB hole in a ~16 KB archive was installed in full (1,073,777,488 bytes)."""
    archive = _sparse_archive(world, tmp_path, tar_format)
    t0 = time.monotonic()
    with pytest.raises(ArchiveError) as e:
        import_archive(archive, debug_dir=tmp_path / "debug", session_root=tmp_path / "sessions")
    took = time.monotonic() - t0
    written = _tree_bytes(tmp_path / "debug") + _tree_bytes(tmp_path / "sessions")
    print(f"\nsparse {' '.join(tar_format)}: {archive.stat().st_size} B archive with a {HOLE_BYTES} B hole refused "
          f"({e.value.reason}) in {took:.3f} s, {written} bytes written")
    assert e.value.reason == "sparse"
    assert written == 0


# --- a malicious serve -------------------------------------------------------------------------------------------

class Evil(http.server.BaseHTTPRequestHandler):
    """Answers /sessions with one session, and its archive with the attack in server.attack; records headers."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):   # quiet
        pass

    def do_GET(self):
        srv = self.server
        srv.seen.append((self.path, self.headers.get("Authorization")))
        if self.path == "/sessions":
            body = json.dumps([{"name": SESSION}]).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        srv.attack(self)


def _serve(attack, *, tls: ssl.SSLContext | None = None) -> http.server.ThreadingHTTPServer:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Evil)
    srv.daemon_threads = True
    srv.attack, srv.seen = attack, []
    if tls is not None:
        srv.socket = tls.wrap_socket(srv.socket, server_side=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def _url(srv, scheme="http") -> str:
    return f"{scheme}://127.0.0.1:{srv.server_address[1]}"


def _pull(url: str, dest: Path, *extra: str, timeout_s: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    token = dest / "token"
    dest.mkdir(parents=True, exist_ok=True)
    token.write_text(TOKEN)
    cmd = [sys.executable, "-m", "buildidd.cli", "pull", url, "--token-file", str(token),
           "--debug-dir", str(dest / "debug"), "--session-root", str(dest / "sessions"),
           "--work-dir", str(dest / "work"), *extra]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    return r, time.monotonic() - t0


def _endless(h):
    h.send_response(200)
    h.send_header("Transfer-Encoding", "chunked")
    h.end_headers()
    block = b"\0" * (1 << 20)
    chunk = f"{len(block):x}\r\n".encode() + block + b"\r\n"
    try:
        while True:
            h.wfile.write(chunk)
    except OSError:
        pass


def test_endless_body_stops_at_the_cap(tmp_path):
    """Attack 3a: an endless 200 body wrote 12.9 GB in 30 s; now it stops at --max-bytes and is discarded."""
    srv = _serve(_endless)
    try:
        r, took = _pull(_url(srv), tmp_path, "--max-bytes", str(64 << 20))
    finally:
        srv.shutdown()
    left = _tree_bytes(tmp_path / "work")
    print(f"\nendless body: stopped after {took:.2f} s at the 64 MiB cap, {left} bytes left on disk; {r.stderr.strip()}")
    assert r.returncode != 0 and "cap" in r.stderr
    assert left == 0


def test_declared_size_over_the_cap_is_refused_unread(tmp_path):
    """A Content-Length over --max-bytes is refused before a byte of the body is read."""
    def huge(h):
        h.send_response(200)
        h.send_header("Content-Length", str(1 << 40))
        h.end_headers()
        h.wfile.write(b"x" * 4096)
    srv = _serve(huge)
    try:
        r, _ = _pull(_url(srv), tmp_path, "--max-bytes", str(1 << 30))
    finally:
        srv.shutdown()
    assert r.returncode != 0 and "over the cap" in r.stderr
    assert _tree_bytes(tmp_path / "work") == 0


def test_trickling_body_stops_at_the_deadline(tmp_path):
    """Attack 3b: 1 byte every 2 s never trips --timeout 5; --deadline 6 must end it."""
    def trickle(h):
        h.send_response(200)
        h.send_header("Content-Length", str(1 << 20))
        h.end_headers()
        try:
            for _ in range(60):
                h.wfile.write(b"x")
                h.wfile.flush()
                time.sleep(2)
        except OSError:
            pass
    srv = _serve(trickle)
    try:
        r, took = _pull(_url(srv), tmp_path, "--timeout", "5", "--deadline", "6", timeout_s=50)
    finally:
        srv.shutdown()
    print(f"\ntrickle 1 B / 2 s, --timeout 5 --deadline 6: pull ended after {took:.2f} s; {r.stderr.strip()[-200:]}")
    assert r.returncode != 0 and "--deadline" in r.stderr
    assert took < 6 + 5 + 3


def _answer(status: int, location: str | None = None):
    """An attack that answers status with an empty body (and a Location when given)."""
    def attack(h):
        h.send_response(status)
        if location is not None:
            h.send_header("Location", location)
        h.send_header("Content-Length", "0")
        h.end_headers()
    return attack


def test_token_never_crosses_an_origin(tmp_path):
    """Attack 3c: a 302 to another origin received ``Authorization: Bearer …``."""
    elsewhere = _serve(_answer(404))
    srv = _serve(_answer(302, f"{_url(elsewhere)}/loot"))
    try:
        r, _ = _pull(_url(srv), tmp_path, "--timeout", "5")
    finally:
        srv.shutdown()
        elsewhere.shutdown()
    print(f"\nredirect: home saw {srv.seen}, the other origin saw {elsewhere.seen}")
    assert r.returncode != 0
    assert all(auth == f"Bearer {TOKEN}" for _, auth in srv.seen)          # the home origin gets its token
    assert elsewhere.seen and all(auth is None for _, auth in elsewhere.seen)


def test_https_to_http_redirect_is_refused(tmp_path):
    """Attack 3c: an https → http redirect would send the token in clear; it is not followed at all."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    plain = _serve(_answer(404))
    srv = _serve(_answer(302, f"{_url(plain)}/sessions/{SESSION}/archive"), tls=ctx)
    try:
        r, _ = _pull(_url(srv, "https"), tmp_path, "--timeout", "5", "--cafile", str(cert))
    finally:
        srv.shutdown()
        plain.shutdown()
    assert r.returncode != 0 and "refused" in r.stderr, r.stderr
    assert plain.seen == []

"""pull's HTTP client (urllib3) against real, misbehaving HTTP servers on 127.0.0.1: a read that stalls is
cut by the per-read timeout, a trickle by the deadline, and the token follows redirects only on its origin."""

from __future__ import annotations

import http.server
import threading
import time

import pytest

from buildidd.errors import ServeError
from buildidd.offline.pull import PullOptions, _Broken, _Client, _Download

TOKEN = "client-token"
#: How long a stalling server holds its connection (ended early at teardown); far above every timeout used.
STALL_S = 60.0


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.server.seen.append((self.path, self.headers.get("Authorization")))
        self.server.answer(self)


@pytest.fixture
def serve():
    """Factory: a threaded HTTP server on 127.0.0.1 answering every GET with answer(handler); its base URL.
    At teardown the servers stop and any stall ends."""
    servers, release = [], threading.Event()

    def make(answer):
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        srv.daemon_threads = True
        srv.answer, srv.seen, srv.release = answer, [], release
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return srv, f"http://127.0.0.1:{srv.server_address[1]}"

    yield make
    release.set()
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def _options(url: str, tmp_path, **kw) -> PullOptions:
    return PullOptions(url=url, sessions=(), session_root=str(tmp_path / "sessions"), token=TOKEN,
                       work_dir=str(tmp_path / "work"), **kw)


def _body_then_stall(sent: bytes, declared: int):
    def answer(h):
        h.send_response(200)
        h.send_header("Content-Length", str(declared))
        h.end_headers()
        h.wfile.write(sent)
        h.wfile.flush()
        h.server.release.wait(STALL_S)
    return answer


def test_a_read_that_stalls_is_cut_by_the_per_read_timeout(serve, tmp_path):
    srv, url = serve(_body_then_stall(b"0123456789", 1 << 20))
    opts = _options(url, tmp_path, timeout_s=1.0, deadline_s=STALL_S)
    (tmp_path / "work").mkdir()
    dl = _Download(_Client(opts), "s1", tmp_path / "work", opts)
    t0 = time.monotonic()
    with pytest.raises(_Broken, match=r"transfer broke after 10 bytes: .*[Rr]ead timed out"):
        dl._attempt()
    took = time.monotonic() - t0
    assert took < STALL_S / 2, took           # the timeout ended the read, not the server
    assert dl.part.read_bytes() == b"0123456789"                 # what came is kept for the resumption
    assert srv.seen == [("/sessions/s1/archive", f"Bearer {TOKEN}")]


def test_headers_that_never_come_are_cut_by_the_timeout(serve, tmp_path):
    def silent(h):
        h.server.release.wait(STALL_S)
    _srv, url = serve(silent)
    client = _Client(_options(url, tmp_path, timeout_s=1.0))
    t0 = time.monotonic()
    with pytest.raises(_Broken, match="timed out"):
        client.open("/sessions")
    assert time.monotonic() - t0 < STALL_S / 2


def test_a_trickle_that_never_idles_stops_at_the_deadline(serve, tmp_path):
    def trickle(h):
        h.send_response(200)
        h.send_header("Content-Length", str(1 << 20))
        h.end_headers()
        for _ in range(int(STALL_S / 0.2)):
            if h.server.release.wait(0.2):
                return
            h.wfile.write(b"x")
            h.wfile.flush()
    _srv, url = serve(trickle)
    opts = _options(url, tmp_path, timeout_s=5.0, deadline_s=1.5)
    (tmp_path / "work").mkdir()
    dl = _Download(_Client(opts), "s1", tmp_path / "work", opts)
    with pytest.raises(ServeError, match="--deadline"):
        dl._attempt()
    assert 0 < dl._have() < 1 << 20                 # bytes did come: no read was idle for timeout_s


def test_the_token_follows_redirects_on_its_origin_only(serve, tmp_path):
    other, other_url = serve(lambda h: _empty(h, 404))
    home_answers = {"/sessions": (302, "/moved"), "/moved": (302, f"{other_url}/loot")}

    def home_answer(h):
        status, location = home_answers[h.path]
        _empty(h, status, location)
    home, url = serve(home_answer)
    resp = _Client(_options(url, tmp_path, timeout_s=5.0)).open("/sessions")
    with resp:
        assert resp.status == 404
    assert home.seen == [("/sessions", f"Bearer {TOKEN}"), ("/moved", f"Bearer {TOKEN}")]   # relative: same origin
    assert other.seen == [("/loot", None)]


def test_an_endless_redirect_chain_is_refused(serve, tmp_path):
    srv, url = serve(lambda h: _empty(h, 307, h.path + "x"))
    with pytest.raises(ServeError, match="more than 10 redirects"):
        _Client(_options(url, tmp_path, timeout_s=5.0)).open("/a")
    assert len(srv.seen) == 11


def _empty(h, status: int, location: str | None = None) -> None:
    h.send_response(status)
    if location is not None:
        h.send_header("Location", location)
    h.send_header("Content-Length", "0")
    h.end_headers()

"""Control socket: protocol, server and client over real Unix sockets and threads.

Every test talks to a real ControlServer through real sockets; the abusive
clients are raw sockets that do what ControlClient never would.  Timeouts are
short (0.5 s) so the slow-client cases run quickly.
"""

from __future__ import annotations

import grp
import json
import os
import shutil
import socket
import stat
import tempfile
import threading
import time

import pytest

from buildidd.control import ControlClient, ControlError, ControlServer, ServerOptions
from buildidd.control import protocol
from buildidd.control.protocol import MAX_REQUEST_BYTES
from buildidd.errors import ProtocolError

TIMEOUT_S = 0.5
NOBODY = 65534


class Boom(Exception):
    pass


def _raise(_args):
    raise Boom("handler exploded")


def _bad_args(args):
    raise ControlError(protocol.BAD_REQUEST, f"missing 'pid' in {sorted(args)}")


HANDLERS = {
    "status": lambda args: {"pid": os.getpid(), "uptime_s": 1.5, "sessions": ["a", "b"]},
    "echo": lambda args: args,
    "boom": _raise,
    "needs_pid": _bad_args,
    "unserialisable": lambda args: {"x": object()},
    "big": lambda args: "x" * int(args["size_bytes"]),
}


@pytest.fixture
def sockdir():
    """A short directory that every user may traverse (pytest's tmp_path is 0700
    under /tmp/pytest-of-root, and sun_path holds only 107 bytes)."""
    d = tempfile.mkdtemp(prefix="bctl-", dir="/tmp")
    os.chmod(d, 0o711)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def serve(sockdir):
    """Factory: a started ControlServer on sockdir/ctl.sock; stopped at teardown."""
    started = []

    def make(handlers=HANDLERS, **kw):
        kw.setdefault("group", None)
        kw.setdefault("client_timeout_s", TIMEOUT_S)
        srv = ControlServer(os.path.join(sockdir, "ctl.sock"), handlers, ServerOptions(**kw))
        srv.start()
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()
        assert srv._thread is None, "server thread did not stop"


def raw(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5.0)
    s.connect(path)
    return s


def read_until_eof(s: socket.socket, timeout_s: float = 5.0) -> tuple[list[dict], bool]:
    """(parsed response lines, whether the server closed) within timeout_s seconds."""
    buf = b""
    deadline = time.monotonic() + timeout_s
    closed = False
    while time.monotonic() < deadline:
        s.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            data = s.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            closed = True
            break
        if not data:
            closed = True
            break
        buf += data
    return [json.loads(line) for line in buf.split(b"\n") if line], closed


def read_line(f) -> dict:
    """The next response from f, a ``sock.makefile("rb")``."""
    line = f.readline()
    assert line.endswith(b"\n"), f"EOF after {line!r}"
    return json.loads(line)


def code(resp: dict) -> str:
    assert resp["ok"] is False, resp
    return resp["error"]["code"]


def wait_for(pred, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


# ---- protocol ---------------------------------------------------------------------------------

def test_protocol_round_trip_and_limits():
    line = protocol.encode_request("echo", {"s": "é\n"})
    assert line.endswith(b"\n") and line.count(b"\n") == 1 and line.isascii()
    assert protocol.decode_request(line) == ("echo", {"s": "é\n"})
    assert protocol.decode_request(b'{"cmd":"status"}') == ("status", {})
    assert protocol.decode_response(protocol.encode_response([1, None])) == [1, None]
    with pytest.raises(ControlError) as e:
        protocol.decode_response(protocol.encode_error("busy", "full"))
    assert (e.value.code, e.value.message) == ("busy", "full")
    assert isinstance(e.value, ProtocolError)
    for bad, want in [(b"\xff\n", "bad_json"), (b"[]", "bad_request"), (b'{"cmd":"a","x":1}', "bad_request"),
                      (b'{"cmd":"a","args":NaN}', "bad_json"), (b"[" * 100_000, "too_large"),
                      (b"[" * 60_000, "bad_json")]:
        with pytest.raises(ControlError) as e:
            protocol.decode_request(bad)
        assert e.value.code == want, bad[:20]
    with pytest.raises(ControlError) as e:
        protocol.decode_response(b'{"result": 1}')
    assert e.value.code == "bad_response"
    with pytest.raises(ControlError) as e:
        protocol.encode_request("echo", {"x": "y" * MAX_REQUEST_BYTES})
    assert e.value.code == "too_large"


# ---- server and client -------------------------------------------------------------------------

def test_status_round_trip(serve):
    srv = serve()
    with ControlClient(srv.path) as c:
        assert c.request("status") == {"pid": os.getpid(), "uptime_s": 1.5, "sessions": ["a", "b"]}
        assert c.request("echo", a=1, b=["é", None]) == {"a": 1, "b": ["é", None]}
    assert srv.stats["connections"] == 1  # both requests on one connection
    assert srv.stats["requests"] == 2
    assert srv.stats["errors"] == {}


def test_socket_file_mode_group_and_cleanup(sockdir):
    path = os.path.join(sockdir, "run", "ctl.sock")  # parent does not exist yet
    with ControlServer(path, HANDLERS, ServerOptions(group="nogroup", client_timeout_s=TIMEOUT_S)) as srv:
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
        assert st.st_uid == 0 and st.st_gid == grp.getgrnam("nogroup").gr_gid == srv.gid
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o755
        assert os.listdir(os.path.dirname(path)) == ["ctl.sock"]  # no temporary bind name left
        with pytest.raises(FileExistsError):  # a live server is never replaced
            ControlServer(path, HANDLERS, ServerOptions(group=None)).start()
        assert ControlClient(path).request("echo", x=1) == {"x": 1}
    assert not os.path.exists(path)


def test_missing_group_keeps_root_group_and_stale_socket_replaced(sockdir):
    path = os.path.join(sockdir, "ctl.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()  # a socket file nobody listens on
    with ControlServer(path, HANDLERS, ServerOptions(group="no-such-group-buildidd")) as srv:
        assert srv.gid is None and os.stat(path).st_gid == 0
        assert ControlClient(path).request("echo") == {}
    with open(path, "w"):  # a regular file is not ours to delete
        pass
    with pytest.raises(FileExistsError):
        ControlServer(path, HANDLERS, ServerOptions(group=None)).start()
    assert os.path.isfile(path)


BAD_LINES = [
    (b"\x00\x01garbage}{\n", "bad_json"),
    (b"\xc3\x28\xff\n", "bad_json"),                       # invalid UTF-8
    (b"[1, 2, 3]\n", "bad_request"),                      # JSON, not an object
    (b'{"args": {}}\n', "bad_request"),                   # missing cmd
    (b'{"cmd": 7}\n', "bad_request"),                     # cmd not a string
    (b'{"cmd": "echo", "args": [1]}\n', "bad_request"),   # args not an object
    (b'{"cmd": "nope"}\n', "unknown_command"),
    (b"[" * 60_000 + b"\n", "bad_json"),                  # nested too deep for the parser
    (b"\n", "bad_json"),
]


@pytest.mark.parametrize("line,want", BAD_LINES, ids=[w + str(i) for i, (_, w) in enumerate(BAD_LINES)])
def test_malformed_request_gets_code_and_connection_survives(serve, line, want):
    srv = serve()
    with raw(srv.path) as s, s.makefile("rb") as f:
        s.sendall(line + b'{"cmd": "echo", "args": {"after": true}}\n')
        assert code(read_line(f)) == want
        assert read_line(f) == {"ok": True, "result": {"after": True}}
    assert ControlClient(srv.path).request("echo", other=1) == {"other": 1}
    assert srv.stats["errors"] == {want: 1}


def test_handler_errors(serve):
    srv = serve()
    with ControlClient(srv.path) as c:
        with pytest.raises(ControlError) as e:
            c.request("boom")
        assert e.value.code == "internal" and "Boom" in e.value.message
        with pytest.raises(ControlError) as e:
            c.request("needs_pid")
        assert e.value.code == "bad_request" and "missing 'pid'" in e.value.message
        with pytest.raises(ControlError) as e:
            c.request("unserialisable")
        assert e.value.code == "internal"
        with pytest.raises(ControlError) as e:
            c.request("nope")
        assert e.value.code == "unknown_command"
        assert c.request("status")["pid"] == os.getpid()  # still serving, same connection
    assert srv.stats["errors"] == {"internal": 2, "bad_request": 1, "unknown_command": 1}
    assert srv._thread.is_alive()


def test_line_of_exactly_max_bytes_is_accepted(serve):
    srv = serve()
    body = b'{"cmd": "echo"}'
    with raw(srv.path) as s, s.makefile("rb") as f:
        s.sendall(body + b" " * (MAX_REQUEST_BYTES - len(body)) + b"\n")
        assert read_line(f) == {"ok": True, "result": {}}


def test_oversized_line_too_large_and_closed(serve):
    srv = serve()
    with raw(srv.path) as s:
        try:
            s.sendall(b"x" * (MAX_REQUEST_BYTES + 1000))  # no newline
        except BrokenPipeError:
            pass  # the server may already have closed; its answer is still queued
        lines, closed = read_until_eof(s)
    assert [code(r) for r in lines] == ["too_large"] and closed
    assert ControlClient(srv.path).request("echo", ok=1) == {"ok": 1}


@pytest.mark.parametrize("send", [b"", b'{"cmd": "sta'], ids=["silent", "partial-line"])
def test_slow_client_times_out(serve, send):
    srv = serve()
    with raw(srv.path) as s:
        t0 = time.monotonic()
        s.sendall(send)
        lines, closed = read_until_eof(s, timeout_s=5 * TIMEOUT_S)
        waited_s = time.monotonic() - t0
    # The server answered "timeout" and closed (an event; read_until_eof's 5 * TIMEOUT_S only bounds
    # a hang), and not before the client's timeout ran out.
    assert [code(r) for r in lines] == ["timeout"] and closed
    assert TIMEOUT_S * 0.9 <= waited_s < 5 * TIMEOUT_S


def test_trickling_client_times_out(serve):
    """Bytes without a complete line do not count as progress (slowloris)."""
    srv = serve()
    with raw(srv.path) as s:
        t0 = time.monotonic()
        try:
            for _ in range(int(4 * TIMEOUT_S / 0.05)):
                s.send(b" ")
                time.sleep(0.05)
        except (BrokenPipeError, ConnectionResetError):
            pass
        lines, closed = read_until_eof(s)
    assert [code(r) for r in lines] == ["timeout"] and closed
    assert time.monotonic() - t0 < 4 * TIMEOUT_S


def test_half_closed_client_gets_all_responses(serve):
    srv = serve()
    with raw(srv.path) as s:
        s.sendall(b'{"cmd": "echo", "args": {"n": 1}}\n{"cmd": "nope"}\n{"cmd": "echo", "args": {"n": 3}}')
        s.shutdown(socket.SHUT_WR)
        lines, closed = read_until_eof(s)
    assert lines[0] == {"ok": True, "result": {"n": 1}}
    assert code(lines[1]) == "unknown_command"
    assert lines[2] == {"ok": True, "result": {"n": 3}}  # the final line needs no "\n" at EOF
    assert closed and len(lines) == 3


def test_client_that_never_reads_is_dropped_without_blocking_others(serve):
    srv = serve()
    size_bytes = 900_000  # below the 1 MiB response cap, far above the socket buffer
    with raw(srv.path) as hog:
        hog.sendall(json.dumps({"cmd": "big", "args": {"size_bytes": size_bytes}}).encode() + b"\n")
        # While the hog's response is stuck, others are served: before the hog is dropped at its
        # timeout (an order of events, not a wall-clock budget).
        with ControlClient(srv.path) as c:
            for _ in range(20):
                assert c.request("echo", x=1) == {"x": 1}
        assert srv.stats["dropped"] == 0
        wait_for(lambda: srv.stats["dropped"] == 1, timeout_s=5 * TIMEOUT_S)
        got = b""
        while chunk := hog.recv(1 << 20):  # what the kernel had buffered, then EOF
            got += chunk
    assert 0 < len(got) < size_bytes and b"\n" not in got  # truncated: no complete response
    assert srv.stats["dropped"] == 1 and len(srv._conns) == 0


def test_response_over_cap_is_too_large(serve):
    srv = serve(max_response_bytes=100_000)
    with ControlClient(srv.path) as c:
        assert len(c.request("big", size_bytes=50_000)) == 50_000
        with pytest.raises(ControlError) as e:
            c.request("big", size_bytes=200_000)
        assert e.value.code == "too_large"
        assert c.request("echo") == {}


def test_max_clients_busy(serve):
    srv = serve(max_clients=2)
    held = [ControlClient(srv.path), ControlClient(srv.path)]
    for c in held:
        c.request("echo")  # both connections are now being served
    with pytest.raises(ControlError) as e:
        ControlClient(srv.path).request("echo")
    assert e.value.code == "busy"
    assert srv.stats["refused"] == 1
    held[0].close()
    wait_for(lambda: len(srv._conns) == 1)
    assert ControlClient(srv.path).request("echo", again=True) == {"again": True}
    held[1].close()


def test_client_reconnects_after_server_idle_timeout(serve):
    srv = serve()
    with ControlClient(srv.path) as c:
        assert c.request("echo", n=1) == {"n": 1}
        time.sleep(TIMEOUT_S * 1.5)  # the server times the idle connection out and closes it
        assert c.request("echo", n=2) == {"n": 2}
    assert srv.stats["connections"] == 2


def test_client_errors_are_oserrors(sockdir, serve):
    with pytest.raises(FileNotFoundError):
        ControlClient(os.path.join(sockdir, "absent.sock")).request("status")
    # A server that accepts and never answers: the client's own timeout.
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.path.join(sockdir, "mute.sock"))
    listener.listen(1)
    try:
        with pytest.raises(TimeoutError):
            ControlClient(os.path.join(sockdir, "mute.sock"), timeout_s=0.3).request("status")
    finally:
        listener.close()


def test_heartbeat_never_stalls_during_abuse(serve):
    """The caller's thread keeps ticking every 1 ms while clients misbehave."""
    # A long client timeout, so that a server waiting on a silent client would
    # stall the caller far longer (2 s) than any scheduling hiccup of a loaded
    # machine running the whole suite (the bound below is 1 s).
    stall_s = 2.0
    srv = serve(max_clients=8, client_timeout_s=stall_s,
                handlers={**HANDLERS, "slow": lambda a: time.sleep(0.001) or "ok"})
    errors: list[BaseException] = []
    good_rounds = [0]

    def silent():
        with raw(srv.path) as s:
            read_until_eof(s, timeout_s=3 * stall_s)

    def oversized():
        with raw(srv.path) as s:
            try:
                s.sendall(b"y" * (3 * MAX_REQUEST_BYTES))
            except (BrokenPipeError, ConnectionResetError):
                pass
            read_until_eof(s)

    def garbage():
        with raw(srv.path) as s:
            s.sendall(os.urandom(4096).replace(b"\n", b"") + b"\n" + b"\xff" * 100 + b"\n")
            s.shutdown(socket.SHUT_WR)
            read_until_eof(s)

    def non_reader():
        with raw(srv.path) as s:
            s.sendall(b'{"cmd": "big", "args": {"size_bytes": 900000}}\n')
            time.sleep(3 * stall_s)

    def flood():
        for _ in range(30):
            try:
                ControlClient(srv.path, timeout_s=2).request("slow")
            except ControlError as e:
                assert e.code == "busy"

    timeouts_when_good_done: list[int] = []

    def good():
        with ControlClient(srv.path) as c:
            for i in range(50):
                assert c.request("echo", i=i) == {"i": i}
                good_rounds[0] += 1
        timeouts_when_good_done.append(srv.stats["errors"].get("timeout", 0))

    def guard(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # reported by the main thread
                errors.append(e)
        return run

    # Seven abusers at most at once, so the good client always finds one of
    # the server's 8 slots (with 8 abusers it is rightly told "busy").
    threads = [threading.Thread(target=guard(f)) for f in
               (silent, silent, oversized, garbage, non_reader, non_reader, flood, good)]
    for t in threads:
        t.start()
    ticks = 0
    max_gap_s = 0.0
    last = time.monotonic()
    while any(t.is_alive() for t in threads):
        time.sleep(0.001)
        ticks += 1
        now = time.monotonic()
        max_gap_s = max(max_gap_s, now - last)
        last = now
    for t in threads:
        t.join()
    assert not errors, errors
    assert good_rounds[0] == 50
    # A server that waited on a silent client would serve the good client only after that client's
    # stall_s timeout: the good client's 50 rounds end before any silent client is timed out (an
    # order of events), and the caller's ticker never stops for a whole stall_s.
    assert timeouts_when_good_done == [0], timeouts_when_good_done
    assert ticks > 300 and max_gap_s < stall_s, (ticks, max_gap_s)
    wait_for(lambda: len(srv._conns) == 0, timeout_s=5 * stall_s)
    assert srv.stats["dropped"] == 2
    assert srv.stats["errors"]["timeout"] >= 2 and srv.stats["errors"]["too_large"] == 1
    assert ControlClient(srv.path).request("status")["pid"] == os.getpid()


# ---- SO_PEERCRED -------------------------------------------------------------------------------

def request_as(path: str, uid: int, gid: int, groups: list[int]) -> dict:
    """Run ControlClient(path).request("echo") in a forked child with these ids.

    Returns {"result": ...}, {"code": ...} or {"oserror": ...} from the child.
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: only already-imported, lock-free code until _exit
        status = 1
        try:
            os.close(r)
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            try:
                out = {"result": ControlClient(path, timeout_s=5).request("echo", who=uid)}
            except ControlError as e:
                out = {"code": e.code}
            except OSError as e:
                out = {"oserror": repr(e)}
            os.write(w, json.dumps(out).encode())
            status = 0
        finally:
            os._exit(status)
    os.close(w)
    deadline = time.monotonic() + 10
    while True:
        done, wstatus = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("child did not finish")
        time.sleep(0.01)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    assert os.waitstatus_to_exitcode(wstatus) == 0, data
    return json.loads(data)


def test_peer_not_root_not_in_group_is_refused(serve):
    srv = serve(mode=0o666)  # the file mode lets anyone connect: the refusal is SO_PEERCRED's
    assert request_as(srv.path, NOBODY, NOBODY, []) == {"code": "permission_denied"}
    assert srv.stats["refused"] == 1 and srv.stats["errors"] == {"permission_denied": 1}
    assert ControlClient(srv.path).request("echo", who=0) == {"who": 0}  # root still served


def test_allowed_uid_is_accepted(serve):
    srv = serve(mode=0o666, allowed_uids={NOBODY})
    assert request_as(srv.path, NOBODY, NOBODY, []) == {"result": {"who": NOBODY}}


def test_allowed_gid_is_accepted(serve):
    srv = serve(mode=0o666, allowed_gids={12345})
    assert request_as(srv.path, NOBODY, 12345, []) == {"result": {"who": NOBODY}}
    assert request_as(srv.path, NOBODY, NOBODY, []) == {"code": "permission_denied"}


def test_supplementary_group_of_socket_group_is_accepted(serve):
    srv = serve(mode=0o666, group="nogroup")
    nogroup = grp.getgrnam("nogroup").gr_gid
    assert request_as(srv.path, NOBODY, 12345, [nogroup]) == {"result": {"who": NOBODY}}
    assert request_as(srv.path, NOBODY, 12345, [4242]) == {"code": "permission_denied"}


def test_file_mode_still_applies(serve):
    """With the default 0660 root:root socket, nobody cannot even connect."""
    srv = serve()
    out = request_as(srv.path, NOBODY, NOBODY, [])
    assert "PermissionError" in out.get("oserror", ""), out

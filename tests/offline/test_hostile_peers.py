"""``buildidd serve`` under attack by a real unprivileged local user (the ``attacker`` fixture).

Each test is one attack of issue 33 run for real: the attacker's client
(tests/offline/hostile_client.py, the system's python3 run with setpriv) holds
connections that never read, floods slow headers, or asks for session logs;
root's own requests must still be answered, and /metrics must count what was
refused.  Figures are printed (``pytest -s``) for the README's Reliability table.
"""

from __future__ import annotations

import grp
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from buildidd.sessionlog import SessionWriter
from buildidd.store import Store
from conftest import ServeProcess, as_user, as_user_popen, gcc, store_add
from offline.test_serve import request, request_unix

CLIENT = str(Path(__file__).with_name("hostile_client.py"))
SYSTEM_PYTHON = "/usr/bin/python3"
TOKEN = "hostile-peers-token"
SESSION = "20261126T000000Z-33"
BIG_SECTION = ".bigdata"
BIG_SECTION_BYTES = 48 << 20
CONTROL_GROUP = "buildidd-test-ctl"
SRC = '#include <stdio.h>\nint main(void) { puts("%s"); return 0; }\n'


@pytest.fixture(scope="module")
def control_group():
    """A real group for the control group's members (made with groupadd when absent, kept)."""
    try:
        return grp.getgrnam(CONTROL_GROUP).gr_gid
    except KeyError:
        pass
    r = subprocess.run(["groupadd", "-r", CONTROL_GROUP], capture_output=True, text=True)
    if r.returncode != 0 and "already exists" not in r.stderr:
        pytest.fail(f"groupadd: {r.stderr}")
    return grp.getgrnam(CONTROL_GROUP).gr_gid


@pytest.fixture(scope="module")
def world(tmp_path_factory, public_tmp_factory, attacker, control_group):
    """A store with ``small`` and ``big`` (a 48 MiB random section, so its archive and its section are far larger
    than a socket buffer), a session naming both, a config naming the control group, a public socket dir."""
    tmp = tmp_path_factory.mktemp("hostile-peers")
    bins = public_tmp_factory("buildidd-hostile-bins-")
    small = gcc(SRC % "small", bins / "small")
    base = gcc(SRC % "big", bins / "big-base")
    blob = tmp / "blob"
    blob.write_bytes(os.urandom(BIG_SECTION_BYTES))
    big = bins / "big"
    subprocess.run(["objcopy", "--add-section", f"{BIG_SECTION}={blob}", str(base), str(big)], check=True)
    os.chmod(big, 0o755)
    store = Store(tmp / "store", debug_root=tmp / "no-debug")
    bids = {"small": store_add(store, small), "big": store_add(store, big)}
    w = SessionWriter(tmp / "sessions" / SESSION, compress=True)
    w.write({"type": "session", "time_ns": 1, "host": "h", "boot_id": "b", "kernel_release": "6",
             "kernel_build_id": None, "module_build_ids": {}, "boot_to_wall_offset_ns": 0})
    for i, (path, bid) in enumerate(((small, bids["small"]), (big, bids["big"]))):
        w.write({"type": "mmap", "time_ns": 10 + i, "pid": 5, "tid": 5, "comm": "x", "start": 0x400000,
                 "len": 4096, "pgoff": 0, "path": str(path), "build_id": bid, "error": None})
    w.write({"type": "end", "time_ns": 100})
    w.close()
    (tmp / "token").write_text(TOKEN + "\n")
    (tmp / "config.toml").write_text(f'control_group = "{CONTROL_GROUP}"\n')
    sock_dir = public_tmp_factory("buildidd-hostile-sock-")
    return {"tmp": tmp, "store": tmp / "store", "sessions": tmp / "sessions", "bids": bids,
            "sock_dir": sock_dir, "config": tmp / "config.toml"}


def _serve(world, name: str, *extra: str, token: bool = True, wrapper: tuple[str, ...] = ()) -> ServeProcess:
    args = ["--config", str(world["config"]), "--send-timeout", "3", *extra]
    if token:
        args += ["--token-file", str(world["tmp"] / "token")]
    return ServeProcess(world["store"], world["tmp"] / f"{name}.log", *args, session_root=world["sessions"],
                        wrapper=wrapper)


def _auth() -> dict:
    return {"Authorization": f"Bearer {TOKEN}"}


def _metric(serve: ServeProcess, name: str, headers: dict | None = None, sock: Path | None = None) -> int:
    """A counter or gauge of /metrics, labels included in name (``buildidd_serve_refused_total{reason="x"}``);
    asked with headers (the token), or over serve's unix socket sock as root."""
    status, _, body = request(serve.url, "GET", "/metrics", headers) if sock is None else \
        request_unix(sock, "GET", "/metrics")
    assert status == 200
    for line in body.decode().splitlines():
        if line.startswith(name + " "):
            return int(float(line.split()[-1]))
    return 0


def _rss_bytes(pid: int) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", text, re.M).group(1)) * 1024


def _start_holders(attacker, serve: ServeProcess, n: int, path: str, hold_s: float) -> subprocess.Popen:
    p = as_user_popen(attacker, [SYSTEM_PYTHON, CLIENT, "hold", "127.0.0.1", str(serve.port), str(n), path,
                                 TOKEN, str(hold_s)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready = p.stderr.readline()
    assert "ready" in ready, ready + p.stderr.read()
    return p


def _timed(serve: ServeProcess, path: str, headers: dict | None = None) -> tuple[int, float]:
    t0 = time.monotonic()
    status = request(serve.url, "GET", path, headers)[0]
    return status, time.monotonic() - t0


def test_archive_readers_that_never_read_stall_nothing(world, attacker):
    """Attack 1: archive requests whose client never reads (4 KiB receive buffer, a ~48 MB archive) held
    every executor thread; lookups, /sessions and /metrics must answer, and the readers be cut."""
    serve = _serve(world, "stall")
    try:
        holders = _start_holders(attacker, serve, 6, f"/sessions/{SESSION}/archive", hold_s=8)
        time.sleep(1.0)
        bid = world["bids"]["small"]
        answers = [_timed(serve, p, _auth()) for p in (f"/buildid/{bid}/executable", "/sessions", "/metrics",
                                                       f"/buildid/{bid}/section/.text")]
        assert [s for s, _ in answers] == [200, 200, 200, 200], answers
        assert max(t for _, t in answers) < 5.0, answers
        deadline = time.monotonic() + 30
        while _metric(serve, 'buildidd_serve_refused_total{reason="send_timeout"}', _auth()) < 6:
            assert time.monotonic() < deadline, "the readers that never read were not cut"
            time.sleep(0.5)
        cut_after_s = time.monotonic() - deadline + 30 + 1.0
        out = json.loads(holders.communicate(timeout=60)[0])
        print(f"\nstall: 4 lookups answered in max {max(t for _, t in answers):.3f} s while 6 readers held; "
              f"all 6 cut within {cut_after_s:.1f} s of the attack; bytes each got: {out['bytes']}")
        assert all(b < 48 << 20 for b in out["bytes"]), out   # cut before the whole archive went out
    finally:
        log = serve.stop()
    assert "Traceback" not in log, log[-3000:]


def test_section_readers_that_never_read_cost_no_memory(world, attacker):
    """Attack 4a: 30 never-read ``/buildid/ID/section/NAME`` of a 48 MiB section took RSS to 2.93 GB;
    streamed from the file, RSS must stay within 64 MiB of the start."""
    serve = _serve(world, "sections", "--max-streams-per-peer", "64")
    try:
        bid = world["bids"]["big"]
        assert _timed(serve, f"/buildid/{bid}/section/{BIG_SECTION}", _auth())[0] == 200   # warm: parse once
        before = _rss_bytes(serve.proc.pid)
        holders = _start_holders(attacker, serve, 30, f"/buildid/{bid}/section/{BIG_SECTION}", hold_s=2)
        peak = before
        for _ in range(10):
            peak = max(peak, _rss_bytes(serve.proc.pid))
            time.sleep(0.2)
        out = json.loads(holders.communicate(timeout=60)[0])
        print(f"\nsections: 30 never-read requests of a {BIG_SECTION_BYTES} B section: RSS "
              f"{before / 2**20:.1f} MiB before, peak {peak / 2**20:.1f} MiB; statuses {sorted(set(out['status']))}")
        assert set(out["status"]) == {200}, out
        assert peak - before < 64 << 20
        status, headers, body = request(serve.url, "GET", f"/buildid/{bid}/section/{BIG_SECTION}",
                                        {**_auth(), "Range": "bytes=100-199"})
        assert status == 206 and len(body) == 100 and headers["content-range"] == f"bytes 100-199/{BIG_SECTION_BYTES}"
    finally:
        serve.stop()


def test_per_peer_cap_refuses_and_counts(world, attacker):
    """Slow readers are bounded per peer: past --max-streams-per-peer the attacker gets 503, counted; another local
    user (root, over the same 127.0.0.1) is another peer (its socket's uid) and is still served meanwhile."""
    serve = _serve(world, "perpeer", "--max-streams-per-peer", "4")
    try:
        bid = world["bids"]["big"]
        holders = _start_holders(attacker, serve, 10, f"/buildid/{bid}/section/{BIG_SECTION}", hold_s=3)
        time.sleep(0.5)
        root = [_timed(serve, f"/buildid/{world['bids']['small']}/executable", _auth()) for _ in range(5)]
        out = json.loads(holders.communicate(timeout=60)[0])
        refused = _metric(serve, 'buildidd_serve_refused_total{reason="streams_peer"}', _auth())
        print(f"\nper-peer cap 4: attacker statuses {out['status']}, refused {refused}; root meanwhile {root}")
        assert [s for s, _ in root] == [200] * 5, root
        assert out["status"].count(503) == 6 and out["status"].count(200) == 4, out
        assert refused >= 6
    finally:
        serve.stop()


def test_slow_header_flood_under_1024_descriptors(world, attacker):
    """Attack 4b/4c: 1,800 slow-header connections against 1,024 descriptors made legitimate requests fail
    and the log take tracebacks; now the idlest go first, every root request is answered, the log stays short."""
    serve = _serve(world, "flood", wrapper=("prlimit", "--nofile=1024:1024", "--"))
    try:
        flood = as_user_popen(attacker, [SYSTEM_PYTHON, CLIENT, "slowheaders", "127.0.0.1", str(serve.port),
                                         "1800", "8"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert "ready" in flood.stderr.readline()
        bid = world["bids"]["small"]
        answers = [_timed(serve, f"/buildid/{bid}/executable", _auth()) for _ in range(20)]
        evicted = _metric(serve, 'buildidd_serve_refused_total{reason="evicted_idle"}', _auth())
        cap = _metric(serve, "buildidd_serve_connections_max", _auth())
        fout, ferr = flood.communicate(timeout=60)
        assert fout, ferr
        out = json.loads(fout)
    finally:
        log = serve.stop()
    print(f"\nflood: {out['opened']} slow-header connections (cap {cap} under 1,024 fds); {evicted} idle evicted; "
          f"root: {sum(s == 200 for s, _ in answers)}/20 answered, slowest {max(t for _, t in answers):.3f} s; "
          f"log {len(log)} bytes")
    assert [s for s, _ in answers] == [200] * 20, answers
    assert cap < 1024 and evicted >= out["opened"] - cap
    assert "Traceback" not in log and len(log) < 20_000, log[-3000:]


def test_malformed_requests_are_counted_not_logged_each(world, attacker):
    """Attack 4c, the log: each malformed request cost a traceback (and an assertion in the access logger);
    now they are counted (``bad_requests``) and at most 10 lines a minute reach the log."""
    serve = _serve(world, "garbage")
    try:
        r = as_user(attacker, [SYSTEM_PYTHON, CLIENT, "garbage", "127.0.0.1", str(serve.port), "200"], timeout=60)
        assert json.loads(r.stdout)["sent"] == 200, r.stderr
        counted = _metric(serve, 'buildidd_serve_refused_total{reason="bad_requests"}', _auth())
    finally:
        log = serve.stop()
    print(f"\ngarbage: 200 malformed requests, {counted} counted, log {len(log)} bytes")
    assert counted >= 100       # the bad Content-Length half; aiohttp logs the TLS bytes at debug level only
    assert "Traceback" not in log and log.count("\n") <= 14, log[-2000:]


def test_session_logs_need_rights(world, attacker, control_group):
    """Attack 5: on loopback, any local user downloaded the session logs.  Now: TCP without a token → 403;
    the unix socket → 403 for a user outside the control group, 200 for a member and for root."""
    sock = world["sock_dir"] / "serve.sock"
    serve = _serve(world, "rights", "--unix-socket", str(sock), token=False)
    try:
        tcp = json.loads(as_user(attacker, [SYSTEM_PYTHON, CLIENT, "get", "127.0.0.1", str(serve.port),
                                            "/sessions"], timeout=30).stdout)
        tcp_archive = json.loads(as_user(attacker, [SYSTEM_PYTHON, CLIENT, "get", "127.0.0.1", str(serve.port),
                                                    f"/sessions/{SESSION}/archive"], timeout=30).stdout)
        unix_other = json.loads(as_user(attacker, [SYSTEM_PYTHON, CLIENT, "get-unix", str(sock), "/sessions"],
                                        timeout=30).stdout)
        uid, gid, _ = attacker
        member = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", f"--groups={control_group}", "--",
                                 SYSTEM_PYTHON, CLIENT, "get-unix", str(sock), "/sessions"],
                                capture_output=True, text=True, timeout=30)
        root = json.loads(subprocess.run([SYSTEM_PYTHON, CLIENT, "get-unix", str(sock), "/sessions"],
                                         capture_output=True, text=True, timeout=30).stdout)
        lookup = json.loads(as_user(attacker, [SYSTEM_PYTHON, CLIENT, "get-unix", str(sock),
                                               f"/buildid/{world['bids']['small']}/executable"], timeout=30).stdout)
        forbidden = _metric(serve, 'buildidd_serve_refused_total{reason="sessions_forbidden"}', sock=sock)
    finally:
        serve.stop()
    print(f"\nrights: attacker TCP {tcp['status']}/{tcp_archive['status']}, attacker unix {unix_other['status']}, "
          f"group member unix {json.loads(member.stdout)['status']}, root unix {root['status']}; counted {forbidden}")
    assert tcp["status"] == 403 and tcp_archive["status"] == 403 and unix_other["status"] == 403
    assert json.loads(member.stdout)["status"] == 200 and root["status"] == 200
    assert lookup["status"] == 200      # build-id lookups stay open to every local user
    assert forbidden == 3


def test_zero_suffix_range_is_416(world):
    """Minor: ``Range: bytes=-0`` gave 206 with the whole file."""
    serve = _serve(world, "range")
    try:
        bid = world["bids"]["small"]
        for path in (f"/buildid/{bid}/executable", f"/buildid/{bid}/section/.text", f"/sessions/{SESSION}/archive"):
            request(serve.url, "GET", path, _auth())        # the archive is spooled by the first GET
            status, headers, body = request(serve.url, "GET", path, {**_auth(), "Range": "bytes=-0"})
            assert status == 416 and re.fullmatch(r"bytes \*/\d+", headers.get("content-range", "")), (path, status)
            assert request(serve.url, "GET", path, {**_auth(), "Range": "bytes=-1"})[0] == 206
    finally:
        serve.stop()


def test_unix_socket_refuses_a_non_socket_path(world):
    """--unix-socket never unlinks a file that is not a socket."""
    path = world["tmp"] / "not-a-socket"
    path.write_text("keep me")
    with pytest.raises(AssertionError, match="not a socket"):
        _serve(world, "notsock", "--unix-socket", str(path), token=False)
    assert path.read_text() == "keep me"

"""The control socket of a running daemon, as a client: status, abuse, refused peers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from buildidd.control.client import ControlClient
from buildidd.control.protocol import ControlError


@pytest.fixture
def daemon(bpf, tmp_path):
    ctl = tmp_path / "ctl" / "control.sock"
    notify = tmp_path / "notify.sock"
    ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ns.bind(str(notify))
    ns.settimeout(60)
    p = subprocess.Popen([sys.executable, "-m", "buildidd.cli", "run", "--session-root", str(tmp_path / "s"), "--store-root", str(tmp_path / "store"),
                          "--control-socket", str(ctl)],
                         env={**os.environ, "NOTIFY_SOCKET": str(notify)}, stderr=subprocess.PIPE)
    while "READY=1" not in ns.recv(4096).decode():
        pass
    yield p, ctl
    p.terminate()
    assert p.wait(timeout=60) == 0


def _raw(path, data: bytes, *, shut_wr=False, timeout=5.0) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        if data:
            s.sendall(data)
        if shut_wr:
            s.shutdown(socket.SHUT_WR)
        out = b""
        try:
            while not out.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                out += chunk
        except (socket.timeout, ConnectionResetError):
            pass
        return out


def test_status_abuse_and_refusal_while_recording(daemon):
    p, ctl = daemon
    with ControlClient(str(ctl)) as c:
        before = c.request("status")
    for key in ("session", "session_dir", "uptime_s", "events", "events_per_s", "lost", "identity_cache",
                "build_ids_resolved", "build_ids_missing", "snapshots", "last_errors"):
        assert key in before, key
    # A workload keeps exec'ing while clients misbehave.
    stop = threading.Event()
    execs = [0]

    def work():
        while not stop.is_set():
            subprocess.run(["/bin/true"])
            execs[0] += 1
            time.sleep(0.01)
    t = threading.Thread(target=work)
    t.start()
    try:
        assert json.loads(_raw(ctl, b"\xff\xfe garbage\n"))["error"]["code"] == "bad_json"
        assert json.loads(_raw(ctl, b'["status"]\n'))["error"]["code"] == "bad_request"
        assert json.loads(_raw(ctl, b'{"cmd":"reboot"}\n'))["error"]["code"] == "unknown_command"
        assert json.loads(_raw(ctl, b"x" * (70 * 1024)))["error"]["code"] == "too_large"
        slow = _raw(ctl, b"", timeout=15)                 # connects, says nothing
        assert json.loads(slow)["error"]["code"] == "timeout"
        half = json.loads(_raw(ctl, b'{"cmd":"status"}\n', shut_wr=True))
        assert half["ok"] and half["result"]["session"] == before["session"]
        with pytest.raises(ControlError) as e:
            with ControlClient(str(ctl)) as c:
                c.request("lookup", pid="nonsense", addr=1)
        assert e.value.code == "bad_request"
        # A peer without permission: uid/gid nobody.
        r = subprocess.run([sys.executable, "-c", f"""
import os, socket, sys
os.setgroups([]); os.setgid(65534); os.setuid(65534)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect({str(ctl)!r})
    s.sendall(b'{{"cmd":"status"}}\\n')
    print(s.recv(4096).decode())
except PermissionError:
    print("EACCES")
"""], capture_output=True, text=True, timeout=30)
        assert "EACCES" in r.stdout or "permission_denied" in r.stdout, r
        assert "session_dir" not in r.stdout
    finally:
        stop.set()
        t.join()
    with ControlClient(str(ctl)) as c:
        after = c.request("status")
        assert after["events"].get("exec", 0) - before["events"].get("exec", 0) >= execs[0] * 0.9
        look = c.request("lookup", pid=p.pid, addr=int(open(f"/proc/{p.pid}/maps").readline().split("-")[0], 16))
        assert look["pid"] == p.pid and look["path"]
        assert c.request("rotate")["rotated"]
    # The CLI, as an operator types it.
    cli = [sys.executable, "-m", "buildidd.cli"]
    text = subprocess.run([*cli, "status", "--socket", str(ctl)], capture_output=True, text=True, timeout=30)
    assert text.returncode == 0, text.stderr
    for word in ("session", "uptime", "events", "lost", "identity", "build-ids", "snapshots"):
        assert word in text.stdout, (word, text.stdout)
    as_json = json.loads(subprocess.run([*cli, "status", "--socket", str(ctl), "--json"], capture_output=True,
                                        text=True, timeout=30).stdout)
    assert as_json["session"] == before["session"]
    lk = subprocess.run([*cli, "lookup", "--socket", str(ctl), str(p.pid), hex(look["addr"])],
                        capture_output=True, text=True, timeout=30)
    assert lk.returncode == 0 and look["path"] in lk.stdout
    gone = subprocess.run([*cli, "status", "--socket", str(ctl) + ".absent"], capture_output=True, text=True)
    # NotRunningError: exit status 3, as systemctl status of an inactive unit.
    assert gone.returncode == 3 and f"no buildidd listening on {ctl}.absent" in gone.stderr
    assert p.poll() is None

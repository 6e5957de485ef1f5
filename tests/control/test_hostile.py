"""The control socket against a real unprivileged user (the ``attacker`` fixture).

The attacker's side runs as that user (setpriv) with the same ControlClient the
CLI uses; root's side runs in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from buildidd.control import ControlClient, protocol
from buildidd.control.handlers import make_handlers
from conftest import as_user, as_user_popen

from control.test_control import serve, sockdir  # noqa: F401  (fixtures)

PY = sys.executable

#: Run as the attacker: one request, prints the result or {"code": ...} as JSON.
REQUEST = r"""
import json, sys
from buildidd.control import ControlClient, ControlError
path, cmd, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
if args.get("addr") == "self":
    import os
    args["pid"] = os.getpid()
    args["addr"] = int(open("/proc/self/maps").readline().split("-")[0], 16)
try:
    with ControlClient(path, timeout_s=10) as c:
        print(json.dumps({"result": c.request(cmd, **args)}))
except ControlError as e:
    print(json.dumps({"code": e.code, "message": e.message}))
"""

#: Run as the attacker: connect and close as fast as it can until killed.
LOOP = r"""
import socket, sys
while True:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(sys.argv[1])
    except OSError:
        pass
    s.close()
"""

#: Run as the attacker: open connections, send nothing, keep them (until killed).
HOLD = r"""
import socket, sys, time
held = []
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sys.argv[1])
    held.append(s)
print("held", flush=True)
time.sleep(600)
"""


class FakeRecorder:
    """What status and rotate read of a Recorder (no BPF needed for the socket's rules)."""

    def status(self) -> dict:
        return {"session": "s"}

    def request_rotate(self, timeout_s: float) -> bool:
        time.sleep(0.5)  # a slow rotation: the recording thread is busy
        return True

    def current_segment(self):
        return None

    def next_segment(self):
        return None


@pytest.fixture
def hostile_server(serve, attacker):
    """A ControlServer with the daemon's handlers that admits the attacker's uid."""
    def whoami(_args, peer):
        return {"pid": peer.pid, "uid": peer.uid, "gid": peer.gid}

    handlers = {**make_handlers(FakeRecorder()), "whoami": whoami}
    srv = serve(handlers, mode=0o666, allowed_uids={attacker[0]}, client_timeout_s=2.0)
    return srv


def attacker_request(attacker, path: str, cmd: str, **args) -> dict:
    r = as_user(attacker, [PY, "-c", REQUEST, path, cmd, json.dumps(args)], timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_handlers_get_the_callers_credentials(hostile_server, attacker):
    got = attacker_request(attacker, hostile_server.path, "whoami")["result"]
    assert (got["uid"], got["gid"]) == attacker[:2] and got["pid"] > 0
    with ControlClient(hostile_server.path) as c:
        me = c.request("whoami")
    assert (me["pid"], me["uid"]) == (os.getpid(), 0)


def test_lookup_across_users_is_denied(hostile_server, attacker):
    # Root's process (this test): /proc/PID/maps would deny the attacker.
    addr = int(open("/proc/self/maps").readline().split("-")[0], 16)
    got = attacker_request(attacker, hostile_server.path, "lookup", pid=os.getpid(), addr=addr)
    assert got["code"] == protocol.NOT_PERMITTED == "not_permitted"
    assert "permission denied" in got["message"]
    # ... and the oracle agrees: the attacker cannot read those maps itself.
    r = as_user(attacker, ["cat", f"/proc/{os.getpid()}/maps"])
    assert r.returncode != 0 and "Permission denied" in r.stderr
    # pid 1 too; a pid that does not exist is not_found, as for root.
    assert attacker_request(attacker, hostile_server.path, "lookup", pid=1, addr=0)["code"] == "not_permitted"
    # Its own process: allowed, the mapping is found.
    own = attacker_request(attacker, hostile_server.path, "lookup", addr="self", pid=0)
    assert own["result"]["start"] == own["result"]["addr"]
    # Root may look up anything.
    with ControlClient(hostile_server.path) as c:
        assert c.request("lookup", pid=os.getpid(), addr=addr)["start"] == addr


@pytest.mark.xfail(reason="the owner of /proc/PID (task_dump_owner) was seen stale (the euid) after "
                   "PR_SET_DUMPABLE 0 when the dentry existed before; lookup then allows what maps denies",
                   strict=False)
def test_lookup_of_a_non_dumpable_process_of_the_same_user_is_denied(hostile_server, attacker):
    """A setuid-style process (here: prctl PR_SET_DUMPABLE 0) hides its maps even from its owner."""
    src = "import ctypes,time; ctypes.CDLL(None).prctl(4, 0, 0, 0, 0); print('ok', flush=True); time.sleep(60)"
    p = as_user_popen(attacker, [PY, "-c", src], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ok"
        assert os.stat(f"/proc/{p.pid}").st_uid == 0   # task_dump_owner: root when not dumpable
        got = attacker_request(attacker, hostile_server.path, "lookup", pid=p.pid, addr=0)
        assert got["code"] == "not_permitted"
    finally:
        p.kill()
        p.wait()


def test_looping_and_holding_clients_do_not_lock_root_out(hostile_server, attacker):
    path = hostile_server.path
    loops = [as_user_popen(attacker, [PY, "-c", LOOP, path]) for _ in range(3)]
    holder = as_user_popen(attacker, [PY, "-c", HOLD, path, "20"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        ok = 0
        for _ in range(30):
            with ControlClient(path, timeout_s=5) as c:
                if c.request("status") == {"session": "s"}:
                    ok += 1
        assert ok == 30
        assert all(p.poll() is None for p in loops), "the looping clients stopped early"
        refused = hostile_server.stats["errors"].get("busy", 0)
        assert refused > 0, "the per-uid limit never applied"
        print(f"control socket: root's status answered {ok}/30 while 3 looping clients and 1 holder ran; "
              f"{refused} of the attacker's connections refused (busy)")
    finally:
        for p in [*loops, holder]:
            p.kill()
            p.wait()


def test_rotate_does_not_block_status(hostile_server):
    import threading

    done = []
    t = threading.Thread(target=lambda: done.append(ControlClient(hostile_server.path).request("rotate")))
    t.start()
    with ControlClient(hostile_server.path) as c:
        assert c.request("status") == {"session": "s"}
        assert not done, "status waited for the slow rotation"
    t.join(10)
    assert done and done[0]["rotated"] is True


def test_an_idle_client_is_disconnected(hostile_server, attacker):
    src = r"""
import socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
t = time.monotonic()
data = b""
s.settimeout(30)
while chunk := s.recv(4096):
    data += chunk
print(round(time.monotonic() - t, 1), data.decode().strip())
"""
    r = as_user(attacker, [PY, "-c", src, hostile_server.path], timeout=60)
    assert r.returncode == 0, r.stderr
    _seconds, line = r.stdout.split(" ", 1)
    assert json.loads(line)["error"]["code"] == "timeout"
    assert hostile_server.stats["errors"]["timeout"] >= 1


def test_cli_lookup_across_users_exits_4_with_one_line(hostile_server, attacker):
    """``buildidd lookup`` as the attacker, of root's process: exit 4 (permission denied), no traceback."""
    addr = int(open("/proc/self/maps").readline().split("-")[0], 16)
    r = as_user(attacker, [PY, "-m", "buildidd.cli", "lookup", "--socket", hostile_server.path,
                           str(os.getpid()), f"{addr:x}"], timeout=60)
    assert r.returncode == 4, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "permission denied" in lines[0] and "Traceback" not in r.stderr

"""Errors are one line naming the thing and the fix, with the documented exit status (no BPF needed)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from buildidd.cli.common import missing_capabilities
from conftest import public_python
from buildidd.control.handlers import make_handlers
from buildidd.control.server import ControlServer, ServerOptions

BUILDIDD = [sys.executable, "-m", "buildidd.cli"]
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def _run(*args, prefix=(), **kw):
    """buildidd with args; with a prefix (another user), through a Python that user can reach, in /."""
    cli = [public_python(), *BUILDIDD[1:]] if prefix else BUILDIDD
    if prefix:
        kw.setdefault("cwd", "/")
    return subprocess.run([*prefix, *cli, *args], capture_output=True, text=True, timeout=120, **kw)


def _one_line(r) -> str:
    assert "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.splitlines()) == 1, r.stderr
    return r.stderr.strip()


@pytest.fixture
def open_dir():
    """A directory every user may enter (pytest's tmp_path is root-only)."""
    with tempfile.TemporaryDirectory(prefix="buildidd-cli-") as d:
        os.chmod(d, 0o755)
        yield Path(d)


@pytest.fixture
def server(open_dir):
    """A real control server with the daemon's lookup handler, on a socket in open_dir."""
    srv = ControlServer(str(open_dir / "control.sock"), make_handlers(None), ServerOptions())
    srv.start()
    yield srv
    srv.stop()


def test_no_daemon_exits_3_naming_the_socket_and_the_unit(tmp_path):
    sock = tmp_path / "control.sock"
    for verb in (["status"], ["rotate"], ["lookup", "1", "7f3c75c44000"]):
        r = _run(*verb, "--socket", str(sock))
        assert r.returncode == 3
        assert _one_line(r) == (f"buildidd: no buildidd listening on {sock}; is buildidd.service running? "
                                "(systemctl start buildidd, or --socket PATH)")


def test_default_socket_message_is_the_documented_one():
    if os.path.exists("/run/buildidd/control.sock"):
        pytest.skip("a buildidd runs on this host")
    r = _run("status")
    assert r.returncode == 3 and _one_line(r).startswith(
        "buildidd: no buildidd listening on /run/buildidd/control.sock; is buildidd.service running?")


def test_stale_socket_exits_3_and_says_stale(tmp_path):
    path = tmp_path / "control.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))          # bound, never listening: what a killed daemon leaves behind
    s.close()
    r = _run("status", "--socket", str(path))
    assert r.returncode == 3 and "stale socket" in _one_line(r) and str(path) in r.stderr


def test_verbose_adds_the_traceback(tmp_path):
    r = _run("-v", "status", "--socket", str(tmp_path / "none"))
    assert r.returncode == 3 and "Traceback" in r.stderr and "NotRunningError" in r.stderr


def test_socket_permission_denied_exits_4(server, open_dir):
    os.chmod(server.path, 0o600)
    r = _run("status", "--socket", server.path, prefix=NOBODY)
    assert r.returncode == 4
    assert _one_line(r) == (f"buildidd: permission denied on {server.path}; run as root or as a member of "
                            "group 'buildidd'")


def test_daemon_refusing_the_user_exits_4(server):
    os.chmod(server.path, 0o666)           # the socket lets nobody in; SO_PEERCRED check refuses
    r = _run("status", "--socket", server.path, prefix=NOBODY)
    assert r.returncode == 4 and "refused this user" in _one_line(r)


def test_not_root_names_the_missing_capabilities_and_exits_4(open_dir):
    for verb in (["record", "--", "/bin/true"], ["run", "--duration", "1"]):
        r = _run(*verb, "--session-root", str(open_dir / "s"), prefix=NOBODY)
        assert r.returncode == 4, r.stderr
        assert re.fullmatch(rf"buildidd: {verb[0]} needs CAP_SYS_ADMIN, CAP_PERFMON, CAP_BPF; this process lacks "
                            rf"CAP_SYS_ADMIN, CAP_PERFMON, CAP_BPF: run it as root \(sudo buildidd {verb[0]} ...\)",
                            _one_line(r)), r.stderr
        assert "tracefs" not in r.stderr
    assert not (open_dir / "s").exists()


def test_missing_capabilities_reads_cap_eff(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tx\nCapEff:\t0000008000200000\n")       # bits 21 and 39
    assert missing_capabilities(status=str(status)) == ["CAP_PERFMON"]
    status.write_text("CapEff:\t000001ffffffffff\n")
    assert missing_capabilities(status=str(status)) == []


def test_second_daemon_refused_before_loading_anything(server, tmp_path):
    r = _run("run", "--control-socket", server.path, "--session-root", str(tmp_path / "s"), "--duration", "1")
    assert r.returncode == 1
    assert _one_line(r) == (f"buildidd: another buildidd (pid {os.getpid()}) already listens on {server.path}; "
                            "stop it first (systemctl stop buildidd), or give this one --control-socket PATH or ''")
    assert not (tmp_path / "s").exists()


def test_lookup_takes_the_proc_maps_address_form(server):
    me = subprocess.Popen([sys.executable, "-c", "import sys; print('ready', flush=True); sys.stdin.read()"],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert me.stdout.readline() == "ready\n"    # exec'd: its maps are its own, not the forked parent's
        line = next(x for x in Path(f"/proc/{me.pid}/maps").read_text().splitlines() if "libc.so" in x)
        start_text = line.split("-")[0]                               # e.g. 7f3c75c44000, no 0x
        start = int(start_text, 16)
        maps_range = line.split()[0]                                  # pasted as maps prints it: START-END
        for form in ([start_text], [f"0x{start_text}"], ["--decimal", str(start)], [maps_range]):
            r = _run("lookup", "--socket", server.path, str(me.pid), *form)
            assert r.returncode == 0, (form, r.stderr)
            assert r.stdout.startswith(f"{start:#x}-") and "libc.so" in r.stdout, r.stdout
        r = _run("lookup", "--socket", server.path, str(me.pid), "0x10")
        assert r.returncode == 1 and _one_line(r) == (f"buildidd: process {me.pid} has no mapping at 0x10 "
                                                      f"(see /proc/{me.pid}/maps)")
    finally:
        me.stdin.close()
        me.wait()
    r = _run("lookup", "--socket", server.path, str(me.pid), start_text)
    assert r.returncode == 1 and _one_line(r) == (f"buildidd: no process {me.pid} (it exited, or it lives in "
                                                  "another PID namespace than the daemon's)")


def test_usage_errors_exit_2():
    r = _run("lookup", "1", "not-an-address")
    assert r.returncode == 2 and "--decimal" in _one_line(r)
    r = _run("record", "--segment-max-bytes", "64Q", "--", "true")
    assert r.returncode == 2 and "64Q" in r.stderr and "K, M or G" in r.stderr
    r = _run("record")
    assert r.returncode == 2 and "give the command after --" in _one_line(r)
    r = _run("no-such-verb")
    assert r.returncode == 2

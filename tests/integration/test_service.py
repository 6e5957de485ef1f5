"""The daemon under a service manager: sd_notify protocol, SIGTERM, SIGHUP; the unit file."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from conftest import need, session_records

ROOT = Path(__file__).resolve().parents[2]


def _recv_until(sock, needle, timeout):
    got = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            msg = sock.recv(4096).decode()
        except socket.timeout:
            break
        got.append(msg)
        if needle in msg:
            return got
    raise AssertionError(f"{needle!r} not received; got {got}")


def test_notify_ready_watchdog_stopping_and_complete_last_segment(bpf, tmp_path):
    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    root = tmp_path / "sessions"
    env = {**os.environ, "NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "200000"}
    env.pop("WATCHDOG_PID", None)
    p = subprocess.Popen([sys.executable, "-m", "buildidd.cli", "run", "--session-root", str(root), "--store-root", str(tmp_path / "store")],
                         env=env, stderr=subprocess.PIPE)
    try:
        _recv_until(sock, "READY=1", 60)
        # READY only after the programs are attached and running processes synthesized:
        (sdir,) = list(root.iterdir())
        before = session_records(sdir)
        assert before[0]["type"] == "session"
        assert any(r["type"] == "mmap" and r["origin"] == "synthesized" for r in before)
        assert "bpf_compile_s" in before[0]
        # An exec right after READY is recorded: the probes were attached.
        subprocess.run(["/bin/true"], check=True)
        _recv_until(sock, "WATCHDOG=1", 5)
        _recv_until(sock, "STATUS=", 5)
        p.send_signal(signal.SIGTERM)
        _recv_until(sock, "STOPPING=1", 30)
        assert p.wait(timeout=60) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    records = session_records(sdir)
    assert records[-1]["type"] == "end"                  # the last segment is complete
    assert any(r["type"] == "exec" and r["filename"] == "/bin/true" for r in records)
    assert list(sdir.glob("segment-*.jsonl.zst")) and not list(sdir.glob("segment-*.jsonl"))


def test_sighup_rotates(bpf, tmp_path):
    root = tmp_path / "sessions"
    p = subprocess.Popen([sys.executable, "-m", "buildidd.cli", "run", "--session-root", str(root), "--store-root", str(tmp_path / "store"),
                          "--no-compress"], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not list(root.glob("*/segment-*.jsonl")):
            time.sleep(0.1)
        time.sleep(0.5)
        p.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            subprocess.run(["/bin/true"])
            if len(list(root.glob("*/segment-*.jsonl"))) >= 2:
                break
            time.sleep(0.1)
        assert len(list(root.glob("*/segment-*.jsonl"))) >= 2
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
    assert "configuration reloaded" in p.stderr.read()


def test_unit_verifies_and_is_hardened(tmp_path):
    need(shutil.which("systemd-analyze") is not None, "systemd-analyze missing")
    dest = tmp_path / "root"
    env = {**os.environ, "DESTDIR": str(dest)}
    r = subprocess.run([str(ROOT / "scripts" / "install")], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    unit = dest / "etc/systemd/system/buildidd.service"
    text = unit.read_text()
    assert "Type=notify" in text and f"{ROOT}/.venv/bin/buildidd run" in text
    r = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(unit)], capture_output=True, text=True)
    line = [x for x in r.stdout.splitlines() if "Overall exposure level" in x][0]
    score = float(line.split("buildidd.service:")[1].split()[0])
    assert score <= 3.5, line
    assert (dest / "etc/buildidd/buildidd.toml").exists()
    import tomllib
    tomllib.loads((dest / "etc/buildidd/buildidd.toml").read_text())

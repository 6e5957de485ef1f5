"""The daemon under a service manager: sd_notify protocol, SIGTERM, SIGHUP; the unit file."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from conftest import need, offline_pip_env, public_checkout, public_wheel, session_records

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


def test_watchdog_pings_keep_their_pace_while_the_recorder_sleeps_between_records(bpf, tmp_path):
    """WATCHDOG_USEC=1 s: a ping every 0.5 s, however the quiet waits of an idle recorder and the
    steps of records arriving at odd moments fall; a gap of WatchdogSec would get it killed."""
    import random

    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    env = {**os.environ, "NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "1000000"}
    env.pop("WATCHDOG_PID", None)
    p = subprocess.Popen([sys.executable, "-m", "buildidd.cli", "run", "--session-root", str(tmp_path / "s"),
                          "--store-root", "", "--control-socket", ""], env=env, stderr=subprocess.PIPE)
    pings = []
    try:
        _recv_until(sock, "READY=1", 60)
        rng = random.Random(7)
        deadline = time.monotonic() + 8.0
        next_exec = time.monotonic()
        sock.settimeout(0.02)
        while time.monotonic() < deadline:
            if time.monotonic() >= next_exec:       # records at odd moments: steps between pings
                subprocess.run(["/bin/true"])
                next_exec = time.monotonic() + rng.uniform(0.05, 0.9)
            try:
                if "WATCHDOG=1" in sock.recv(4096).decode():
                    pings.append(time.monotonic())
            except socket.timeout:
                pass
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
    gaps = [b - a for a, b in zip(pings, pings[1:])]
    assert len(pings) >= 10, pings
    assert max(gaps) < 0.8, gaps          # half of WATCHDOG_USEC, and some slack


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


def _install(dest: Path, *prefix: str, path_dir: Path | None = None) -> subprocess.CompletedProcess:
    """DESTDIR=dest scripts/install of the session's wheel, its dependencies from the session's wheelhouse
    (conftest.offline_pip_env); with a prefix (another user), the copy of the
    checkout that user can read."""
    env = {**os.environ, "DESTDIR": str(dest), "HOME": "/nonexistent", "BUILDIDD_WHEEL": str(public_wheel()),
           **offline_pip_env()}
    if path_dir is not None:
        env["PATH"] = f"{path_dir}:{env['PATH']}"
    root = public_checkout() if prefix else ROOT
    return subprocess.run([*prefix, str(root / "scripts" / "install")], env=env, capture_output=True, text=True,
                          cwd="/" if prefix else None, timeout=600)


def test_unit_verifies_and_is_hardened(tmp_path):
    need(shutil.which("systemd-analyze") is not None, "systemd-analyze missing")
    dest = tmp_path / "root"
    r = _install(dest)
    assert r.returncode == 0, r.stderr
    unit = dest / "etc/systemd/system/buildidd.service"
    text = unit.read_text()
    assert "Type=notify" in text and "\nExecStart=/opt/buildidd/venv/bin/buildidd run --config /etc/buildidd/buildidd.toml\n" in text
    assert str(ROOT) not in text                                              # the unit outlives the clone
    settings = [x for x in text.splitlines() if x and not x.startswith("#")]
    assert not [x for x in settings if re.search(r"@[A-Z_]+@", x)]          # every placeholder filled
    # The host's /tmp stays visible (short-lived binaries there keep their build-ids and snapshots).
    assert not re.search(r"^PrivateTmp=(yes|true)", text, re.M)
    assert re.search(r"^ReadWritePaths=-/var/lib/buildidd/sessions -/var/lib/buildidd/store -/sys/fs/bpf/buildidd "
                     r"-/var/cache/buildidd/bpf$",
                     text, re.M)
    assert re.search(r"^StartLimitIntervalSec=\d+$", text, re.M) and re.search(r"^StartLimitBurst=\d+$", text, re.M)
    assert "\nMemoryHigh=256M\n" in text and "\nMemoryMax=512M\n" in text
    assert "\nIOSchedulingClass=best-effort\n" in text and "\nIOSchedulingPriority=7\n" in text
    r = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(unit)], capture_output=True, text=True)
    line = [x for x in r.stdout.splitlines() if "Overall exposure level" in x][0]
    score = float(line.split("buildidd.service:")[1].split()[0])
    assert score <= 2.9, line
    assert (dest / "etc/buildidd/buildidd.toml").read_text() == (ROOT / "systemd/buildidd.toml").read_text()
    man = (dest / "usr/local/share/man/man8/buildidd.8").read_text()
    assert man.startswith(".TH BUILDIDD \"8\"") and "lookup" in man


def test_unit_write_paths_follow_the_configured_roots(tmp_path):
    dest = tmp_path / "root"
    (dest / "etc/buildidd").mkdir(parents=True)
    (dest / "etc/buildidd/buildidd.toml").write_text('session_root = "/srv/bid/sessions"\nstore_root = ""\n'
                                                     'bpf_cache_dir = "/srv/bid/bpf"\n')
    r = _install(dest)
    assert r.returncode == 0, r.stderr
    text = (dest / "etc/systemd/system/buildidd.service").read_text()
    assert re.search(r"^ReadWritePaths=-/srv/bid/sessions -/sys/fs/bpf/buildidd -/srv/bid/bpf$", text, re.M), text
    (dest / "etc/buildidd/buildidd.toml").write_text('bpf_cache_dir = ""\nbpf_pin_root = ""\n')
    r = _install(dest)
    assert r.returncode == 0, r.stderr
    text = (dest / "etc/systemd/system/buildidd.service").read_text()
    assert re.search(r"^ReadWritePaths=-/var/lib/buildidd/sessions -/var/lib/buildidd/store$", text, re.M), text
    (dest / "etc/buildidd/buildidd.toml").write_text('sesion_root = "/x"\n')          # a typo: refused
    r = _install(dest)
    assert r.returncode != 0 and "unknown key 'sesion_root'" in r.stderr


def test_install_with_destdir_changes_nothing_outside_it(tmp_path):
    """As an unprivileged user (any write outside DESTDIR would fail) and with the host-changing tools
    replaced by stubs that log their call: nothing is called, only DESTDIR is written."""
    need(shutil.which("setpriv") is not None, "setpriv missing")
    top = Path(tempfile.mkdtemp(prefix="buildidd-install-"))
    try:
        os.chmod(top, 0o777)
        stubs, calls = top / "stubs", top / "calls.log"
        stubs.mkdir()
        for tool in ("systemctl", "groupadd", "useradd", "chown", "chgrp", "apt-get", "pip", "mount",
                     "scripts-setup", "getent", "sudo"):
            (stubs / tool).write_text(f"#!/bin/sh\necho {tool} \"$@\" >> {calls}\nexit 1\n")
            (stubs / tool).chmod(0o755)
        calls.touch()
        calls.chmod(0o666)
        watched = [Path("/etc/systemd/system"), Path("/etc/buildidd"), Path("/etc/group"), ROOT / ".venv",
                   Path("/usr/local/share/man/man8")]
        before = {p: (p.stat().st_mtime_ns, sorted(os.listdir(p)) if p.is_dir() else None)
                  for p in watched if p.exists()}
        dest = top / "root"
        r = _install(dest, "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", path_dir=stubs)
        assert r.returncode == 0, r.stdout + r.stderr
        assert calls.read_text() == ""
        assert {p: (p.stat().st_mtime_ns, sorted(os.listdir(p)) if p.is_dir() else None)
                for p in watched if p.exists()} == before
        written = sorted(str(p.relative_to(dest)) for p in dest.rglob("*")
                         if (p.is_file() or p.is_symlink()) and not p.is_relative_to(dest / "opt/buildidd/venv"))
        assert written == ["etc/buildidd/buildidd.toml", "etc/systemd/system/buildidd-push.service",
                           "etc/systemd/system/buildidd-serve.service",
                           "etc/systemd/system/buildidd.service", "opt/buildidd/README.md",
                           "opt/buildidd/installed-files", "opt/buildidd/share/buildidd.toml",
                           "usr/local/bin/buildidd", "usr/local/share/man/man8/buildidd.8"]
        assert os.readlink(dest / "usr/local/bin/buildidd") == "/opt/buildidd/venv/bin/buildidd"
        assert (dest / "opt/buildidd/venv/bin/buildidd").read_text().startswith("#!/opt/buildidd/venv/bin/python")
        assert sorted(x.name for x in top.iterdir()) == ["calls.log", "root", "stubs"]
    finally:
        shutil.rmtree(top)

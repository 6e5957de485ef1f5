"""The recording process keeps no compiler: after READY, `buildidd run` maps no
libLLVM, libclang or libbcc (BCC compiles in kernel.loader's short-lived child).

Its RSS and USS after READY are printed (``pytest -s``), not asserted: sizes and
times belong to the bench (`scripts/bench --scenarios footprint`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

from conftest import session_records

#: Shared objects the compiler brings (BCC's libbcc, LLVM, clang's C++ library).
COMPILER_LIBS = ("libLLVM", "libclang", "libbcc")


def _wait_ready(sock: socket.socket, p: subprocess.Popen, timeout_s: float) -> None:
    sock.settimeout(timeout_s)
    got = []
    while True:
        try:
            msg = sock.recv(4096).decode()
        except socket.timeout:
            raise AssertionError(f"no READY=1 within {timeout_s} s (exit {p.poll()}); got {got}") from None
        got.append(msg)
        if "READY=1" in msg.split("\n"):
            return


def _kib(status: str, key: str) -> int:
    return int(status.split(f"{key}:")[1].split()[0])


def test_recording_process_maps_no_compiler_after_ready(bpf, tmp_path):
    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    root = tmp_path / "sessions"
    env = {**os.environ, "NOTIFY_SOCKET": str(sock_path)}
    p = subprocess.Popen([sys.executable, "-m", "buildidd.cli", "run", "--session-root", str(root),
                          "--store-root", str(tmp_path / "store")], env=env, stderr=subprocess.DEVNULL)
    try:
        _wait_ready(sock, p, 120)
        with open(f"/proc/{p.pid}/maps") as f:
            maps = f.read()
        with open(f"/proc/{p.pid}/status") as f:
            status = f.read()
        with open(f"/proc/{p.pid}/smaps_rollup") as f:
            rollup = f.read()
        # The programs really are loaded and attached: an exec after READY is recorded.
        subprocess.run(["/bin/true"], check=True)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        sock.close()
    compiler = sorted({line.split()[-1] for line in maps.splitlines() if any(s in line for s in COMPILER_LIBS)})
    assert compiler == [], compiler
    assert "bpf-map" in maps          # the rings, mapped from fds the loader's child handed over
    uss_kib = _kib(rollup, "Private_Clean") + _kib(rollup, "Private_Dirty")
    print(f"\nbuildidd run after READY: RSS {_kib(status, 'VmRSS') / 1024:.1f} MiB, "
          f"USS {uss_kib / 1024:.1f} MiB, peak {_kib(status, 'VmHWM') / 1024:.1f} MiB")
    (sdir,) = list(root.iterdir())
    assert any(r["type"] == "exec" and r["filename"] == "/bin/true" for r in session_records(sdir))

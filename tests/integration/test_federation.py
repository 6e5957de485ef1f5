"""A fleet: the real elfutils ``debuginfod`` federating two ``buildidd serve`` on loopback.

``DEBUGINFOD_URLS="http://127.0.0.1:A http://127.0.0.1:B" debuginfod -p PORT -d DB`` with no
scan directories asks both upstreams (in parallel) for what it does not hold, so one URL
resolves a build-id recorded on either host.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from buildidd.store import Store
from conftest import ServeProcess, free_port, gcc, store_add

pytestmark = pytest.mark.skipif(shutil.which("debuginfod") is None or shutil.which("debuginfod-find") is None,
                                reason="elfutils debuginfod not installed")

SRC = '#include <stdio.h>\nint main(void) { puts("%s"); return 0; }\n'


def wait_listening(port: int, proc: subprocess.Popen, log: Path) -> None:
    """Until 127.0.0.1:port accepts a connection (debuginfod has no readiness signal)."""
    for _ in range(300):
        assert proc.poll() is None, f"debuginfod exited: {log.read_text()}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"debuginfod does not listen on {port}: {log.read_text()}")


@pytest.fixture
def fleet(tmp_path, public_tmp_factory):
    hosts = {}
    bins = public_tmp_factory("buildidd-fleet-")      # not private: served (tmp_path is 0700)
    for host in ("host1", "host2"):
        (tmp_path / host).mkdir()
        (bins / host).mkdir()
        exe = gcc(SRC % host, bins / host / "prog", "-g")
        store = Store(tmp_path / host / "store")
        hosts[host] = {"exe": exe, "bid": store_add(store, exe),
                       "serve": ServeProcess(tmp_path / host / "store", tmp_path / host / "serve.log")}
    port = free_port()
    log = tmp_path / "debuginfod.log"
    env = dict(os.environ, DEBUGINFOD_URLS=" ".join(h["serve"].url for h in hosts.values()),
               DEBUGINFOD_CACHE_PATH=str(tmp_path / "federator-cache"))
    with open(log, "w") as f:
        proc = subprocess.Popen(["debuginfod", "-p", str(port), "-d", str(tmp_path / "federator.db")],
                                stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        wait_listening(port, proc, log)
        yield {"hosts": hosts, "url": f"http://127.0.0.1:{port}", "tmp": tmp_path}
    finally:
        proc.kill()
        proc.wait()
        for h in hosts.values():
            h["serve"].stop()


def test_one_url_resolves_build_ids_of_either_host(fleet):
    env = dict(os.environ, DEBUGINFOD_URLS=fleet["url"], DEBUGINFOD_CACHE_PATH=str(fleet["tmp"] / "client-cache"))
    for host, h in fleet["hosts"].items():
        for kind in ("executable", "debuginfo"):
            r = subprocess.run(["debuginfod-find", kind, h["bid"]], env=env, capture_output=True, text=True,
                               timeout=120)
            assert r.returncode == 0, (host, kind, r.stderr)
            assert Path(r.stdout.strip()).read_bytes() == h["exe"].read_bytes(), (host, kind)


def test_a_build_id_held_by_neither_is_404(fleet):
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{fleet['url']}/buildid/{'5a' * 20}/executable", timeout=120)
    assert e.value.code == 404
    env = dict(os.environ, DEBUGINFOD_URLS=fleet["url"], DEBUGINFOD_CACHE_PATH=str(fleet["tmp"] / "client-cache"))
    r = subprocess.run(["debuginfod-find", "executable", "5b" * 20], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and r.stdout == ""

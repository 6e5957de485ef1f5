"""Smaller frictions of issue 34: export needs no --perf; serve's help names no internal constant."""

from __future__ import annotations

import shutil
import subprocess
import sys

from buildidd.offline.serve import DEFAULT_LISTEN
from tests.cli.test_times_addresses import BID_A, _live_session

BUILDIDD = [sys.executable, "-m", "buildidd.cli"]


def test_export_without_perf_writes_perf_data(tmp_path):
    _live_session(tmp_path / "s")
    out = tmp_path / "maps.data"
    r = subprocess.run([*BUILDIDD, "export", str(tmp_path / "s"), "-o", str(out)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stderr.startswith(f"{out}: ") and out.read_bytes()[:8] == b"PERFILE2"
    if shutil.which("perf"):
        ids = subprocess.run(["perf", "buildid-list", "-i", str(out)], capture_output=True, text=True, timeout=60)
        assert BID_A in ids.stdout, ids


def test_serve_listen_help_shows_the_default_not_an_internal_name():
    r = subprocess.run([*BUILDIDD, "serve", "--help"], capture_output=True, text=True, timeout=60,
                       env={"COLUMNS": "200"})
    assert r.returncode == 0
    line = next(x for x in r.stdout.splitlines() if x.strip().startswith("--listen"))
    assert f"default {DEFAULT_LISTEN};" in line and "offline." not in r.stdout and "DEFAULT_LISTEN" not in r.stdout

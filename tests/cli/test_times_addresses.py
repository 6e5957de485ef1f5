"""Addresses and times on the command line of lookup, resolve and show: the frictions of issue 34, each with
its message and exit status (no BPF needed: sessions are written by the session log's writer)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from datetime import datetime

from buildidd import clock
from buildidd.inputs import SessionClock
from buildidd.sessionlog import SessionWriter
from tests.offline.test_replay import mmap, task

BUILDIDD = [sys.executable, "-m", "buildidd.cli"]
S = 10**9
BID_A, BID_B = "aa" * 20, "bb" * 20


def _cli(*args, stdin=None):
    return subprocess.run([*BUILDIDD, *args], input=stdin, capture_output=True, text=True, timeout=60)


def _live_session(directory):
    """pid 100 ran /bin/a (mapped at 0x1000) from 120 s ago, exec'd /bin/b 60 s ago, exited 50 s ago (the
    session's last record is 10 s old);
    times are this boot's, with this host's offset, so relative and wall-clock times land in it."""
    now, offset = clock.boot_ns(), clock.boot_to_wall_offset_ns()
    with SessionWriter(directory, compress=True) as w:
        w.write({"type": "session", "time_ns": now - 130 * S, "boot_to_wall_offset_ns": offset, "host": "h"})
        w.write(mmap(now - 120 * S, 100, 0x1000, 0x1000, "/bin/a", BID_A))
        w.write(task("exec", now - 60 * S, 100, old_tid=100, filename="/bin/b"))
        w.write(mmap(now - 59 * S, 100, 0x1000, 0x1000, "/bin/b", BID_B))
        w.write({"type": "resolution", "time_ns": now - 58 * S, "dev": 1, "ino": 2, "ino_generation": 0,
                 "size": 100, "mtime_ns": 0, "build_id": BID_B})
        w.write(task("exit", now - 50 * S, 100, exit_code=0))
        w.write(task("comm", now - 10 * S, 7))                # another task: the session goes on
    return now, offset


def test_resolve_time_may_start_with_a_dash(tmp_path):
    now, _ = _live_session(tmp_path / "s")
    for when, path in (("-90s", "/bin/a"), ("-40s", "/bin/b"), ("-2min", "/bin/a")):
        for form in (["--time", when], [f"--time={when}"]):
            r = _cli("resolve", str(tmp_path / "s"), "100", "1800", *form, "--store-root", "")
            assert r.returncode == 0 and r.stdout.split()[2] == path, (form, r.stdout, r.stderr)


def test_resolve_bad_time_is_a_usage_error(tmp_path):
    _live_session(tmp_path / "s")
    r = _cli("resolve", str(tmp_path / "s"), "100", "1800", "--time=-40 parsecs", "--store-root", "")
    assert r.returncode == 2
    assert r.stderr == ("buildidd: time '-40 parsecs': a relative time takes units like -40s, -2min, -1h30min, "
                        "-2d\n")
    r = _cli("resolve", str(tmp_path / "s"), "100", "1800", "--time", "half past", "--store-root", "")
    assert r.returncode == 2 and r.stderr.startswith("buildidd: time 'half past': give ns since boot")


def test_resolve_stdin_takes_perf_times_and_goes_on_after_a_bad_line(tmp_path):
    now, _ = _live_session(tmp_path / "s")
    perf_a = f"{(now - 90 * S) // 1000 / 1e6:.6f}:"           # perf script's "sec.usec:" column
    perf_b = f"{(now - 55 * S) / 1e9:.6f}"
    stdin = f"100 1800 {perf_a}\n100 nonsense\n100 55be404ab000-55be404ac000 {perf_b}\n100 0x1800 {perf_b}\n"
    r = _cli("resolve", str(tmp_path / "s"), "--store-root", "", stdin=stdin)
    assert r.returncode == 2
    lines = r.stdout.splitlines()
    assert [line.split()[2] for line in lines] == ["/bin/a", "-", "/bin/b"]
    assert r.stderr.splitlines() == [
        "buildidd: stdin line 2: address 'nonsense': give hex as /proc/PID/maps and perf print it "
        "(7f3c75c44000 or 0x7f3c75c44000, or a maps range 7f3c75c44000-7f3c75c46000), or decimal with --decimal",
        "buildidd: resolve: 1 of 4 stdin lines not understood (named above), 3 answered, 2 with a mapping"]


def test_resolve_shows_exit_times_as_wall_clock(tmp_path):
    now, offset = _live_session(tmp_path / "s")
    r = _cli("resolve", str(tmp_path / "s"), "100", "0x1800", "--store-root", "")
    exited = SessionClock(offset).format(now - 50 * S)
    assert r.returncode == 0 and r.stdout.rstrip().endswith(f"(process exited at {exited})"), r.stdout
    assert re.search(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}[+-]\d{4}\)$", r.stdout.rstrip())


def test_resolve_decimal_address_gets_the_hint(tmp_path):
    _live_session(tmp_path / "s")
    r = _cli("resolve", str(tmp_path / "s"), "100", "139897650563600", "--store-root", "")
    assert r.returncode == 2 and "pass --decimal" in r.stderr and len(r.stderr.splitlines()) == 1
    r = _cli("resolve", str(tmp_path / "s"), "100", "6144", "--decimal", "--store-root", "")   # 0x1800
    assert r.returncode == 0 and r.stdout.split()[1:3] == ["0x1800", "/bin/b"]


def test_lookup_decimal_address_gets_the_hint_before_asking_the_daemon(tmp_path):
    r = _cli("lookup", "--socket", str(tmp_path / "none"), "1", "139897650563600")
    assert r.returncode == 2
    assert r.stderr == ("buildidd: address '139897650563600' has only decimal digits and, read as hex as "
                        "/proc/PID/maps prints it (0x139897650563600), lies beyond user space: if it is decimal "
                        "(0x7f3c75c44a10), pass --decimal; if it is hex, write 0x139897650563600\n")
    r = _cli("lookup", "--socket", str(tmp_path / "none"), "1", "55be404ac000-55be404ab000")
    assert r.returncode == 2 and "is inverted" in r.stderr


def test_show_time_of_day_and_inverted_range(tmp_path):
    now, offset = _live_session(tmp_path / "s")
    when = datetime.fromtimestamp((now - 100 * S + offset) / 1e9).astimezone()
    if when.date() != datetime.now().date():            # just after midnight: "today" is the other day
        when = datetime.fromtimestamp((now - 45 * S + offset) / 1e9).astimezone()
    r = _cli("show", str(tmp_path / "s"), "--since", when.strftime("%H:%M:%S"), "--json")
    assert r.returncode == 0, r.stderr
    assert r.stdout and all(f'"time_ns":{now - 100 * S}' not in line for line in r.stdout.splitlines())
    r = _cli("show", str(tmp_path / "s"), "--since", "now", "--until", "-1h")
    assert r.returncode == 2
    assert re.fullmatch(r"buildidd: --since 'now' \(\S+\) is not before --until '-1h' \(\S+\): the range is "
                        r"inverted\n", r.stderr), r.stderr


def test_show_type_resolution(tmp_path):
    _live_session(tmp_path / "s")
    r = _cli("show", str(tmp_path / "s"), "--type", "resolution", "--json")
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 1 and '"type":"resolution"' in r.stdout


def test_a_reader_gone_is_silent_for_every_printing_verb(tmp_path):
    _live_session(tmp_path / "s")
    s = str(tmp_path / "s")
    for verb in (["help-man"], ["show", s], ["show", s, "--json"], ["buildid-list", s, "--json"],
                 ["resolve", s, "100", "1800", "--store-root", ""], ["--help"]):
        rd, wr = os.pipe()
        os.close(rd)                       # as `| head -c100` after its 100 bytes
        try:
            r = subprocess.run([*BUILDIDD, *verb], stdout=wr, stderr=subprocess.PIPE, text=True, timeout=60)
        finally:
            os.close(wr)
        assert (r.returncode, r.stderr) == (0, ""), verb

"""`buildidd show` on sessions written by the real SessionWriter: times, filters, segment selection, output safety."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import time
from pathlib import Path

import pytest

from buildidd import clock
from buildidd.cli.show import SEGMENT_SLACK_NS, escape, segments_in_range
from buildidd.sessionlog import SessionWriter, list_segments

BUILDIDD = [sys.executable, "-m", "buildidd.cli"]
MIN = 60 * 10**9
LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"


def _mmap(t, pid, path, bid, comm="cc1"):
    return {"type": "mmap", "time_ns": t, "pid": pid, "tid": pid, "comm": comm, "start": 0x7f0000000000,
            "len": 0x1000, "pgoff": 0, "prot": 5, "flags": 2, "origin": "mmap", "deleted": False, "path": path,
            "build_id": bid, "error": None if bid else "not_elf"}


def make_session(root: Path) -> tuple[Path, list[list[dict]]]:
    """Three segments: from two hours ago, from one hour ago, from five minutes ago; uncompressed (.jsonl)."""
    now = clock.boot_ns()
    offset = clock.boot_to_wall_offset_ns()
    base = now - 2 * 60 * MIN
    segs = [
        [{"type": "session", "time_ns": base, "boot_to_wall_offset_ns": offset, "session": root.name},
         _mmap(base + 1, 10, LIBC, "aa" * 20), _mmap(base + 2, 10, "/usr/bin/cc1", "bb" * 20)],
        [_mmap(base + 60 * MIN, 11, LIBC, "aa" * 20), _mmap(base + 60 * MIN + 5, 11, "/tmp/x", None)],
        [_mmap(now - 5 * MIN, 14, LIBC, "cc" * 20, comm="make"),     # in the last segment, before --since
         _mmap(now - 10 * 10**9, 12, LIBC, "cc" * 20, comm="make"),
         _mmap(now - 9 * 10**9, 12, "/usr/lib/x86_64-linux-gnu/libm.so.6", "dd" * 20),
         _mmap(now - 8 * 10**9, 13, "/opt/lib/libcrypt.so.1", None, comm="evil\x1b[2J\x07"),
         {"type": "exit", "time_ns": now - 7 * 10**9, "pid": 12, "tid": 12, "comm": "make", "exit_code": 0}],
    ]
    w = SessionWriter(root, compress=False)
    for i, seg in enumerate(segs):
        if i:
            w.rotate()
        w.write_lines([json.dumps(r).encode() for r in seg])
    w.close()
    return root, segs


def _show(*args, env=None):
    return subprocess.run([*BUILDIDD, "show", *args], capture_output=True, text=True, env=env)


def test_since_and_path_glob_return_exactly_the_matching_records_from_the_overlapping_segment_only(tmp_path):
    sdir, segs = make_session(tmp_path / "s")
    segments = list_segments(sdir)
    assert len(segments) == 3
    # Damage the two old segments after their first line: reading them would report torn records.
    for seg in segments[:2]:
        with open(seg, "ab") as f:
            f.write(b"not json\n")
    r = _show(str(sdir), "--since", "-1min", "--path", "*/libc.so*", "--json")
    assert r.returncode == 0, r.stderr
    got = [json.loads(x) for x in r.stdout.splitlines()]
    assert got == [segs[2][1]]               # libc.so.6 in the last minute; not libm, not libcrypt, not older libc
    assert "torn" not in r.stderr            # the old segments were not read
    r = _show(str(sdir), "--path", "*/libc.so*", "--json")   # without --since every segment is read
    assert [json.loads(x)["pid"] for x in r.stdout.splitlines()] == [10, 11, 14, 12]
    assert r.stderr.count("torn") == 2


def test_segments_in_range_uses_first_times_and_slack():
    segs = [Path(f"segment-00000{i}.jsonl") for i in range(4)]
    firsts = dict(zip(segs, [100 * MIN, 200 * MIN, None, 300 * MIN]))
    pick = lambda since, until: segments_in_range(segs, since, until, first_time=firsts.get)
    assert pick(None, None) == segs
    assert pick(250 * MIN, None) == segs[1:]                   # segment 2's range is unknown: kept
    assert pick(None, 150 * MIN) == [segs[0], segs[2]]         # 1 and 3 start after --until
    # Segment 0 ends at segment 1's first record, plus the slack for late records.
    assert segs[0] in pick(200 * MIN + SEGMENT_SLACK_NS, None)
    assert segs[0] not in pick(200 * MIN + SEGMENT_SLACK_NS + 1, None)
    # Segment 1 ends where the next known first time is (segment 3's), the unknown segment 2 too.
    assert pick(300 * MIN + SEGMENT_SLACK_NS + 1, None) == segs[3:]
    assert pick(300 * MIN + SEGMENT_SLACK_NS, None) == segs[1:]


def test_filters_by_pid_comm_build_id_type_and_until(tmp_path):
    sdir, segs = make_session(tmp_path / "s")
    js = lambda *a: [json.loads(x) for x in _show(str(sdir), "--json", *a).stdout.splitlines()]
    assert [r["pid"] for r in js("--pid", "11")] == [11, 11]
    assert [r["pid"] for r in js("--comm", "ma*")] == [14, 12, 12]
    assert [r["build_id"] for r in js("--build-id", "AAAA")] == ["aa" * 20, "aa" * 20]
    assert [r["type"] for r in js("--type", "exit")] == ["exit"]
    assert [r["pid"] for r in js("--until", "-30min", "--type", "mmap")] == [10, 10, 11, 11]
    r = _show(str(sdir), "--build-id", "xyz")
    assert r.returncode == 2 and "hex prefix" in r.stderr and "Traceback" not in r.stderr


def test_text_shows_dated_zoned_times_escapes_control_characters_and_reports_no_records(tmp_path):
    sdir, segs = make_session(tmp_path / "s")
    r = _show(str(sdir), "--utc", "--pid", "13")
    assert r.returncode == 0
    line = r.stdout.strip()
    offset = segs[0][0]["boot_to_wall_offset_ns"]
    day = time.strftime("%Y-%m-%dT%H:%M", time.gmtime((segs[2][3]["time_ns"] + offset) // 10**9))
    assert line.startswith(day) and "+0000" in line.split()[0]
    assert "\x1b" not in r.stdout and "\x07" not in r.stdout and "evil\\x1b[2J\\x07" in line
    assert "(not_elf)" in line and line.endswith("/opt/lib/libcrypt.so.1")
    r = _show(str(sdir), "--boot-time", "--pid", "13")
    assert r.stdout.split()[0] == str(segs[2][3]["time_ns"])
    r = _show(str(sdir), "--pid", "999999")
    assert r.returncode == 0 and r.stdout == "" and r.stderr.strip() == "-- no records --"


def _on_tty(args, env):
    leader, follower = pty.openpty()
    p = subprocess.Popen([*BUILDIDD, "show", *args], stdout=follower, stderr=subprocess.PIPE, env=env)
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:   # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    p.wait()
    os.close(leader)
    return out


def test_colour_only_on_a_tty_and_never_with_no_color(tmp_path):
    sdir, _ = make_session(tmp_path / "s")
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"} | {"TERM": "xterm"}
    assert b"\x1b[" in _on_tty([str(sdir)], env)
    assert b"\x1b[" not in _on_tty([str(sdir)], env | {"NO_COLOR": "1"})
    assert "\x1b[" not in _show(str(sdir), env=env).stdout          # a pipe


def test_not_a_session_is_an_error_with_the_fix(tmp_path):
    (tmp_path / "empty").mkdir()
    r = _show(str(tmp_path / "empty"))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip() == (f"buildidd: {tmp_path / 'empty'} is not a buildidd session (no segment-*.jsonl "
                                "files in it); give a session directory, its name under --session-root, or 'latest'")
    r = _show("nosuch", "--session-root", str(tmp_path))
    assert r.returncode == 1 and "no session 'nosuch'" in r.stderr and len(r.stderr.splitlines()) == 1


def test_show_into_a_closed_pipe_is_quiet(tmp_path):
    sdir, _ = make_session(tmp_path / "s")
    r = subprocess.run(f"{sys.executable} -m buildidd.cli show {sdir} | head -1", shell=True, capture_output=True,
                       text=True)
    assert len(r.stdout.splitlines()) == 1 and r.stderr == ""


def test_escape():
    assert escape("plain /usr/lib/libc.so.6") == "plain /usr/lib/libc.so.6"
    assert escape("a\nb\tc\x9b") == "a\\x0ab\\x09c\\x9b"
    assert escape("bad\udcffbyte") == "bad\\xffbyte"

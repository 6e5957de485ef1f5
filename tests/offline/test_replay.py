"""Replaying sessions written with SessionWriter: exec, fork, supersede, pid reuse, two build-ids for a path."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from datetime import datetime, timezone

import pytest

from conftest import gcc, readelf_build_id

from buildidd.offline.resolutions import LateResolutions
from buildidd.offline.replay import MAX_FORK_HOPS, Query, Replay
from buildidd.offline.symbols import Symbolizer
from buildidd.sessionlog import SessionWriter
from buildidd.store import Store

OFFSET_NS = 1_700_000_000_000_000_000
BID_A, BID_B, BID_LIBC, BID_NEW = "aa" * 20, "bb" * 20, "cc" * 20, "dd" * 20
BID_V1, BID_V2 = "01" * 20, "02" * 16


def mmap(t, pid, start, length, path, bid, pgoff=0, origin="mmap", tid=None):
    return {"type": "mmap", "time_ns": t, "pid": pid, "tid": tid or pid, "comm": "x", "start": start,
            "len": length, "pgoff": pgoff, "prot": 5, "flags": 2, "origin": origin, "deleted": False,
            "path": path, "dev": 1, "ino": 2, "ino_generation": 0, "size": 100, "mtime_ns": 0,
            "build_id": bid, "build_id_source": "map_files" if bid else "none",
            "error": None if bid else "no_build_id"}


def task(kind, t, pid, **kw):
    return {"type": kind, "time_ns": t, "pid": pid, "tid": kw.pop("tid", pid), "comm": kw.pop("comm", "x"), **kw}


def write_session(directory, records):
    with SessionWriter(directory, compress=True) as w:
        w.write({"type": "session", "time_ns": 0, "boot_to_wall_offset_ns": OFFSET_NS, "host": "h",
                 "kernel_release": "6.18", "kernel_build_id": "ee" * 20})
        for r in records:
            w.write(r)
    return directory


@pytest.fixture
def history(tmp_path):
    """pid 100: synthesized /bin/a and libc, exec of /bin/b at 10; forks 200 at 20 (which execs at 40);
    maps a new lib over part of libc at 30; pid 300 runs /opt/app v1 (exit 55); pid 301 runs /opt/app
    v2 (replaced binary); pid 300 is reused by a fork of 100 at 70; a thread of 100 is created at 22."""
    recs = [
        mmap(1, 100, 0x1000, 0x1000, "/bin/a", BID_A, origin="synthesized"),
        mmap(1, 100, 0x7000, 0x2000, "/lib/libc.so", BID_LIBC, pgoff=0x1000, origin="synthesized"),
        task("exec", 10, 100, old_tid=100, filename="/bin/b"),
        mmap(11, 100, 0x1000, 0x2000, "/bin/b", BID_B, origin="exec"),
        mmap(12, 100, 0x7000, 0x2000, "/lib/libc.so", BID_LIBC, pgoff=0x1000),
        task("fork", 20, 200, ppid=100, ptid=100),
        task("fork", 22, 100, tid=101, ppid=100, ptid=100),           # a thread: same address space
        mmap(30, 100, 0x7000, 0x1000, "/lib/new.so", BID_NEW, tid=101),
        task("exec", 40, 200, old_tid=200, filename="/opt/other"),
        task("exec", 50, 300, old_tid=300, filename="/opt/app"),
        mmap(51, 300, 0x400000, 0x1000, "/opt/app", BID_V1, origin="exec"),
        task("exit", 55, 300, exit_code=0),
        task("exec", 60, 301, old_tid=301, filename="/opt/app"),
        mmap(61, 301, 0x400000, 0x1000, "/opt/app", BID_V2, origin="exec"),
        task("fork", 70, 300, ppid=100, ptid=101),
    ]
    # The log is ordered by ring, not by time: move the fork of 200 after its exec.
    recs.insert(8, recs.pop(5))
    return Replay.load(write_session(tmp_path / "s", recs))


def _bid(answer):
    return answer.mapping.dso.build_id if answer.mapping else answer.reason


def test_exec_starts_the_address_space_anew(history):
    assert _bid(history.resolve(100, 0x1800, 5)) == BID_A
    assert history.resolve(100, 0x2800, 5).reason == "not_mapped"
    assert history.resolve(100, 0x1800, 10).reason == "not_mapped"     # exec'd, /bin/b not mapped yet
    b = history.resolve(100, 0x2800, 11)
    assert _bid(b) == BID_B and b.file_offset == 0x1800 and b.via == ()


def test_fork_inherits_the_parents_maps_at_fork_time(history):
    a = history.resolve(200, 0x8100, 25)
    assert _bid(a) == BID_LIBC and a.via == (200,) and a.mapping.pid == 100
    assert a.file_offset == 0x8100 - 0x7000 + 0x1000
    # The parent maps new.so over libc's first page at 30: the child still has libc there,
    # the parent (any of its threads) has new.so.
    assert _bid(history.resolve(200, 0x7100, 35)) == BID_LIBC
    assert _bid(history.resolve(100, 0x7100, 35)) == BID_NEW
    assert _bid(history.resolve(100, 0x8100, 35)) == BID_LIBC          # the part not superseded
    assert history.resolve(200, 0x7100, 45).reason == "not_mapped"     # the child exec'd at 40
    assert history.resolve(200, 0x7100, 15).reason == "unknown_pid"    # before the fork


def test_a_path_with_two_build_ids_pid_reuse_and_exit(history):
    assert _bid(history.resolve(300, 0x400010, 52)) == BID_V1
    assert _bid(history.resolve(301, 0x400010)) == BID_V2             # default: end of session
    after_exit = history.resolve(300, 0x400010, 58)
    assert _bid(after_exit) == BID_V1 and after_exit.exited_ns == 55
    reused = history.resolve(300, 0x7100, 80)                          # pid 300 again: a fork of 100
    assert _bid(reused) == BID_NEW and reused.via == (300,) and reused.exited_ns is None
    assert history.resolve(300, 0x400010, 80).reason == "not_mapped"


def test_thread_creation_is_not_a_new_address_space(history):
    assert [e.kind for e in history.epochs(100)] == ["initial", "exec"]
    assert history.resolve(4242, 0x1000).reason == "unknown_pid"


def test_resolve_many_keeps_the_order_and_matches_one_by_one(history):
    qs = [Query(pid, addr, t) for pid in (100, 200, 300, 301, 7) for addr in (0x1800, 0x7100, 0x8100, 0x400010)
          for t in (1, 11, 25, 35, 45, 52, 58, 80)]
    random.Random(1).shuffle(qs)
    many = history.resolve_many(qs)
    assert [a.query for a in many] == qs
    assert many == [history.resolve(q.pid, q.addr, q.time_ns) for q in qs]


def test_sweep_matches_the_latest_covering_mapping_by_brute_force(tmp_path):
    """perf's rule for one process: the latest mapping at or before T that contains ADDR."""
    rng = random.Random(7)
    recs = [mmap(t, 5, rng.randrange(0, 64) * 0x1000, rng.randrange(1, 8) * 0x1000, f"/f{t}", f"{t:040x}",
                 pgoff=rng.randrange(0, 4) * 0x1000) for t in range(1, 400)]
    replay = Replay.load(write_session(tmp_path / "s", recs))
    qs = [Query(5, rng.randrange(0, 72 * 0x1000), rng.randrange(0, 420)) for _ in range(3000)]
    for q, a in zip(qs, replay.resolve_many(qs)):
        want = None
        for r in recs:
            if r["time_ns"] <= q.time_ns and r["start"] <= q.addr < r["start"] + r["len"]:
                want = r
        if want is None:
            assert a.mapping is None and a.reason == "not_mapped", q
        else:
            assert a.mapping.dso.path == want["path"], q
            assert a.file_offset == q.addr - want["start"] + want["pgoff"]


def test_a_fork_cycle_in_a_hostile_session_ends(tmp_path):
    recs = [task("fork", 10, 1, ppid=2, ptid=2), task("fork", 10, 2, ppid=1, ptid=1)]
    replay = Replay.load(write_session(tmp_path / "s", recs))
    a = replay.resolve(1, 0x1000, 20)
    assert a.reason == "not_mapped" and len(a.via) <= MAX_FORK_HOPS


def test_malformed_records_are_skipped_not_fatal(tmp_path):
    recs = [mmap(1, 9, 0x1000, 0x1000, "/ok", BID_A), {"type": "mmap", "time_ns": 2, "pid": "x"},
            dict(mmap(3, 9, 0x5000, 0x1000, "/neg", BID_B), start=-5)]
    replay = Replay.load(write_session(tmp_path / "s", recs))
    assert replay.skipped == 2 and _bid(replay.resolve(9, 0x1000)) == BID_A


SYM_SRC = r"""
__attribute__((noinline)) int buildidd_probe_target(int x) { return x * 3 + 1; }
int main(int argc, char **argv) { (void)argv; return buildidd_probe_target(argc) == 4 ? 0 : 1; }
"""


def _nm_address(exe, name):
    out = subprocess.run(["nm", str(exe)], check=True, capture_output=True, text=True).stdout
    return int(re.search(rf"^([0-9a-f]+) T {name}$", out, re.M).group(1), 16)


@pytest.mark.parametrize("strip", [False, True])
def test_symbolize_names_a_gcc_function_from_the_store(tmp_path, strip):
    """The file offset of a function in a PIE gcc binary → its name, from .symtab (or .dynsym when
    stripped: the symbol is then exported with -rdynamic)."""
    exe = gcc(SYM_SRC, tmp_path / "prog", "-Wl,--build-id=sha1", "-rdynamic")
    vaddr = _nm_address(exe, "buildidd_probe_target")
    if strip:
        subprocess.run(["strip", str(exe)], check=True)
    bid = readelf_build_id(exe)
    store = Store(tmp_path / "store")
    fd = os.open(exe, os.O_RDONLY)
    try:
        store.add_from_fd(fd, str(exe), bid)
    finally:
        os.close(fd)
    sym = Symbolizer(store)
    table = sym.table(bid)
    # vaddr -> file offset through the PT_LOAD holding it (readelf -l), then back.
    off = next(o + (vaddr - v) for o, n, v in table.loads if v <= vaddr < v + n)
    got = sym.symbolize(bid, off + 2)
    assert got is not None and got.name == "buildidd_probe_target" and got.offset == 2
    assert got.source == ("dynsym" if strip else "symtab")
    assert sym.symbolize("ab" * 20, 0) is None and sym.errors["ab" * 20] == "not_in_store"


def test_symbolize_a_stripped_binary_from_its_stored_debuginfo(tmp_path):
    """strip --strip-all leaves no symbol at all; the store's ``debug`` (from debug_root) names it."""
    exe = gcc(SYM_SRC, tmp_path / "prog", "-Wl,--build-id=sha1")
    vaddr = _nm_address(exe, "buildidd_probe_target")
    bid = readelf_build_id(exe)
    debug_root = tmp_path / "debug"
    dbg = debug_root / ".build-id" / bid[:2] / f"{bid[2:]}.debug"
    dbg.parent.mkdir(parents=True)
    subprocess.run(["objcopy", "--only-keep-debug", str(exe), str(dbg)], check=True)
    subprocess.run(["strip", "--strip-all", str(exe)], check=True)
    store = Store(tmp_path / "store", debug_root=debug_root)
    fd = os.open(exe, os.O_RDONLY)
    try:
        assert store.add_from_fd(fd, str(exe), bid).debuginfo
    finally:
        os.close(fd)
    table = Symbolizer(store).table(bid)
    off = next(o + (vaddr - v) for o, n, v in table.loads if v <= vaddr < v + n)
    got = table.lookup(off)
    assert (got.name, got.offset, got.source) == ("buildidd_probe_target", 0, "debuginfo")


def _cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "buildidd.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=60)


def test_resolve_command_reads_stdin_reports_bad_lines_and_converts_wall_time(tmp_path):
    d = tmp_path / "s"
    write_session(d, [mmap(10, 100, 0x1000, 0x1000, "/bin/a", BID_A),
                      task("exec", 20, 100, old_tid=100, filename="/bin/b"),
                      mmap(21, 100, 0x1000, 0x1000, "/bin/b", BID_B)])
    wall_ns = OFFSET_NS + 15                      # boot time 15, as wall-clock ISO 8601 with ns
    wall_15 = (datetime.fromtimestamp(wall_ns // 10**9, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
               + f".{wall_ns % 10**9:09d}Z")
    stdin = (f"100 0x1800\n100 1800 15\n# a comment\n\n100 zz\n7 0x1000\n100 0x1800 {wall_15}\n"
             "100 0x9000 30\n")
    r = _cli("resolve", str(d), "--store-root", str(tmp_path / "none"), stdin=stdin)
    assert r.returncode == 2 and "stdin line 5: address 'zz': give hex as /proc/PID/maps" in r.stderr
    assert r.stderr.splitlines()[-1] == ("buildidd: resolve: 1 of 6 stdin lines not understood (named above), "
                                         "5 answered, 3 with a mapping")
    lines = r.stdout.splitlines()
    assert [line.split()[2] for line in lines] == ["/bin/b", "/bin/a", "-", "/bin/a", "-"]
    assert lines[0] == f"100 0x1800 /bin/b {BID_B} +0x800 (not in store)"
    assert lines[2].endswith("(unknown_pid)") and lines[4].endswith("(not_mapped)")
    one = _cli("resolve", str(d), "100", "1800", "--time", "15", "--json", "--store-root", "")
    assert one.returncode == 0 and '"build_id":"' + BID_A in one.stdout
    assert _cli("resolve", str(d), "100", "--store-root", "").returncode == 2      # PID without ADDR


def test_buildid_list_command_filters_like_perf(tmp_path):
    d = tmp_path / "s"
    write_session(d, [mmap(10, 100, 0x1000, 0x1000, "/bin/a", BID_A),
                      dict(mmap(11, 200, 0x1000, 0x1000, "/bin/b", BID_B), comm="other"),
                      mmap(12, 200, 0x5000, 0x1000, "/bin/nobid", None)])
    r = _cli("buildid-list", str(d), "--store-root", "")
    assert r.stdout.splitlines() == [f"{'ee' * 20} [kernel.kallsyms]", f"{BID_A} /bin/a", f"{BID_B} /bin/b"]
    r = _cli("buildid-list", str(d), "--comm", "other", "--json", "--store-root", "")
    import json
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    assert [(x["path"], x["build_id"], x["error"]) for x in rows[1:]] == [("/bin/b", BID_B, None)]
    r = _cli("buildid-list", str(d), "--pid", "200", "--json", "--store-root", "")
    assert [x["error"] for x in map(json.loads, r.stdout.splitlines())][1:] == [None, "no_build_id"]


def _timeout(m, dev, ino):
    """A mapping record whose resolution missed its deadline (recorded with error timeout, no build-id)."""
    return dict(m, build_id=None, build_id_source="none", error="timeout", dev=dev, ino=ino, size=4096,
                mtime_ns=123)


def _resolution(t, dev, ino, bid, **kw):
    return {"type": "resolution", "time_ns": t, "dev": dev, "ino": ino, "ino_generation": 0, "size": 4096,
            "mtime_ns": 123, "build_id": bid, "build_id_source": "map_files", "error": None, **kw}


@pytest.fixture
def late_session(tmp_path):
    """pid 100 runs a script (exec filename /opt/tool.sh, path the interpreter /usr/bin/interp); two libraries
    time out: /lib/late.so (dev 7, ino 9) is resolved by a later resolution record, /lib/never.so never is;
    a resolution of another identity (other mtime) must not apply."""
    return write_session(tmp_path / "s", [
        dict(task("exec", 10, 100, old_tid=100, filename="/opt/tool.sh", path="/usr/bin/interp"),
             build_id=BID_A, build_id_source="kernel", error=None),
        mmap(11, 100, 0x1000, 0x1000, "/usr/bin/interp", BID_A, origin="exec"),
        _timeout(mmap(12, 100, 0x7000, 0x1000, "/lib/late.so", None), 7, 9),
        _timeout(mmap(13, 100, 0x9000, 0x1000, "/lib/never.so", None), 7, 10),
        _resolution(500, 7, 10, BID_LIBC, mtime_ns=999),          # another content at that inode: not it
        _resolution(900, 7, 9, BID_NEW),
    ])


def test_replay_applies_resolution_records_and_keeps_the_exec_path(late_session):
    replay = Replay.load(late_session)
    late, never, main = (replay.resolve(100, a) for a in (0x7800, 0x9800, 0x1800))
    assert (late.mapping.dso.build_id, late.mapping.dso.error) == (BID_NEW, None)
    assert (never.mapping.dso.build_id, never.mapping.dso.error) == (None, "timeout")
    assert main.mapping.dso.build_id == BID_A and main.exec_path == late.exec_path == "/usr/bin/interp"
    assert replay.late.completed == 1
    # A timed-out mapping after its identity's last resolution is not completed by an earlier answer.
    assert LateResolutions.scan(late_session).answer(dict(_timeout(mmap(901, 1, 0, 1, "/x", None), 7, 9))) is None


def test_buildid_list_and_resolve_show_late_build_ids_and_the_exec_path(late_session):
    r = _cli("buildid-list", str(late_session), "--store-root", "")
    assert r.returncode == 0, r.stderr
    assert f"{BID_NEW} /lib/late.so" in r.stdout.splitlines()
    assert f"{BID_A} /usr/bin/interp" in r.stdout.splitlines() and "tool.sh" not in r.stdout
    rows = {x["path"]: x for x in map(json.loads, _cli("buildid-list", str(late_session), "--json",
                                                        "--store-root", "").stdout.splitlines())}
    assert rows["/usr/bin/interp"]["filenames"] == ["/opt/tool.sh"] and rows["/lib/never.so"]["error"] == "timeout"
    out = _cli("resolve", str(late_session), "100", "0x7800", "--store-root", "").stdout
    assert out.startswith(f"100 0x7800 /lib/late.so {BID_NEW} +0x800") and "(running /usr/bin/interp)" in out
    one = json.loads(_cli("resolve", str(late_session), "100", "0x7800", "--json", "--store-root", "").stdout)
    assert one["build_id"] == BID_NEW and one["exec_path"] == "/usr/bin/interp"


def test_session_facts_reference_late_build_ids_with_their_paths(late_session):
    from buildidd.offline.sessions import session_facts
    uses = session_facts(late_session).uses
    assert uses[BID_NEW].paths == ["/lib/late.so"] and uses[BID_A].paths == ["/usr/bin/interp"]
    assert BID_LIBC not in uses or uses[BID_LIBC].paths == []     # the other identity's answer names no mapping

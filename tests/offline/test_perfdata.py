"""export --perf: perf.data files written from SessionWriter sessions, read back by the real perf."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess

import pytest

from buildidd.offline.perfabi import BUILD_ID_ENTRY, FILE_HEADER, PERF_RECORD_MISC_BUILD_ID_SIZE, SECTION
from buildidd.offline.perfdata import ATTR_SIZE, export_perf

from offline.test_replay import mmap, task, write_session

PERF = shutil.which("perf")
pytestmark = pytest.mark.skipif(PERF is None, reason="perf (linux-perf) is not installed")

KERNEL_BID = "ee" * 20
MMAP2_RE = re.compile(r"PERF_RECORD_MMAP2 (\d+)/(\d+): \[(0x[0-9a-f]+)\((0x[0-9a-f]+)\) @ (0x[0-9a-f]+|0) "
                      r"(?:<([0-9a-f]+)>|[0-9a-f]+:[0-9a-f]+ \d+ \d+)\]: (\S+) (.+)$")


def _perf(*args) -> str:
    r = subprocess.run([PERF, *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.fixture
def session(tmp_path):
    """Two runs of /opt/app with different build-ids (a replaced binary, 20- and 16-byte ids), a
    64-byte build-id perf cannot carry, a file without one, a fork, a thread, an exec, exits;
    records out of time order in the log."""
    recs = [
        mmap(1000, 10, 0x55d000001000, 0x2000, "/opt/app", "01" * 20, pgoff=0x1000, origin="synthesized"),
        task("fork", 2000, 11, ppid=10, ptid=10, comm="app"),
        task("exec", 2100, 11, old_tid=11, filename="/opt/app", comm="app2"),
        mmap(2200, 11, 0x56e000001000, 0x3000, "/opt/app", "02" * 16, pgoff=0x2000, origin="exec"),
        mmap(2300, 11, 0x7f0000000000, 0x1000, "/opt/big.so", "03" * 64),
        mmap(2400, 11, 0x7f0000100000, 0x1000, "/opt/nobid.so", None),
        task("fork", 2500, 11, tid=12, ppid=11, ptid=11),
        mmap(2700, 11, 0x7f0000200000, 0x5000, "/usr/lib/libz.so.1", "04" * 20, pgoff=0x3000, tid=12),
        task("exit", 3000, 11, exit_code=0),
    ]
    recs.insert(1, recs.pop(7))            # the thread's mapping reached the log early
    return write_session(tmp_path / "s", recs), recs


def test_perf_buildid_list_reads_every_build_id_of_the_session(session, tmp_path):
    directory, recs = session
    out = tmp_path / "perf.data"
    stats = export_perf(directory, out)
    want = {(KERNEL_BID, "[kernel.kallsyms]")} | {
        (r["build_id"], r["path"]) for r in recs if r["type"] == "mmap" and r["build_id"]
        and len(r["build_id"]) <= 40}
    got = {tuple(line.split(None, 1)) for line in _perf("buildid-list", "-i", str(out)).splitlines()}
    assert got == want                     # both build-ids of /opt/app, the 16-byte one whole
    assert set(stats.build_ids) == want and stats.build_ids_too_long == 1
    assert stats.records == {"mmap2": 5, "comm": 3, "fork": 2, "exit": 1} and stats.skipped == 0


def test_perf_script_shows_the_mmap2_records_as_recorded(session, tmp_path):
    directory, recs = session
    out = tmp_path / "perf.data"
    export_perf(directory, out)
    text = _perf("script", "-i", str(out), "--show-mmap-events", "--show-task-events")
    got = [m.groups() for m in map(MMAP2_RE.search, text.splitlines()) if m]
    want = sorted((r for r in recs if r["type"] == "mmap"), key=lambda r: r["time_ns"])
    assert [(int(pid), int(tid), int(addr, 16), int(length, 16), int(pgoff, 16), bid, path)
            for pid, tid, addr, length, pgoff, bid, _prot, path in got] == [
        (r["pid"], r["tid"], r["start"], r["len"], r["pgoff"],
         r["build_id"] if r["build_id"] and len(r["build_id"]) <= 40 else None, r["path"]) for r in want]
    assert all(prot == "r-xp" for *_x, prot, _p in got)
    assert "PERF_RECORD_FORK(11:11):(10:10)" in text and "PERF_RECORD_FORK(11:12):(11:11)" in text
    assert "PERF_RECORD_EXIT(11:11):(10:10)" in text
    assert re.search(r"PERF_RECORD_COMM exec: app2:11/11", text)
    # Times are the session's (ns since boot), in perf's sec.usec.
    assert re.search(r"0\.000002: PERF_RECORD_MMAP2 11/11: \[0x56e000001000", text)


def test_layout_is_perfs(session, tmp_path):
    """The header and the build-id entries as header.c lays them out (checked byte-wise, then by perf)."""
    directory, _ = session
    out = tmp_path / "perf.data"
    export_perf(directory, out)
    data = out.read_bytes()
    magic, size, attr_size, attrs_off, attrs_size, data_off, data_size, *_rest = FILE_HEADER.unpack_from(data)
    assert (magic, size, attr_size, attrs_size) == (b"PERFILE2", 104, ATTR_SIZE + 16, ATTR_SIZE + 16)
    assert struct.unpack_from("<II", data, attrs_off) == (1, ATTR_SIZE)        # PERF_TYPE_SOFTWARE, size
    features = struct.unpack_from("<Q", data, 72)[0]
    assert features == 0b11100                                                 # BUILD_ID, HOSTNAME, OSRELEASE
    bid_off, bid_size = SECTION.unpack_from(data, data_off + data_size)
    pos, sizes = bid_off, []
    while pos < bid_off + bid_size:
        _t, misc, rsize, _pid, _raw, n, *_r = BUILD_ID_ENTRY.unpack_from(data, pos)
        assert misc & PERF_RECORD_MISC_BUILD_ID_SIZE and (rsize - BUILD_ID_ENTRY.size) % 64 == 0
        sizes.append(n)
        pos += rsize
    assert pos == bid_off + bid_size and sorted(sizes) == [16, 20, 20, 20]
    header = _perf("report", "-i", str(out), "--header-only")
    assert "# hostname : h" in header and "# os release : 6.18" in header


def test_an_empty_session_is_a_valid_file(tmp_path):
    out = tmp_path / "perf.data"
    stats = export_perf(write_session(tmp_path / "s", []), out)
    assert stats.size_bytes == out.stat().st_size < 1024
    assert _perf("buildid-list", "-i", str(out)).split() == [KERNEL_BID, "[kernel.kallsyms]"]


def test_export_carries_build_ids_of_resolution_records(tmp_path):
    from offline.test_replay import _resolution, _timeout
    late_bid = "5a" * 20
    d = write_session(tmp_path / "s", [_timeout(mmap(10, 100, 0x7000, 0x1000, "/lib/late.so", None), 7, 9),
                                       _timeout(mmap(11, 100, 0x9000, 0x1000, "/lib/never.so", None), 7, 10),
                                       _resolution(900, 7, 9, late_bid)])
    out = tmp_path / "perf.data"
    stats = export_perf(d, out)
    got = {tuple(line.split(None, 1)) for line in _perf("buildid-list", "-i", str(out)).splitlines()}
    assert got == {(KERNEL_BID, "[kernel.kallsyms]"), (late_bid, "/lib/late.so")} and stats.resolved_late == 1
    mmaps = [m for m in map(MMAP2_RE.search, _perf("script", "-i", str(out), "--show-mmap-events").splitlines()) if m]
    assert {(m.group(8), m.group(6)) for m in mmaps} == {("/lib/late.so", late_bid), ("/lib/never.so", None)}

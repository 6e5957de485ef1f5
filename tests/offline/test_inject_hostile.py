"""buildidd inject on truncated, corrupt and hostile perf.data files: a clear error, a bounded run, no output,
the input untouched.  The inputs are real perf.data files written by perf record, then cut or altered."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from buildidd.errors import AnalysisError
from buildidd.offline.inject import inject
from buildidd.offline.perfabi import FILE_HEADER, SECTION
from buildidd.offline.perffile import PerfDataError, PerfFile

from conftest import need
from perfcompare import perf_record_lock

BUILDIDD = [sys.executable, "-m", "buildidd.cli"]


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> Path:
    """A small real profile: perf record -e cpu-clock -g of a shell pipeline, under the host's perf record
    lock (perfcompare.perf_record_lock)."""
    need(shutil.which("perf") is not None, "perf missing")
    d = tmp_path_factory.mktemp("inject-hostile")
    (d / "bid").mkdir()
    out = d / "perf.data"
    with perf_record_lock():
        r = subprocess.run(["perf", "--buildid-dir", str(d / "bid"), "record", "-q", "-N", "--no-buildid", "-e",
                            "cpu-clock", "-g", "-o", str(out), "--", "sh", "-c",
                            "ls -R /usr/lib >/dev/null; cat /dev/null"],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture
def session(tmp_path) -> Path:
    """A session log with its session record and no mappings (the real reader reads it)."""
    s = tmp_path / "session"
    s.mkdir()
    (s / "segment-000001.jsonl").write_text(json.dumps({"type": "session", "time_ns": 1, "host": "elsewhere"}) + "\n")
    return s


def _digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _refused(src: Path, session: Path, out: Path, match: str | None = None) -> str:
    before = _digest(src)
    t0 = time.monotonic()
    with pytest.raises(PerfDataError, match=match) as e:
        inject(src, session, out)
    assert time.monotonic() - t0 < 5
    assert not out.exists() and not list(out.parent.glob(".inject-*"))
    assert _digest(src) == before
    return str(e.value)


def _header(data: bytes) -> list:
    return list(FILE_HEADER.unpack_from(data))


def test_truncated_anywhere_is_refused(profile, session, tmp_path):
    data = profile.read_bytes()
    h = _header(data)
    data_offset, data_size = h[5], h[6]
    cuts = [0, 7, 60, 103, 104, 200, data_offset + 5, data_offset + data_size // 2, data_offset + data_size - 3,
            data_offset + data_size + 8, len(data) - 1]
    for cut in cuts:
        bad = tmp_path / f"cut{cut}.data"
        bad.write_bytes(data[:cut])
        msg = _refused(bad, session, tmp_path / "out.data")
        assert str(bad) in msg and ("truncated" in msg or "corrupt" in msg or "not a perf.data" in msg), (cut, msg)


def _first_record_at(data: bytes) -> int:
    return _header(data)[5]


def test_corrupt_sizes_and_counts_are_refused(profile, session, tmp_path):
    data = bytearray(profile.read_bytes())
    h = _header(data)
    d_off = h[5]
    with open(profile, "rb") as f:
        last = max(off for off, *_ in PerfFile.open(profile, f).records(f))
    last_size = struct.unpack_from("<H", data, last + 6)[0]

    def variant(name: str, edit) -> Path:
        b = bytearray(data)
        edit(b)
        p = tmp_path / f"{name}.data"
        p.write_bytes(b)
        return p

    cases = {
        "record size 0": (lambda b: struct.pack_into("<H", b, d_off + 6, 0), "size 0"),
        "record past the end": (lambda b: struct.pack_into("<H", b, last + 6, last_size + 8), "data section ends"),
        "data size absurd": (lambda b: struct.pack_into("<Q", b, 48, 1 << 62), "outside the file"),
        "attr_size absurd": (lambda b: struct.pack_into("<Q", b, 16, 1 << 40), "attr_size"),
        "attrs count absurd": (lambda b: struct.pack_into("<Q", b, 32, h[2] * (1 << 30)), "attrs section"),
        "big-endian magic": (lambda b: b.__setitem__(slice(0, 8), b"2ELIFREP"), "big-endian"),
        "pipe header": (lambda b: struct.pack_into("<Q", b, 8, 16), "pipe-mode"),
        "feature offset absurd": (lambda b: struct.pack_into("<Q", b, h[5] + h[6], 1 << 60), "feature"),
    }
    for name, (edit, match) in cases.items():
        _refused(variant(name.replace(" ", "_"), edit), session, tmp_path / "out.data", match)


def test_a_build_id_section_with_a_bad_entry_is_refused(profile, tmp_path):
    s = tmp_path / "kernel-session"
    s.mkdir()
    (s / "segment-000001.jsonl").write_text(json.dumps({"type": "session", "time_ns": 1, "kernel_build_id": "ab" * 20})
                                            + "\n")
    with_bids = tmp_path / "with-build-ids.data"
    inject(profile, s, with_bids)                   # HEADER_BUILD_ID: the kernel's entry
    data = bytearray(with_bids.read_bytes())
    with open(with_bids, "rb") as f:
        pf = PerfFile.open(with_bids, f)
    assert pf.features.get(2, (0, 0))[1] > 0, "no HEADER_BUILD_ID entry"
    session = s
    off, _size = pf.features[2]
    struct.pack_into("<H", data, off + 6, 3)        # the first entry's size: 3 bytes
    bad = tmp_path / "bad-build-id.data"
    bad.write_bytes(data)
    _refused(bad, session, tmp_path / "out.data", "HEADER_BUILD_ID")


def test_random_damage_gives_an_error_or_a_readable_file_in_bounded_time(profile, session, tmp_path):
    data = profile.read_bytes()
    d_off = _header(data)[5]
    rng = random.Random(32)
    outcomes = {"refused": 0, "written": 0}
    for i in range(150):
        b = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            at = rng.randrange(0, d_off + 4096) if rng.random() < 0.6 else rng.randrange(len(b))
            b[at] = rng.randrange(256)
        p = tmp_path / "fuzz.data"
        p.write_bytes(b)
        out = tmp_path / "fuzz.out"
        t0 = time.monotonic()
        try:
            inject(p, session, out)
        except (PerfDataError, AnalysisError):
            outcomes["refused"] += 1
            assert not out.exists()
        else:
            outcomes["written"] += 1
            with open(out, "rb") as f:          # what was written reads back whole
                pf = PerfFile.open(out, f)
                assert sum(1 for _ in pf.records(f)) > 0
            out.unlink()
        assert time.monotonic() - t0 < 5, i
    print("random damage:", outcomes)
    assert outcomes["refused"] > 0 and outcomes["written"] > 0


def test_the_output_is_never_the_input(profile, session, tmp_path):
    copy = tmp_path / "in.data"
    shutil.copyfile(profile, copy)
    link = tmp_path / "link.data"
    link.symlink_to(copy)
    before = _digest(copy)
    for out in (copy, link):
        with pytest.raises(AnalysisError, match="is the input"):
            inject(copy, session, out)
    assert _digest(copy) == before


def test_without_session_matches_perf_sees_the_same_profile(profile, session, tmp_path):
    """No mapping of the session matches: every record is copied, and perf script prints the same samples."""
    out = tmp_path / "out.data"
    stats = inject(profile, session, out)
    assert stats.matched == 0 and stats.mmap_records > 0
    assert stats.not_matched["pid_not_in_session"] > 0
    assert any("host" in w for w in stats.warnings)        # another host's session: said
    script = [["perf", "script", "-i", str(p), "-F", "comm,pid,tid,time,ip,sym,dso"] for p in (profile, out)]
    a, b = (subprocess.run(c, capture_output=True, text=True, timeout=60).stdout for c in script)
    if stats.flag_without_build_id:     # perf cannot read the input (another perf ran --buildid-mmap meanwhile)
        assert b.count("\n") >= stats.samples["total"] * 0.99
    else:
        assert a and a == b
    with open(out, "rb") as f:
        pf = PerfFile.open(out, f)
        assert 2 in pf.features and SECTION.size


def test_cli_error_is_one_line_with_status_1(profile, session, tmp_path):
    bad = tmp_path / "bad.data"
    bad.write_bytes(profile.read_bytes()[:500])
    r = subprocess.run([*BUILDIDD, "inject", str(bad), str(session), "-o", str(tmp_path / "o.data")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert len(r.stderr.strip().splitlines()) == 1 and "perf.data" in r.stderr, r.stderr
    r = subprocess.run([*BUILDIDD, "inject", str(tmp_path), str(session), "-o", str(tmp_path / "o.data")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "directory" in r.stderr


def test_a_forged_session_cannot_break_the_output(profile, tmp_path):
    """Session records naming the profile's own mappings: one with a build-id that is not hex (refused as
    invalid_build_id), one with a well-formed one (written, and perf reads it back on that mapping)."""
    from buildidd.offline.inject import parse_mmap

    with open(profile, "rb") as f:
        pf = PerfFile.open(profile, f)
        maps = [parse_mmap(pf, t, rec)[0] for _o, t, misc, rec in pf.records(f)
                if t == 10 and misc & 7 == 2 and rec[72:73] == b"/"]
    assert len(maps) >= 2
    s = tmp_path / "forged"
    s.mkdir()
    lines = [{"type": "session", "time_ns": 1}]
    for m, bid in zip(maps[:2], ("zz" * 20, "ab" * 20)):
        lines.append({"type": "mmap", "time_ns": 2, "pid": m.pid, "tid": m.pid, "start": m.start, "pgoff": m.pgoff,
                      "len": 4096, "dev": None, "ino": None, "path": m.filename.decode(), "build_id": bid})
    (s / "segment-000001.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out.data"
    stats = inject(profile, s, out)
    assert stats.not_matched["invalid_build_id"] >= 1 and stats.matched >= 1
    shown = subprocess.run(["perf", "script", "-i", str(out), "--show-mmap-events"], capture_output=True, text=True,
                           timeout=60).stdout
    assert f"<{'ab' * 20}>" in shown and "zzzz" not in shown


def _as_mmap(profile: Path, dest: Path) -> tuple:
    """A copy of profile whose first user-space MMAP2 is a PERF_RECORD_MMAP (perf 6.1 writes only MMAP2):
    the 32 bytes of maj/min/ino/ino_generation, prot and flags taken out, the data size and the feature
    sections moved to match.  Returns that mapping's PerfMapping."""
    from buildidd.offline.inject import parse_mmap

    data = bytearray(profile.read_bytes())
    with open(profile, "rb") as f:
        pf = PerfFile.open(profile, f)
        off, rec = next((o, bytes(r)) for o, t, misc, r in pf.records(f)
                        if t == 10 and misc & 7 == 2 and r[72:73] == b"/")
        m = parse_mmap(pf, 10, memoryview(rec))[0]
    mmap = struct.pack("<IHH", 1, struct.unpack_from("<H", rec, 4)[0], len(rec) - 32) + rec[8:40] + rec[72:]
    out = data[:off] + mmap + data[off + len(rec):]
    struct.pack_into("<Q", out, 48, pf.data_size - 32)
    index = pf.data_offset + pf.data_size - 32
    for i in range(len(pf.features)):
        at = index + i * SECTION.size
        struct.pack_into("<Q", out, at, struct.unpack_from("<Q", out, at)[0] - 32)
    dest.write_bytes(out)
    return m


def test_an_mmap_record_becomes_an_mmap2_with_the_build_id(profile, tmp_path):
    crafted = tmp_path / "mmap.data"
    m = _as_mmap(profile, crafted)
    shown = subprocess.run(["perf", "script", "-i", str(crafted), "--show-mmap-events"], capture_output=True,
                           text=True, timeout=60).stdout
    assert f"PERF_RECORD_MMAP {m.pid}/" in shown                 # perf reads the crafted input
    s = tmp_path / "s"
    s.mkdir()
    lines = [{"type": "session", "time_ns": 1},
             {"type": "mmap", "time_ns": 2, "pid": m.pid, "tid": m.pid, "start": m.start, "pgoff": m.pgoff,
              "len": 4096, "path": m.filename.decode(), "build_id": "cd" * 20}]
    (s / "segment-000001.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out.data"
    stats = inject(crafted, s, out)
    assert stats.matched == 1
    shown = subprocess.run(["perf", "script", "-i", str(out), "--show-mmap-events"], capture_output=True,
                           text=True, timeout=60).stdout
    line = next(x for x in shown.splitlines() if "cd" * 20 in x)
    assert "PERF_RECORD_MMAP2" in line and f"{m.pid}/" in line and "r-xp" in line and m.filename.decode() in line


def test_an_mmap_record_is_not_given_the_build_id_a_session_names_at_its_address_for_another_path(profile, tmp_path):
    """A PERF_RECORD_MMAP has no dev or inode: the session's record at its (pid, vm_start, pgoff) is its file
    only when the paths agree.  Another path there is identity_differs (not a guess); a record whose
    path_bytes is not base64 is skipped and counted."""
    crafted = tmp_path / "mmap.data"
    m = _as_mmap(profile, crafted)
    s = tmp_path / "s"
    s.mkdir()
    at = {"type": "mmap", "pid": m.pid, "tid": m.pid, "start": m.start, "pgoff": m.pgoff, "len": 4096}
    lines = [{"type": "session", "time_ns": 1},
             {**at, "time_ns": 2, "path": "/elsewhere/libother.so", "build_id": "cd" * 20},
             {**at, "time_ns": 3, "path": m.filename.decode(), "path_bytes": "!not base64!", "build_id": "ef" * 20}]
    (s / "segment-000001.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    stats = inject(crafted, s, tmp_path / "out.data")
    assert stats.matched == 0 and stats.not_matched["identity_differs"] == 1, stats.to_json()
    assert stats.session_records_skipped == 1

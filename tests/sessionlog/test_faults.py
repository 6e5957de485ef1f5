"""The session log under faults: a full tmpfs (ENOSPC), EIO from a real descriptor, and sealing
of sessions a crash left open.

Every line of the result is checked as raw bytes (not through the tolerant
reader): valid JSON, no record twice, records written + records counted lost =
records offered, and a ``lost`` record whose time range covers the gap.
"""

from __future__ import annotations

import errno
import json
import os
import pty
import time
from pathlib import Path

import pytest
import zstandard

from buildidd import clock
from buildidd.sessionlog import SessionWriter, list_segments, read_session, seal_unclosed_sessions
from buildidd.sessionlog.segments import CLOSED_MARKER
from conftest import fill_disk


def raw_lines(session: Path) -> list[bytes]:
    """Every line of every segment, as bytes, decompressing ``.zst`` ones."""
    out: list[bytes] = []
    for seg in list_segments(session):
        data = seg.read_bytes()
        if seg.suffix == ".zst":
            data = zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=True).read()
        assert data.endswith(b"\n"), f"{seg} does not end with a newline"
        out.extend(data[:-1].split(b"\n"))
    return out


def line(i: int) -> bytes:
    return json.dumps({"type": "mmap", "time_ns": clock.boot_ns(), "i": i, "pad": "p" * 60},
                      separators=(",", ":")).encode()


def wait_for(cond, what: str, limit_s: float = 10.0) -> None:
    """Poll cond() until true (a bound on a background retry, not a timing assertion)."""
    end = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < end, f"{what} did not happen within {limit_s} s"
        time.sleep(0.05)


def check_session(session: Path, offered: dict[int, int]) -> tuple[set[int], list[dict]]:
    """The accounting of a session written with records ``offered`` (i → time_ns).

    Returns (ids written, lost records); asserts the rules of the module docstring.
    """
    ids: list[int] = []
    lost: list[dict] = []
    for raw in raw_lines(session):
        rec = json.loads(raw)  # every line is valid JSON: a torn line would raise here
        if rec["type"] == "lost":
            lost.append(rec)
        else:
            ids.append(rec["i"])
    assert len(ids) == len(set(ids)), "a record was written twice"
    assert ids == sorted(ids), "records out of order"
    counted = sum(r["counts"].get("disk_full", 0) + r["counts"].get("io_error", 0) for r in lost)
    assert len(ids) + counted == len(offered)
    missing = sorted(set(offered) - set(ids))
    for i in missing:  # each dropped record lies inside a lost record's range
        assert any(r["first_ns"] <= offered[i] <= r["last_ns"] for r in lost), f"record {i} not covered"
    return set(ids), lost


@pytest.mark.parametrize("max_segment_bytes, compress", [(1 << 30, False), (16 << 10, True)])
def test_enospc_resumes_without_duplicate_or_torn_line(tmpfs_mount, max_segment_bytes, compress):
    mnt = tmpfs_mount("256k")
    filler = mnt / "filler"
    filler.write_bytes(b"f" * (64 << 10))
    session = mnt / "session"
    writer = SessionWriter(session, max_segment_bytes=max_segment_bytes, compress=compress)
    writer.set_max_pending_bytes(2048)      # ~20 records: the rest of the outage is dropped
    offered: dict[int, int] = {}
    i = 0

    def offer(n: int) -> None:
        nonlocal i
        batch = []
        for _ in range(n):
            batch.append(line(i))
            offered[i] = json.loads(batch[-1])["time_ns"]
            i += 1
        writer.write_lines(batch)

    while writer.stats["failing"] is None:
        assert i < 100_000, "the tmpfs never filled up"
        offer(7)
    assert writer.stats["failing"] == "disk_full"
    for _ in range(30):  # the outage goes on: the backlog fills, then records are dropped
        # The finishing thread compresses closed segments meanwhile, which frees
        # space: taken back at once, so the outage lasts.
        fill_disk(filler)
        offer(7)
    stats = writer.stats
    assert stats["records_lost"]["disk_full"] > 0
    assert 0 < stats["pending_bytes"] <= 2048 + 200
    assert stats["write_errors"] >= 1

    filler.unlink()
    wait_for(lambda: writer.stats["pending_records"] == 0 and writer.stats["failing"] is None,
             "the retry thread writing the backlog")
    offer(7)
    writer.close()
    ids, lost = check_session(session, offered)
    # One lost record per stretch of the outage: usually one; two when the finishing thread's
    # compression freed space that the retry thread used before the filler took it back (a busy host).
    assert lost and all(set(r["counts"]) == {"disk_full"} for r in lost), lost
    assert sum(r["counts"]["disk_full"] for r in lost) == writer.stats["records_lost"]["disk_full"]
    # The lost records sit where the gaps were: after the records kept, before the later ones.
    assert max(ids) == i - 1
    assert json.loads((session / CLOSED_MARKER).read_bytes())["clean"] is True
    print(f"ENOSPC (segments of {max_segment_bytes} bytes, compress={compress}): {i} records offered, "
          f"{len(ids)} written once each, {lost[0]['counts']['disk_full']} counted in one lost record, "
          f"0 duplicated, 0 torn")


def test_many_outages_each_get_their_lost_record(tmpfs_mount):
    mnt = tmpfs_mount("256k")
    session = mnt / "session"
    writer = SessionWriter(session, compress=False)
    writer.set_max_pending_bytes(1024)
    offered: dict[int, int] = {}
    i = 0
    for outage in range(3):
        filler = mnt / f"filler{outage}"
        fill_disk(filler)
        for _ in range(20):
            batch = [line(k) for k in range(i, i + 5)]
            for k, raw in zip(range(i, i + 5), batch):
                offered[k] = json.loads(raw)["time_ns"]
            i += 5
            writer.write_lines(batch)
        filler.unlink()
        wait_for(lambda: writer.stats["pending_records"] == 0, "resume")
    writer.close()
    _ids, lost = check_session(session, offered)
    assert len(lost) == 3


def test_eio_from_a_real_descriptor_resumes(tmp_path):
    """EIO through a real fd: the segment's descriptor is swapped for a pty slave whose master
    is closed (write(2) on it fails with EIO, tty_write after hangup), then restored."""
    session = tmp_path / "s"
    writer = SessionWriter(session, compress=False)
    offered = {}
    batch = [line(k) for k in range(5)]
    offered.update({k: 0 for k in range(5)})
    writer.write_lines(batch)
    seg_fd = writer._chain.segment.fd  # the one private reach: no file system here fails on demand
    saved = os.dup(seg_fd)
    master, slave = pty.openpty()
    os.close(master)
    with pytest.raises(OSError) as e:
        os.write(slave, b"x")
    assert e.value.errno == errno.EIO
    os.dup2(slave, seg_fd)
    writer.write_lines([line(k) for k in range(5, 10)])
    offered.update({k: 0 for k in range(5, 10)})
    stats = writer.stats
    assert stats["failing"] == "io_error" and stats["pending_records"] == 5
    assert "Input/output error" in stats["last_write_error"]
    os.dup2(saved, seg_fd)
    os.close(saved)
    os.close(slave)
    writer.write_lines([line(k) for k in range(10, 15)])
    offered.update({k: 0 for k in range(10, 15)})
    assert writer.stats["failing"] is None and writer.stats["pending_records"] == 0
    writer.close()
    ids, lost = check_session(session, offered)
    assert ids == set(range(15)) and lost == []


def test_a_live_session_is_locked(tmp_path):
    root = tmp_path / "sessions"
    writer = SessionWriter(root / "live", compress=False)
    writer.write_lines([line(0)])
    assert seal_unclosed_sessions(root) == []     # skipped: its writer holds the flock
    assert not (root / "live" / CLOSED_MARKER).exists()
    writer.close()


def crashed_session(root: Path, name: str, *, torn: bool, rotated: int = 0) -> Path:
    """A session as kill -9 leaves it: rotated .jsonl segments, an open one, maybe a torn tail."""
    d = root / name
    d.mkdir(parents=True)
    for n in range(rotated + 1):
        (d / f"segment-{n:06d}.jsonl").write_bytes(b"".join(line(n * 10 + k) + b"\n" for k in range(10)))
    if torn:
        with open(d / f"segment-{rotated:06d}.jsonl", "ab") as f:
            f.write(b'{"type":"mmap","i":99')
    (d / f"segment-{rotated:06d}.jsonl.zst.tmp").write_bytes(b"partial")
    return d


def test_seal_crashed_sessions(tmp_path):
    root = tmp_path / "sessions"
    torn = crashed_session(root, "a", torn=True, rotated=2)
    plain = crashed_session(root, "b", torn=False)
    old_mtime = 1_600_000_000 * 10**9
    for p in [*plain.iterdir(), plain]:
        os.utime(p, ns=(old_mtime, old_mtime))
    clean_dir = root / "c"
    with SessionWriter(clean_dir) as w:
        w.write({"type": "end", "time_ns": 1})
    not_a_session = root / "d"
    not_a_session.mkdir()
    (not_a_session / "notes.txt").write_text("x")

    reports = {r.path.name: r for r in seal_unclosed_sessions(root, exclude=["c"])}
    assert set(reports) == {"a", "b"}
    assert reports["a"].sealed and reports["a"].torn_lines == 1 and reports["a"].compressed == 3
    assert reports["b"].sealed and reports["b"].torn_lines == 0
    for d in (torn, plain):
        names = sorted(p.name for p in d.iterdir())
        assert all(n.endswith(".zst") or n == CLOSED_MARKER for n in names), names
        records = list(read_session(d, on_torn=lambda *_: None))
        assert records[-1]["type"] == "end" and records[-1]["clean"] is False
        assert json.loads((d / CLOSED_MARKER).read_bytes())["clean"] is False
    assert [r["i"] for r in read_session(torn, on_torn=lambda *_: None) if r["type"] == "mmap"] == list(range(30))
    # Retention by age still sees when the session was last written.
    assert plain.stat().st_mtime_ns == old_mtime
    assert all(p.stat().st_mtime_ns == old_mtime for p in plain.iterdir())
    # A second start finds nothing to do, and the clean session was left alone.
    assert seal_unclosed_sessions(root) == []
    assert "clean" not in list(read_session(clean_dir))[-1]


def test_seal_after_rotation_without_next_segment(tmp_path):
    """Crash right after a rotation: the last segment is a .zst and there is no end record."""
    root = tmp_path / "sessions"
    w = SessionWriter(root / "s")
    w.write_lines([line(k) for k in range(5)])
    w.rotate()
    w._chain.finisher.close()
    os.close(w._dir_fd)        # what the kernel does at kill -9: the lock goes away
    (report,) = seal_unclosed_sessions(root)
    assert report.sealed and report.compressed == 1
    assert [p.name for p in list_segments(root / "s")] == ["segment-000000.jsonl.zst", "segment-000001.jsonl.zst"]
    assert list(read_session(root / "s"))[-1]["clean"] is False


def test_seal_compresses_rotated_segments_of_a_closed_session(tmp_path):
    """A cleanly closed session whose compression failed (full disk) keeps .jsonl: compressed now."""
    root = tmp_path / "sessions"
    with SessionWriter(root / "s", compress=False) as w:
        w.write_lines([line(k) for k in range(5)])
        w.rotate()
        w.write({"type": "end", "time_ns": 1})
    (report,) = seal_unclosed_sessions(root)
    assert not report.sealed and report.compressed == 2
    assert all(p.suffix == ".zst" for p in list_segments(root / "s"))
    assert len(list(read_session(root / "s"))) == 6

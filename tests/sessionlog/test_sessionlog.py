"""Tests of buildidd.sessionlog on real files (tmp_path, and a small tmpfs as root).

The zstd CLI (and jq when present) are the oracles for the compressed segments.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import zstandard

from buildidd.errors import SessionLogError
from buildidd.sessionlog import SEGMENT_GLOB, SessionWriter, list_segments, read_session
from conftest import fill_disk
from buildidd.sessionlog.segments import MAX_LINE_BYTES


# -- helpers ------------------------------------------------------------------


class FakeClock:
    """A clock in seconds that moves only when told."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def record(i: int, pad: int = 20) -> dict:
    return {"type": "mmap", "i": i, "pad": "x" * pad}


def encode(rec: dict) -> bytes:
    return json.dumps(rec, separators=(",", ":")).encode()


def noisy_record(i: int) -> dict:
    """About 200 bytes that zstd compresses only ~2x, so a segment spans many blocks."""
    digest = hashlib.sha256(str(i).encode()).hexdigest()
    return {"type": "mmap", "i": i, "build_id": digest, "path": f"/usr/lib/{digest[:40]}.so.{i}", "h": digest[::-1]}


def decompress_file(path: Path) -> bytes:
    """Decode a .zst with the zstd CLI when installed, else with zstandard."""
    zstd = shutil.which("zstd")
    if zstd:
        return subprocess.run([zstd, "-q", "-dc", str(path)], check=True, capture_output=True).stdout
    with open(path, "rb") as f:
        return zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True).read()


def segment_records(path: Path) -> list[dict]:
    data = decompress_file(path) if path.suffix == ".zst" else path.read_bytes()
    assert data.endswith(b"\n")
    return [json.loads(line) for line in data.splitlines()]


def ids(records) -> list[int]:
    return [r["i"] for r in records]


class TornLog:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def __call__(self, path: str, lineno: int) -> None:
        self.calls.append((path, lineno))


# -- rotation and compression ---------------------------------------------------


def test_rotation_by_size_keeps_order_and_compresses(tmp_path):
    session = tmp_path / "sessions" / "s1"
    max_bytes = 200
    writer = SessionWriter(session, max_segment_bytes=max_bytes, max_segment_age_s=1e9)
    assert session.is_dir()
    umask = os.umask(0)
    os.umask(umask)
    assert session.stat().st_mode & 0o777 == 0o750 & ~umask

    # Expected segmentation: rotate before a write when the segment holds >= max_bytes.
    expected: list[list[int]] = [[]]
    size = 0
    for i in range(30):
        line = encode(record(i))
        if size >= max_bytes:
            expected.append([])
            size = 0
        writer.write(record(i))
        expected[-1].append(i)
        size += len(line) + 1
    # A batch larger than max_segment_bytes is never split; the next write rotates.
    batch = [encode(record(i)) for i in range(30, 50)]
    writer.write_lines(batch)
    if size >= max_bytes:
        expected.append([])
    expected[-1].extend(range(30, 50))
    writer.write(record(50))
    expected.append([50])
    writer.close()
    writer.close()  # idempotent

    segments = list_segments(session)
    assert [p.name for p in segments] == [f"segment-{n:06d}.jsonl.zst" for n in range(len(expected))]
    assert not list(session.glob("*.jsonl")) and not list(session.glob("*.tmp"))
    assert [ids(segment_records(p)) for p in segments] == expected
    assert ids(read_session(session)) == list(range(51))
    stats = writer.stats
    assert stats["records_written"] == 51
    assert stats["segments_closed"] == stats["segments_compressed"] == len(expected)
    assert stats["write_errors"] == stats["compress_errors"] == 0
    assert stats["current_segment"] is None
    assert stats["bytes_written"] == sum(len(encode(record(i))) + 1 for i in range(51))


def test_rotation_by_age_with_fake_clock(tmp_path):
    clock = FakeClock()
    writer = SessionWriter(tmp_path / "s", max_segment_age_s=10.0, clock=clock)
    plan = [(0.0, 0), (5.0, 1), (9.99, 2), (10.0, 3), (15.0, 4), (19.9, 5), (20.0, 6), (100.0, 7)]
    start = clock.now_s
    for t, i in plan:
        clock.now_s = start + t
        writer.write(record(i))
    # seg0 starts at 0 -> rotated at 10; seg1 starts at 10 -> rotated at 20; seg2 at 20 -> at 100.
    assert writer.current_segment_stats.number == 3
    writer.close()
    segments = list_segments(tmp_path / "s")
    assert [ids(segment_records(p)) for p in segments] == [[0, 1, 2], [3, 4, 5], [6], [7]]
    assert ids(read_session(tmp_path / "s")) == list(range(8))


def test_idle_writer_makes_no_empty_segments(tmp_path):
    clock = FakeClock()
    writer = SessionWriter(tmp_path / "s", max_segment_age_s=1.0, clock=clock)
    writer.rotate()  # nothing open: no-op
    clock.now_s += 100
    writer.write(record(0))
    writer.rotate()
    writer.rotate()  # nothing written since: no-op
    writer.close()
    assert [p.name for p in list_segments(tmp_path / "s")] == ["segment-000000.jsonl.zst"]


def test_zstdcat_jq_pipeline(tmp_path):
    zstdcat, jq = shutil.which("zstdcat"), shutil.which("jq")
    if not (zstdcat and jq):
        pytest.skip("zstdcat or jq not installed")
    writer = SessionWriter(tmp_path / "s", max_segment_bytes=300)
    for i in range(40):
        writer.write(record(i))
    writer.close()
    out = subprocess.run(
        f"{zstdcat} {tmp_path / 's'}/*.zst | {jq} -c .i",
        shell=True, check=True, capture_output=True, text=True,
    ).stdout
    assert [int(x) for x in out.split()] == list(range(40))


def test_uncompressed_session(tmp_path):
    writer = SessionWriter(tmp_path / "s", max_segment_bytes=100, compress=False)
    for i in range(10):
        writer.write(record(i))
    writer.close()
    segments = list_segments(tmp_path / "s")
    assert len(segments) > 1 and all(p.suffix == ".jsonl" for p in segments)
    assert ids(read_session(tmp_path / "s")) == list(range(10))
    assert writer.stats["segments_compressed"] == 0


# -- writer contract -------------------------------------------------------------


def test_directory_with_segments_is_refused(tmp_path):
    session = tmp_path / "s"
    session.mkdir()
    (session / "unrelated.txt").write_text("x")
    SessionWriter(session).close()  # an empty (or foreign-file-only) dir is adopted
    for name in ("segment-000000.jsonl", "segment-000003.jsonl.zst", "segment-000001.jsonl.zst.tmp"):
        d = tmp_path / name.replace(".", "_")
        d.mkdir()
        (d / name).write_bytes(b"")
        with pytest.raises(SessionLogError):
            SessionWriter(d)
    assert SEGMENT_GLOB  # the glob that test relies on is exported
    (tmp_path / "file").write_text("x")
    with pytest.raises(SessionLogError):
        SessionWriter(tmp_path / "file")


def test_bad_lines_are_refused(tmp_path):
    writer = SessionWriter(tmp_path / "s")
    with pytest.raises(ValueError):
        writer.write_lines([b'{"a":1}\n{"b":2}'])
    with pytest.raises(ValueError):
        writer.write_lines([b'{"a":"' + b"x" * MAX_LINE_BYTES + b'"}'])
    writer.write_lines([])
    assert writer.stats["records_written"] == 0 and writer.stats["current_segment"] is None
    writer.write_lines([b'{"a":1}', b'{"b":2}'])
    writer.close()
    with pytest.raises(SessionLogError):
        writer.write(record(1))
    assert list(read_session(tmp_path / "s")) == [{"a": 1}, {"b": 2}]


# -- crash recovery --------------------------------------------------------------


def test_torn_last_line_after_crash(tmp_path):
    session = tmp_path / "s"
    writer = SessionWriter(session, max_segment_bytes=150)
    for i in range(10):
        writer.write(record(i))
    open_segment = Path(writer.stats["current_segment"])
    with open(open_segment, "ab") as f:
        f.write(b'{"type":"mm')
    # Crash: no close().  Closed segments may still be compressing; both forms read.
    n_lines = len(open_segment.read_bytes().splitlines())
    torn = TornLog()
    assert ids(read_session(session, on_torn=torn)) == list(range(10))
    assert torn.calls == [(str(open_segment), n_lines)]

    # Closing now terminates the torn line inside the .zst: segments stay line-aligned.
    writer.close()
    last = list_segments(session)[-1]
    assert last.name == open_segment.name + ".zst"
    assert decompress_file(last).endswith(b'{"type":"mm\n')
    torn = TornLog()
    assert ids(read_session(session, on_torn=torn)) == list(range(10))
    assert torn.calls == [(str(last), n_lines)]


def test_crash_during_compression(tmp_path):
    session = tmp_path / "s"
    writer = SessionWriter(session, max_segment_bytes=150, compress=False)
    for i in range(20):
        writer.write(record(i))
    writer.close()
    plain = list_segments(session)
    assert len(plain) >= 5
    cctx = zstandard.ZstdCompressor(write_checksum=True)

    def zst(p: Path) -> Path:
        return p.with_name(p.name + ".zst")

    # seg0: compressed normally (.jsonl removed).
    zst(plain[0]).write_bytes(cctx.compress(plain[0].read_bytes()))
    plain[0].unlink()
    # seg1: crash after rename, before unlink: .jsonl and a complete .zst.
    zst(plain[1]).write_bytes(cctx.compress(plain[1].read_bytes()))
    # seg2: crash while compressing: .jsonl and a partial .zst.tmp.
    data = cctx.compress(plain[2].read_bytes())
    plain[2].with_name(plain[2].name + ".zst.tmp").write_bytes(data[: len(data) // 2])
    # seg3: .jsonl next to a .zst that is damaged (e.g. not synced before a power loss).
    zst(plain[3]).write_bytes(b"\x28\xb5\x2f\xfd garbage")
    # the rest: plain .jsonl (failed compression, or the open segment).

    chosen = list_segments(session)
    assert [p.name for p in chosen] == [zst(plain[0]).name] + [p.name for p in plain[1:]]
    torn = TornLog()
    assert ids(read_session(session, on_torn=torn)) == list(range(20))
    assert torn.calls == []
    with pytest.raises(SessionLogError):
        SessionWriter(session)


def test_truncated_zst_yields_records_before_damage(tmp_path):
    session = tmp_path / "s"
    writer = SessionWriter(session, max_segment_bytes=512 << 10)
    n = 6000  # ~1.3 MB: three segments, each several zstd blocks
    for start in range(0, n, 100):
        writer.write_lines([encode(noisy_record(i)) for i in range(start, start + 100)])
    writer.close()
    segments = list_segments(session)
    assert len(segments) == 3 and all(p.suffix == ".zst" for p in segments)
    first = ids(segment_records(segments[0]))

    size = segments[0].stat().st_size
    os.truncate(segments[0], size // 2)
    torn = TornLog()
    got = ids(read_session(session, on_torn=torn))
    prefix = got[: got.index(first[-1] + 1)] if first[-1] + 1 in got else got
    assert 0 < len(prefix) < len(first)
    assert prefix == first[: len(prefix)]
    assert got == prefix + list(range(first[-1] + 1, n))
    assert torn.calls == [(str(segments[0]), len(prefix) + 1)]


def test_zst_missing_only_its_checksum_is_reported(tmp_path):
    session = tmp_path / "s"
    with SessionWriter(session) as writer:
        for i in range(50):
            writer.write(record(i))
    (segment,) = list_segments(session)
    os.truncate(segment, segment.stat().st_size - 2)
    torn = TornLog()
    assert ids(read_session(session, on_torn=torn)) == list(range(50))
    assert torn.calls == [(str(segment), 51)]


def test_corrupt_bytes_in_zst_are_reported(tmp_path):
    session = tmp_path / "s"
    with SessionWriter(session) as writer:
        for i in range(50):
            writer.write(record(i))
    (segment,) = list_segments(session)
    data = bytearray(segment.read_bytes())
    data[len(data) // 2] ^= 0xFF
    segment.write_bytes(bytes(data))
    torn = TornLog()
    got = ids(read_session(session, on_torn=torn))
    assert got == list(range(len(got)))  # a prefix, possibly empty
    assert torn.calls == [(str(segment), len(got) + 1)]


def test_garbage_non_objects_and_long_lines_are_skipped(tmp_path):
    session = tmp_path / "s"
    session.mkdir()
    lines = [
        b'{"i":0}',
        b"not json",
        b"[1,2]",
        b"",
        b"\xff\xfe{}",
        b'{"i":1,"big":"' + b"y" * MAX_LINE_BYTES + b'"}',
        b"[" * 100_000,
        b'{"i":2}',
    ]
    (session / "segment-000000.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (session / "segment-000001.jsonl").write_bytes(b'{"i":3}\n{"i":4}')  # complete, unterminated
    torn = TornLog()
    assert ids(read_session(session, on_torn=torn)) == [0, 2, 3, 4]
    assert torn.calls == [(str(session / "segment-000000.jsonl"), n) for n in (2, 3, 4, 5, 6, 7)]


def test_reading_without_callback_and_missing_directory(tmp_path, caplog):
    session = tmp_path / "s"
    session.mkdir()
    (session / "segment-000000.jsonl").write_bytes(b'{"i":0}\n{"i"')
    assert ids(read_session(session)) == [0]
    assert "segment-000000.jsonl:2" in caplog.text
    with pytest.raises(SessionLogError):
        list(read_session(tmp_path / "absent"))


# -- full disk (tmpfs, root) -----------------------------------------------------

@pytest.fixture
def small_tmpfs(tmpfs_mount):
    """A 256 KiB tmpfs (a disk that fills up)."""
    return tmpfs_mount("256k")


def test_compression_fails_on_full_disk_and_keeps_jsonl(small_tmpfs):
    session = small_tmpfs / "session"
    writer = SessionWriter(session)
    for start in range(0, 200, 20):
        writer.write_lines([encode(noisy_record(k)) for k in range(start, start + 20)])
    fill_disk(small_tmpfs / "filler")
    writer.rotate()
    writer.close()
    stats = writer.stats
    assert stats["compress_errors"] == 1 and stats["segments_compressed"] == 0
    assert sorted(p.name for p in session.iterdir() if not p.name.startswith(".")) == ["segment-000000.jsonl"]
    torn = TornLog()
    assert ids(read_session(session, on_torn=torn)) == list(range(200))
    assert torn.calls == []

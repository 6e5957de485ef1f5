"""Segments compressed as they are written (sessionlog/stream.py): the frame holds the bytes the
writer wrote, read from nowhere else; a finisher that falls behind, or a file that is not what was
written, falls back to compressing the file."""

from __future__ import annotations

import json
from pathlib import Path

import zstandard

from buildidd.sessionlog import compress, read_session
from buildidd.sessionlog.writer import SessionWriter


def _lines(n: int, start: int = 0) -> list[bytes]:
    return [json.dumps({"type": "t", "i": i, "pad": "x" * 50}, separators=(",", ":")).encode()
            for i in range(start, start + n)]


def _zst(session: Path) -> list[Path]:
    return sorted(session.glob("segment-*.jsonl.zst"))


def test_the_frame_is_made_from_what_was_written_not_from_the_file(tmp_path):
    session = tmp_path / "s"
    writer = SessionWriter(session, max_segment_bytes=1 << 20)
    for k in range(20):
        writer.write_lines(_lines(50, 50 * k))
    segment = Path(writer.stats["current_segment"])
    written = segment.read_bytes()
    # Overwrite the file in place with bytes of the same length: a frame read back from the
    # file would hold them; the stream holds what the writer wrote.
    segment.write_bytes(written.replace(b'"pad"', b'"PAD"'))
    writer.close()
    (zst,) = _zst(session)
    assert zstandard.ZstdDecompressor().decompress(zst.read_bytes(), max_output_size=1 << 24) == written
    assert not segment.exists() and not zst.with_name(zst.name + ".tmp").exists()
    assert writer.stats["finish_cpu_ns"] > 0 and writer.stats["finished_bytes"] == len(written)


def test_rotations_stream_each_segment(tmp_path):
    session = tmp_path / "s"
    writer = SessionWriter(session, max_segment_bytes=8 << 10)
    for k in range(40):
        writer.write_lines(_lines(10, 10 * k))
    writer.close()
    assert len(_zst(session)) >= 3 and not list(session.glob("*.jsonl")) and not list(session.glob("*.tmp"))
    assert [r["i"] for r in read_session(session)] == list(range(400))


def test_a_finisher_behind_the_writer_compresses_the_file_instead(tmp_path, monkeypatch):
    monkeypatch.setattr(compress, "STREAM_PENDING_MAX", 1)      # every feed is over the bound
    session = tmp_path / "s"
    writer = SessionWriter(session, max_segment_bytes=1 << 20)
    writer.write_lines(_lines(100))
    segment = Path(writer.stats["current_segment"])
    written = segment.read_bytes()
    writer.close()
    (zst,) = _zst(session)
    assert zstandard.ZstdDecompressor().decompress(zst.read_bytes(), max_output_size=1 << 24) == written
    assert [r["i"] for r in read_session(session)] == list(range(100))

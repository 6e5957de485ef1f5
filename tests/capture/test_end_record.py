"""The end record stays small, and every record the writer can write is read back by the reader.

The largest end record is built from a coverage ledger filled to its budget
with the paths JSON escapes most, over more uids than are listed; it is
written by the session writer and read back by the session reader and by
``buildidd show --type end``.  The gap file holds every gap the end record
only counts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from buildidd.capture.report import END_RECORD_MAX_BYTES, end_line
from buildidd.sessionlog import SessionWriter, find_gap_file, read_gaps, read_session, write_gaps
from buildidd.sessionlog.records import dict_line
from buildidd.sessionlog.segments import MAX_LINE_BYTES
from buildidd.store.coverage import Coverage


def _full_ledger() -> Coverage:
    """A ledger at its budget: 3,000 uids (past the bucket cap), paths of escaped bytes, every reason."""
    cov = Coverage(max_bytes=8 << 20, uid_share=0.01)
    ugly = "/" + "\udcff\x01\u2028" * 1500
    reasons = ["unreachable", "process_gone", "queue_full", "failed", "gone", "quota", "uid_share", "file_cap",
               "replaced_before_pin", "handover_dropped", "too_large", "alt_limit", "in_progress"]
    i = 0
    while cov.bytes < cov.max_bytes - 4096 and i < 200_000:
        bid = os.urandom(64).hex()                     # the longest build-id the ELF reader accepts
        cov.named(bid, f"{ugly}{i}", i % 3000)
        cov.outcome(bid, reasons[i % len(reasons)])
        i += 1
    return cov


def _end_record(cov: Coverage, gaps: list) -> dict:
    return {"type": "end", "time_ns": 123, "reason": "stopped", "resolutions_abandoned": 0,
            "events": {t: 10**12 for t in ("mmap", "exec", "fork", "exit", "comm", "resolution", "file_id")},
            "lost": {c: 10**9 for c in ("ringbuf_full", "no_vma", "read_failed", "pending_full", "disk_full")},
            "store_coverage": cov.report(lambda b: False, final=True, all_gaps=gaps)}


def test_the_largest_end_record_fits_and_reads_back(tmp_path):
    assert END_RECORD_MAX_BYTES <= MAX_LINE_BYTES      # the reader's limit is above the end record's bound
    cov = _full_ledger()
    gaps: list = []
    record = _end_record(cov, gaps)
    line = end_line(record)
    print(f"\nend record {len(line)} bytes; {record['store_coverage']['gaps_total']} gaps, "
          f"{record['store_coverage']['missing_listed']} listed inline, {len(gaps)} for the gap file")
    assert len(line) <= END_RECORD_MAX_BYTES
    assert record["store_coverage"]["gaps_total"] > 1000 and len(record["store_coverage"]["by_uid"]) == 16
    w = SessionWriter(tmp_path / "s")
    w.write({"type": "session", "time_ns": 1})
    w.write_block(line + b"\n", 1)
    w.close()
    (end,) = [r for r in read_session(tmp_path / "s") if r["type"] == "end"]
    assert end == json.loads(line)
    info = write_gaps(tmp_path / "s", gaps, compress=True, max_bytes=cov.max_bytes)
    back = list(read_gaps(tmp_path / "s"))
    assert info["gaps"] == len(back) and info["gaps"] + info["omitted"] == len(gaps)
    inline = end["store_coverage"]["missing"]
    assert back[:len(inline)] == [{"type": "gap", **m} for m in inline]
    assert info["bytes"] <= cov.max_bytes


def test_an_end_record_too_big_for_any_other_reason_is_cut_to_fit():
    record = {"type": "end", "time_ns": 1, "reason": "stopped",
              "store": {"skipped": {f"r{i}": i for i in range(20000)}},
              "store_coverage": {"named": 1, "held": 0, "gaps": {"failed": 1}, "missing": [], "by_uid": {}}}
    line = end_line(record)
    assert len(line) <= END_RECORD_MAX_BYTES
    assert json.loads(line) == {"type": "end", "time_ns": 1, "reason": "stopped", "trimmed": True}


def test_a_record_the_reader_would_skip_is_never_written(tmp_path):
    """dict_line refuses a record over MAX_LINE_BYTES; one of exactly MAX_LINE_BYTES is read back."""
    with pytest.raises(ValueError):
        dict_line({"type": "lost", "pad": "x" * MAX_LINE_BYTES})
    pad = MAX_LINE_BYTES - len(dict_line({"type": "lost", "pad": ""}))
    line = dict_line({"type": "lost", "pad": "x" * pad})
    assert len(line) == MAX_LINE_BYTES
    w = SessionWriter(tmp_path / "s")
    w.write_lines([line])
    w.close()
    assert [r["type"] for r in read_session(tmp_path / "s")] == ["lost"]


def test_the_gap_file_is_bounded_atomic_and_read_by_show(tmp_path):
    session = tmp_path / "sessions" / "20261201T000000Z-1"
    w = SessionWriter(session)
    w.write({"type": "session", "time_ns": 1, "boot_to_wall_offset_ns": 0})
    w.write({"type": "end", "time_ns": 2, "store_coverage": {"named": 3, "held": 0, "gaps": {"failed": 3},
                                                            "by_uid": {"0": {"gaps": {"failed": 1}}}}})
    w.close()
    gaps = [{"build_id": f"{i:040x}", "path": f"/p{i}", "reason": "failed", "uid": 1000} for i in range(3)]
    info = write_gaps(session, gaps, compress=False, max_bytes=250)
    assert info["gaps"] == 2 and info["omitted"] == 1 and info["name"] == "gaps.jsonl"
    assert sorted(os.listdir(session)) == [".closed", "gaps.jsonl", "segment-000000.jsonl.zst"]
    assert find_gap_file(session).name == "gaps.jsonl"
    out = subprocess.run([sys.executable, "-m", "buildidd.cli", "show", str(session), "--type", "gap", "--json"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert [json.loads(x)["build_id"] for x in out.stdout.splitlines()] == [g["build_id"] for g in gaps[:2]]
    out = subprocess.run([sys.executable, "-m", "buildidd.cli", "show", str(session), "--type", "gap",
                          "--path", "/p1"], capture_output=True, text=True)
    assert out.returncode == 0 and len(out.stdout.splitlines()) == 1 and "/p1" in out.stdout, out
    out = subprocess.run([sys.executable, "-m", "buildidd.cli", "sessions", "--json", "--session-root",
                          str(session.parent), "--store-root", ""], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    (row,) = [json.loads(x) for x in out.stdout.splitlines()]
    assert row["gaps"] == 3 and row["gaps_file"] == "gaps.jsonl" and row["gaps_in_file"] == 2
    assert row["gaps_by_uid"] == {"0": 1}

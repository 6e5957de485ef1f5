"""The recording thread never waits for a segment's fsync: the finishing thread syncs it.

os.fsync is wrapped (it still syncs) to record which thread called it on
which file: an fsync of a 64 MiB segment blocked the recording thread for
75-120 ms on this VM, enough for a 1 MiB ring to overflow at 130k mappings/s.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from buildidd.sessionlog import SessionWriter, read_session


@pytest.fixture
def fsync_calls(monkeypatch):
    """[(thread name, path synced)] for every os.fsync from now on."""
    calls: list[tuple[str, str]] = []
    real = os.fsync

    def traced(fd):
        calls.append((threading.current_thread().name, os.readlink(f"/proc/self/fd/{fd}")))
        return real(fd)

    monkeypatch.setattr(os, "fsync", traced)
    return calls


@pytest.mark.parametrize("compress", [True, False])
def test_rotation_syncs_off_the_writing_thread(tmp_path, fsync_calls, compress):
    w = SessionWriter(tmp_path / "s", max_segment_bytes=4096, compress=compress)
    lines = [b'{"type":"mmap","i":%d,"pad":"%s"}' % (i, b"x" * 200) for i in range(200)]
    for k in range(0, 200, 10):
        w.write_lines(lines[k:k + 10])
    assert w.stats["segments_closed"] >= 5
    w.close()
    me = threading.current_thread().name
    segment_syncs = [(t, p) for t, p in fsync_calls if Path(p).name.startswith("segment-")]
    closed = w.stats["segments_closed"]
    # Each closed .jsonl synced once, by the finisher; a compressed one's .zst.tmp too.
    raw = [(t, p) for t, p in segment_syncs if p.endswith(".jsonl")]
    assert len(raw) == closed
    assert {t for t, _ in segment_syncs} == {"buildidd-sessionlog-finish"}
    assert all(t != me for t, _ in segment_syncs)
    if compress:
        assert w.stats["segments_compressed"] == closed
        assert len([p for _, p in segment_syncs if p.endswith(".zst.tmp")]) == closed
    else:
        # The session directory is synced after each uncompressed segment.
        assert sum(1 for t, p in fsync_calls if p == str(tmp_path / "s") and t != me) >= closed
    assert w.stats["write_errors"] == w.stats["compress_errors"] == 0
    got = [r["i"] for r in read_session(tmp_path / "s")]
    assert got == list(range(200))

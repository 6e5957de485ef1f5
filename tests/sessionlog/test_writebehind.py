"""sessionlog.writebehind on a real file system: the open segment's older bytes go to disk and
out of the page cache (util-linux fincore as the oracle), intact; 0 keeps them cached."""

from __future__ import annotations

import subprocess
import time

import pytest

from buildidd.sessionlog import SessionWriter, read_session
from buildidd.sessionlog.writebehind import release_range

WINDOW = 256 << 10
LINE = b'{"type":"mmap","pad":"' + b"x" * 400 + b'"}'


def _resident_bytes(path) -> int:
    """Bytes of path in the page cache, as fincore(1) counts them."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "-o", "RES", str(path)],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def _pages(nbytes: int) -> int:
    """nbytes rounded up to whole pages (the page cache holds pages)."""
    return -(-nbytes // 4096) * 4096


def _fs_is_tmpfs(path) -> bool:
    out = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True).stdout
    return out.strip() == "tmpfs"


def _write(directory, window: int, nbytes: int):
    w = SessionWriter(directory, compress=False)
    w.write_behind.set_window(window)
    lines = nbytes // (len(LINE) + 1)
    for _ in range(lines // 100):
        w.write_lines([LINE] * 100, trusted=True)
    return w, lines // 100 * 100


def test_older_bytes_leave_the_page_cache_and_stay_on_disk(tmp_path):
    if _fs_is_tmpfs(tmp_path):
        pytest.skip("tmpfs pages cannot be dropped")
    w, lines = _write(tmp_path / "s", WINDOW, 8 << 20)
    try:
        segment = w.stats["current_segment"]
        size = w.stats["bytes_written"]
        deadline = time.monotonic() + 10
        while w.stats["page_cache_released_bytes"] < size - 3 * WINDOW and time.monotonic() < deadline:
            time.sleep(0.02)
        stats = w.stats
        assert stats["page_cache_released_bytes"] >= size - 3 * WINDOW, stats
        assert stats["page_cache_release_errors"] == 0
        # What stays cached: the window, what was written since the last hand-over (< a window),
        # a range the thread has not finished (< a window), a page at a range edge.
        assert _resident_bytes(segment) <= 3 * WINDOW + 2 * 4096 < size
    finally:
        w.close()
    records = list(read_session(tmp_path / "s"))
    assert len(records) == lines and all(r["pad"] == "x" * 400 for r in records)


def test_a_window_of_zero_leaves_the_page_cache_alone(tmp_path):
    w, _ = _write(tmp_path / "s", 0, 2 << 20)
    try:
        segment = w.stats["current_segment"]
        time.sleep(0.2)
        assert w.stats["page_cache_released_bytes"] == 0
        assert _resident_bytes(segment) == _pages(w.stats["bytes_written"])
    finally:
        w.close()


def test_each_segment_is_released_behind_its_own_writes(tmp_path):
    """After a rotation the next segment (which usually gets the same fd number) is counted
    from 0: released behind its own writes, its first window not released early."""
    if _fs_is_tmpfs(tmp_path):
        pytest.skip("tmpfs pages cannot be dropped")
    w = SessionWriter(tmp_path / "s", compress=False, max_segment_bytes=2 << 20)
    w.write_behind.set_window(WINDOW)
    batch = [LINE] * 100                      # ~41 KiB
    try:
        while w.stats["segments_closed"] == 0:
            w.write_lines(batch, trusted=True)
        for _ in range(5):                    # ~200 KiB into the second segment: under 2 windows
            w.write_lines(batch, trusted=True)
        time.sleep(0.2)
        current = w.stats["current_segment"]
        assert _resident_bytes(current) == _pages(w.current_segment_stats.size_bytes)
        released = w.stats["page_cache_released_bytes"]
        for _ in range(40):                   # ~1.6 MiB more: several windows
            w.write_lines(batch, trusted=True)
        # The background thread releases the queued windows one after the other (idle I/O
        # class, SCHED_BATCH): wait until it has caught up with all but the last windows.
        bound = 3 * WINDOW + 2 * 4096
        deadline = time.monotonic() + 10
        while ((w.stats["page_cache_released_bytes"] < released + 2 * WINDOW or _resident_bytes(current) > bound)
               and time.monotonic() < deadline):
            time.sleep(0.02)
        assert w.stats["current_segment"] == current and w.stats["segments_closed"] == 1
        assert w.stats["page_cache_released_bytes"] >= released + 2 * WINDOW
        assert _resident_bytes(current) <= bound < w.current_segment_stats.size_bytes
    finally:
        w.close()
    assert len(list(read_session(tmp_path / "s"))) == w.stats["records_written"]


@pytest.mark.parametrize("compress", [False, True])
def test_a_final_segment_keeps_no_page_cache(tmp_path, compress):
    """The finisher drops what the write-behind left (the last window) once the segment is final."""
    if _fs_is_tmpfs(tmp_path):
        pytest.skip("tmpfs pages cannot be dropped")
    w = SessionWriter(tmp_path / "s", compress=compress)
    w.write_behind.set_window(WINDOW)
    for _ in range(20):
        w.write_lines([LINE] * 100, trusted=True)
    w.close()
    (final,) = sorted((tmp_path / "s").glob("segment-*.jsonl*"))
    assert final.name.endswith(".zst") == compress
    assert _resident_bytes(final) == 0
    assert len(list(read_session(tmp_path / "s"))) == 2000


def test_release_range_drops_from_drop_from_and_never_before_it(tmp_path):
    """DONTNEED drops whole folios: a range's own drop may leave a large folio that straddles
    its start; a drop from the first synced byte takes it (writebehind's second pass)."""
    if _fs_is_tmpfs(tmp_path):
        pytest.skip("tmpfs pages cannot be dropped")
    for name, drop_from, kept in (("own", None, 768 << 10), ("from-0", 0, 0), ("clamped", 2 << 20, 768 << 10)):
        path = tmp_path / name
        with open(path, "wb") as f:
            f.write(b"x" * (1 << 20))
            f.flush()
            release_range(f.fileno(), 768 << 10, 256 << 10, drop_from=drop_from)
            resident = _resident_bytes(path)
        if kept:
            assert resident >= kept, (name, resident)      # nothing before the drop's start goes
        else:
            assert resident == 0, (name, resident)         # every folio of [0, 1 MiB) synced and dropped
        assert path.read_bytes() == b"x" * (1 << 20)

"""`buildidd record`'s summary and exit status, without BPF (the session is written by the real SessionWriter)."""

from __future__ import annotations

import json

from buildidd.cli.record import _dso_summary, exit_status
from buildidd.sessionlog import SessionWriter


def test_summary_sorts_a_path_seen_with_and_without_a_build_id(tmp_path):
    def mmap(path, bid, error=None):
        return json.dumps({"type": "mmap", "time_ns": 1, "pid": 1, "path": path, "build_id": bid,
                           "error": error}).encode()

    with SessionWriter(tmp_path / "s", compress=False) as w:
        w.write_lines([mmap("/t/z", "aa" * 20), mmap("/t/z", None, "no_build_id"), mmap("/t/a", None, "not_elf"),
                       mmap("/t/z", None, "file_replaced"), mmap("/t/z", "bb" * 20)])
    assert _dso_summary(tmp_path / "s") == [("/t/a", None, "not_elf"), ("/t/z", None, "no_build_id"),
                                            ("/t/z", "aa" * 20, None), ("/t/z", "bb" * 20, None)]


def test_exit_status_is_the_shells():
    assert [exit_status(c) for c in (0, 9, 127, -9, -15)] == [0, 9, 127, 137, 143]

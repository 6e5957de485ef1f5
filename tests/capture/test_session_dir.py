"""Session directory names: one per session, even two sessions of one process in one second."""

from __future__ import annotations

import os

from buildidd.capture.recorder import new_session_dir


def test_two_sessions_of_one_process_get_two_directories_made_at_naming_time(tmp_path):
    root = tmp_path / "sessions"
    first = new_session_dir(str(root))
    assert first.is_dir() and not os.listdir(first) and first.name.endswith(f"-{os.getpid()}")
    # Named before either session starts writing: the second must not get the first's name.
    second = new_session_dir(str(root))
    third = new_session_dir(str(root))
    assert len({first, second, third}) == 3 and all(p.is_dir() for p in (second, third))
    if second.name.startswith(first.name):          # the same second: suffixes sort in start order
        assert sorted([third.name, second.name, first.name]) == [first.name, second.name, third.name]

"""Session directory names: one per session, even two sessions of one process in one second."""

from __future__ import annotations

import os

from buildidd.capture.recorder import new_session_dir


def test_a_second_session_of_the_same_process_in_the_same_second_gets_its_own_directory(tmp_path):
    first = new_session_dir(str(tmp_path))
    assert first.name.endswith(f"-{os.getpid()}")
    first.mkdir()
    second = new_session_dir(str(tmp_path))
    assert second != first and second.parent == tmp_path
    second.mkdir()
    third = new_session_dir(str(tmp_path))
    assert len({first, second, third}) == 3

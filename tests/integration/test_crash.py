"""kill -9 of `buildidd run` during an exec storm, 5 times in a row (scripts/crashloop.py; 100 by hand).

Asserts the script's checks: READY each time, the daemon's BPF programs no
longer running after each kill (gone, or kept pinned for the next start with
no attachment), every killed session sealed at the next start (end record
``"clean": false``, ``.closed`` marker), every segment compressed and
decodable, at most one torn line per crash.
"""

from __future__ import annotations

import shutil

from conftest import need

import crashloop


def test_kill_9_storm(bpf):
    need(shutil.which("bpftool") is not None, "bpftool lists the BPF programs left behind")
    figures = crashloop.run(iterations=5, max_run_s=2.0, seed=15)
    summary = figures["summary"]
    assert figures["failures"] == []
    assert summary["crashes_checked"] == 5 and summary["sealed"] == 5
    assert figures["bpf_left"] == 0
    print(f"READY s: {figures['ready_s']}; programs kept pinned (detached) after the kills: "
          f"{figures['bpf_kept_pinned']}")
    assert all(s["torn_lines"] <= 1 and not s["uncompressed"] and s["marker_clean"] is False
               for s in figures["sessions"])
    assert len(figures["ready_s"]) == 6

"""Every mapping and exec record names the user charged for it: the task's real uid (event_header.uid),
read by the BPF side from current's credentials at the event, from the task's at a synthesized mapping."""

from __future__ import annotations

import subprocess
import time

from conftest import as_user, as_user_popen, session_records


def _records_of(rec, pid: int, want: set[str], timeout_s: float = 10.0) -> list[dict]:
    """pid's records of the types in want, once each type has one of /bin/sleep (or timeout_s passed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rec.step()
        got = [r for r in session_records(rec.session_dir) if r.get("pid") == pid and r["type"] in want]
        if {r["type"] for r in got if r["path"].endswith("sleep")} >= want or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def test_exec_and_mmap_records_carry_the_tasks_real_uid(recorder, attacker):
    uid = attacker[0]
    rec = recorder()
    mine = subprocess.Popen(["/bin/sleep", "30"])
    theirs = as_user_popen(attacker, ["/bin/sleep", "30"])
    try:
        root_recs = _records_of(rec, mine.pid, {"exec", "mmap"})
        user_recs = _records_of(rec, theirs.pid, {"exec", "mmap"})
    finally:
        for p in (mine, theirs):
            p.kill()
            p.wait()
    # setpriv execs /bin/sleep as the user: the exec and every mapping after it are the user's.
    assert {r["type"] for r in user_recs} == {"exec", "mmap"}
    assert {r["uid"] for r in user_recs if r["type"] == "exec" and r["path"].endswith("sleep")} == {uid}
    assert {r["uid"] for r in user_recs if r["type"] == "exec" and r["path"].endswith("setpriv")} == {0}
    assert {r["uid"] for r in user_recs if r["type"] == "mmap" and r["path"].endswith("sleep")} == {uid}
    assert {r["type"] for r in root_recs} == {"exec", "mmap"}
    assert {r["uid"] for r in root_recs} == {0}


def test_synthesized_mappings_carry_the_running_tasks_uid(recorder, attacker):
    """A process that runs before the recorder starts is synthesized (task_vma iterator, or /proc at a
    rescan): its records carry the uid read from its task's credentials."""
    p = as_user_popen(attacker, ["/bin/sleep", "30"])
    try:
        time.sleep(0.3)
        assert as_user(attacker, ["/bin/true"]).returncode == 0
        rec = recorder()
        recs = _records_of(rec, p.pid, {"mmap"})
    finally:
        p.kill()
        p.wait()
    synth = [r for r in recs if r["origin"] == "synthesized"]
    assert synth, recs
    assert {r["uid"] for r in synth} == {attacker[0]}

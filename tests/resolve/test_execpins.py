"""Exec pins (resolve.execpins): the file an exec opened, held through a rename and an unlink."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pytest

from buildidd.kernel.events import Identity
from buildidd.resolve.execpins import ExecPins, PinPolicy
from buildidd.resolve.fanotify import pinnable_mounts

from conftest import need


def _ident(path) -> Identity:
    st = os.stat(path)
    return Identity(st.st_dev, st.st_ino, 0, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _wait(cond, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def pins():
    need(os.geteuid() == 0, "fanotify needs CAP_SYS_ADMIN")
    made = []

    def make(**kw):
        p = ExecPins(PinPolicy(**kw))
        p.start()
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def test_mountinfo_marks_local_file_systems_once_each_and_undoes_escapes():
    text = ("22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
            "23 22 0:5 / /proc rw - proc proc rw\n"
            "24 22 8:1 /srv /mnt/with\\040space rw shared:1 - ext4 /dev/sda1 rw\n"
            "25 22 0:40 / /run/user/1000/fuse rw - fuse.sshfs host: rw\n"
            "26 22 0:41 / /tmp rw - tmpfs tmpfs rw\n"
            "garbage line\n")
    assert pinnable_mounts(text) == {"8:1": "/", "0:41": "/tmp"}
    assert pinnable_mounts("24 22 8:2 / /mnt/with\\040space rw - xfs /dev/sdb rw") == {"8:2": "/mnt/with space"}


def test_a_program_renamed_over_and_unlinked_after_its_exec_is_still_read_through_its_pin(pins, tmp_path):
    p = pins(max_files=64, ttl_s=30)
    assert p.marked() >= 1
    prog = tmp_path / "prog"
    shutil.copy("/bin/true", prog)
    ident = _ident(prog)
    subprocess.run([str(prog)], check=True)
    shutil.copy("/bin/false", tmp_path / "new")
    os.rename(tmp_path / "new", prog)              # an upgrade, 0 ms after the exit
    assert _wait(lambda: p.status()["pinned"] >= 1)
    fd = p.take(ident, named_at_event=True)
    assert fd is not None
    try:
        assert os.fstat(fd).st_nlink == 0          # the old inode, with no name left
        with open("/bin/true", "rb") as f:
            assert os.pread(fd, 1 << 20, 0) == f.read(1 << 20)
    finally:
        os.close(fd)
    assert p.take(ident) is None                   # taken once
    assert p.status()["taken"] == 1


def test_a_pin_is_refused_for_another_identity_and_an_ignore_mark_stops_repeats(pins, tmp_path):
    p = pins(max_files=64, ttl_s=30)
    prog = tmp_path / "prog"
    shutil.copy("/bin/true", prog)
    ident = _ident(prog)
    subprocess.run([str(prog)], check=True)
    assert _wait(lambda: p.status()["pinned"] >= 1)
    wrong = Identity(ident.dev, ident.ino, 0, ident.size + 1, ident.mtime_ns, ident.ctime_ns)
    assert p.take(wrong) is None                   # same inode, other contents: refused
    fd = p.take(ident)
    assert fd is not None
    p.ignore(fd)
    os.close(fd)
    assert p.status()["ignore_marks"] == 1 and p.status()["ignore_mark_errors"] == 0   # 5.19+: evictable
    pinned = p.status()["pinned"]
    for _ in range(5):
        subprocess.run([str(prog)], check=True)
    subprocess.run(["/bin/true"], check=True)      # an exec that is not ignored, read after prog's
    assert _wait(lambda: p.status()["pinned"] > pinned or p.status()["repeats"] > 0)
    time.sleep(0.2)
    assert p.take(ident) is None                   # prog's execs made no pin


def _variant(path, i, src="/bin/true"):
    shutil.copy(src, path)
    with open(path, "ab") as f:
        f.write(bytes([i]))                        # each its own inode and contents


def _run_variants(tmp_path, n, until=None):
    """n programs, each its own inode, each run once; their identities.  With until (a condition on
    the identities): each lives until it holds (then is killed), so its uid is read from /proc while
    it lives (a program gone before its event is read is charged to no known uid); _wait's timeout
    only bounds a hang."""
    idents, procs = [], []
    for i in range(n):
        prog = tmp_path / f"prog{i}"
        _variant(prog, i, "/bin/sleep" if until else "/bin/true")
        idents.append(_ident(prog))
        procs.append(subprocess.Popen([str(prog)] + (["600"] if until else [])))
        if not until:
            assert procs[-1].wait() == 0
    if until:
        try:
            assert _wait(lambda: until(idents), timeout_s=60)
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
    return idents


def test_pins_are_bounded(pins, tmp_path):
    p = pins(max_files=3, ttl_s=30, uid_share=1.0)
    idents = _run_variants(tmp_path, 8)
    assert _wait(lambda: p.status()["file_cap"] >= 5)
    assert p.status()["held"] <= 3
    taken = [p.take(i) for i in idents]
    gone = [i for i, fd in zip(idents, taken) if fd is None]
    for fd in set(taken) - {None}:
        os.close(fd)
    assert len(gone) >= 5                                    # closed at the cap
    assert all(p.closed_reason(i, 0) == "file_cap" for i in gone)   # what a hand-over's gap then says


def _held(p, ident) -> bool:
    return bool(p.ledger.of_inode(ident.dev, ident.ino))


# Other work on the host execs too (as root, mostly): the tests check their own files' pins, and
# counters only from below.

def test_a_users_pins_are_capped_at_their_share_and_named_uid_pin_cap(pins, tmp_path):
    p = pins(max_files=64, ttl_s=30, uid_share=0.25)
    idents = _run_variants(tmp_path, 24, until=lambda _ids: p.status()["by_uid"].get("0", {}).get("uid_cap", 0) >= 8)
    assert p.status()["by_uid"]["0"]["held"] <= 16
    assert not _held(p, idents[0]) and p.closed_reason(idents[0], 0) == "uid_pin_cap"
    assert p.closed_reason(idents[0], 12345) is None          # root's pin: not another user's gap


def test_a_users_flood_of_execs_of_roots_files_closes_that_users_pins_not_roots(pins, tmp_path, attacker,
                                                                               public_tmp_factory):
    from conftest import as_user
    p = pins(max_files=256, ttl_s=60)
    # root's program, pinned first (the oldest)
    (root_ident,) = _run_variants(tmp_path, 1, until=lambda ids: _held(p, ids[0]))
    work = public_tmp_factory()
    for i in range(96):                  # root-owned programs the user may run: charged to the user
        _variant(work / f"u{i}", i, "/bin/sleep")
    r = as_user(attacker, ["sh", "-c", f"for i in $(seq 0 95); do {work}/u$i 1 & done; wait"])
    assert r.returncode == 0, r.stderr
    user = str(attacker[0])
    assert _wait(lambda: p.status()["by_uid"].get(user, {}).get("uid_cap", 0) >= 32)   # its share: 64
    assert p.status()["by_uid"][user]["held"] == 64
    fd = p.take(root_ident)                                   # root's pin outlived the flood
    assert fd is not None, json.dumps(p.status())
    os.close(fd)


def test_an_unconfirmed_pin_is_closed_once_the_recording_thread_read_past_it(pins, tmp_path):
    from buildidd import clock
    from buildidd.kernel.events import st_dev_to_kdev
    p = pins(max_files=256, ttl_s=60, uid_share=1.0, confirm_s=0.5)
    failed, ok = _run_variants(tmp_path, 2, until=lambda ids: all(_held(p, i) for i in ids))
    # The recording thread took ok's exec record (pid unknown here: its uid's pin of the file is it).
    p.recorded([(0, 0, st_dev_to_kdev(ok.dev), ok.ino, clock.boot_ns())], clock.boot_ns() - 10**9)
    assert _wait(lambda: p.status()["confirms"] >= 1)
    time.sleep(0.3)
    assert _held(p, failed)                                   # not read past it by confirm_s yet
    time.sleep(0.5)
    p.recorded([], clock.boot_ns())
    assert _wait(lambda: not _held(p, failed))                # no pin for an exec without a record
    assert p.status()["exec_failed"] >= 1 and p.status()["by_uid"]["0"]["exec_failed"] >= 1
    fd = p.take(ok)
    assert fd is not None
    os.close(fd)


def test_a_claimed_pin_outlives_its_ttl_until_its_hand_over_ran(pins, tmp_path):
    p = pins(max_files=256, ttl_s=1, uid_share=1.0)
    # charged to root (read while it lives)
    claimed, other = _run_variants(tmp_path, 2, until=lambda ids: all(_held(p, i) for i in ids))
    p.claim(claimed, 0, 0)                                    # a hand-over of it is queued
    assert _wait(lambda: not _held(p, other) and p.status()["expired"] >= 1, timeout_s=60)   # past ttl_s
    assert _held(p, claimed)
    p.unclaim(claimed)
    p.claim(claimed, 0, 0)
    fd = p.take(claimed)
    assert fd is not None
    os.close(fd)


def test_a_pin_nobody_takes_expires(pins, tmp_path):
    p = pins(max_files=64, ttl_s=1)
    (ident,) = _run_variants(tmp_path, 1)
    assert _wait(lambda: p.status()["pinned"] >= 1)
    # ttl_s, and the reader's 1 s poll (the timeout only bounds a hang)
    assert _wait(lambda: p.status()["expired"] >= 1, timeout_s=60)
    assert p.take(ident) is None
    assert p.status()["expired"] >= 1 and p.status()["file_cap"] == 0


def test_a_held_file_released_with_no_pin_open_gets_its_ignore_mark_at_its_next_exec(pins, tmp_path):
    p = pins(max_files=64, ttl_s=30)
    prog = tmp_path / "prog"
    shutil.copy("/bin/true", prog)
    ident = _ident(prog)
    p.release(ident, held=True)                    # settled in the store; no exec of it yet, no pin
    time.sleep(1.2)                                # the reader thread's next round (at most 1 s apart) reads it
    subprocess.run([str(prog)], check=True)
    assert _wait(lambda: p.status()["held_ignored"] == 1 and p.status()["ignore_marks"] == 1)
    for _ in range(5):
        subprocess.run([str(prog)], check=True)
    _variant(tmp_path / "marker", 9)
    marker = _ident(tmp_path / "marker")
    subprocess.run([str(tmp_path / "marker")], check=True)   # its event is read after prog's (one queue)
    assert _wait(lambda: p.ledger.of_inode(marker.dev, marker.ino) != [])
    assert p.status()["held_ignored"] == 1         # the mark stopped prog's later events
    assert p.take(ident) is None                   # and none made a pin
    _variant(tmp_path / "new", 7)
    os.rename(tmp_path / "new", prog)              # other contents under the name: pinned as before
    new = _ident(prog)
    subprocess.run([str(prog)], check=True)
    assert _wait(lambda: p.ledger.of_inode(new.dev, new.ino) != [])
    fd = p.take(new)
    assert fd is not None
    os.close(fd)


def test_a_gone_users_pid_keeps_the_uid_it_was_read_with_a_gone_roots_is_unknown(attacker, monkeypatch):
    """A failing-exec flood's events outlive its process: charged to no known uid they would fill that
    share and close others' short-lived programs' pins in it (the hostile battery's failing-exec flood)."""
    from buildidd.resolve import execuids
    from buildidd.resolve.pinledger import UNKNOWN_UID
    from buildidd.resolve.procfs import read_uid
    from conftest import as_user_popen
    uids = execuids.ExecUids()
    user = as_user_popen(attacker, ["sleep", "60"])
    root = subprocess.Popen(["sleep", "60"])
    try:
        assert _wait(lambda: read_uid(user.pid) == attacker[0])          # setpriv dropped to the user
        assert uids.of(user.pid) == attacker[0] and uids.of(root.pid) == 0
    finally:
        for p in (user, root):
            p.kill()
            p.wait()
    assert read_uid(user.pid) == -1 and read_uid(root.pid) == -1
    assert uids.of(user.pid) == attacker[0]              # gone: the uid it was last read with
    assert uids.of(root.pid) == UNKNOWN_UID              # root's is never kept
    monkeypatch.setattr(execuids, "UID_CACHE_S", 0.0)
    monkeypatch.setattr(execuids, "UID_GONE_S", 0.0)
    assert uids.of(user.pid) == UNKNOWN_UID              # past the window: no known uid


def test_a_gone_programs_event_takes_the_uid_of_an_exec_record_published_before_it_was_read(pins, attacker,
                                                                                          public_tmp_factory):
    """The reader is behind (held here); the program has exited and its exec record was published: the
    event is charged to the record's uid at once, never to no known uid (whose share a flood may fill)."""
    from buildidd import clock
    from buildidd.kernel.events import st_dev_to_kdev
    from conftest import as_user_popen
    p = pins(max_files=256, ttl_s=60)
    exe = public_tmp_factory() / "short"
    _variant(exe, 7, "/bin/true")
    ident = _ident(exe)
    added = []                                                # the keys the reader pins under, in order
    add = p.ledger.add
    p.ledger.add = lambda key, pin: (added.append(key), add(key, pin))[1]
    with p._reading:                                          # the reader thread waits: it is behind
        prog = as_user_popen(attacker, [str(exe)])
        assert prog.wait(timeout=30) == 0
        p.recorded([(prog.pid, attacker[0], st_dev_to_kdev(ident.dev), ident.ino, clock.boot_ns())],
                   clock.boot_ns())
    # its pin is the user's from the start, never first charged to no known uid
    assert _wait(lambda: _held(p, ident)), p.status()
    assert [k[2] for k in added if k[:2] == (ident.dev, ident.ino)] == [attacker[0]], added

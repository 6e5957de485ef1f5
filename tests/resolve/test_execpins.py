"""Exec pins (resolve.execpins): the file an exec opened, held through a rename and an unlink."""

from __future__ import annotations

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


def _run_variants(tmp_path, n):
    idents = []
    for i in range(n):
        prog = tmp_path / f"prog{i}"
        shutil.copy("/bin/true", prog)
        with open(prog, "ab") as f:
            f.write(bytes([i]))                    # each its own inode and contents
        idents.append(_ident(prog))
        subprocess.run([str(prog)], check=True)
    return idents


def test_pins_are_bounded(pins, tmp_path):
    p = pins(max_files=3, ttl_s=30)
    idents = _run_variants(tmp_path, 6)
    assert _wait(lambda: p.status()["file_cap"] >= 3)
    assert p.status()["held"] <= 3
    assert all(p.take(i) is None for i in idents[:3])       # the oldest were closed at the cap


def test_a_users_flood_of_execs_closes_that_users_pins_not_roots(pins, tmp_path, attacker, public_tmp_factory):
    from conftest import as_user
    p = pins(max_files=8, ttl_s=60)
    (root_ident,) = _run_variants(tmp_path, 1)               # root's program, pinned first (the oldest)
    assert _wait(lambda: p.status()["pinned"] >= 1)
    work = public_tmp_factory()
    for i in range(20):                                       # the user's own programs, each its own inode
        prog = work / f"u{i}"
        shutil.copy("/bin/true", prog)
        with open(prog, "ab") as f:
            f.write(bytes([i]))
        os.chown(prog, attacker[0], attacker[1])
    r = as_user(attacker, ["sh", "-c", f"for i in $(seq 0 19); do {work}/u$i; done"])
    assert r.returncode == 0, r.stderr
    assert _wait(lambda: p.status()["file_cap"] >= 13)
    fd = p.take(root_ident)                                   # root's pin outlived the flood
    assert fd is not None
    os.close(fd)


def test_a_pin_nobody_takes_expires(pins, tmp_path):
    p = pins(max_files=64, ttl_s=1)
    (ident,) = _run_variants(tmp_path, 1)
    assert _wait(lambda: p.status()["pinned"] >= 1)
    time.sleep(2.5)                                          # ttl_s, and the reader's 1 s poll
    assert p.take(ident) is None
    assert p.status()["expired"] >= 1 and p.status()["file_cap"] == 0

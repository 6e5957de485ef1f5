"""The quota charges the user who fills it (issue 42 item 5).

A real unprivileged user (the ``attacker`` fixture) makes its own files without
a build-id and hands them to the store through the daemon's path (Snapshotter,
htlhash key) while root's real system binaries fill the store, one of them
(/usr/bin/sleep) named by a retained session that housekeeping reads.  Before
this, the user's copies, within its share, evicted root's entries, sleep
among them, and root's next copies were refused.
"""

from __future__ import annotations

import os
import pwd
import stat
import subprocess
import time
from pathlib import Path

import pytest

from buildidd.capture.housekeeping import Housekeeping, RetentionPolicy
from buildidd.resolve.fileid import file_id
from buildidd.sessionlog import SessionWriter
from buildidd.store import Store
from buildidd.store.copyqueue import CopyJob
from buildidd.store.coverage import HELD
from buildidd.store.origin import KEY_GNU, KEY_HTLHASH
from buildidd.store.snapshotter import SnapshotPolicy, Snapshotter

from conftest import as_user, gcc, readelf_build_id

SHARE = 0.25


def _key_of(path: Path, key: str) -> str:
    if key == KEY_GNU:
        return readelf_build_id(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        return file_id(fd)
    finally:
        os.close(fd)


def _through(snap: Snapshotter, path: Path, key: str = KEY_GNU, uid: int | None = None) -> tuple[str, str]:
    """Hand path over as the recorder does (a descriptor of the file, charged to uid: the task that mapped
    it, by default the file's owner) and wait for its outcome: (bid, state)."""
    bid = _key_of(path, key)
    fd = os.open(path, os.O_RDONLY)
    try:
        snap.submit(CopyJob(bid, str(path), None, uid=os.fstat(fd).st_uid if uid is None else uid, key=key), fd)
    finally:
        os.close(fd)
    deadline = time.monotonic() + 30
    while snap.coverage.state(bid) is None:
        assert time.monotonic() < deadline, f"{path}: not handled"
        time.sleep(0.005)
    time.sleep(0.01)            # the next entry's mtime (its recency) lies a clock tick later
    return bid, snap.coverage.state(bid)


def _system_binaries(total_bytes: int) -> list[Path]:
    """/usr/bin/sleep, then root-owned system binaries with a GNU build-id (100 KB to 1 MB) up to total_bytes."""
    out, seen, size = [], set(), 0
    for name in ["sleep", *sorted(os.listdir("/usr/bin"))]:
        p = Path("/usr/bin", name)
        st = p.lstat()
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o6022 or p in out:
            continue
        if name != "sleep" and not 100_000 <= st.st_size <= 1_000_000:
            continue
        bid = readelf_build_id(p)
        if not bid or bid in seen:
            continue
        out.append(p)
        seen.add(bid)
        size += st.st_blocks * 512
        if size >= total_bytes:
            return out
    pytest.fail(f"/usr/bin holds less than {total_bytes} bytes of binaries to fill the store with")


def _user_files(user, directory: Path, base: Path, sizes: list[int], prefix: str) -> list[Path]:
    """Files the user makes itself in its own directory: base's bytes, then sizes[i] random bytes (a new htlhash)."""
    script = "; ".join(f"cp {base} {prefix}{i} && head -c {n} /dev/urandom >> {prefix}{i}"
                       for i, n in enumerate(sizes))
    r = as_user(user, ["sh", "-ec", script], cwd=str(directory))
    assert r.returncode == 0, r.stderr
    files = [directory / f"{prefix}{i}" for i in range(len(sizes))]
    assert all(f.stat().st_uid == user[0] for f in files)
    return files


@pytest.fixture
def stage(tmp_path, attacker, public_tmp_factory):
    """(store, a snapshotter factory, sessions dir, public dir, base no-build-id binary, the attacker's own
    directory).  A snapshotter is a daemon run: its housekeeping protects what it saw and what retained
    sessions name."""
    public = public_tmp_factory("buildidd-quota-")
    base = gcc('#include <stdio.h>\nint main(void) { puts("no build-id"); return 0; }\n', public / "base",
               "-Wl,--build-id=none")
    os.chmod(base, 0o755)
    mine = public / "attacker"
    mine.mkdir()
    os.chown(mine, attacker[0], attacker[1])
    st = Store(tmp_path / "store", debug_root=tmp_path / "no-debug", uid_share=SHARE)
    sessions = tmp_path / "sessions"
    running: list[Snapshotter] = []

    def daemon_run() -> Snapshotter:
        for old in running:
            old.stop()
        snap = Snapshotter(st, SnapshotPolicy(rate_bytes_per_s=0, housekeeping_interval_s=3600),
                           housekeeping=Housekeeping(st, RetentionPolicy(session_root=sessions)))
        snap.start()
        running.append(snap)
        return snap

    yield st, daemon_run, sessions, public, base, mine
    for snap in running:
        snap.stop()


def test_a_users_flood_evicts_only_its_own_oldest_entries(stage, attacker):
    st, daemon_run, sessions, public, base, mine = stage
    snap = daemon_run()
    # Root's real binaries fill the store; sleep, the oldest, is named by a retained session.
    root_bids = [_through(snap, p) for p in _system_binaries(2_500_000)]
    assert all(state == HELD for _, state in root_bids), root_bids
    sleep_bid = root_bids[0][0]
    with SessionWriter(sessions / "retained") as w:
        w.write({"type": "session", "kernel_build_id": "ee" * 20})
        w.write({"type": "exec", "pid": 1, "path": "/usr/bin/sleep", "build_id": sleep_bid})
    # A bystander's file (nobody's), in the store before the flood.
    nobody = pwd.getpwnam("nobody")
    theirs = public / "theirs"
    subprocess.run(f"cp {base} {theirs} && head -c 50000 /dev/urandom >> {theirs}", shell=True, check=True)
    os.chown(theirs, nobody.pw_uid, nobody.pw_gid)
    bystander, state = _through(snap, theirs, KEY_HTLHASH)
    assert state == HELD
    held = st.disk_bytes()
    st.quota_bytes = held * 8 // 7          # free: a seventh of what is held, half of a user's share
    share = int(SHARE * st.quota_bytes)

    # The flood: more than the user's share in files a quarter of the free room each.  Housekeeping
    # runs after each copy, so that every entry is referenced (this run saw them all), as in a long run.
    unit = (st.quota_bytes - held) // 4
    flood = _user_files(attacker, mine, base, [unit - base.stat().st_size] * 12, "f")
    assert sum(f.stat().st_blocks * 512 for f in flood) > share
    outcomes = []
    for f in flood:
        outcomes.append(_through(snap, f, KEY_HTLHASH))
        snap.housekeeping()
        assert st.disk_bytes() <= st.quota_bytes and not st.over_quota
    assert [b for b, _ in root_bids if not st.contains(b)] == [] and st.contains(bystander)
    assert [state for _, state in outcomes] == [HELD] * len(flood)      # each accepted, in its turn
    kept = [st.contains(bid) for bid, _ in outcomes]
    assert 0 < kept.count(True) < len(flood) and kept == sorted(kept), kept   # the oldest went, the newest stayed
    assert st.counters["evicted"] == st.counters["evicted_in_use"] == kept.count(False)
    assert st.counters["evicted_for_root"] == 0
    assert st.uid_bytes(attacker[0]) <= share

    # Refused, counted by reason, nothing evicted: a file over the share, and one that only
    # root's and nobody's bytes (not the user's own) could make room for.
    free_and_own = st.quota_bytes - st.disk_bytes() + st.uid_bytes(attacker[0])
    assert free_and_own < share * 3 // 4
    over_share, over_room = _user_files(attacker, mine, base, [share + 8192, share * 3 // 4], "g")
    evicted = st.counters["evicted"]
    assert _through(snap, over_share, KEY_HTLHASH)[1] == "uid_share"
    assert _through(snap, over_room, KEY_HTLHASH)[1] == "quota"
    refused = dict(snap.skipped)
    assert refused == {"uid_share": 1, "quota": 1}
    assert st.counters["skipped_uid_share"] == 1 and st.counters["skipped_quota"] == 1
    assert st.counters["evicted"] == evicted
    assert [st.contains(bid) for bid, _ in outcomes] == kept

    # The next run: the flood's entries are no longer referenced (its session was not retained).  Root's
    # new copy is taken, making room from the user holding the most (the attacker), its oldest first.
    snap = daemon_run()
    snap.housekeeping()
    free = st.quota_bytes - st.disk_bytes()
    pad = free + st.uid_bytes(attacker[0]) // 2
    rootprog = gcc(f"static char pad[{pad}] __attribute__((used)) = {{1}};\nint main(void) {{ return 0; }}\n",
                   public / "rootprog", "-Wl,--build-id=sha1")
    os.chmod(rootprog, 0o755)
    assert _through(snap, rootprog)[1] == HELD
    left = [st.contains(bid) for bid, _ in outcomes]
    assert left == sorted(left) and left.count(True) < kept.count(True)
    assert st.counters["evicted_for_root"] == kept.count(True) - left.count(True)
    assert all(st.contains(b) for b, _ in root_bids) and st.contains(bystander) and st.contains(sleep_bid)
    assert st.disk_bytes() <= st.quota_bytes
    print(f"\nflood: {len(flood)} files of {unit} bytes by uid {attacker[0]} (share {share} of {st.quota_bytes}); "
          f"{kept.count(False)} of its own evicted, 0 of root's {len(root_bids)} nor the bystander's; refused "
          f"{refused}; root's {rootprog.stat().st_size}-byte copy then evicted "
          f"{st.counters['evicted_for_root']} of the user's")


def test_a_trusted_copy_of_a_users_content_leaves_the_users_share(tmp_path, attacker, public_tmp_factory):
    """The same bytes from a system path take a user's copy over: its bytes move from the user's share to root."""
    public = public_tmp_factory("buildidd-quota-")
    copy = public / "true"
    subprocess.run(["cp", "/usr/bin/true", str(copy)], check=True)
    os.chown(copy, attacker[0], attacker[1])
    st = Store(tmp_path / "store", debug_root=tmp_path / "no-debug", quota_bytes=64 << 20, uid_share=SHARE)
    bid = readelf_build_id(copy)
    for path in (copy, Path("/usr/bin/true")):
        fd = os.open(path, os.O_RDONLY)
        try:
            st.add_from_fd(fd, str(path), bid)
        finally:
            os.close(fd)
        if path == copy:
            assert st.uid_bytes(attacker[0]) > 0 and st.origin(bid).uid == attacker[0]
    assert st.origin(bid).uid == 0 and st.origin(bid).trusted
    assert st.uid_bytes(attacker[0]) == 0


def test_a_users_copy_of_another_users_file_is_charged_to_the_user_who_mapped_it(stage, attacker, bystander):
    """The attacker maps the bystander's readable files: their copies are charged to the attacker (the
    record's uid), not to the bystander, whose share stays its own; root's file mapped by the attacker
    stays root's."""
    st, daemon_run, _sessions, public, base, _mine = stage
    snap = daemon_run()
    theirs = public / "bystander"
    theirs.mkdir()
    os.chown(theirs, bystander[0], bystander[1])
    own, mapped = _user_files(bystander, theirs, base, [30000, 40000], "b")
    own_bid, s1 = _through(snap, own, KEY_HTLHASH)                           # the bystander runs its own
    theirs_before, mine_before = st.uid_bytes(bystander[0]), st.uid_bytes(attacker[0])
    mapped_bid, s2 = _through(snap, mapped, KEY_HTLHASH, uid=attacker[0])    # the attacker maps the other
    sleep_bid, s3 = _through(snap, Path("/usr/bin/sleep"), uid=attacker[0])
    assert (s1, s2, s3) == (HELD, HELD, HELD)
    assert (st.origin(mapped_bid).uid, st.origin(mapped_bid).charged_uid) == (bystander[0], attacker[0])
    assert st.origin(mapped_bid).payer == attacker[0] and st.origin(own_bid).payer == bystander[0]
    assert st.origin(sleep_bid).payer == 0
    assert theirs_before >= own.stat().st_blocks * 512 and mine_before == 0
    assert st.uid_bytes(bystander[0]) == theirs_before                      # not a byte of the attacker's
    assert st.uid_bytes(attacker[0]) >= mapped.stat().st_blocks * 512

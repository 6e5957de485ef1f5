"""The store against a local attacker: disk filling, size cap, per-uid share, poisoning, privacy, eviction.

Real files owned by a real unprivileged user (the ``attacker`` fixture), real
gcc binaries, real processes; no mocks.
"""

from __future__ import annotations

import grp
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from buildidd.errors import StoreRefusedError
from buildidd.store import Store

from conftest import as_user, gcc, readelf_build_id

FORGED_BID = "5eed" * 10  # 20 bytes: a SHA-1-sized build-id both files claim


def _exe(path: Path, src: str = "int main(void) { return 0; }", *flags: str) -> Path:
    out = gcc(src, path, *flags)
    os.chmod(out, 0o755)
    return out


def _add(st: Store, path: Path, bid: str | None = None, name: str | None = None):
    fd = os.open(path, os.O_RDONLY)
    try:
        return st.add_from_fd(fd, name or str(path), bid or readelf_build_id(path))
    finally:
        os.close(fd)


@pytest.fixture
def public_dir():
    """A world-traversable directory outside the system dirs (pytest's tmp_path is 0o700: private)."""
    d = Path(tempfile.mkdtemp(prefix="buildidd-hostile-"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d)


@pytest.fixture
def system_dir():
    """A root-owned directory under /usr (a system package directory)."""
    d = Path(tempfile.mkdtemp(prefix="buildidd-test-", dir="/usr/lib"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d)


def _disk(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def test_sparse_files_stay_sparse(tmp_path, public_dir, attacker):
    """Two 300 MB sparse ELF files (a few KiB of data) take a few KiB in the store, not 600 MB."""
    st = Store(tmp_path / "store", debug_root=tmp_path / "no-debug")
    before = st.disk_bytes()
    sources = []
    for n in range(2):
        exe = _exe(public_dir / f"sparse{n}", f"int main(void) {{ return {n}; }}", "-Wl,--build-id=sha1")
        os.truncate(exe, 300 << 20)        # the rest is a hole
        os.chown(exe, attacker[0], attacker[1])
        sources.append(exe)
        res = _add(st, exe)
        assert res.added and res.path.stat().st_size == 300 << 20
        assert _disk(res.path) <= _disk(exe) + 8192, (_disk(res.path), _disk(exe))
    after = st.disk_bytes()
    print(f"sparse attack: sources {sum(_disk(s) for s in sources)} bytes on disk; "
          f"store {before} -> {after} bytes on disk for {2 * 300 << 20} apparent bytes")
    assert after - before < 1 << 20
    assert st.size_bytes() >= 2 * (300 << 20)          # apparent size says what was copied


def test_size_cap_refuses_and_leaves_nothing(tmp_path, public_dir):
    st = Store(tmp_path / "store", debug_root=tmp_path / "no-debug", file_max_bytes=1 << 20)
    exe = _exe(public_dir / "big", "int main(void) { return 0; }", "-Wl,--build-id=sha1")
    os.truncate(exe, 2 << 20)
    with pytest.raises(StoreRefusedError) as e:
        _add(st, exe)
    assert e.value.reason == "too_large" and st.counters["skipped_too_large"] == 1
    assert not st.contains(readelf_build_id(exe)) and st.disk_bytes() == 0


def test_uid_share_limits_one_user_not_root(tmp_path, public_dir, system_dir, attacker):
    """Past its share a user's copy evicts that user's own oldest entries; a file over the share is refused."""
    pad = "static char pad[%d] __attribute__((used)) = {%d};"
    st = Store(tmp_path / "store", debug_root=tmp_path / "no-debug", quota_bytes=2 << 20, uid_share=0.25)
    share = (2 << 20) // 4
    bids = []
    for n in range(1, 6):
        exe = _exe(public_dir / f"u{n}", pad % (200000, n) + "int main(void) { return 0; }", "-Wl,--build-id=sha1")
        os.chown(exe, attacker[0], attacker[1])
        assert _add(st, exe).added
        bids.append(readelf_build_id(exe))
        assert st.uid_bytes(attacker[0]) <= share
    assert [st.contains(b) for b in bids] == [False, False, False, True, True]   # the oldest three made room
    assert st.counters["evicted"] == 3 and st.counters["skipped_uid_share"] == 0
    big = _exe(public_dir / "big", pad % (share + 4096, 7) + "int main(void) { return 0; }", "-Wl,--build-id=sha1")
    os.chown(big, attacker[0], attacker[1])
    with pytest.raises(StoreRefusedError) as e:
        _add(st, big)
    assert e.value.reason == "uid_share" and st.counters["skipped_uid_share"] == 1
    assert st.contains(bids[3]) and st.contains(bids[4]) and st.counters["evicted"] == 3   # nothing evicted for it
    root_exe = _exe(system_dir / "rootprog", pad % (200000, 9) + "int main(void) { return 0; }", "-Wl,--build-id=sha1")
    assert _add(st, root_exe).added                   # root's files are not held to a share


def test_forged_build_id_never_wins_over_the_system_copy(tmp_path, public_dir, system_dir, attacker):
    st = Store(tmp_path / "store", debug_root=tmp_path / "no-debug")
    forged = _exe(public_dir / "tac", 'int main(void) { return 66; }', f"-Wl,--build-id=0x{FORGED_BID}")
    os.chown(forged, attacker[0], attacker[1])
    real = _exe(system_dir / "tac", 'int main(void) { return 0; }', f"-Wl,--build-id=0x{FORGED_BID}")
    assert readelf_build_id(forged) == readelf_build_id(real) == FORGED_BID
    assert forged.read_bytes() != real.read_bytes()

    first = _add(st, forged)                          # mapped before the real one ever ran
    assert first.added and st.origin(FORGED_BID).uid == attacker[0] and not st.origin(FORGED_BID).trusted
    second = _add(st, real)
    assert second.added
    assert st.best(FORGED_BID).read_bytes() == real.read_bytes()
    assert st.path_of(FORGED_BID).read_bytes() == real.read_bytes()
    assert st.origin(FORGED_BID).trusted and st.origin(FORGED_BID).uid == 0
    assert st.counters["conflicts"] == 1 and st.counters["promoted"] == 1
    alts = list((st.path_of(FORGED_BID).parent / "alt").iterdir())
    assert len(alts) == 1 and (alts[0] / "elf").read_bytes() == forged.read_bytes()   # kept, not served
    # The attacker adding again changes nothing; a new forged content stays an alternative.
    assert not _add(st, forged).added
    other = _exe(public_dir / "tac2", 'int main(void) { return 67; }', f"-Wl,--build-id=0x{FORGED_BID}")
    os.chown(other, attacker[0], attacker[1])
    assert _add(st, other).path.parent.parent.name == "alt"
    assert st.best(FORGED_BID).read_bytes() == real.read_bytes() and st.counters["conflicts"] == 2


def test_forged_build_id_at_the_same_path_in_another_namespace(tmp_path, public_dir, system_dir, attacker):
    """The attacker's mapping may carry the system path itself (a mount namespace): same entry directory."""
    st = Store(tmp_path / "store", debug_root=tmp_path / "no-debug")
    forged = _exe(public_dir / "x", 'int main(void) { return 66; }', f"-Wl,--build-id=0x{FORGED_BID}")
    os.chown(forged, attacker[0], attacker[1])
    real = _exe(system_dir / "x", 'int main(void) { return 0; }', f"-Wl,--build-id=0x{FORGED_BID}")
    _add(st, forged, name=str(real))
    _add(st, real)
    assert st.best(FORGED_BID).read_bytes() == real.read_bytes() and st.counters["promoted"] == 1


def test_stripped_first_never_blocks_the_unstripped_copy(tmp_path, system_dir):
    full = _exe(system_dir / "prog", "static int f(int x) { return x + 1; } int main(int c, char **v) { return f(c); }",
                "-g", "-Wl,--build-id=sha1")
    stripped = system_dir / "prog.stripped"
    subprocess.run(["strip", "--strip-all", "-o", str(stripped), str(full)], check=True)
    bid = readelf_build_id(full)
    st = Store(tmp_path / "store", debug_root=tmp_path / "no-debug")
    _add(st, stripped, name=str(full))
    assert st.best(bid, "debug") is None
    _add(st, full)
    assert st.best(bid, "elf").read_bytes() == stripped.read_bytes()      # the first trusted copy stays main
    assert st.best(bid, "debug").read_bytes() == full.read_bytes()        # symbols come from the unstripped one


def _group_gid() -> int:
    try:
        return grp.getgrnam("buildidd").gr_gid
    except KeyError:
        return 0


def test_modes_whatever_the_umask_and_source(tmp_path, public_dir, attacker):
    exe = _exe(public_dir / "suid", "int main(void) { return 0; }", "-Wl,--build-id=sha1")
    os.chmod(exe, 0o6777)
    old = os.umask(0)
    try:
        st = Store(tmp_path / "store", debug_root=tmp_path / "no-debug")
        res = _add(st, exe)
    finally:
        os.umask(old)
    for dirpath, dirnames, filenames in os.walk(st.root):
        for d in dirnames:
            s = os.lstat(os.path.join(dirpath, d))
            if not stat.S_ISLNK(s.st_mode):
                assert stat.S_IMODE(s.st_mode) == 0o750 and (s.st_uid, s.st_gid) == (0, _group_gid()), d
        for f in filenames:
            s = os.lstat(os.path.join(dirpath, f))
            assert stat.S_IMODE(s.st_mode) == 0o640 and (s.st_uid, s.st_gid) == (0, _group_gid()), f
    assert not st.is_private(readelf_build_id(exe))
    assert as_user(attacker, ["cat", str(res.path)]).returncode != 0


def test_private_sources_stay_private(tmp_path, public_dir, attacker):
    hidden = public_dir / "hidden"
    hidden.mkdir(mode=0o700)
    exe = _exe(hidden / "prog", "int main(void) { return 0; }", "-Wl,--build-id=sha1")   # 0o755 in a 0o700 dir
    st = Store(public_dir / "store", debug_root=tmp_path / "no-debug")
    os.chmod(st.root, 0o755)
    bid = readelf_build_id(exe)
    res = _add(st, exe)
    assert st.is_private(bid) and stat.S_IMODE(res.path.parent.stat().st_mode) == 0o700
    assert as_user(attacker, ["cat", str(res.path)]).returncode != 0

    memfd = os.memfd_create("payload")
    other = _exe(public_dir / "m", "int main(void) { return 3; }", "-Wl,--build-id=sha1")
    os.write(memfd, other.read_bytes())
    try:
        res = st.add_from_fd(memfd, "/memfd:payload", readelf_build_id(other))
    finally:
        os.close(memfd)
    assert st.is_private(readelf_build_id(other)) and st.counters["private"] == 2
    assert as_user(attacker, ["cat", str(res.path)]).returncode != 0


def test_eviction_makes_room_from_unmapped_in_use_entries_and_says_so(tmp_path, public_dir):
    pad = "static char pad[300000] __attribute__((used)) = {%d};"
    exes = [_exe(public_dir / f"e{n}", pad % n + "int main(void) { pause(); return 0; }",
                 "-include", "unistd.h", "-Wl,--build-id=sha1") for n in range(1, 5)]
    bids = [readelf_build_id(e) for e in exes]
    st = Store(tmp_path / "store", debug_root=tmp_path / "no-debug")
    for e in exes[:3]:
        _add(st, e)
    running = subprocess.Popen([str(exes[0])])        # a process maps the oldest one
    try:
        st.quota_bytes = st.disk_bytes() + 100_000    # the fourth does not fit
        st.enforce_quota(set(bids[:3]))               # all three in use by the session: nothing removed
        assert all(st.contains(b) for b in bids[:3])
        assert _add(st, exes[3]).added
        assert st.contains(bids[0])                   # still mapped: kept
        assert not st.contains(bids[1])               # the oldest unmapped one went
        assert st.counters["evicted_in_use"] == 1 and st.counters["evicted"] == 1
        assert st.disk_bytes() <= st.quota_bytes
    finally:
        running.kill()
        running.wait()


def test_private_entries_parents_are_closed_to_the_control_group(tmp_path, public_dir, attacker):
    """A member of the control group could list the names of a private entry's directories (parents 0750)."""
    import grp
    group = "buildidd-test-ctl"
    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        subprocess.run(["groupadd", "-r", group], capture_output=True, text=True)
        gid = grp.getgrnam(group).gr_gid
    hidden = public_dir / "hidden2"
    hidden.mkdir(mode=0o700)
    secret = _exe(hidden / "secret-name", "int main(void) { return 5; }", "-Wl,--build-id=sha1")
    plain = _exe(public_dir / "plain2", "int main(void) { return 6; }", "-Wl,--build-id=sha1")
    st = Store(public_dir / "store2", debug_root=tmp_path / "no-debug", group=group)
    os.chmod(st.root, 0o755)
    private_entry = _add(st, secret).path.parent
    public_entry = _add(st, plain).path.parent
    uid, ugid, _ = attacker
    member = ["setpriv", f"--reuid={uid}", f"--regid={ugid}", f"--groups={gid}", "--"]
    assert subprocess.run(member + ["ls", str(public_entry.parent)], capture_output=True).returncode == 0
    for d in (private_entry.parent, private_entry.parent.parent):     # .../hidden2/secret-name and .../hidden2
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
        assert subprocess.run(member + ["ls", str(d)], capture_output=True).returncode != 0, d

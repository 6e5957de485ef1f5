"""Enrichment without BPF: identity-checked routes, reasons, the bounded identity cache."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from buildidd.resolve.enrich import Enricher
from buildidd.kernel.events import EventType, MapOrigin, RawEvent
from buildidd.resolve.procfs import identity_of, parse_maps_line

from conftest import gcc, readelf_build_id


def _event(path, ident, pid=999999999, nlink=1):
    # A pid that does not exist: map_files and /proc/PID/root fail, like a process that exited.
    return RawEvent(EventType.MAP, pid, pid, 1, "t", 0x1000, 0x1000, 0, 5, 2, MapOrigin.MMAP, ident, nlink, 0, str(path))


def _ident(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        return identity_of(fd)
    finally:
        os.close(fd)


def test_path_route_accepts_only_the_same_identity(tmp_path):
    a = gcc("int main(void){return 0;}\n", tmp_path / "a", "-Wl,--build-id=sha1")
    b = gcc("int main(void){return 1;}\n", tmp_path / "b", "-Wl,--build-id=sha1")
    ident = _ident(a)
    e = Enricher()
    res = e.resolve(_event(a, ident))
    assert res.build_id == readelf_build_id(a) and res.source == "path" and res.error is None
    # Replace a by b (rename over): an event with a's old identity must not get b's build-id.
    shutil.copy(b, tmp_path / "b2")
    os.rename(tmp_path / "b2", a)
    e2 = Enricher()
    res = e2.resolve(_event(a, ident))
    assert res.build_id is None and res.error == "file_replaced"
    os.unlink(a)
    res = Enricher().resolve(_event(a, ident))
    assert res.build_id is None and res.error == "file_vanished"
    res = Enricher().resolve(_event(a, ident, nlink=0))
    assert res.error == "file_deleted"


def test_reasons_for_non_elf_and_no_note(tmp_path):
    txt = tmp_path / "x.txt"
    txt.write_text("hello\n")
    none = gcc("int main(void){return 0;}\n", tmp_path / "n", "-Wl,--build-id=none")
    e = Enricher()
    assert e.resolve(_event(txt, _ident(txt))).error == "not_elf"
    assert e.resolve(_event(none, _ident(none))).error == "no_build_id"


def test_cache_is_bounded_and_hits(tmp_path):
    evicted = []
    e = Enricher(cache_entries=16, on_evicted=evicted.append)
    files = []
    for i in range(20):
        f = tmp_path / f"f{i}"
        f.write_bytes(b"\x7fELF" + bytes([i]) * 60)
        files.append((f, _ident(f)))
    for f, ident in files:
        e.resolve(_event(f, ident))
    assert len(e.cache) == 16 and len(evicted) == 4
    f, ident = files[-1]
    hits = e.hits
    e.resolve(_event(f, ident))
    assert e.hits == hits + 1


def test_maps_line_parsing():
    m = parse_maps_line("7f0000000000-7f0000001000 r-xp 00002000 fe:01 1234   /usr/lib/x (deleted)\n")
    assert (m.start, m.end, m.offset, m.ino, m.path, m.deleted, m.prot) == (
        0x7F0000000000, 0x7F0000001000, 0x2000, 1234, "/usr/lib/x", True, 5)
    assert m.dev == os.makedev(0xFE, 0x01)
    assert parse_maps_line("garbage") is None
    assert parse_maps_line("zz-yy r-xp 0 0:0 0") is None


def test_anonymous_devices_compare_equal_but_real_ones_do_not():
    from buildidd.kernel.events import Identity
    from buildidd.resolve.procfs import mismatch
    a = Identity(os.makedev(0, 40), 5, 0, 10, 99)
    assert mismatch(a, Identity(os.makedev(0, 51), 5, 0, 10, 99)) is None       # btrfs subvolume anon_dev
    assert mismatch(a, Identity(os.makedev(254, 1), 5, 0, 10, 99)) == "other_inode"
    assert mismatch(a, Identity(os.makedev(0, 40), 6, 0, 10, 99)) == "other_inode"
    assert mismatch(a, Identity(os.makedev(0, 40), 5, 0, 11, 99)) == "modified"


def test_a_path_with_a_nul_byte_gets_a_reason_not_an_exception(tmp_path):
    f = gcc("int main(void){return 0;}\n", tmp_path / "a", "-Wl,--build-id=sha1")
    res = Enricher().resolve(_event(str(f) + "\0junk", _ident(f)))
    assert res.build_id is None and res.error == "file_vanished"


def test_a_fifo_or_a_symlink_at_the_path_is_never_opened(tmp_path):
    f = gcc("int main(void){return 0;}\n", tmp_path / "a", "-Wl,--build-id=sha1")
    ident = _ident(f)
    os.unlink(f)
    os.mkfifo(f)              # no writer: an open(O_RDONLY) without O_NONBLOCK would block for ever
    res = Enricher().resolve(_event(f, ident))
    assert res.build_id is None and res.error == "not_regular" and res.source == "none"
    os.unlink(f)
    os.symlink("/usr/bin/true", f)
    assert Enricher().resolve(_event(f, ident)).error == "not_regular"


def test_a_job_past_its_deadline_is_recorded_as_timeout_then_completed(tmp_path):
    import threading

    from buildidd.resolve.enrich import Offload

    f = gcc("int main(void){return 0;}\n", tmp_path / "a", "-Wl,--build-id=sha1")
    ident = _ident(f)
    e = Enricher(offload=Offload(deadline_s=0.05))
    gate = threading.Event()
    real = e.routes.fresh

    def stuck(req):           # a file system that answers late (FUSE, NFS): the worker blocks
        gate.wait(30)
        return real(req)

    e.routes.fresh = stuck
    res = e.resolve(_event(f, ident))
    assert res.error == "timeout" and not res.final and e.timeouts == 1
    assert e.resolve(_event(f, ident)).error == "timeout"      # pending: no second job, no wait
    assert e.status()["pending"] == 1 and e.status()["suspect_devices"] == 1
    gate.set()
    for _ in range(500):
        late = e.take_late()
        if late:
            break
        threading.Event().wait(0.01)
    assert late and late[0][0] == ident and late[0][1].build_id == readelf_build_id(f)
    assert e.resolve(_event(f, ident)).build_id == readelf_build_id(f)
    assert e.status()["pending"] == 0 and e.close() == 0


def test_ctime_is_compared_while_the_file_has_a_name_and_not_once_it_has_none(tmp_path):
    """A package upgrade renames the new file over the old one: the mapped inode's ctime moves
    (nlink 1 -> 0) but its bytes do not; a chmod (or a write whose mtime was set back) on a
    file that keeps its name is still refused."""
    import time
    from buildidd.resolve.procfs import Source, open_identified, open_route
    from buildidd.errors import FileRefusedError

    lib = tmp_path / "lib.so"
    lib.write_bytes(b"\x7fELF" + b"\0" * 60)
    fd = os.open(lib, os.O_RDONLY)
    try:
        mapped = identity_of(fd)                   # as at map time (ctime known)
        assert mapped.ctime_ns
        time.sleep(0.02)
        os.chmod(lib, 0o700)                       # ctime moves, the name stays
        pfd = open_route(Source.PATH, os.getpid(), str(lib))
        try:
            try:
                os.close(open_identified(pfd, mapped))
                raise AssertionError("a named file whose ctime moved was accepted")
            except FileRefusedError as e:
                assert e.reason == "modified"
        finally:
            os.close(pfd)
        chmodded = identity_of(fd)
        (tmp_path / "new.so").write_bytes(b"other")
        time.sleep(0.02)
        os.rename(tmp_path / "new.so", lib)        # the upgrade: no name left for the mapped inode
        assert os.fstat(fd).st_nlink == 0 and os.fstat(fd).st_ctime_ns != chmodded.ctime_ns
        assert identity_of(fd).ctime_ns == 0
        pfd = os.open(f"/proc/self/fd/{fd}", os.O_PATH)
        try:
            os.close(open_identified(pfd, chmodded))
        finally:
            os.close(pfd)
    finally:
        os.close(fd)


def test_a_file_without_a_name_already_at_the_event_is_still_compared_on_ctime(tmp_path):
    """A memfd or a file unlinked before its mmap: the event's ctime is after the unlink, so a later
    ctime change is a real change (a write whose mtime was set back)."""
    import time
    from buildidd.resolve.procfs import open_identified
    from buildidd.errors import FileRefusedError

    fd = os.memfd_create("bidd-test")
    try:
        os.write(fd, b"\x7fELF" + b"\0" * 60)
        mapped = identity_of(fd, named_at_event=False)
        assert mapped.ctime_ns                          # nlink 0 at the event: ctime kept
        st = os.fstat(fd)
        time.sleep(0.02)
        os.pwrite(fd, b"X", 10)                            # other bytes, same size
        os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime as at the event
        pfd = os.open(f"/proc/self/fd/{fd}", os.O_PATH)
        try:
            try:
                os.close(open_identified(pfd, mapped, named_at_event=False))
                raise AssertionError("a memfd rewritten with its mtime set back was accepted")
            except FileRefusedError as e:
                assert e.reason == "modified"
        finally:
            os.close(pfd)
    finally:
        os.close(fd)


def test_a_hand_over_reaches_the_mapped_file_without_map_files_while_its_path_names_it(tmp_path, monkeypatch):
    """The store's copy of a kernel-resolved mapping: the path inside the process's root first (no
    lock of the process), /proc/PID/map_files (which takes its mmap_lock) only when the path names
    another file now; the exact mapped inode either way."""
    import mmap
    import subprocess
    import sys
    from buildidd.resolve import handover as handover_mod
    from buildidd.resolve.filekeys import FileKeys
    from buildidd.resolve.handover import HandOverJob
    from buildidd.resolve.procfs import Source
    from buildidd.resolve.resolution import Request, make_resolution
    lib = gcc("int f(void) { return 1; }\n", tmp_path / "lib.so", "-shared", "-fPIC", "-Wl,--build-id=sha1")
    bid = readelf_build_id(lib)
    ident = _ident(lib)
    child = subprocess.Popen([sys.executable, "-c", (
        "import mmap, os, sys\n"
        f"fd = os.open({str(lib)!r}, os.O_RDONLY)\n"
        "m = mmap.mmap(fd, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_EXEC, flags=mmap.MAP_PRIVATE)\n"
        "print('ready', flush=True); sys.stdin.read()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"ready\n"
        with open(f"/proc/{child.pid}/maps") as f:
            line = next(x for x in f if x.rstrip().endswith(str(lib)))
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        tried, got = [], []
        real_open_route = handover_mod.open_route
        monkeypatch.setattr(handover_mod, "open_route",
                            lambda source, *a, **k: tried.append(source) or real_open_route(source, *a, **k))
        r = HandOverJob(lambda ident_, res, fd, urgency, uid: got.append(os.fstat(fd).st_ino), FileKeys(),
                        None, None, None)
        req = Request(child.pid, start, end - start, str(lib), 1, ident)
        res = make_resolution(ident, bid, Source.NONE, None, str(lib))
        assert r.run((req, res)) is True
        assert tried == [Source.PROC_ROOT] and got == [ident.ino]
        # The path now names another file: refused there, reached through map_files.
        shutil.copy(lib, tmp_path / "other.so")
        os.rename(tmp_path / "other.so", lib)
        tried.clear()
        got.clear()
        assert r.run((req, res)) is True
        assert tried == [Source.PROC_ROOT, Source.MAP_FILES] and got == [ident.ino]
    finally:
        child.stdin.close()
        child.wait()


@pytest.mark.parametrize("swap", ["symlink", "fifo"])
def test_a_users_path_swapped_after_the_mapping_never_stands_in_for_the_mapped_file(attacker, swap):
    """A real unprivileged user maps its own library, moves its directory away and puts at the
    library's path a symlink to a system binary, or a FIFO.  The hand-over (as root) tries that
    path inside the user's root first: the symlink is not followed (O_NOFOLLOW), the FIFO never
    opened for reading, each refused; the mapped inode is reached through map_files."""
    import subprocess
    import sys
    import tempfile
    from buildidd.resolve import handover as handover_mod
    from buildidd.resolve.filekeys import FileKeys
    from buildidd.resolve.handover import HandOverJob
    from buildidd.resolve.procfs import Source
    from buildidd.resolve.resolution import Request, make_resolution
    from conftest import as_user_popen
    work = Path(tempfile.mkdtemp(prefix="buildidd-handover-", dir="/tmp"))  # root's tmp_path is 0700
    try:
        uid, gid, _ = attacker
        (work / "d").mkdir()
        for d in (work, work / "d"):
            os.chmod(d, 0o755)
            os.chown(d, uid, gid)
        lib = gcc("int f(void) { return 2; }\n", work / "d" / "lib.so", "-shared", "-fPIC", "-Wl,--build-id=sha1")
        os.chown(lib, uid, gid)
        bid, ident = readelf_build_id(lib), _ident(lib)
        put = f"os.symlink('/usr/bin/true', {str(lib)!r})" if swap == "symlink" else f"os.mkfifo({str(lib)!r})"
        mapper = as_user_popen(attacker, [sys.executable, "-c", (
            "import mmap, os, sys\n"
            f"fd = os.open({str(lib)!r}, os.O_RDONLY)\n"
            "m = mmap.mmap(fd, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_EXEC, flags=mmap.MAP_PRIVATE)\n"
            f"os.close(fd); os.rename({str(work / 'd')!r}, {str(work / 'moved')!r}); os.mkdir({str(work / 'd')!r})\n"
            f"{put}\n"
            "print('ready', flush=True); sys.stdin.read()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            assert mapper.stdout.readline() == b"ready\n"
            with open(f"/proc/{mapper.pid}/maps") as f:
                start, end = (int(x, 16) for x in next(x for x in f if "lib.so" in x).split()[0].split("-"))
            tried, got = [], []
            real = handover_mod.open_route
            mp = pytest.MonkeyPatch()
            mp.setattr(handover_mod, "open_route", lambda source, *a, **k: tried.append(source) or real(source, *a, **k))
            try:
                r = HandOverJob(lambda ident_, res, fd, urgency, uid: got.append(os.fstat(fd).st_ino), FileKeys(),
                                None, None, None)
                req = Request(mapper.pid, start, end - start, str(lib), 1, ident)
                assert r.run((req, make_resolution(ident, bid, Source.NONE, None, str(lib)))) is True
            finally:
                mp.undo()
            assert tried == [Source.PROC_ROOT, Source.MAP_FILES]
            assert got == [ident.ino]
        finally:
            mapper.stdin.close()
            mapper.wait()
    finally:
        shutil.rmtree(work, ignore_errors=True)

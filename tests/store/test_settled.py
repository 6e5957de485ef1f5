"""SettledView.settled remembers a trusted, public entry only while the entry stays what it was."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from buildidd.store import CopyJob, Snapshotter, Store
from conftest import store_add


def _libm() -> Path:
    with open("/proc/self/maps") as f:
        return next(Path(line.split()[-1]) for line in f
                    if "/libm.so" in line and line.split()[-1].startswith("/usr/"))



def _identity(path: Path):
    """The identity (dev, inode, size, mtime, ctime, generation) of the file at path, as a mapping gives it."""
    from buildidd.resolve.procfs import identity_of

    fd = os.open(path, os.O_RDONLY)
    try:
        return identity_of(fd, True)
    finally:
        os.close(fd)

def test_a_remembered_answer_follows_removal_and_an_untrusted_copy(public_tmp_factory):
    d = public_tmp_factory()
    store = Store(d / "store")
    bid = store_add(store, _libm())
    snap = Snapshotter(store)
    assert snap.view.settled(bid) and snap.view.settled(bid)          # the second from memory
    stamp = store.origin_stamp(bid)
    assert stamp is not None and snap.view.answers[bid].stamp == stamp
    store.remove(bid)                                        # an eviction
    assert store.origin_stamp(bid) is None and not snap.view.settled(bid)
    copy = d / "libm-copy.so"                                # the same bytes where any user could have put them
    shutil.copy(_libm(), copy)
    os.chmod(copy, 0o755)
    assert store_add(store, copy) == bid
    assert not store.origin(bid).trusted and not snap.view.settled(bid)


def test_a_settled_entry_is_touched_once_per_period(public_tmp_factory):
    d = public_tmp_factory()
    store = Store(d / "store")
    bid = store_add(store, _libm())
    snap = Snapshotter(store)
    assert snap.view.settled(bid)
    entry = store.linkname(bid).resolve()
    os.utime(entry, (1, 1))
    snap.view.touch(bid)
    assert entry.stat().st_mtime > 1                         # touched: recent for the quota
    os.utime(entry, (1, 1))
    snap.view.touch(bid)
    assert entry.stat().st_mtime == 1                        # not again within SETTLED_TTL_S


def test_an_untrusted_copy_is_settled_for_its_own_unchanged_file_only(public_tmp_factory):
    d = public_tmp_factory()
    store = Store(d / "store")
    lib = d / "libuser.so"                                   # where any user could have put it: untrusted
    shutil.copy(_libm(), lib)
    os.chmod(lib, 0o755)
    bid = store_add(store, lib)
    assert not store.origin(bid).trusted

    snap = Snapshotter(store)
    assert not snap.view.settled(bid)                             # not for any file
    assert snap.view.settled(bid, _identity(lib), str(lib)) and snap.view.settled(bid, _identity(lib), str(lib))
    assert not snap.view.settled(bid, _identity(lib), str(d / "elsewhere.so"))     # another path: its facts may differ
    os.chmod(lib, 0o700)                                     # a new ctime: owner or mode may have changed
    assert not snap.view.settled(bid, _identity(lib), str(lib))
    assert not snap.view.settled(bid)


def test_the_same_content_from_a_new_file_moves_the_origin_to_it(public_tmp_factory):
    from buildidd.resolve.procfs import identity_of

    d = public_tmp_factory()
    store = Store(d / "store")
    lib = d / "libuser.so"
    shutil.copy(_libm(), lib)
    os.chmod(lib, 0o755)
    bid = store_add(store, lib)
    old_ino = store.origin(bid).ino
    new = d / "libuser.so.new"                               # a rebuild: the same bytes, a new inode
    shutil.copy(_libm(), new)
    os.chmod(new, 0o755)
    os.rename(new, lib)
    fd = os.open(lib, os.O_RDONLY)
    try:
        ident = identity_of(fd)
        snap = Snapshotter(store)
        assert not snap.view.settled(bid, ident, str(lib))        # the stored copy came from the old file
        assert not store.add_from_fd(fd, str(lib), bid).added
    finally:
        os.close(fd)
    assert store.origin(bid).ino == ident.ino != old_ino
    assert snap.view.settled(bid, ident, str(lib))                # its next sighting needs no copy


def test_a_user_who_rewrites_the_file_and_puts_its_mtime_back_is_not_settled(public_tmp_factory, attacker):
    """The owner of an untrusted stored file changes its bytes, then sets its mtime back (touch -d):
    the ctime the kernel keeps still moves, so the next sighting is not taken for the stored copy."""
    from conftest import as_user

    uid, gid, _ = attacker
    d = public_tmp_factory()
    lib = d / "libmine.so"
    shutil.copy(_libm(), lib)
    os.chown(lib, uid, gid)
    os.chmod(lib, 0o755)
    store = Store(d / "store")
    bid = store_add(store, lib)
    snap = Snapshotter(store)

    before = _identity(lib)
    assert snap.view.settled(bid, before, str(lib))
    stamp = f"@{before.mtime_ns // 10**9}.{before.mtime_ns % 10**9:09d}"
    r = as_user(attacker, ["sh", "-c", f'printf x | dd of="{lib}" bs=1 seek=100 conv=notrunc 2>/dev/null && '
                                       f'touch -d "{stamp}" "{lib}"'])
    assert r.returncode == 0, r.stderr
    after = _identity(lib)
    assert (after.ino, after.size, after.mtime_ns) == (before.ino, before.size, before.mtime_ns)
    assert after.ctime_ns != before.ctime_ns
    assert not snap.view.settled(bid, after, str(lib))


def test_stamped_origin_reads_the_stamp_and_origin_together_and_refuses_what_is_not_an_entry(public_tmp_factory):
    d = public_tmp_factory()
    store = Store(d / "store")
    bid = store_add(store, _libm())
    stamp, origin = store.stamped_origin(bid)
    assert stamp == store.origin_stamp(bid) and origin == store.origin(bid)
    link = store.linkname(bid)
    entry = link.resolve()
    main = store.path_of(bid)
    os.rename(main, entry / "elf.aside")                     # no main file: not an entry
    assert store.stamped_origin(bid) is None and not store.contains(bid)
    os.rename(entry / "elf.aside", main)
    target = os.readlink(link)
    os.unlink(link)
    os.symlink("../../../" + "x" * 8, link)                 # a link out of the store
    assert store.stamped_origin(bid) is None and store.origin_stamp(bid) is None
    os.unlink(link)
    os.symlink(target, link)
    (entry / "origin.json").write_text("not json")           # an origin that is not one
    assert store.stamped_origin(bid) is None


def test_stored_file_id_reads_again_once_the_entry_changed(public_tmp_factory):
    """The htlhash settled() remembered with the origin is given only while the entry's stamp holds."""

    d = public_tmp_factory()
    store = Store(d / "store")
    bid = store_add(store, _libm())
    ident = _identity(_libm())
    snap = Snapshotter(store)
    assert snap.view.settled(bid)
    fid = store.origin(bid).file_id
    assert fid and snap.view.stored_file_id(bid, ident) == fid
    origin = store.linkname(bid).resolve() / "origin.json"
    text = origin.read_text().replace(fid, "0" * 32)
    tmp = origin.with_name("origin.json.new")                # a new origin, renamed into place
    tmp.write_text(text)
    os.rename(tmp, origin)
    assert snap.view.stored_file_id(bid, ident) == "0" * 32


def test_a_settled_sighting_without_a_file_is_done_at_submit(public_tmp_factory):
    """No worker runs here: a settled sighting is counted, touched and held at submit, queueing
    nothing; one that is not settled waits in the queue for the worker."""
    d = public_tmp_factory()
    store = Store(d / "store")
    bid = store_add(store, _libm())
    entry = store.linkname(bid).resolve()
    os.utime(entry, (1, 1))
    snap = Snapshotter(store)
    snap.submit(CopyJob(bid, str(_libm()), None), None)
    assert snap.stats["already_present"] == 1 and not snap.queued()
    assert snap.coverage.state(bid) == "held"
    assert entry.stat().st_mtime > 1                         # touched
    snap.submit(CopyJob(bid, str(_libm()), None), None)                # seen: nothing more
    assert snap.stats["already_present"] == 1
    other = "ab" * 20                                        # not in the store: queued
    snap.submit(CopyJob(other, "/usr/lib/x86_64-linux-gnu/libnothere.so", None), None)
    assert snap.queued() == 1 and snap.stats["already_present"] == 1


def test_an_entry_evicted_before_its_touch_is_counted_failed(public_tmp_factory):
    """The entry goes (a quota eviction) between settled() and the touch: the sighting is counted
    failed and named so in the ledger, not counted present."""
    d = public_tmp_factory()
    store = Store(d / "store")
    bid = store_add(store, _libm())
    snap = Snapshotter(store)
    touch = snap.view.touch

    def evicted_first(build_id):
        store.remove(build_id)
        touch(build_id)

    snap.view.touch = evicted_first
    snap.submit(CopyJob(bid, str(_libm()), None), None)
    assert snap.stats["failed"] == 1 and snap.stats["already_present"] == 0
    assert snap.coverage.state(bid) == "failed" and bid in (snap.last_error or "")

"""A batch of new entries (Store.batch): one syncfs before any link, and a crash at any step leaves whole
entries or none.

A real child process adds gcc-built binaries to a real store inside one batch, under ``strace``: the
trace shows the order of the calls that make files durable and visible, and strace's fault injection
kills the child with SIGKILL on entering each of them in turn.  A second test kills a child that adds
batch after batch with a real ``kill -9`` at an arbitrary moment.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from buildidd.errors import StoreError
from buildidd.resolve.buildid import read_build_id
from buildidd.store import Store
from buildidd.store import batch as batch_mod
from buildidd.store.origin import read_origin

from conftest import gcc, need
from store.test_crash_order import trace_store_calls

TRACED = ("fsync", "syncfs", "rename", "symlink", "mkdir")

CHILD = """
import os, sys
from buildidd.store import Store
root, rounds, *pairs = sys.argv[1:]
st = Store(root, debug_root=root + "-no-debug")
for r in range(int(rounds)):
    with st.batch() as b:
        for path, bid in zip(pairs[::2], pairs[1::2]):
            fd = os.open(path, os.O_RDONLY)
            st.add_from_fd(fd, path, bid)
            os.close(fd)
    assert not b.failed, b.failed
    print(r, flush=True)
    if r + 1 < int(rounds):
        for bid in pairs[1::2]:
            st.remove(bid)
"""


@pytest.fixture
def binaries(tmp_path) -> list[tuple[Path, str]]:
    """Three gcc-built programs with distinct build-ids."""
    out = []
    for i in range(3):
        exe = gcc(f"int main(void) {{ return {i}; }}", tmp_path / f"prog{i}", "-Wl,--build-id=sha1")
        bid = read_build_id(exe)
        assert bid is not None
        out.append((exe, bid.hex))
    assert len({b for _e, b in out}) == 3
    return out


def _args(store: Path, binaries, rounds: int = 1) -> list[str]:
    return [sys.executable, "-c", CHILD, str(store), str(rounds), *[str(x) for exe, bid in binaries for x in (exe, bid)]]


def _strace(store: Path, binaries, *inject: str) -> tuple[int, list[tuple[str, str, int]]]:
    """The child under strace: test_crash_order.trace_store_calls."""
    return trace_store_calls(store, _args(store, binaries), TRACED, *inject)


def _whole(store: Path, binaries) -> int:
    """How many of binaries the store shows; fails the test when a shown one is not whole."""
    st = Store(store, debug_root=store.with_name("no-debug"))
    shown = 0
    for exe, bid in binaries:
        if not st.contains(bid):
            continue
        shown += 1
        entry = st.path_of(bid).parent
        origin = read_origin(entry)
        assert (entry / "elf").read_bytes() == exe.read_bytes(), f"{bid}: a link names a torn elf"
        assert origin is not None and origin.size_bytes == exe.stat().st_size, f"{bid}: torn origin.json"
        assert (entry / "probes").exists(), f"{bid}: no probes"
    return shown


def test_a_batch_syncs_its_files_before_any_link_and_its_links_after(tmp_path, binaries):
    status, traced = _strace(tmp_path / "store", binaries)
    assert status == 0, traced
    calls = [(name, args) for name, args, _n in traced]
    links = [i for i, (name, _a) in enumerate(calls) if name == "symlink"]
    syncs = [i for i, (name, _a) in enumerate(calls) if name == "syncfs"]
    renames = [i for i, (name, a) in enumerate(calls) if name == "rename" and "/.build-id/" not in a]
    assert len(links) == 3 and len(syncs) == 2, calls
    assert max(renames) < syncs[0] < min(links) and max(links) < syncs[1], calls
    # No file of the batch is fsync-ed on its own: the two syncfs stand for the 15 fsyncs of three adds.
    assert not [a for name, a in calls if name == "fsync"], calls


def test_a_batch_killed_at_any_step_leaves_whole_entries_or_none(tmp_path, binaries):
    status, steps = _strace(tmp_path / "dry", binaries)
    assert status == 0 and len(steps) >= 15, steps
    for name, args, nth in steps:
        store = tmp_path / f"store-{name}-{nth}"
        status, _ = _strace(store, binaries, "-e", f"inject={name}:signal=SIGKILL:when={nth}")
        assert status != 0, f"the batch survived a SIGKILL at {name} {args}"
        _whole(store, binaries)
        st = Store(store, debug_root=tmp_path / "no-debug")
        st.sweep_temps()
        with st.batch() as b:
            for exe, bid in binaries:
                fd = os.open(exe, os.O_RDONLY)
                try:
                    st.add_from_fd(fd, str(exe), bid)
                finally:
                    os.close(fd)
        assert not b.failed
        assert _whole(store, binaries) == 3, f"killed at {name} {args}: not all added after"


def test_kill_9_during_batches_leaves_whole_entries_or_none(tmp_path, binaries):
    """A real kill -9, at a different moment each time, of a child adding and removing batch after batch."""
    for i, delay_s in enumerate((0.0, 0.01, 0.03, 0.07)):
        store = tmp_path / f"store-{i}"
        child = subprocess.Popen(_args(store, binaries, rounds=1000), stdout=subprocess.PIPE, text=True,
                                 env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
        assert child.stdout.readline().strip() == "0"     # one batch done: the next ones are under way
        time.sleep(delay_s)
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait() == -signal.SIGKILL
        child.stdout.close()
        _whole(store, binaries)
        st = Store(store, debug_root=tmp_path / "no-debug")
        st.sweep_temps()
        for exe, bid in binaries:
            fd = os.open(exe, os.O_RDONLY)
            try:
                st.add_from_fd(fd, str(exe), bid)
            finally:
                os.close(fd)
        assert _whole(store, binaries) == 3


def _add(st: Store, exe: Path, bid: str):
    fd = os.open(exe, os.O_RDONLY)
    try:
        return st.add_from_fd(fd, str(exe), bid)
    finally:
        os.close(fd)


def test_an_entry_is_visible_only_after_the_commit_and_a_second_add_commits_first(tmp_path, binaries):
    st = Store(tmp_path / "store", debug_root=tmp_path / "no-debug")
    (exe0, bid0), (exe1, bid1), _ = binaries
    with st.batch() as b:
        assert _add(st, exe0, bid0).added
        assert not st.contains(bid0) and st.counters["added"] == 0
        other = []
        t = threading.Thread(target=lambda: other.append(_add(st, exe1, bid1)))   # another thread: single add
        t.start()
        t.join()
        assert other[0].added and st.contains(bid1)
        again = _add(st, exe0, bid0)                 # the batch holds bid0: committed, then found present
        assert not again.added and st.contains(bid0)
    assert not b.failed and b.committed == 1 and st.counters["added"] == 2
    with pytest.raises(StoreError):
        with st.batch():
            with st.batch():
                pass


def test_a_failed_sync_removes_the_batch_entries_and_names_them(tmp_path, binaries, monkeypatch):
    """syncfs failing (EIO from the disk cannot be made here for real: the one stand-in of this file)."""
    st = Store(tmp_path / "store", debug_root=tmp_path / "no-debug")
    before = st.disk_bytes()

    def eio(path):
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))

    monkeypatch.setattr(batch_mod, "syncfs", eio)
    with st.batch() as b:
        for exe, bid in binaries:
            assert _add(st, exe, bid).added
    assert set(b.failed) == {bid for _e, bid in binaries}
    assert all("cannot sync" in why for why in b.failed.values())
    for _exe, bid in binaries:
        assert not st.contains(bid) and not (tmp_path / "store" / str(_exe).lstrip("/") / bid).exists()
    assert st.disk_bytes() == before and st.counters["copy_errors"] == 1

"""Crash ordering of an add: its link is made only after everything the link names is durable.

A real child process adds a gcc-built binary to a real store under ``strace``:
the trace shows the order of the calls that make files durable and visible
(fsync, rename, symlink), and strace's fault injection kills the child with
SIGKILL on entering each of them in turn, a crash at every step of an add.
What a killed add leaves must never be a link to an incomplete entry, and the
next add of the same file must complete.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from buildidd.resolve.buildid import read_build_id
from buildidd.store import Store
from buildidd.store.origin import read_origin

from conftest import gcc, need

#: The calls an add orders: what makes a file durable, then visible.
TRACED = ("fsync", "rename", "symlink", "mkdir")

CHILD = """
import os, sys
from buildidd.store import Store
root, path, bid = sys.argv[1:4]
fd = os.open(path, os.O_RDONLY)
Store(root, debug_root=root + "-no-debug").add_from_fd(fd, path, bid)
"""

_CALL = re.compile(r'^(?P<name>\w+)\((?P<args>.*)\)\s+= (?P<ret>-?\d+)')


def trace_store_calls(store: Path, argv: list[str], traced: tuple[str, ...], *inject: str
                      ) -> tuple[int, list[tuple[str, str, int]]]:
    """Run argv under strace (fds shown as paths, traced calls only, strace's fault injections inject);
    (exit status, [(call, its arguments, which call of that name it is, from 1)] for the calls on the
    store, in order).  Shared with test_batch.py."""
    need(shutil.which("strace") is not None, "needs strace")
    log = store.with_name(store.name + ".trace")
    cmd = ["strace", "-qq", "-y", "-o", str(log), "-e", "trace=" + ",".join(traced), *inject, *argv]
    r = subprocess.run(cmd, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}, capture_output=True, text=True)
    calls, nth = [], dict.fromkeys(traced, 0)
    for line in log.read_text().splitlines():
        m = _CALL.match(line)
        if m is None:
            continue
        nth[m["name"]] += 1
        if str(store) in m["args"]:
            calls.append((m["name"], m["args"], nth[m["name"]]))
    return r.returncode, calls


def _strace(store: Path, exe: Path, bid: str, *inject: str) -> tuple[int, list[tuple[str, str, int]]]:
    """CHILD adding exe under strace: :func:`trace_store_calls`."""
    return trace_store_calls(store, [sys.executable, "-c", CHILD, str(store), str(exe), bid], TRACED, *inject)


def _complete(store: Path, bid: str, exe: Path) -> bool:
    """Whether bid's link, when there is one that resolves, names an entry with all its files whole."""
    st = Store(store, debug_root=store.with_name("no-debug"))
    if not st.contains(bid):
        return True                     # no entry visible: nothing to be incomplete
    entry = st.path_of(bid).parent
    origin = read_origin(entry)
    return (read_build_id(entry / "elf") is not None and read_build_id(entry / "elf").hex == bid
            and (entry / "elf").read_bytes() == exe.read_bytes()
            and origin is not None and origin.size_bytes == exe.stat().st_size
            and (entry / "probes").exists())


@pytest.fixture
def binary(tmp_path) -> tuple[Path, str]:
    exe = gcc("int main(void) { return 7; }", tmp_path / "prog", "-Wl,--build-id=sha1")
    bid = read_build_id(exe)
    assert bid is not None
    return exe, bid.hex


def test_every_file_and_the_entry_directory_are_synced_before_the_link(tmp_path, binary):
    exe, bid = binary
    status, traced = _strace(tmp_path / "store", exe, bid)
    assert status == 0, traced
    calls = [(name, args) for name, args, _nth in traced]
    link_at = next(i for i, (name, args) in enumerate(calls) if name == "symlink")
    entry = f"/{bid}"
    renames = [(i, args) for i, (name, args) in enumerate(calls) if name == "rename" and entry + "/." in args]
    assert {re.search(r'/\.(\w+(?:\.json)?)\.buildidd-tmp', a)[1] for _, a in renames} >= {"elf", "origin.json",
                                                                                           "probes"}
    for i, args in renames:
        temp = args.split('"')[1]
        synced = [j for j, (name, a) in enumerate(calls[:i]) if name == "fsync" and f"<{temp}>" in a]
        assert synced, f"{temp} renamed into place before it was synced"
    dir_synced = [j for j, (name, a) in enumerate(calls) if name == "fsync" and a.rstrip(">").endswith(entry)]
    assert dir_synced and max(i for i, _ in renames) < dir_synced[-1] < link_at, calls
    link_dir = f"{tmp_path}/store/.build-id/{bid[:2]}>"
    assert any(name == "fsync" and a.endswith(link_dir) for name, a in calls[link_at:]), calls


def test_an_add_killed_at_any_step_leaves_no_link_to_an_incomplete_entry(tmp_path, binary):
    exe, bid = binary
    status, steps = _strace(tmp_path / "dry", exe, bid)
    assert status == 0
    assert [name for name, _a, _n in steps].count("symlink") == 1 and len(steps) >= 10, steps
    for name, args, nth in steps:
        store = tmp_path / f"store-{name}-{nth}"
        status, _ = _strace(store, exe, bid, "-e", f"inject={name}:signal=SIGKILL:when={nth}")
        assert status != 0, f"the add survived a SIGKILL at {name} {args}"
        assert _complete(store, bid, exe), f"killed at {name} {args}: a link names an incomplete entry"
        st = Store(store, debug_root=tmp_path / "no-debug")
        st.sweep_temps()
        fd = os.open(exe, os.O_RDONLY)
        try:
            st.add_from_fd(fd, str(exe), bid)
        finally:
            os.close(fd)
        assert st.contains(bid) and _complete(store, bid, exe), f"killed at {name} {args}: not added after"

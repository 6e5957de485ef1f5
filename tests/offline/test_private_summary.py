"""Issue 43 item 4: what archive, import and pull leave out as private is summarized by the directory that made it
private and its owner, with what to do; each build-id is listed only on request (--list-left-out).

Real parts: a real unprivileged user (the ``attacker`` fixture) makes a 0700 directory, as a Python installed in
a home would be; gcc builds six programs in it (two levels deep, owned by that user) and one world-unreadable file
of root's in a public directory; the store records each copy's origin; ``buildidd archive``, ``import``, ``serve``
and ``pull`` run as subprocesses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from buildidd.offline.archive import write_archive
from buildidd.sessionlog import SessionWriter
from buildidd.store import Store
from buildidd.store.origin import ORIGIN_NAME
from conftest import ServeProcess, as_user, gcc, store_add

SESSION = "20261124T000000Z-43"
SRC = "int bidd_priv_%s(int x) { return x * %d; }\nint main(void) { return bidd_priv_%s(1) == 0; }\n"
CLI = [sys.executable, "-m", "buildidd.cli"]
NAMES = ("python3.11", "libpython3.11.so", "dyn/_ssl.so", "dyn/_json.so", "dyn/_ctypes.so", "dyn/math.so")


@pytest.fixture(scope="module")
def world(tmp_path_factory, public_tmp_factory, attacker):
    """The user's 0700 ``pyhome`` (6 programs), root's 0600 ``notes`` in a public directory, one public
    program; a store holding all 8, a session naming them, and a serve of both."""
    tmp = tmp_path_factory.mktemp("privsum")
    public = public_tmp_factory("buildidd-privsum-")
    os.chown(public, attacker[0], attacker[1])                 # the user's own (public) directory
    home = public / "pyhome"
    r = as_user(attacker, ["mkdir", "-m", "0700", str(home)])
    assert r.returncode == 0, r.stderr
    assert os.stat(home).st_mode & 0o777 == 0o700 and os.stat(home).st_uid == attacker[0]
    files = []
    for i, name in enumerate(NAMES):
        out = home / "lib" / name
        out.parent.mkdir(parents=True, exist_ok=True)
        files.append(gcc(SRC % (i, i + 2, i), out))
    for d, _, names in os.walk(home):
        os.chown(d, attacker[0], attacker[1])
        for n in names:
            os.chown(os.path.join(d, n), attacker[0], attacker[1])
    notes = gcc(SRC % ("n", 9, "n"), public / "notes")
    os.chmod(notes, 0o600)
    plain = gcc(SRC % ("p", 7, "p"), public / "plain")
    store = Store(tmp / "store", debug_root=tmp / "no-debug")
    bids = [store_add(store, f) for f in files]
    notes_bid, plain_bid = store_add(store, notes), store_add(store, plain)
    assert all(store.is_private(b) for b in bids + [notes_bid]) and not store.is_private(plain_bid)
    w = SessionWriter(tmp / "sessions" / SESSION, compress=True)
    w.write({"type": "session", "time_ns": 1, "host": "h", "boot_id": "b", "kernel_release": "6",
             "kernel_build_id": None, "module_build_ids": {}, "boot_to_wall_offset_ns": 0})
    for i, (path, bid) in enumerate(zip(files + [notes, plain], bids + [notes_bid, plain_bid])):
        w.write({"type": "mmap", "time_ns": 10 + i, "pid": 5, "tid": 5, "comm": "python3", "start": 0x400000 + i * 0x10000,
                 "len": 4096, "pgoff": 0, "path": str(path), "build_id": bid, "error": None})
    w.write({"type": "end", "time_ns": 100})
    w.close()
    yield {"tmp": tmp, "store": store, "home": home, "files": files, "bids": bids, "notes": notes,
           "notes_bid": notes_bid, "user": attacker[2]}


def _summary_lines(world) -> tuple[str, str]:
    home, user = world["home"], world["user"]
    return (f"    {home} (mode 0700) made 6 files of {user} private, e.g. ",
            f"    {world['notes'].parent}: 1 file of root private by their own mode (no read for others), "
            f"e.g. {world['notes']}")


def _check_summary(out: str, world) -> None:
    """The summary: one line for the user's directory, one for root's file; no build-id listed."""
    dir_line, own_line = _summary_lines(world)
    lines = out.splitlines()
    assert "7 missing (7 private)" in out, out
    assert any(x.startswith(dir_line) for x in lines), out
    assert own_line in lines, out
    assert any("to share them: open up that directory" in x and "--share-private" in x for x in lines), out
    assert any("--list-left-out" in x for x in lines), out
    assert not any(b in out for b in world["bids"]), out
    first = next(i for i, x in enumerate(lines) if x.startswith("  left out"))
    last = next(i for i, x in enumerate(lines) if "--list-left-out" in x)
    assert last - first + 1 == 5, out             # reason, two causes, the share hint, the list hint


def test_the_store_records_the_directory_that_made_a_copy_private(world):
    origin = world["store"].origin(world["bids"][2])
    assert (origin.private, origin.private_by, origin.private_by_mode) == (True, str(world["home"]), 0o700)
    notes = world["store"].origin(world["notes_bid"])
    assert (notes.private_by, notes.private_by_mode) == (str(world["notes"]), 0o600)


def test_archive_and_import_summarize_by_directory_and_owner(world, tmp_path):
    out = tmp_path / "a.tar.zst"
    r = subprocess.run([*CLI, "archive", str(world["tmp"] / "sessions" / SESSION), "-o", str(out),
                        "--store-root", str(world["tmp"] / "store")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    _check_summary(r.stdout, world)
    r = subprocess.run([*CLI, "import", str(out), "--debug-dir", str(tmp_path / "debug"),
                        "--session-root", str(tmp_path / "sessions")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    _check_summary(r.stdout, world)
    r = subprocess.run([*CLI, "import", str(out), "--debug-dir", str(tmp_path / "debug"), "--list-left-out",
                        "--session-root", str(tmp_path / "sessions")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for bid, path in zip(world["bids"], world["files"]):
        assert f"      {bid}  {path}" in r.stdout.splitlines(), r.stdout


def test_pull_summarizes_the_same_way(world, tmp_path):
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    serve = ServeProcess(world["tmp"] / "store", tmp_path / "serve.log", "--token-file", str(token),
                         session_root=world["tmp"] / "sessions")
    try:
        r = subprocess.run([*CLI, "pull", serve.url, SESSION, "--token-file", str(token),
                            "--debug-dir", str(tmp_path / "debug"), "--session-root", str(tmp_path / "sessions"),
                            "--work-dir", str(tmp_path / "work")], capture_output=True, text=True, timeout=300)
    finally:
        serve.stop()
    assert r.returncode == 0, r.stderr
    _check_summary(r.stdout, world)


def test_an_entry_stored_before_the_cause_was_recorded_is_explained_from_its_path(world, tmp_path):
    """An origin.json without private_by (an older store): archive derives the cause from the path as it is now."""
    bid = world["bids"][0]
    entry = world["store"].best(bid).parent
    saved = (entry / ORIGIN_NAME).read_bytes()
    raw = json.loads(saved)
    del raw["private_by"], raw["private_by_mode"]
    try:
        (entry / ORIGIN_NAME).write_text(json.dumps(raw))
        m = write_archive(world["tmp"] / "sessions" / SESSION, Store(world["tmp"] / "store"), open(os.devnull, "wb"))
    finally:
        (entry / ORIGIN_NAME).write_bytes(saved)
    ref = next(r for r in m.build_ids if r.build_id == bid)
    assert (ref.reason, ref.private_by, ref.private_by_mode, ref.owner) == (
        "private", str(world["home"]), 0o700, world["user"])


def test_a_hostile_manifests_explanation_is_bounded(world):
    from buildidd.offline.manifest import Manifest
    m = write_archive(world["tmp"] / "sessions" / SESSION, world["store"], open(os.devnull, "wb"))
    raw = json.loads(m.to_json())
    raw["build_ids"][0].update(owner="x" * 5000, private_by_mode=True)
    raw["build_ids"][1].update(private_by=["/"], private_by_mode=0o70000)
    back = Manifest.from_json(json.dumps(raw).encode())
    assert (back.build_ids[0].owner, back.build_ids[0].private_by_mode) == (None, None)
    assert (back.build_ids[1].private_by, back.build_ids[1].private_by_mode) == (None, None)

"""Separate debuginfo found through a binary's .gnu_debuglink (CRC checked) and /usr/lib/debug/PATH.debug."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from buildidd.store import Store
from buildidd.store.debuginfo import read_debuglink
from conftest import gcc, need, readelf_build_id, store_add

SRC = "int helper(int x) { return x * 3; }\nint main(int argc, char **argv) { return helper(argc); }\n"


@pytest.fixture
def system_dir():
    """A root-owned directory under /usr/lib (a system directory), removed after."""
    need(os.geteuid() == 0, "a system directory needs root")
    d = Path(tempfile.mkdtemp(prefix="buildidd-test-", dir="/usr/lib"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _split(prog: Path, debug: Path) -> None:
    """binutils' separate debuginfo: keep the debug sections in debug, strip them from prog, link prog to it."""
    subprocess.run(["objcopy", "--only-keep-debug", str(prog), str(debug)], check=True)
    subprocess.run(["objcopy", "--strip-debug", "--strip-unneeded", f"--add-gnu-debuglink={debug}", str(prog)],
                   check=True, cwd=debug.parent)


def test_a_debuglinked_file_beside_the_binary_is_stored_as_its_debug(system_dir, tmp_path):
    prog = gcc(SRC, system_dir / "prog", "-g")
    (system_dir / ".debug").mkdir()
    debug = system_dir / ".debug" / "prog.debug"
    _split(prog, debug)
    name, crc = read_debuglink(prog)
    assert name == "prog.debug" and isinstance(crc, int)
    store = Store(tmp_path / "store", debug_root=tmp_path / "no-debug-tree")
    bid = store_add(store, prog)
    held = store.best(bid, "debug")
    assert held is not None and held.read_bytes() == debug.read_bytes()
    assert readelf_build_id(held) == bid and store.quality(bid) == "dwarf"
    # gdb reads the stored copy's DWARF for the stripped binary's function.
    r = subprocess.run(["gdb", "-batch", "-nx", "-ex", f"symbol-file {held}", "-ex", "info line helper",
                        str(store.best(bid, "elf"))], capture_output=True, text=True, timeout=60)
    assert 'Line 1 of "' in r.stdout and "prog.c" in r.stdout, r.stdout + r.stderr


def test_a_debuglink_with_the_wrong_crc_or_a_users_file_is_not_taken(system_dir, tmp_path, attacker):
    prog = gcc(SRC, system_dir / "prog", "-g")
    debug = system_dir / "prog.debug"
    _split(prog, debug)
    other = gcc(SRC.replace("3", "5"), tmp_path / "other", "-g")
    shutil.copyfile(other, debug)                    # the name matches, the CRC does not
    store = Store(tmp_path / "store", debug_root=tmp_path / "no-debug-tree")
    bid = store_add(store, prog)
    assert store.best(bid, "debug") is None
    # The right bytes, but owned by a user: never a system binary's debuginfo.
    prog2 = gcc(SRC.replace("3", "7"), system_dir / "prog2", "-g")
    debug2 = system_dir / "prog2.debug"
    _split(prog2, debug2)
    os.chown(debug2, attacker[0], attacker[1])
    bid2 = store_add(store, prog2)
    assert store.best(bid2, "debug") is None


def test_usr_lib_debug_path_dot_debug_is_found(system_dir, tmp_path):
    prog = gcc(SRC, system_dir / "prog", "-g")
    tree = tmp_path / "debug-tree"
    debug = tree / str(system_dir).lstrip("/") / "prog.debug"
    debug.parent.mkdir(parents=True)
    subprocess.run(["objcopy", "--only-keep-debug", str(prog), str(debug)], check=True)
    subprocess.run(["objcopy", "--strip-debug", str(prog)], check=True)       # no debuglink: found by path
    store = Store(tmp_path / "store", debug_root=tree)
    bid = store_add(store, prog)
    held = store.best(bid, "debug")
    assert held is not None and held.read_bytes() == debug.read_bytes()

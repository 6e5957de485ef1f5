"""perf reads the store as its build-id cache: perf record, then perf report after the binary is gone.

Needs perf and perf_event_open (root); skips otherwise, fails under BUILDIDD_REQUIRE_BPF=1.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from buildidd.resolve.host import kernel_build_id
from buildidd.store import KALLSYMS_DSO, Store

from conftest import gcc, need, readelf_build_id
from perfcompare import perf_record_lock

SPIN_SRC = """
#include <stdlib.h>
static volatile unsigned long sink;
static __attribute__((noinline)) void bidd_spin_target(long n) { for (long i = 0; i < n; i++) sink += i; }
int main(int argc, char **argv) { bidd_spin_target(argc > 1 ? atol(argv[1]) : 100000000L); return 0; }
"""
SYMBOL = "bidd_spin_target"


def run_perf(*args: str, buildid_dir: Path, cwd: Path) -> str:
    """perf ARGS with buildid_dir as its build-id cache; a perf record under the host's perf_record_lock."""
    env = {k: v for k, v in os.environ.items() if k != "DEBUGINFOD_URLS"}
    with perf_record_lock() if args[0] == "record" else contextlib.nullcontext():
        r = subprocess.run(["perf", "--buildid-dir", str(buildid_dir), *args], capture_output=True, text=True,
                           env=env, cwd=cwd)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.fixture
def perf_ok(tmp_path):
    need(shutil.which("perf") is not None, "perf (linux-perf) not installed")
    with perf_record_lock():
        r = subprocess.run(["perf", "record", "-N", "-q", "-e", "cpu-clock", "-o", str(tmp_path / "probe.data"),
                            "--", "true"], capture_output=True, text=True)
    need(r.returncode == 0, f"perf record does not work here: {r.stderr.strip()[:200]}")


def record_then_delete(tmp_path: Path, exe: Path) -> tuple[Path, int]:
    """perf record exe without perf's own cache; then exe is deleted (an fd kept open)."""
    data = tmp_path / "perf.data"
    run_perf("record", "-N", "-q", "-e", "cpu-clock", "-o", str(data), "--", str(exe), "100000000",
             buildid_dir=tmp_path / "unused", cwd=tmp_path)
    fd = os.open(exe, os.O_RDONLY)
    exe.unlink()
    return data, fd


def report(tmp_path: Path, data: Path, buildid_dir: Path) -> str:
    buildid_dir.mkdir(exist_ok=True)
    return run_perf("report", "-i", str(data), "--stdio", "--sort", "dso,sym", buildid_dir=buildid_dir,
                    cwd=tmp_path)


def test_perf_report_finds_a_deleted_binary_in_the_store(tmp_path, perf_ok):
    exe = gcc(SPIN_SRC, tmp_path / "spin", "-g", "-Wl,--build-id=sha1")
    bid = readelf_build_id(exe)
    data, fd = record_then_delete(tmp_path, exe)
    try:
        assert SYMBOL not in report(tmp_path, data, tmp_path / "empty")  # the control
        st = Store(tmp_path / "store", debug_root=tmp_path / "no-debug")
        assert st.add_from_fd(fd, str(exe), bid).added
    finally:
        os.close(fd)
    assert SYMBOL in report(tmp_path, data, tmp_path / "store")


@pytest.mark.parametrize("with_debuginfo", [True, False])
def test_perf_report_uses_the_stores_debuginfo(tmp_path, perf_ok, with_debuginfo):
    full = gcc(SPIN_SRC, tmp_path / "spin.full", "-g", "-Wl,--build-id=sha1")
    exe = tmp_path / "spin"
    subprocess.run(["strip", "--strip-all", "-o", str(exe), str(full)], check=True)
    bid = readelf_build_id(exe)
    debug_root = tmp_path / "debugroot"
    if with_debuginfo:
        dst = debug_root / ".build-id" / bid[:2] / f"{bid[2:]}.debug"
        dst.parent.mkdir(parents=True)
        subprocess.run(["objcopy", "--only-keep-debug", str(full), str(dst)], check=True)
    data, fd = record_then_delete(tmp_path, exe)
    try:
        st = Store(tmp_path / "store", debug_root=debug_root)
        assert st.add_from_fd(fd, str(exe), bid).debuginfo == with_debuginfo
    finally:
        os.close(fd)
    # The static function is only in the debuginfo's .symtab.
    assert (SYMBOL in report(tmp_path, data, tmp_path / "store")) == with_debuginfo


def _tree(root: Path, top: str) -> dict[str, tuple]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root / top):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st = os.lstat(p)
            out[str(p.relative_to(root))] = stat.S_IFMT(st.st_mode)  # modes differ: perf 0o755, the store 0o640
    return out


def test_kallsyms_layout_is_perf_records(tmp_path, perf_ok):
    bid = kernel_build_id()
    need(bid is not None, "the running kernel has no build-id")
    perf_dir = tmp_path / "perf"
    run_perf("record", "-a", "-q", "-e", "cpu-clock", "-o", str(tmp_path / "k.data"), "--", "sleep", "0.1",
             buildid_dir=perf_dir, cwd=tmp_path)
    st = Store(tmp_path / "store", debug_root=tmp_path / "no-debug")
    st.add_kallsyms(bid, vmlinux_paths=[])

    link = f".build-id/{bid[:2]}/{bid[2:]}"
    assert os.readlink(st.root / link) == os.readlink(perf_dir / link) == f"../../{KALLSYMS_DSO}/{bid}"
    ours = {k: v for k, v in _tree(st.root, KALLSYMS_DSO).items() if not k.endswith("/modules")}
    assert ours == _tree(perf_dir, KALLSYMS_DSO)
    # Same text (BPF programs loaded between the two reads may differ further down).
    theirs = (perf_dir / KALLSYMS_DSO / bid / "kallsyms").read_text().splitlines()
    mine = (st.root / KALLSYMS_DSO / bid / "kallsyms").read_text().splitlines()
    assert mine[:1000] == theirs[:1000] and abs(len(mine) - len(theirs)) < 1000

"""The analyst's walkthrough of the README, on a real crash: root records a gcc-built program on the "host" until
it dumps core (the kernel's own core file), archives the session (0600), and the program is gone; a real
unprivileged analyst, in a clean directory of their own, imports with no option, and then every offline verb
finds what import wrote (sessions, which, buildid-list, resolve --symbolize, serve), and gdb opens the core
with ``set debug-file-directory`` alone: no executable named, no debuginfod, the host's file times kept."""

from __future__ import annotations

import os
import re
import resource
import shutil
import stat
import subprocess
import sys
import time
import urllib.request
from email.utils import parsedate_to_datetime

from buildidd.store import Store

from conftest import as_user, as_user_popen, gcc, need, readelf_build_id

BUILDIDD = [sys.executable, "-m", "buildidd.cli"]

CRASHER = r"""
#include <stdio.h>
#include <unistd.h>
volatile int *bidd_null;
__attribute__((noinline)) void bidd_analyst_inner(int depth) { *bidd_null = depth; }
__attribute__((noinline)) void bidd_analyst_outer(void) { bidd_analyst_inner(7); __asm__ volatile(""); }
int main(void) {
    char c;
    printf("%p\n", (void *)bidd_analyst_inner);
    fflush(stdout);
    if (read(0, &c, 1) < 0) return 2;
    bidd_analyst_outer();
    return 0;
}
"""
#: The host file's mtime (2021-01-01T00:00:00Z): long before any core the test makes.
HOST_MTIME_S = 1609459200


def _core_limit():
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def _crash_on_the_host(recorder, tmp_path, public_tmp_factory):
    """Record the crasher until the store holds it, crash it (a kernel core), remove it: (session, store
    root, program path, build-id, pid, address of bidd_analyst_inner, core path)."""
    need(os.path.basename(open("/proc/sys/kernel/core_pattern").read().strip()).startswith("core"),
         "the kernel writes cores to a file named core* in the process's directory")
    host = public_tmp_factory("buildidd-analyst-host-")          # world-readable: archived (not private)
    prog = gcc(CRASHER, host / "crasher", "-g", "-O0")
    os.utime(prog, (HOST_MTIME_S, HOST_MTIME_S))
    bid = readelf_build_id(prog)
    store_root = tmp_path / "store"
    rec = recorder(store_root=str(store_root), snapshot_rate_bytes_per_s=0)
    crash_dir = tmp_path / "crash"
    crash_dir.mkdir()
    p = subprocess.Popen([str(prog)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=crash_dir,
                         preexec_fn=_core_limit)
    try:
        addr = p.stdout.readline().decode().strip()
        store = Store(store_root)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not store.contains(bid):
            rec.step()
            time.sleep(0.05)
        assert store.contains(bid)
        p.stdin.write(b"x")
        p.stdin.close()
        assert p.wait(timeout=20) < 0                             # SIGSEGV
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    for _ in range(5):
        rec.step()
    rec.close()
    cores = sorted(crash_dir.glob("core*"))
    assert cores, "the kernel wrote no core"
    os.unlink(prog)                                               # the other machine has no copy
    return rec.session_dir, store_root, prog, bid, p.pid, addr, cores[0]


def _handed_over(src, dest_dir, user):
    """src copied into dest_dir and given to user (as scp would leave it)."""
    dest = dest_dir / src.name
    shutil.copyfile(src, dest)
    os.chown(dest, user[0], user[1])
    os.chmod(dest, 0o600)
    return dest


def test_the_analysts_walkthrough_from_import_to_gdb_on_a_core(recorder, tmp_path, public_tmp_factory, attacker):
    need(shutil.which("gdb") is not None, "gdb missing")
    session, store_root, prog, bid, pid, addr, core = _crash_on_the_host(recorder, tmp_path, public_tmp_factory)
    analyst = attacker

    # The host: archives are the owner's alone by default, --mode widens them on request.
    out = public_tmp_factory("buildidd-analyst-out-")
    archive = out / "host1.tar.zst"
    r = subprocess.run([*BUILDIDD, "archive", str(session), "-o", str(archive), "--store-root", str(store_root)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(os.stat(archive).st_mode) == 0o600 and "mode 0600" in r.stdout
    assert as_user(analyst, ["cat", str(archive)], text=False).returncode != 0     # not readable by others
    shared = out / "shared.tar.zst"
    r = subprocess.run([*BUILDIDD, "archive", str(session), "-o", str(shared), "--store-root", str(store_root),
                        "--mode", "0640"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and stat.S_IMODE(os.stat(shared).st_mode) == 0o640, r.stderr
    r = subprocess.run([*BUILDIDD, "archive", str(session), "-o", str(out / "x"), "--mode", "4755"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "set-id" in r.stderr

    # The other machine: a clean directory of the analyst's, the archive and the core handed over.
    home = public_tmp_factory("buildidd-analyst-home-")
    os.chown(home, analyst[0], analyst[1])
    os.chmod(home, 0o700)
    work = home / "work"
    work.mkdir()
    os.chown(work, analyst[0], analyst[1])
    _handed_over(archive, work, analyst)
    _handed_over(core, work, analyst).rename(work / "core")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home)}

    def analyst_runs(*argv, shell=None):
        cmd = ["sh", "-c", shell] if shell else [*BUILDIDD, *argv]
        r = as_user(analyst, cmd, cwd=str(work), env=env, timeout=120)
        assert r.returncode == 0, f"{cmd}: {r.stdout}{r.stderr}"
        return r.stdout + r.stderr

    analyst_runs("import", "host1.tar.zst")
    gdb_exe = home / ".debug/.gdb/.build-id" / bid[:2] / bid[2:]
    assert os.stat(gdb_exe).st_mtime == HOST_MTIME_S              # the host's time, not the import's
    assert os.path.realpath(gdb_exe) == os.path.realpath(home / ".debug/.build-id" / bid[:2] / bid[2:] / "elf")

    row = next(line.split() for line in analyst_runs("sessions").splitlines() if line.startswith(session.name))
    assert int(row[7]) >= 1, row                                  # STORED: the imported store is read
    assert re.search(rf"^{bid}  {re.escape(str(prog))} .*  held$", analyst_runs("which", str(prog)), re.M)
    assert f"{bid} {prog} dwarf" in analyst_runs("buildid-list", "latest", "--quality")
    resolved = analyst_runs("resolve", "latest", str(pid), addr, "--symbolize")
    assert f" {bid} " in resolved and " bidd_analyst_inner+0x0 " in resolved, resolved
    assert str(home / ".debug") in resolved, resolved

    # gdb, as the README says it: the core alone, the executable and its debuginfo by build-id.
    bt = analyst_runs(shell="gdb -batch -nx -iex 'set debug-file-directory ~/.debug/.gdb' -c core -ex bt")
    assert re.search(r"#0 .*bidd_analyst_inner \(depth=7\) at \S*crasher\.c:\d+", bt), bt
    assert re.search(r"#1 .*bidd_analyst_outer \(\) at \S*crasher\.c:\d+", bt), bt
    assert "newer than core" not in bt, bt
    # The control: perf's tree alone gives gdb no executable for the core.
    control = analyst_runs(shell="gdb -batch -nx -iex 'set debug-file-directory ~/.debug' -c core -ex bt")
    assert "bidd_analyst_inner" not in control, control

    # serve, run by the analyst with no store option, serves what import wrote, with the host's time.
    srv = as_user_popen(analyst, [*BUILDIDD, "serve", "--listen", "127.0.0.1:0", "--socket", ""], cwd=str(work),
                        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = srv.stdout.readline()
        m = re.match(r"listening on http://\S+:(\d+)", line)
        assert m, line + srv.stderr.read() if srv.poll() is not None else line
        with urllib.request.urlopen(f"http://127.0.0.1:{m.group(1)}/buildid/{bid}/executable", timeout=10) as resp:
            body, modified = resp.read(), resp.headers["Last-Modified"]
        assert body == (home / ".debug/.build-id" / bid[:2] / bid[2:] / "elf").read_bytes()
        assert parsedate_to_datetime(modified).timestamp() == HOST_MTIME_S
    finally:
        srv.terminate()
        srv.wait(timeout=10)


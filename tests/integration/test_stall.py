"""A user cannot stall the recording: FIFOs put at mapped paths.

A real unprivileged user (conftest ``attacker``) maps files of its own
executable, with their pages evicted so that user space has to read them,
and swaps a FIFO in at their paths, after munmap and while still mapped.
Before, the recording thread opened the FIFO and blocked until a writer
came.  Now: an exec by root during the attack is in the session, the
attacker's mappings are recorded with a reason, and SIGTERM ends
``buildidd run``.  A stalled thread never gets there (it waits for a writer
that never comes), so the waits below are hang bounds (HANG_S), not budgets:
how fast the recording is belongs to the bench.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import as_user_popen, gcc, need, session_records

#: Bounds a hang only (a stalled recording thread or stop never ends).
HANG_S = 20.0

# argv: DIR N MODE (munmap|mapped). For each i < N: write DIR/lib<i> (an ELF copy of
# argv[0]'s own file: bytes of /proc/self/exe), evict its pages, mmap it PROT_EXEC,
# munmap it (mode munmap) or keep it, then rename a FIFO over its path.
ATTACK = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
static char buf[1 << 20];
int main(int argc, char **argv) {
    int n = atoi(argv[2]), keep = strcmp(argv[3], "mapped") == 0;
    int self = open("/proc/self/exe", O_RDONLY);
    ssize_t len = read(self, buf, sizeof buf);
    for (int i = 0; i < n; i++) {
        char path[4096], fifo[4096];
        snprintf(path, sizeof path, "%s/lib%d", argv[1], i);
        snprintf(fifo, sizeof fifo, "%s/fifo%d", argv[1], i);
        buf[len - 1] = (char)i;                       /* each file its own contents */
        int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0755);
        if (fd < 0 || write(fd, buf, len) != len) return 2;
        fdatasync(fd);
        posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);  /* the kernel path finds nothing cached */
        void *p = mmap(NULL, len, PROT_READ | PROT_EXEC, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) return 3;
        close(fd);
        if (!keep) munmap(p, len);
        if (mkfifo(fifo, 0644) || rename(fifo, path)) return 4;
    }
    puts("done");
    fflush(stdout);
    if (keep) pause();
    return 0;
}
"""


def _start_daemon(tmp_path):
    root = tmp_path / "sessions"
    p = subprocess.Popen([sys.executable, "-m", "buildidd.cli", "run", "--session-root", str(root),
                          "--store-root", "", "--control-socket", ""], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        dirs = list(root.iterdir()) if root.is_dir() else []
        if dirs and any(r["type"] == "session" for r in session_records(dirs[0])):
            # READY once the synthesized mappings are written: wait for one.
            if any(r["type"] == "mmap" for r in session_records(dirs[0])):
                return p, dirs[0]
        if p.poll() is not None:
            raise AssertionError(f"buildidd run exited: {p.stderr.read()}")
        time.sleep(0.05)
    p.kill()
    raise AssertionError("buildidd run did not start")


def _seen_within(sdir, pred, timeout_s):
    """Seconds until a record matching pred is in the session, or None after timeout_s."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if any(pred(r) for r in session_records(sdir)):
            return time.monotonic() - t0
        time.sleep(0.02)
    return None


def _attack_and_check(tmp_path, attacker, mode, request_cleanup):
    uid, gid, _name = attacker
    # Under /tmp itself: pytest's tmp_path lies in root's 0700 directory.
    work = Path(tempfile.mkdtemp(prefix=f"buildidd-attack-{mode}-", dir="/tmp"))
    request_cleanup.append(work)
    os.chmod(work, 0o755)
    os.chown(work, uid, gid)
    exe = gcc(ATTACK, work / "attack")
    os.chown(exe, uid, gid)
    marker = gcc("int main(void) { return 0; }\n", tmp_path / f"root-marker-{mode}")
    p, sdir = _start_daemon(tmp_path)
    atk = None
    try:
        atk = as_user_popen(attacker, [str(exe), str(work), "40", mode], stdout=subprocess.PIPE, text=True)
        assert atk.stdout.readline().strip() == "done", f"attack failed: exit {atk.wait()}"
        # The attacker's FIFOs stand at every path it mapped; root execs a program now.
        subprocess.run([str(marker)], check=True)
        seen = _seen_within(sdir, lambda r: r["type"] == "exec" and r.get("filename") == str(marker), HANG_S)
        assert seen is not None, "root's exec was never recorded: the recording is stalled"
        # The attacker's mappings are recorded too, each with a build-id or a reason.
        mine = [r for r in session_records(sdir) if r["type"] == "mmap" and r["pid"] == atk.pid
                and "/lib" in r["path"]]
        assert mine and all(r["build_id"] or r["error"] for r in mine)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=HANG_S)
        stop_s = time.monotonic() - t0
        assert rc == 0, p.stderr.read()
        print(f"FIFO attack ({mode}): {len(mine)} attacker mappings recorded, root's exec recorded after "
              f"{seen:.2f} s, SIGTERM to exit {stop_s:.2f} s")
    finally:
        for proc in (atk, p):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    records = session_records(sdir)
    assert records[-1]["type"] == "end" and records[-1]["reason"] == "stopped"
    assert records[-1]["event_errors"] == {}
    return mine


@pytest.fixture
def cleanup():
    dirs = []
    yield dirs
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def test_fifo_swapped_in_after_munmap_stalls_nothing(bpf, attacker, tmp_path, cleanup):
    need(os.path.exists("/usr/bin/setpriv"), "setpriv (util-linux) runs the attacker")
    mine = _attack_and_check(tmp_path, attacker, "munmap", cleanup)
    # User space had to read what the kernel could not, and met FIFOs at the paths
    # (before, the recording thread blocked in open() on the first of them).
    assert len(mine) >= 40
    assert any(r["error"] == "not_regular" and r["build_id_source"] == "none" for r in mine)


def test_fifo_swapped_in_while_mapped_stalls_nothing(bpf, attacker, tmp_path, cleanup):
    mine = _attack_and_check(tmp_path, attacker, "mapped", cleanup)
    # The mapping was alive: map_files reached the very inode, whatever the path names now.
    assert len(mine) >= 40
    # changed_at_map: written within a clock tick of its mmap (the attacker writes, then maps at once),
    # so no later read can prove the bytes mapped; said, not guessed.
    odd = [r for r in mine if not (r["build_id"] or r["error"] in ("no_build_id", "not_regular", "file_replaced",
                                                                    "changed_at_map"))]
    assert not odd, [(r["error"], r.get("build_id_source"), r.get("kernel_status")) for r in odd[:5]]

"""Issue 42, bounded memory: a real unprivileged user maps fresh ELF files (each its own build-id,
PROT_EXEC) from a directory ~3,700 characters deep, unlinking each, FLOOD_FILES of them, while a real
Recorder (BPF, a store) records the host: the recording process's RSS, sampled, grows by no more
than RSS_GROWTH_MAX_BYTES.

The recorder runs in this process (the ``recorder`` fixture), with the heap set as ``buildidd run``
sets it (buildidd.heap: one arena, a fixed mmap threshold, trimmed every heap.TRIM_INTERVAL_S), so
its growth is the daemon's, the session's coverage ledger (store/coverage.py, its own byte budget)
included.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import signal
import socket
import subprocess
import sys

import psutil
import pytest

from buildidd import heap
from conftest import as_user, gcc, readelf_build_id

ROOT = Path(__file__).resolve().parents[2]
#: Files the user's flood maps: twice what the assertions below need recorded, and enough for every
#: per-file cache to pass its budget (their evictions are asserted).  The flood ends on this count,
#: not a clock (a flood of a fixed duration, as the issue's 20 s goal, is a bench scenario).
FLOOD_FILES = 16_000
#: Bounds a hang only.
FLOOD_MAX_S = 300
#: Characters of the flooding user's directory.
DEEP_CHARS = 3700
#: Growth of the recording process's RSS allowed during the flood and just after it: the daemon's
#: RSS after READY (~46 MiB, tests/integration/test_footprint.py) plus this stays within the goal's
#: 128 MiB.
RSS_GROWTH_MAX_BYTES = 64 << 20
#: The issue's goal: the daemon's RSS peaks at this during a 20 s flood.
DAEMON_RSS_MAX_BYTES = 128 << 20
#: A template of ~5 KB: one function, no libc, pages of 4 KiB, the build-id note near the start.
TEMPLATE_SRC = "int f(int x) { return x + 1; }\n"
TEMPLATE_FLAGS = ("-shared", "-fPIC", "-nostdlib", "-s", "-Wl,--build-id=sha1", "-Wl,-z,max-page-size=4096",
                  "-Wl,-z,noseparate-code")


def build_id_offset(path: Path) -> int:
    """The file offset of the GNU build-id note's descriptor in the ELF file at path (readelf's
    build-id found in its bytes, once)."""
    bid = bytes.fromhex(readelf_build_id(path))
    data = path.read_bytes()
    off = data.find(bid)
    assert off > 0 and data.find(bid, off + 1) < 0, "the build-id must occur once"
    return off


def with_build_id_tag(template: Path, off: int, tag: int, out: Path) -> Path:
    """A copy of template at out whose build-id's first 8 bytes are tag (little-endian), as
    scripts/workloads/fresh_flood.c writes each of its files."""
    data = bytearray(template.read_bytes())
    data[off:off + 8] = tag.to_bytes(8, "little")
    out.write_bytes(bytes(data))
    return out


def deep_dir(top: Path, chars: int, owner: tuple[int, int]) -> Path:
    """A chain of 0755 directories under top, made with os.mkdir relative to each parent, whose path
    is at least chars characters long; the last one owned by owner (uid, gid)."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    path = str(top)
    try:
        while len(path) < chars:
            name = "d" * min(200, max(1, chars - len(path) - 1))
            os.mkdir(name, 0o755, dir_fd=fd)
            os.chmod(name, 0o755, dir_fd=fd)
            nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd, path = nfd, f"{path}/{name}"
        os.fchown(fd, *owner)
    finally:
        os.close(fd)
    return Path(path)


class RssSampler:
    """A process's RSS (default: this one's), sampled every interval_s on a thread: base at start,
    peak meanwhile."""

    def __init__(self, interval_s: float = 0.05, pid: int | None = None):
        self.proc = psutil.Process(pid)
        self.base = self.peak = self.proc.memory_info().rss
        self.interval_s = interval_s
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def stop(self) -> int:
        self._stop.set()
        self.thread.join()
        return self.peak


def _flood_setup(attacker, public_tmp_factory) -> tuple[list[str], Path]:
    """The flood's argv (fresh_flood built in a public directory, the template, its build-id's offset,
    a deep directory the attacker owns, FLOOD_MAX_S, FLOOD_FILES) and the deep directory."""
    pub = public_tmp_factory("buildidd-memflood-")
    so = gcc(TEMPLATE_SRC, pub / "t.so", *TEMPLATE_FLAGS)
    os.chmod(so, 0o644)
    flood = gcc((ROOT / "scripts/workloads/fresh_flood.c").read_text(), pub / "fresh_flood", "-O2")
    os.chmod(flood, 0o755)
    deep = deep_dir(pub, DEEP_CHARS, attacker[:2])
    assert len(str(deep)) >= DEEP_CHARS
    return [str(flood), str(so), str(build_id_offset(so)), str(deep), str(FLOOD_MAX_S), str(FLOOD_FILES)], deep


def test_buildidd_runs_rss_stays_within_the_goal_during_a_flood_without_the_uid_budget(bpf, attacker,
                                                                                       public_tmp_factory,
                                                                                       tmp_path):
    """The daemon itself (`buildidd run`, as the unit runs it), every record of the flood reaching it
    (uid_record_rate_bytes_per_s = 0): its RSS, sampled, peaks within DAEMON_RSS_MAX_BYTES."""
    argv, _deep = _flood_setup(attacker, public_tmp_factory)
    conf = tmp_path / "buildidd.toml"
    conf.write_text("uid_record_rate_bytes_per_s = 0\ncontrol_socket = \"\"\n")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify.sock"))
    env = {**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify.sock")}
    p = subprocess.Popen([sys.executable, "-m", "buildidd.cli", "run", "--config", str(conf), "--session-root",
                          str(tmp_path / "sessions"), "--store-root", str(tmp_path / "store"), "--no-compress"],
                         env=env, stderr=subprocess.DEVNULL)
    try:
        sock.settimeout(120)
        while b"READY=1" not in sock.recv(4096).split(b"\n"):
            pass
        rss = RssSampler(pid=p.pid)
        got = as_user(attacker, argv, timeout=FLOOD_MAX_S + 60)
        time.sleep(3.0)                           # the RSS sampled while what the flood queued drains
        peak = rss.stop()
        p.send_signal(signal.SIGTERM)
        t_stop = time.monotonic()
        try:        # how long the stop takes after such a flood is printed, not judged here
            p.wait(timeout=150)
        except subprocess.TimeoutExpired:
            pass
        stop_s, exited = time.monotonic() - t_stop, p.poll() is not None
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        sock.close()
    assert got.returncode == 0, got.stderr
    files, rate = (int(x) for x in got.stdout.split())
    print(f"\nbuildidd run: {files} files ({rate}/s); RSS {rss.base / 2**20:.1f} MiB after READY, "
          f"peak {peak / 2**20:.1f} MiB (goal {DAEMON_RSS_MAX_BYTES >> 20} MiB); "
          f"{'exited' if exited else 'not exited'} {stop_s:.1f} s after SIGTERM")
    assert files >= 8_000
    assert peak <= DAEMON_RSS_MAX_BYTES, f"peak RSS {peak / 2**20:.1f} MiB"


def test_the_patched_template_carries_the_tag_as_its_build_id(tmp_path):
    so = gcc(TEMPLATE_SRC, tmp_path / "t.so", *TEMPLATE_FLAGS)
    off = build_id_offset(so)
    got = readelf_build_id(with_build_id_tag(so, off, 0x1122334455667788, tmp_path / "u.so"))
    assert got.startswith("8877665544332211") and got[16:] == readelf_build_id(so)[16:]


@pytest.mark.parametrize("uid_rate", [None, 0], ids=["uid_budget", "no_uid_budget"])
def test_a_users_flood_of_fresh_deep_files_keeps_the_recorders_rss_bounded(recorder, attacker, public_tmp_factory,
                                                                            tmp_path, uid_rate):
    """uid_budget: as shipped (the BPF side holds back the user's records past
    uid_record_rate_bytes_per_s: few reach the recorder); no_uid_budget: every record reaches it, as
    when many users flood at once: the worst case for the recorder's memory."""
    argv, deep = _flood_setup(attacker, public_tmp_factory)
    heap.configure()                              # as `buildidd run` does, before the workers start
    overrides = {} if uid_rate is None else {"uid_record_rate_bytes_per_s": uid_rate}
    rec = recorder(store_root=str(tmp_path / "store"), **overrides)
    stop = threading.Event()
    next_trim = [0.0]

    def tick():                                   # `buildidd run`'s trim ticker
        if time.monotonic() >= next_trim[0]:
            next_trim[0] = time.monotonic() + heap.TRIM_INTERVAL_S
            heap.trim()
    loop = threading.Thread(target=rec.run, args=(stop.is_set, tick), daemon=True)
    loop.start()
    time.sleep(1.0)
    rss = RssSampler()
    try:
        got = as_user(attacker, argv, timeout=FLOOD_MAX_S + 60)
        files = int(got.stdout.split()[0]) if got.returncode == 0 else 0
        deadline = time.monotonic() + 120         # what the flood left queued is recorded (bounds a hang)
        while (rec.stats.events.get("mmap", 0) + sum(rec.stats.lost.values())
               + rec.status()["throttled"]["records"] < files // 2 and time.monotonic() < deadline):
            time.sleep(0.1)
    finally:
        peak = rss.stop()
        stop.set()
        loop.join(timeout=60)
    assert got.returncode == 0, got.stderr
    files, rate = (int(x) for x in got.stdout.split())
    status = rec.status()
    caches, throttled = status["caches"], status["throttled"]["records"]
    growth = peak - rss.base
    print(f"\nflood: {files} files ({rate}/s), paths of {len(str(deep)) + 8} characters; "
          f"recorder RSS {rss.base / 2**20:.1f} MiB before, peak {peak / 2**20:.1f} MiB "
          f"(+{growth / 2**20:.1f} MiB, bound +{RSS_GROWTH_MAX_BYTES >> 20} MiB); events {rec.stats.events}, "
          f"lost {rec.stats.lost}, held back by the uid budget {throttled}")
    print({name: (c.get("entries"), c.get("bytes"), c.get("max_bytes")) for name, c in caches.items()})
    assert files >= 8_000
    assert rec.stats.events.get("mmap", 0) + sum(rec.stats.lost.values()) + throttled >= files // 2
    if uid_rate == 0:
        assert throttled == 0 and rec.stats.events["mmap"] >= 8_000
    assert caches["path_json"]["evictions"] > 0 and caches["kernel_fast"]["evictions"] > 0
    for name, c in caches.items():
        if c.get("max_bytes") is not None and c.get("bytes") is not None:
            assert c["bytes"] <= c["max_bytes"], name
    assert growth <= RSS_GROWTH_MAX_BYTES, f"RSS grew {growth / 2**20:.1f} MiB"
    shutil.rmtree(deep.parent, ignore_errors=True)

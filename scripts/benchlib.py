"""What the benchmarks under scripts/ share: buildidd as a daemon, its store, memory and CPU readers,
the mmap storms.  Public names only; each benchmark imports what it uses from here.

Run the benchmarks as root after scripts/setup, with the project's .venv python.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from buildidd.fsio import remove_tree  # noqa: F401 - the benches' one removal of a work directory (a store in it can be deeper than shutil.rmtree recurses)
from buildidd.sessionlog import read_session
from workloads import build

__all__ = ["FINISHER", "ONE_SEGMENT", "PY", "SETTLE_S", "Buildidd", "RssSampler", "build", "cpu_s_of",
           "link_bpf_sources", "lost_count", "mapping_records",
           "page_touch_cost", "parse_ramp", "run_mmap_storms", "storm_argv", "uss_of", "warm_store"]

PY = sys.executable
#: Seconds both daemons get between READY and the workload (the same for both).
SETTLE_S = 0.3


def cpu_s_of(pid: int) -> float:
    """CPU seconds (user + system) pid's threads have used, ended ones included, to the ns.

    The process's CPUCLOCK_SCHED clock (clock_getcpuclockid(3): ((~pid) << 3) | 2), the sum of
    its threads' sched runtime, instead of /proc's utime + stime in 10 ms ticks: a 2,000-exec
    storm costs the daemon tens of ms, which ticks would round to a few values.
    """
    return time.clock_gettime_ns(((~pid) << 3) | 2) / 1e9


def uss_of(pid: int) -> int:
    """Unique set size (bytes) of pid: memory only it holds (RSS less shared pages)."""
    return psutil.Process(pid).memory_full_info().uss


class RssSampler:
    """Samples a process's RSS (bytes) every interval_s in a thread: peak and last."""

    def __init__(self, pid: int, interval_s: float = 0.05):
        self.proc = psutil.Process(pid)
        self.peak = 0
        self.last = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                rss = self.proc.memory_info().rss
            except psutil.Error:
                return
            if not rss:      # a zombie reports 0
                return
            self.peak = max(self.peak, rss)
            self.last = rss
            self._stop.wait(0.05)

    def stop(self):
        self._stop.set()
        self._t.join()


#: The kernel name of the daemon's thread that compresses the session log (sessionlog/compress.py).
FINISHER = "sessionlog-fini"
#: --segment-max-bytes of a daemon whose compression is counted: one segment for the whole run,
#: compressed when it stops (Buildidd.zstd_s), never in the middle of a measured window.
ONE_SEGMENT = "64G"


class Buildidd:
    """`buildidd run` as a daemon; READY is awaited on our own NOTIFY_SOCKET.

    compress: closed segments are zstd-compressed (the daemon's default) and kept in one segment
    (ONE_SEGMENT), so that zstd_s() can count a window's share of the compression.
    """

    def __init__(self, workdir: Path, *, extra: list[str] = (), env: dict | None = None, compress: bool = False,
                 store: Path | None = None):
        self.root = Path(tempfile.mkdtemp(prefix="sessions-", dir=workdir))
        self.own_store = store is None
        self.store = Path(f"{self.root}-store") if store is None else store
        sock_path = workdir / f"notify-{os.getpid()}-{time.monotonic_ns()}.sock"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(sock_path))
        self.sock.settimeout(60)
        t0 = time.monotonic()
        self.proc = subprocess.Popen([PY, "-m", "buildidd.cli", "run", "--session-root", str(self.root),
                                      *(["--segment-max-bytes", ONE_SEGMENT] if compress else ["--no-compress"]),
                                      "--store-root", str(self.store), "--control-socket", "", *extra],
                                     env={**os.environ, **(env or {}), "NOTIFY_SOCKET": str(sock_path)},
                                     stderr=subprocess.PIPE)
        while True:
            try:
                msg = self.sock.recv(4096).decode()
            except socket.timeout:
                self.proc.kill()            # never leave a half-started daemon attached
                self.proc.wait()
                raise RuntimeError("buildidd did not become READY in 60 s: "
                                   + self.proc.stderr.read1(4000).decode(errors="replace"))
            if "READY=1" in msg:
                break
        self.ready_s = time.monotonic() - t0
        sock_path.unlink()
        self.ps = psutil.Process(self.proc.pid)
        self.rss = RssSampler(self.proc.pid)

    def uss(self) -> int:
        """Unique set size (bytes): memory only this process holds (RSS less shared library pages)."""
        return uss_of(self.proc.pid)

    def cpu_s(self) -> float:
        return cpu_s_of(self.proc.pid)

    def thread_cpu_s(self, comm: str) -> float:
        """CPU seconds of the daemon's threads whose kernel name is comm (kernel.sched.name_current_thread),
        from /proc/PID/task/TID/schedstat (ns on CPU); 0.0 for none."""
        total = 0
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            try:
                if (task / "comm").read_text().strip() == comm:
                    total += int((task / "schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                pass
        return total / 1e9

    def log_bytes(self) -> int:
        """Bytes of the session's open (uncompressed) segments so far."""
        return sum(p.stat().st_size for p in self.root.glob("*/segment-*.jsonl"))

    def zstd_s(self, window_bytes: int) -> float | None:
        """After stop(): CPU seconds the daemon's finishing thread spent on window_bytes of the
        session log (its zstd, writes and fsyncs, per byte, from the session's closed marker:
        finish_cpu_ns / finished_bytes); None when the tree does not report it.  Part of it ran in
        the window already (FINISHER's CPU there): the caller counts that part once."""
        try:
            marker = json.loads((self.session_dir / ".closed").read_text())
            return marker["finish_cpu_ns"] / 1e9 * window_bytes / marker["finished_bytes"]
        except (OSError, ValueError, KeyError, ZeroDivisionError):
            return None

    def kill_if_running(self) -> None:
        """SIGKILL a daemon that was not stopped (a workload or check failed): never leave one attached."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
            self.rss.stop()
            self.sock.close()

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        if self.own_store:
            shutil.rmtree(self.store, ignore_errors=True)

    def stop(self, read: bool = True) -> list[dict]:
        """SIGTERM the daemon, wait; the session's records (a list: mind the size) when read."""
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=120)
        self.rss.stop()
        self.sock.close()
        (sdir,) = list(self.root.iterdir())
        self.session_dir = sdir
        return list(read_session(sdir)) if read else []


def mapping_records(records: list[dict]) -> list[dict]:
    """The mmap records of a session that the workload made (not those synthesized at start)."""
    return [r for r in records if r.get("type") == "mmap" and r.get("origin") not in ("synthesized",)]


def lost_count(records: list[dict]) -> int:
    """Events a session lost: the sum of its lost records' counts."""
    return sum(sum(r["counts"].values()) for r in records if r.get("type") == "lost")


def page_touch_cost(w: dict, max_ms: int = 1000) -> dict[int, int]:
    """ns of CPU per page read after the thread slept, by ms asleep up to max_ms (workloads/pagetouch.c):
    the machine's.

    Where the host takes back idle guest memory, every daemon step after a sleep costs in
    proportion to the pages it touches, so buildidd's CPU per event (and perf's) means little
    without this line beside it.
    """
    out = subprocess.run([str(w["pagetouch"]), str(max_ms)], check=True, capture_output=True, text=True).stdout
    return {int(ms): int(ns) for ms, ns in (line.split() for line in out.splitlines())}


def warm_store(workdir: Path) -> Path:
    """A store holding what a running daemon would have snapshotted already (returned path)."""
    store = workdir / "store"
    t = time.monotonic()
    d = Buildidd(workdir, store=store)
    time.sleep(1.0)
    d.stop()          # stop() lets the snapshotter finish its queue
    d.cleanup()
    size = sum(f.stat().st_size for f in store.rglob("*") if f.is_file() and not f.is_symlink())
    print(f"  store warmed: {size / 2**20:.1f} MiB in {time.monotonic() - t:.1f} s", flush=True)
    return store


def parse_ramp(spec: str) -> list[tuple[int, int]]:
    """"RATE[xPROCS],..." → [(maps/s per process, 0 = unpaced; processes)]."""
    out = []
    for tok in spec.split(","):
        tok = tok.strip()
        if tok:
            rate, _, procs = tok.partition("x")
            out.append((int(rate), int(procs or 1)))
    return out


def run_mmap_storms(w: dict, rate: int, procs: int, seconds: float) -> tuple[int, int]:
    """procs mmap storms at once (each rate maps/s, 0 = unpaced): (mappings made, total rate achieved)."""
    count = int(rate * seconds) if rate else int(400_000 * seconds)
    ps = [subprocess.Popen([str(w["mmap_storm"]), str(w["lib0"]), str(count), str(rate)],
                           stdout=subprocess.PIPE, text=True) for _ in range(procs)]
    achieved = 0
    for p in ps:
        out, _ = p.communicate()
        if p.returncode:
            raise RuntimeError(f"mmap_storm exited {p.returncode}")
        achieved += int(out.strip())
    return count * procs, achieved


def storm_argv(w: dict, exec_n: int, dlopen_libs: int, dlopen_rounds: int,
               mmap_n: int) -> dict[str, tuple[list[str], set[str]]]:
    """The storms of scripts/workloads, the one definition every benchmark runs:
    name -> (argv, the comms of the workload's processes), for "exec" (storm.c forking exec_n
    child.c), "dlopen" (dlopen_storm.c, dlopen_rounds rounds over lib0..lib{dlopen_libs-1}) and
    "mmap" (mmap_storm.c mapping lib0 mmap_n times, unpaced).  w: build.build()'s answer."""
    libs = [str(w[f"lib{i}"]) for i in range(dlopen_libs)]
    return {"exec": ([str(w["storm"]), str(exec_n), str(w["child"])], {"bidd_child", "bidd_storm"}),
            "dlopen": ([str(w["dlopen_storm"]), str(dlopen_rounds), *libs], {"bidd_dlopen"}),
            "mmap": ([str(w["mmap_storm"]), libs[0], str(mmap_n)], {"bidd_mmap"})}


def link_bpf_sources(tree: Path) -> None:
    """Make tree's daemon load tree's own BPF sources.

    The package data ``buildidd.bpf`` is bpf/ at the top of a tree (pyproject's
    package-dir); an editable install of another checkout would hand out that
    checkout's bpf/.  A link daemon/buildidd/bpf -> ../../bpf in tree is found
    first through PYTHONPATH (made here when missing, and said so).
    """
    link = tree / "daemon" / "buildidd" / "bpf"
    if not link.exists():
        link.symlink_to(Path("..") / ".." / "bpf")
        print(f"made {link} -> ../../bpf (the tree's own BPF sources)", flush=True)

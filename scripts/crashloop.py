#!/usr/bin/env python3
"""kill -9 of `buildidd run` at random moments during an exec storm, N times in a row.

Each iteration: start `buildidd run` (sessions under one root, no store, its own
control socket), wait for READY=1 on a NOTIFY_SOCKET of ours, let it record an
exec storm for a random time, SIGKILL it, then check:

- the BPF programs it loaded (their ids from /proc/PID/fdinfo, noted while it
  ran) no longer run: each is gone from ``bpftool prog show``, or kept pinned
  for the next start (Config.bpf_pin_root, kernel.pinned) with no attachment
  left (no ``bpftool link`` nor ``bpftool perf`` entry uses it);
- at the next start (READY again), the killed session was sealed: its last
  record is an ``end`` with ``"clean": false`` and it has the ``.closed``
  marker; every segment of it is ``.zst`` and decodes strictly (zstd frame
  checksums), and it holds at most one torn line (the crash's).

Prints one JSON object of figures; exit status 1 when a check failed.
Usage: scripts/crashloop.py [-n 100] [--max-run-s 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zstandard

REPO = Path(__file__).resolve().parent.parent
BUILDIDD = [str(REPO / ".venv" / "bin" / "buildidd")]
READY_TIMEOUT_S = 120.0
#: Seconds allowed for the kernel to free the killed daemon's programs.
BPF_RELEASE_LIMIT_S = 10.0


def _bpftool(*args: str, tries: int = 5) -> list[dict]:
    """``bpftool ARGS -j``, parsed.  bpftool lists ids, then opens each: an object another process frees
    in between (another daemon's links, on a host with a bench beside) makes it exit 255, so a failed
    listing is tried again.

    Raises:
        subprocess.CalledProcessError: it failed tries times in a row.
    """
    for attempt in range(tries):
        r = subprocess.run(["bpftool", *args, "-j"], capture_output=True, text=True)
        if r.returncode == 0:
            return json.loads(r.stdout or "[]")
        time.sleep(0.05 * (attempt + 1))
    r.check_returncode()
    return []


def bpf_programs() -> list[dict]:
    """``bpftool prog show -f -j`` (each with ``id``, ``name``, ``pinned`` paths)."""
    return _bpftool("prog", "show", "-f")


def _held_ids(pid: int | str) -> set[int]:
    """Ids of the BPF programs process pid holds open (``prog_id:`` in /proc/PID/fdinfo/*); empty when gone."""
    ids = set()
    try:
        entries = list(Path(f"/proc/{pid}/fdinfo").iterdir())
    except OSError:
        return ids
    for entry in entries:
        try:
            text = entry.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("prog_id:"):
                ids.add(int(line.split()[1]))
    return ids


def programs_of(pid: int) -> dict[int, str]:
    """id → name of the BPF programs process pid holds open."""
    ids = _held_ids(pid)
    return {p["id"]: p.get("name", "") for p in bpf_programs() if p["id"] in ids}


def held_by_others(ids: set[int]) -> set[int]:
    """Those of ids a live process holds open: another daemon on the host that loaded the same pinned
    programs (a bench beside this run) keeps them attached, and they are its, not left by the kill."""
    held = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            held |= _held_ids(d.name) & ids
    return held


def running(ids: set[int]) -> tuple[set[int], set[int]]:
    """(ids of programs that may still run: loaded and unpinned, or attached, and held by no live process;
    ids kept pinned, detached)."""
    loaded = {p["id"]: p.get("pinned") or [] for p in bpf_programs() if p["id"] in ids}
    attached = {x.get("prog_id") for x in _bpftool("link", "show") + _bpftool("perf", "show")}
    left = {i for i, pins in loaded.items() if not pins or i in attached}
    return left - held_by_others(left), set(loaded) - left


def gone_within(ids: set[int], limit_s: float) -> tuple[set[int], set[int]]:
    """:func:`running` after up to limit_s seconds (the kernel frees a program once its last
    reference goes, partly from deferred work: not at the exact kill)."""
    end = time.monotonic() + limit_s
    while True:
        left, kept = running(ids)
        if not left or time.monotonic() >= end:
            return left, kept
        time.sleep(0.05)


def wait_ready(notify: socket.socket, proc: subprocess.Popen) -> float:
    """Seconds until READY=1 arrives; raises RuntimeError if the daemon dies or takes too long."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < READY_TIMEOUT_S:
        if proc.poll() is not None:
            raise RuntimeError(f"buildidd exited with {proc.returncode} before READY")
        try:
            msg = notify.recv(4096).decode(errors="replace")
        except TimeoutError:
            continue
        if "READY=1" in msg.split("\n"):
            return time.monotonic() - t0
    raise RuntimeError("no READY=1 within %.0f s" % READY_TIMEOUT_S)


def check_sealed(session: Path) -> dict:
    """The sealing checks of one killed session; returns its figures."""
    names = sorted(p.name for p in session.iterdir())
    segments = [n for n in names if n.startswith("segment-")]
    bad = [n for n in segments if not n.endswith(".jsonl.zst")]
    torn = 0
    last = None
    records = 0
    for name in segments:
        if not name.endswith(".zst"):
            continue
        with open(session / name, "rb") as f:
            data = zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True).read()
        for line in data.split(b"\n")[:-1]:
            try:
                rec = json.loads(line)
            except ValueError:
                torn += 1
                continue
            records += 1
            last = rec
    marker = json.loads((session / ".closed").read_bytes()) if ".closed" in names else None
    return {"session": session.name, "segments": len(segments), "uncompressed": bad, "records": records,
            "torn_lines": torn, "sealed": bool(last and last.get("type") == "end" and last.get("clean") is False),
            "marker_clean": None if marker is None else marker.get("clean")}


def run(iterations: int, max_run_s: float, seed: int) -> dict:
    rnd = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="crashloop-", dir="/tmp"))
    root = work / "sessions"
    notify_path = str(work / "notify")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    notify.settimeout(0.5)
    env = {**os.environ, "NOTIFY_SOCKET": notify_path}
    storm = subprocess.Popen(["sh", "-c", "while :; do /bin/true; done"])
    figures = {"iterations": iterations, "seed": seed, "failures": [], "ready_s": [], "run_s": [],
               "bpf_left": 0, "bpf_kept_pinned": 0, "sessions": []}
    killed: Path | None = None
    try:
        for i in range(iterations + 1):
            proc = subprocess.Popen([*BUILDIDD, "run", "--session-root", str(root), "--store-root", "",
                                     "--control-socket", str(work / "ctl.sock")], env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                figures["ready_s"].append(round(wait_ready(notify, proc), 3))
            except RuntimeError as e:
                figures["failures"].append(f"iteration {i}: {e}")
                proc.kill()
                proc.wait()
                break
            if killed is not None:  # the previous session must be sealed by now
                result = check_sealed(killed)
                figures["sessions"].append(result)
                if result["uncompressed"] or result["torn_lines"] > 1 or not result["sealed"] \
                        or result["marker_clean"] is not False:
                    figures["failures"].append(f"iteration {i}: {result}")
            if i == iterations:
                proc.send_signal(signal.SIGTERM)  # the last one ends cleanly
                proc.wait(30)
                break
            ours = programs_of(proc.pid)
            run_s = rnd.uniform(0.0, max_run_s)
            figures["run_s"].append(round(run_s, 3))
            time.sleep(run_s)
            proc.kill()
            proc.wait()
            left, kept = gone_within(set(ours), BPF_RELEASE_LIMIT_S)
            figures["bpf_kept_pinned"] += len(kept)
            if not ours:
                figures["failures"].append(f"iteration {i}: no BPF program seen for pid {proc.pid}")
            if left:
                figures["bpf_left"] += len(left)
                figures["failures"].append(f"iteration {i}: BPF programs running {BPF_RELEASE_LIMIT_S:g} s after "
                                           f"kill -9: {sorted((k, ours[k]) for k in left)}")
            sessions = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime_ns)
            killed = next(p for p in sessions if p.name.endswith(f"-{proc.pid}"))
    finally:
        storm.kill()
        storm.wait()
        notify.close()
        shutil.rmtree(work, ignore_errors=True)
    s = figures["sessions"]
    figures["summary"] = {"crashes_checked": len(s), "sealed": sum(r["sealed"] for r in s),
                          "torn_lines": sum(r["torn_lines"] for r in s),
                          "records": sum(r["records"] for r in s),
                          "max_ready_s": max(figures["ready_s"], default=None),
                          "failures": len(figures["failures"])}
    return figures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", "--iterations", type=int, default=100)
    ap.add_argument("--max-run-s", type=float, default=3.0, help="longest random run before kill -9 (s)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--json", action="store_true", help="print every figure, not only the summary")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("crashloop: needs root (BPF)", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    figures = run(args.iterations, args.max_run_s, seed)
    print(json.dumps(figures if args.json else {"seed": seed, **figures["summary"],
                                                 "failures_list": figures["failures"][:10]}, indent=2))
    return 1 if figures["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())

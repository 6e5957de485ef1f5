#!/usr/bin/env python3
"""Rate of ``buildidd resolve`` (addresses/s) on a session of realistic size.

Writes a synthetic session with SessionWriter shaped like an hour of a busy
host: PROCS short-lived processes (a fork from a shell, an exec, the
executable, ld.so, libc and a few libraries mapped), plus a few long-lived
ones that dlopen many libraries; then resolves QUERIES (pid, address, time)
triples, 90% inside a mapping of the process at a time it was alive, 10%
anywhere.  Prints the load time (records/s), the library's rate
(Replay.resolve_many) and the command's rate (``buildidd resolve SESSION``
reading ``PID ADDR TIME`` lines on stdin, text output), each addresses/s.

    .venv/bin/python scripts/bench_resolve.py [--procs 20000] [--queries 1000000]
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from buildidd.offline.replay import Query, Replay
from buildidd.sessionlog import SessionWriter

LIBS = [f"/usr/lib/x86_64-linux-gnu/lib{n}.so" for n in ("c", "m", "z", "ssl", "crypto", "pcre2", "selinux",
                                                          "tinfo", "pthread", "dl", "stdc++", "gcc_s")]


def _mmap(t, pid, start, length, path, bid, origin="mmap"):
    return {"type": "mmap", "time_ns": t, "pid": pid, "tid": pid, "comm": "w", "start": start, "len": length,
            "pgoff": 0x1000, "prot": 5, "flags": 2, "origin": origin, "deleted": False, "path": path, "dev": 1,
            "ino": hash(path) & 0xffffff, "ino_generation": 0, "size": 1 << 20, "mtime_ns": 0, "build_id": bid,
            "build_id_source": "map_files", "error": None}


def write(directory: Path, procs: int, rng: random.Random) -> tuple[int, list[tuple]]:
    """The session; returns (records written, [(pid, start, end, t_from, t_to)] for picking queries)."""
    spans, n = [], 0
    t = 1_000_000_000
    with SessionWriter(directory, compress=True) as w:
        w.write({"type": "session", "time_ns": t, "boot_to_wall_offset_ns": 0, "kernel_build_id": "ee" * 20})
        lines = []
        for pid in range(1000, 1000 + procs):
            t += rng.randrange(50_000, 300_000)
            lines.append({"type": "fork", "time_ns": t, "pid": pid, "tid": pid, "comm": "sh", "ppid": 999,
                          "ptid": 999})
            lines.append({"type": "exec", "time_ns": t + 100_000, "pid": pid, "tid": pid, "comm": "w",
                          "old_tid": pid, "filename": f"/usr/bin/tool{pid % 300}"})
            base = 0x7f0000000000 + rng.randrange(0, 1 << 20) * 0x1000
            maps = [(f"/usr/bin/tool{pid % 300}", 0x55d000000000 + rng.randrange(0, 1 << 16) * 0x1000)]
            maps += [(lib, base + i * 0x400000) for i, lib in enumerate(rng.sample(LIBS, rng.randrange(2, 8)))]
            for i, (path, start) in enumerate(maps):
                length = rng.randrange(1, 400) * 0x1000
                mt = t + 100_100 + i * 1000
                lines.append(_mmap(mt, pid, start, length, path, f"{hash(path) & (1 << 64) - 1:040x}",
                                   "exec" if i == 0 else "mmap"))
                spans.append((pid, start, start + length, mt, mt + 5_000_000))
            lines.append({"type": "exit", "time_ns": t + 5_000_000, "pid": pid, "tid": pid, "comm": "w",
                          "exit_code": 0})
            if len(lines) > 10_000:
                n += len(lines)
                for rec in lines:
                    w.write(rec)
                lines = []
        for pid in range(500, 510):                    # long-lived: 2,000 dlopens each
            for i in range(2000):
                start = 0x7e0000000000 + i * 0x100000
                lines.append(_mmap(t, pid, start, 0x20000, f"/opt/plugins/p{i}.so", f"{i:040x}"))
                spans.append((pid, start, start + 0x20000, t, t + 1))
                t += 1000
        n += len(lines)
        for rec in lines:
            w.write(rec)
    return n, spans


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--procs", type=int, default=20000)
    ap.add_argument("--queries", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="bench-resolve-") as tmp:
        session = Path(tmp) / "s"
        records, spans = write(session, args.procs, rng)
        size = sum(p.stat().st_size for p in session.iterdir())
        t0 = time.perf_counter()
        replay = Replay.load(session)
        load_s = time.perf_counter() - t0
        queries = []
        for _ in range(args.queries):
            pid, start, end, t_from, t_to = rng.choice(spans)
            if rng.random() < 0.9:
                queries.append(Query(pid, rng.randrange(start, end), rng.randrange(t_from, t_to + 1)))
            else:
                queries.append(Query(pid, rng.randrange(0, 1 << 47), rng.randrange(t_from, t_to + 1)))
        t0, c0 = time.perf_counter(), time.process_time()
        answers = replay.resolve_many(queries)
        lib_s, lib_cpu_s = time.perf_counter() - t0, time.process_time() - c0
        hits = sum(a.mapping is not None for a in answers)
        stdin = "".join(f"{q.pid} {q.addr:x} {q.time_ns}\n" for q in queries)
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "buildidd.cli", "resolve", str(session), "--store-root", ""],
                             input=stdin, capture_output=True, text=True, check=True).stdout
        cli_s = time.perf_counter() - t0
        assert out.count("\n") == len(queries)
    print(f"session: {records} records, {len(spans)} mappings, {size / 1e6:.1f} MB compressed, "
          f"{len(replay.pids())} pids")
    print(f"load: {load_s:.2f} s ({records / load_s:,.0f} records/s)")
    print(f"resolve_many: {len(queries)} addresses in {lib_s:.2f} s = {len(queries) / lib_s:,.0f} addresses/s "
          f"({hits} hits; {len(queries) / lib_cpu_s:,.0f} per CPU second)")
    print(f"buildidd resolve (stdin, text, load included): {cli_s:.2f} s = {len(queries) / cli_s:,.0f} addresses/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

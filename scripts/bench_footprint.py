"""How buildidd's cost grows, beside perf record --buildid-mmap.

Run as root after scripts/setup:
    scripts/bench --scenarios footprint [--fp-procs 500,2000,5000] [--fp-dsos 100,1000,10000]
                  [--fp-rates 50000,100000,200000,0] [--seconds 3] [--reps 3]

Four lines, each bounded in time (the development machines have 2 CPUs):
- READY by kind of start: cold, first start of a boot (compile cache), restart (pins);
- READY against the number of running processes (sleeping ones spawned first);
- RSS against the number of distinct DSOs seen (one tiny library copied N
  times, each copy with its own GNU build-id, dlopen'd once each);
- daemon CPU per mapping event against the event rate (paced mmap storms and
  an unpaced one), from the ramp scenario (bench_storms.ramp).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import statistics
import subprocess
import time
from pathlib import Path

import psutil

from bench_storms import ramp
from benchlib import SETTLE_S, Buildidd, RssSampler, build, parse_ramp, remove_tree, uss_of, warm_store
from perfcompare import PerfRecorder, require_quiet_host
from buildidd.resolve.buildid import read_build_id_fd


def _procs(exe: Path, n: int) -> list[subprocess.Popen]:
    out = []
    try:
        for _ in range(n):
            out.append(subprocess.Popen([str(exe)]))
    except OSError:
        _kill(out)
        raise
    return out


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def ready_vs_procs(w: dict, workdir: Path, counts: list[int], store: Path) -> list[dict]:
    """READY (s) and RSS/USS (MiB) of both with n sleeping processes running, per n.

    buildidd starts on the warm store (a restart); one start each.
    """
    rows = []
    for n in counts:
        procs = _procs(w["idle"], n)
        try:
            time.sleep(1.0)
            perf = PerfRecorder(workdir / "perf.data")
            row = {"procs": n, "perf_ready_s": round(perf.ready_s, 3)}
            row["perf_rss_mib"] = round(psutil.Process(perf.proc.pid).memory_info().rss / 2**20, 1)
            perf.finish()
            d = Buildidd(workdir, store=store)
            row["buildidd_ready_s"] = round(d.ready_s, 3)
            time.sleep(SETTLE_S)
            row["buildidd_rss_mib"] = round(d.rss.last / 2**20, 1)
            row["buildidd_uss_mib"] = round(d.uss() / 2**20, 1)
            d.stop(read=False)
            d.cleanup()
        finally:
            _kill(procs)
        print(f"  footprint: {row}", flush=True)
        rows.append(row)
    return rows


def ready_by_start(workdir: Path, store: Path, reps: int = 3,
                   kinds: tuple[str, ...] = ("cold", "boot", "restart")) -> dict:
    """READY (s, median of reps) of buildidd by kind of start, beside perf's (which has one kind):
    cold (no bpffs pins, no compile cache: after an install or a kernel upgrade), first start of a
    boot (pins gone, compile cache warm: kernel.progcache) and restart (pins: kernel.pinned).  kinds: which of
    them, in this order (a restart follows the start before it).
    A pin root and cache of its own, removed at the end."""
    pin_root = f"/sys/fs/bpf/buildidd-bench-{os.getpid()}"
    cache = workdir / "bpf-cache"
    config = workdir / "ready-by-start.toml"
    config.write_text(f'bpf_pin_root = "{pin_root}"\nbpf_cache_dir = "{cache}"\n')
    times: dict[str, list[float]] = {**{k: [] for k in kinds}, "perf": []}
    try:
        for _ in range(reps):
            for kind in kinds:
                if kind != "restart":
                    shutil.rmtree(pin_root, ignore_errors=True)
                if kind == "cold":
                    shutil.rmtree(cache, ignore_errors=True)
                d = Buildidd(workdir, store=store, extra=["--config", str(config)])
                times[kind].append(d.ready_s)
                d.stop(read=False)
                d.cleanup()
            perf = PerfRecorder(workdir / "perf.data")
            times["perf"].append(perf.ready_s)
            perf.finish()
    finally:
        shutil.rmtree(pin_root, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)
    out = {k: round(statistics.median(v), 3) for k, v in times.items()}
    print(f"  footprint: READY by start {out}", flush=True)
    return out


def make_libraries(lib: Path, dest: Path, n: int) -> list[Path]:
    """n copies of lib in dest, each with its own build-id (sha1 of its index, same length):
    the descriptor bytes are patched in place (ELF gABI note: only the descriptor changes)."""
    dest.mkdir(parents=True, exist_ok=True)
    data = lib.read_bytes()
    fd = os.open(lib, os.O_RDONLY)
    try:
        bid = read_build_id_fd(fd)
    finally:
        os.close(fd)
    if bid is None or data.count(bid.raw) != 1:
        raise RuntimeError(f"{lib}: build-id not found exactly once")
    at = data.index(bid.raw)
    out = []
    for i in range(n):
        new = hashlib.sha1(f"buildidd-footprint-{i}".encode()).digest()[:len(bid.raw)]
        path = dest / f"libfp{i}.so"
        path.write_bytes(data[:at] + new + data[at + len(new):])
        out.append(path)
    return out


def rss_vs_dsos(w: dict, workdir: Path, counts: list[int], store: Path) -> list[dict]:
    """RSS/USS/peak (MiB) of both after a process dlopen'd n distinct libraries once each."""
    libs = make_libraries(w["lib0"], workdir / "fp-libs", max(counts))
    rows = []
    for n in counts:
        argv = [str(w["dlopen_storm"]), "1", *map(str, libs[:n])]
        perf = PerfRecorder(workdir / "perf.data")
        prss = RssSampler(perf.proc.pid)
        time.sleep(SETTLE_S)
        subprocess.run(argv, check=True)
        time.sleep(0.5)
        row = {"dsos": n, "perf_rss_mib": round(prss.last / 2**20, 1),
               "perf_uss_mib": round(uss_of(perf.proc.pid) / 2**20, 1)}
        prss.stop()
        row["perf_peak_mib"] = round(prss.peak / 2**20, 1)
        perf.finish()
        d = Buildidd(workdir, store=store)
        time.sleep(SETTLE_S)
        subprocess.run(argv, check=True)
        time.sleep(1.0)     # drained and handed to the store
        row.update(buildidd_rss_mib=round(d.rss.last / 2**20, 1), buildidd_uss_mib=round(d.uss() / 2**20, 1))
        d.stop(read=False)
        row["buildidd_peak_mib"] = round(d.rss.peak / 2**20, 1)
        d.cleanup()
        print(f"  footprint: {row}", flush=True)
        rows.append(row)
    return rows


def run(w: dict, workdir: Path, store: Path, *, procs: str, dsos: str, rates: str, seconds: float,
        reps: int = 3, kinds: tuple[str, ...] = ("cold", "boot", "restart")) -> dict:
    """The lines; returns {"ready_by_start": {...}, "ready_vs_procs": [...], "rss_vs_dsos": [...],
    "cpu_vs_rate": [...]}."""
    ints = lambda spec: [int(x) for x in spec.split(",") if x.strip()]  # noqa: E731
    out = {"ready_by_start": ready_by_start(workdir, store, reps, kinds),
           "ready_vs_procs": ready_vs_procs(w, workdir, ints(procs), store),
           "rss_vs_dsos": rss_vs_dsos(w, workdir, ints(dsos), store),
           "cpu_vs_rate": ramp(w, workdir, parse_ramp(rates), seconds, store)}
    r = out["ready_by_start"]
    what = {"cold": "cold (nothing cached)", "boot": "first start of a boot (compile cache)",
            "restart": "restart (bpffs pins)"}
    print(f"\nREADY by kind of start (s, median of {reps}): buildidd "
          + " | ".join(f"{what[k]} {r[k]:.2f}" for k in kinds) + f" | perf {r['perf']:.2f}")
    print("READY against running processes (s; RSS MiB after READY):")
    for r in out["ready_vs_procs"]:
        print(f"  {r['procs']:>6} processes: buildidd {r['buildidd_ready_s']:.2f} s "
              f"(RSS {r['buildidd_rss_mib']}, USS {r['buildidd_uss_mib']}) | perf {r['perf_ready_s']:.2f} s "
              f"(RSS {r['perf_rss_mib']})")
    print("RSS against distinct DSOs seen (MiB, RSS/USS/peak):")
    for r in out["rss_vs_dsos"]:
        print(f"  {r['dsos']:>6} DSOs: buildidd {r['buildidd_rss_mib']}/{r['buildidd_uss_mib']}/"
              f"{r['buildidd_peak_mib']} | perf {r['perf_rss_mib']}/{r['perf_uss_mib']}/{r['perf_peak_mib']}")
    print("daemon CPU against event rate (µs per mapping event):")
    for r in out["cpu_vs_rate"]:
        print(f"  target {r['target_per_s']!s:>7}/s achieved {r['achieved_per_s']:>7}/s: buildidd "
              f"{r['cpu_us_per_event']:.2f} µs/ev, lost {r['losses']}, peak RSS {r['rss_peak_mib']} MiB | perf "
              f"achieved {r['perf_achieved_per_s']}/s, {r['perf_cpu_us_per_event']:.2f} µs/ev, lost {r['perf_lost']}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fp-procs", default="500,2000,5000", help="running processes")
    ap.add_argument("--fp-dsos", default="100,1000,10000", help="distinct DSOs dlopen'd")
    ap.add_argument("--fp-rates", default="50000,100000,200000,0", help="RATE[xPROCS],... (0 = max)")
    ap.add_argument("--seconds", type=float, default=3.0, help="seconds of each storm of the rate line")
    ap.add_argument("--reps", type=int, default=3, help="starts of each kind for READY by start")
    ap.add_argument("--smoke", action="store_true", help="a few processes, DSOs and one paced rate")
    ap.add_argument("--json", type=Path, help="write the lines here")
    args = ap.parse_args(argv)
    if args.smoke:
        args.fp_procs, args.fp_dsos, args.fp_rates, args.seconds, args.reps = "20", "10", "20000", 0.5, 1
    kinds = ("cold",) if args.smoke else ("cold", "boot", "restart")   # smoke: one start (its own cache: a compile)
    if os.geteuid() != 0:
        print("bench_footprint: must run as root", file=sys.stderr)
        return 2
    if not args.smoke:          # a smoke run asserts no figure: it may run beside other work
        require_quiet_host("bench_footprint")
    workdir = Path(tempfile.mkdtemp(prefix="buildidd-footprint-"))
    try:
        w = build.build(workdir / "bin", n_libs=4)     # idle links 4 of them, as in the storm scenarios
        out = run(w, workdir, warm_store(workdir), procs=args.fp_procs, dsos=args.fp_dsos, rates=args.fp_rates,
                  seconds=args.seconds, reps=args.reps, kinds=kinds)
    finally:
        remove_tree(workdir)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0

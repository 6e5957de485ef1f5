"""The build farm (scripts/bench --scenarios farm): the cost of a new program, beside perf's.

A build or CI host runs thousands of freshly built programs, each once.  The farm links one
object (workloads/upgrade.py build_farm) --farm-n times with gcc at bench time, in parallel, each
with its own random build-id (16 KiB each), and a second build of every --farm-rename-every-th
program; one sh runs each program once and renames its second build over it right after it exits
(farm_script).  Two such sets, with distinct build-ids, are built, in a root-owned directory under
/opt by default (FARM_PARENT).  Every daemon is new, so it meets every program for the first time.
Modes, alternating within each repetition:

  perf      perf record -e dummy -a --buildid-mmap, as the bench's other scenarios, running fresh
            copies of the cold set;
  warm      buildidd running the warm set, which the store holds: one buildidd run copied it before
            the repetitions, from the very files run since (the store's entry names each one), except
            the renamed-over programs, which get new copies of their first build before each run
            (a first sighting of a program the store holds: issue 46 asks at most 100 µs);
  cold      buildidd running new copies of the cold set after its entries were removed from the store
            (each program a new entry: at most 500 µs);
  --against TREE adds both buildidd modes run from that tree.

The store is the bench's warm one.  The window runs from the workload's start until the store holds every program (cold) and the
daemon has gone quiet; the session log's compression is counted as in bench_storms.py (the finishing
thread's share of the window's bytes).  Printed: daemon CPU per program beside perf's, the share of
the programs the store holds and the session named with their build-id (perf: its MMAP2 records
that carry it), and where the daemon's CPU went by thread.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchlib import FINISHER, SETTLE_S, Buildidd, cpu_s_of, lost_count
from perfcompare import PerfRecorder, parse_perf_script
from workloads.upgrade import build_farm, farm_script

#: Issue 46's goals, daemon µs CPU per program: a first sighting of a program the store holds, and a
#: new program (16 KiB class) stored in a cold store.
WARM_GOAL_US = 100.0
COLD_GOAL_US = 500.0
#: The daemon is quiet when it used less than this share of a CPU over QUIET_WINDOW_S.
QUIET_SHARE = 0.05
QUIET_WINDOW_S = 0.2
#: Where the farm is built by default: a root-owned system directory (store.origin.SYSTEM_DIRS), so that
#: its entries are trusted and a later sighting of the same content from any file is settled.  A farm
#: elsewhere (--farm-dir, e.g. under /tmp or a user's home) makes untrusted entries: a sighting from
#: another file of the same content (a fresh copy) then rewrites the entry's origin.
FARM_PARENT = "/opt"
#: Runs that fill the store with the warm set before the repetitions, at most (a run may miss a program:
#: the same as a measured cold run, printed).
FILL_TRIES = 3
#: How long the window may wait for the store and the daemon to finish the farm's work.
DRAIN_LIMIT_S = 120.0


@dataclass
class FarmRun:
    """One mode's run of the farm: daemon (or perf) CPU seconds in the window, with compression for
    buildidd; programs the store holds and the session (perf: its MMAP2 records) named with their
    build-id; records lost; workload wall seconds; buildidd's CPU seconds by thread name."""
    cpu_s: float
    held: int | None
    named: int
    lost: int
    wall_s: float
    threads: dict[str, float] = field(default_factory=dict)
    #: the farm's programs the session names as store gaps, by reason (its end record's
    #: store_coverage.missing, which lists root's gaps first)
    gaps: dict[str, int] = field(default_factory=dict)


@dataclass
class FarmSet:
    """One set of the farm's builds: pristine builds in dir, their build-ids, the indices with a
    second build, and the directory the programs run from (run: the store's entries are named after it)."""
    dir: Path
    bids: list[str]
    renamed: list[int]
    run: Path


@dataclass
class Farm:
    """Two sets of distinct builds (warm: held by the store; cold: removed from it before each cold
    run), and the store."""
    warm: FarmSet
    cold: FarmSet
    store: Path


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of each of pid's live threads, summed by kernel name (/proc/PID/task/TID/comm and
    schedstat, ns on CPU)."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            ns = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        out[comm] = out.get(comm, 0.0) + ns / 1e9
    return out


def held(store: Path, bids: list[str]) -> int:
    """How many of bids the store holds (its .build-id link resolves to an entry with an elf)."""
    return sum(1 for b in bids if (store / ".build-id" / b[:2] / b[2:] / "elf").exists())


def forget(store: Path, fs: FarmSet) -> None:
    """Remove fs's entries from store: their .build-id links and the entries' tree (ROOT + the run
    directory's path, store.layout)."""
    for b in fs.bids:
        (store / ".build-id" / b[:2] / b[2:]).unlink(missing_ok=True)
    shutil.rmtree(f"{store}{fs.run}", ignore_errors=True)


def copy_builds(fs: FarmSet, names: list[str]) -> None:
    """New copies (new inodes, mode 0o755) of fs's pristine builds of these names in fs.run."""
    fs.run.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copyfile(fs.dir / name, fs.run / name)
        (fs.run / name).chmod(0o755)


def fresh_copy(fs: FarmSet) -> None:
    """fs.run gets a new copy of every program and of every second build."""
    shutil.rmtree(fs.run, ignore_errors=True)
    copy_builds(fs, [f"prog{i}" for i in range(len(fs.bids))] + [f"prog{i}.new" for i in fs.renamed])


def restore(fs: FarmSet) -> None:
    """The programs a run renamed over get their first build back (a new copy) and their second one;
    the others stay the very files the store copied."""
    copy_builds(fs, [f"prog{i}" for i in fs.renamed] + [f"prog{i}.new" for i in fs.renamed])


def wait_quiet(d: Buildidd, limit_s: float = DRAIN_LIMIT_S) -> None:
    """Wait until the daemon used less than QUIET_SHARE of a CPU over QUIET_WINDOW_S (limit_s at most):
    its start-up work done (the synthesis' hand-overs, the first housekeeping of a large store), or
    the farm's."""
    deadline = time.monotonic() + limit_s
    last = d.cpu_s()
    while time.monotonic() < deadline:
        time.sleep(QUIET_WINDOW_S)
        now = d.cpu_s()
        if now - last < QUIET_SHARE * QUIET_WINDOW_S:
            return
        last = now


def _drain(d: Buildidd, store: Path, bids: list[str]) -> None:
    """Wait until the store holds every program and the daemon is quiet, DRAIN_LIMIT_S at most."""
    deadline = time.monotonic() + DRAIN_LIMIT_S
    while held(store, bids) < len(bids) and time.monotonic() < deadline:
        time.sleep(0.1)
    wait_quiet(d, max(1.0, deadline - time.monotonic()))


def run_buildidd(farm: Farm, work: Path, cold: bool, env: dict | None) -> FarmRun:
    """One buildidd run of the farm (see the module docstring); env: e.g. another tree's PYTHONPATH."""
    if cold:
        forget(farm.store, farm.cold)
        fresh_copy(farm.cold)
        return run_set(farm.store, farm.cold, work, env)
    if held(farm.store, farm.warm.bids) < len(farm.warm.bids):
        raise RuntimeError("farm: the store lacks programs of the warm set it held before")
    restore(farm.warm)
    return run_set(farm.store, farm.warm, work, env)


def run_set(store: Path, fs: FarmSet, work: Path, env: dict | None) -> FarmRun:
    """buildidd around one run of fs's programs as they are in fs.run; the window ends when the
    store holds every one and the daemon is quiet."""
    d = Buildidd(work, store=store, env=env, compress=True)
    try:
        time.sleep(SETTLE_S)
        wait_quiet(d, 30.0)
        c0, b0, f0, t0 = d.cpu_s(), d.log_bytes(), d.thread_cpu_s(FINISHER), thread_cpu(d.proc.pid)
        t = time.monotonic()
        subprocess.run(["sh", "-c", farm_script(fs.run, len(fs.bids))], check=True)
        wall = time.monotonic() - t
        _drain(d, store, fs.bids)
        c1, b1, f1, t1 = d.cpu_s(), d.log_bytes(), d.thread_cpu_s(FINISHER), thread_cpu(d.proc.pid)
        records = d.stop()
        zstd = d.zstd_s(b1 - b0)
        cpu = c1 - c0 - (f1 - f0 if zstd is not None else 0.0) + (zstd or 0.0)
        want = set(fs.bids)
        named = len({r["build_id"] for r in records if r.get("type") == "mmap" and r.get("build_id") in want})
        threads = {k: v - t0.get(k, 0.0) for k, v in t1.items() if v - t0.get(k, 0.0) > 0}
        gaps: dict[str, int] = {}
        for m in ((records[-1].get("store_coverage") or {}).get("missing") or [] if records else []):
            if m.get("build_id") in want:
                gaps[m["reason"]] = gaps.get(m["reason"], 0) + 1
        return FarmRun(cpu, held(store, fs.bids), named, lost_count(records), wall, threads, gaps)
    finally:
        d.kill_if_running()
        d.cleanup()


def run_perf(farm: Farm, work: Path) -> FarmRun:
    """perf record -e dummy -a --buildid-mmap around one run of the farm.  perf's CPU runs until it
    exits (its rusage, from wait4): it reads its rings when they fill or when it stops, and a farm's
    records may never fill them."""
    fs = farm.cold
    fresh_copy(fs)
    perf = PerfRecorder(work / "farm-perf.data")
    try:
        time.sleep(SETTLE_S)
        c0 = cpu_s_of(perf.proc.pid)
        t = time.monotonic()
        subprocess.run(["sh", "-c", farm_script(fs.run, len(fs.bids))], check=True)
        wall = time.monotonic() - t
        perf.proc.send_signal(signal.SIGINT)
        _, _, ru = os.wait4(perf.proc.pid, 0)
        perf.proc.returncode = 0
        maps = parse_perf_script(subprocess.run(
            ["perf", "script", "-i", str(perf.output), "--show-mmap-events"],
            capture_output=True, text=True, errors="replace").stdout)
    finally:
        perf.finish()
        shutil.rmtree(fs.run, ignore_errors=True)
    want = set(fs.bids)
    return FarmRun(ru.ru_utime + ru.ru_stime - c0, None, len({m.build_id for m in maps if m.build_id in want}),
                   0, wall)


def prepare(work: Path, store: Path, programs: int, rename_every: int, farm_dir: Path) -> Farm:
    """Build the farm's two sets in farm_dir and let one buildidd run of the warm set put its
    programs into store."""
    t = time.monotonic()
    sets = []
    for name in ("warm", "cold"):
        out = build_farm(farm_dir / name, programs, rename_every)
        sets.append(FarmSet(farm_dir / name, out["programs"], out["renamed"], farm_dir / f"run-{name}"))
    print(f"  farm: 2 x {programs} programs and {len(sets[0].renamed)} second builds linked in "
          f"{time.monotonic() - t:.1f} s", flush=True)
    warm, cold = sets
    forget(store, warm)
    for _ in range(FILL_TRIES):
        # Nothing is renamed over in the filling run (no second build in place): the store gets every
        # program however far its copies fall behind the workload.
        shutil.rmtree(warm.run, ignore_errors=True)
        copy_builds(warm, [f"prog{i}" for i in range(programs)])
        filled = run_set(store, warm, work, None)
        if filled.held == programs:
            return Farm(warm, cold, store)
        print(f"  farm: the filling run left the store with {filled.held}/{programs} programs (gaps "
              f"{filled.gaps}); again", flush=True)
    raise RuntimeError(f"farm: the store holds {filled.held}/{programs} programs after {FILL_TRIES} filling runs")


def run(work: Path, store: Path, programs: int, rename_every: int, reps: int,
        against_env: dict | None = None, farm_dir: Path | None = None) -> dict:
    """The farm's modes alternating for reps repetitions; a dict of per-mode lists of FarmRun
    figures (per program) for bench_storms.py's table and JSON.  farm_dir: where the farm is built and run
    (None: a new directory under FARM_PARENT, removed after)."""
    own = farm_dir is None
    farm_dir = Path(tempfile.mkdtemp(prefix="buildidd-bench-farm-", dir=FARM_PARENT)) if own else farm_dir
    try:
        return _run(work, store, (programs, rename_every, reps), against_env, farm_dir)
    finally:
        if own:
            shutil.rmtree(farm_dir, ignore_errors=True)


def _run(work: Path, store: Path, sizes: tuple[int, int, int], against_env: dict | None, farm_dir: Path) -> dict:
    programs, rename_every, reps = sizes
    farm = prepare(work, store, programs, rename_every, farm_dir)
    modes = ["perf", "warm", "cold"] + (["against warm", "against cold"] if against_env is not None else [])
    got: dict[str, list[FarmRun]] = {m: [] for m in modes}
    for i in range(reps):
        k = i % len(modes)
        for mode in modes[k:] + modes[:k]:
            if mode == "perf":
                r = run_perf(farm, work)
            else:
                r = run_buildidd(farm, work, cold=mode.endswith("cold"),
                                 env=against_env if mode.startswith("against") else None)
            got[mode].append(r)
        print(f"  farm rep {i + 1}/{reps}: " + ", ".join(
            f"{m} {got[m][-1].cpu_s * 1e6 / programs:.0f} µs/program" for m in modes), flush=True)
    return summarize(got, programs)


def summarize(got: dict[str, list[FarmRun]], programs: int) -> dict:
    """Medians per mode: µs CPU per program, stored and named shares (worst repetition), losses,
    wall seconds, µs per program by thread."""
    out = {"programs": programs, "modes": {}}
    for mode, runs in got.items():
        names = sorted({k for r in runs for k in r.threads})
        out["modes"][mode] = {
            "cpu_us_per_program": statistics.median(r.cpu_s * 1e6 / programs for r in runs),
            "cpu_us_per_program_reps": [round(r.cpu_s * 1e6 / programs, 1) for r in runs],
            "held_min": min((r.held for r in runs if r.held is not None), default=None),
            "named_min": min(r.named for r in runs),
            "lost": sum(r.lost for r in runs),
            "gaps": {k: sum(r.gaps.get(k, 0) for r in runs) for k in sorted({k for r in runs for k in r.gaps})},
            "wall_s": statistics.median(r.wall_s for r in runs),
            "threads_us_per_program": {n: round(statistics.median(r.threads.get(n, 0.0) for r in runs)
                                                * 1e6 / programs, 1) for n in names},
        }
    return out


def fmt(out: dict) -> list[str]:
    """The farm's table, the goals beside perf, and the daemon's CPU by thread."""
    n, modes = out["programs"], out["modes"]
    perf = modes["perf"]["cpu_us_per_program"]
    lines = [f"build farm, {n} new programs each run once (daemon µs CPU per program, median; stored and "
             "named: the worst repetition):",
             f"  {'mode':<14} {'µs/program':>10} {'x perf':>8} {'stored':>12} {'named':>12} {'lost':>5} {'wall s':>7}"]
    for mode, m in modes.items():
        x_perf = f"{m['cpu_us_per_program'] / perf:.1f}" if perf else "-"
        stored = f"{m['held_min']}/{n}" if m["held_min"] is not None else "-"
        lines.append(f"  {mode:<14} {m['cpu_us_per_program']:>10.1f} {x_perf:>8} "
                     f"{stored:>12} {m['named_min']:>7}/{n:<4} {m['lost']:>5} {m['wall_s']:>7.2f}")
    for mode, m in modes.items():
        if m.get("gaps"):
            lines.append(f"  {mode}: the farm's programs the sessions name as store gaps, by reason, all "
                         f"repetitions: {m['gaps']}")
    for mode, goal in (("warm", WARM_GOAL_US), ("cold", COLD_GOAL_US)):
        v = modes[mode]["cpu_us_per_program"]
        lines.append(f"  goal: {mode} store <= {goal:g} µs per program: {v:.1f} (perf {perf:.1f}) "
                     f"{'met' if v <= goal else 'NOT met, x%.2f' % (v / goal)}")
    for mode, m in modes.items():
        if m["threads_us_per_program"]:
            lines.append(f"  {mode} by thread, µs/program: " + ", ".join(
                f"{k} {v:.1f}" for k, v in sorted(m["threads_us_per_program"].items(), key=lambda kv: -kv[1])
                if v >= 0.5))
    return lines


def failures(out: dict) -> list[str]:
    """Why the farm failed: a program the store lacks, one the session did not name, a loss."""
    n, bad = out["programs"], []
    for mode, m in out["modes"].items():
        if m["held_min"] is not None and m["held_min"] < n:
            bad.append(f"farm {mode}: the store holds {m['held_min']}/{n} programs (gaps named, all "
                       f"repetitions: {m['gaps'] or 'none'})")
        if mode != "perf" and m["named_min"] < n:
            bad.append(f"farm {mode}: the session named {m['named_min']}/{n} programs")
        if m["lost"]:
            bad.append(f"farm {mode}: {m['lost']} events lost")
    return bad

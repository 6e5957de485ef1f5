"""Kernel ns per event of buildidd's BPF programs (bpf_stats), per storm, for one source tree.

Run as root:  scripts/bench --scenarios kernel-ns [--tree DIR] [--reps N] [--perf] [--no-kfuncs] [--storms exec,...]

For each storm of scripts/workloads (exec, dlopen, mmap: benchlib.storm_argv, at the sizes the storm
scenarios use by default) it starts ``buildidd run`` from DIR/daemon (default: this
checkout; DIR may be a ``git worktree`` of an older commit, with its fast path
built in place), turns kernel.bpf_stats_enabled on, and reads run_time_ns and
run_cnt of every BPF program the daemon holds (``bpftool prog show --json``;
the programs are those of fds in the daemon's /proc/PID/fdinfo) before and
after the workload.  It prints, per program, runs and ns per run (the figure
to compare: the exec storm's event is on_sched_process_exec's run; in the
dlopen and mmap storms on_sys_exit (raw_syscalls:sys_exit) runs for every
syscall and does the work for mmap and mprotect), and the sum over programs
divided by the workload's recorded exec+mmap records.  That sum is host-wide:
the programs run for every process (on a shared machine, others' too), and it
includes the runs on syscalls that record nothing (on_sys_exit returns after
reading orig_ax), so it is an upper bound of the kernel ns per event.

With --perf, perf's cost beside it: perf --buildid-mmap works inside the
kernel (no BPF program), so it is estimated from the workload's own CPU time
(user + sys, rusage of the child) with perf attached minus without, divided by
the same number of events; the daemon's is given the same way.  These are
noisy on a shared machine: compare medians over --reps.
The figures of a run are also written as JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

from benchlib import Buildidd, build, link_bpf_sources, remove_tree, storm_argv  # noqa: E402
from perfcompare import PerfRecorder, require_quiet_host  # noqa: E402

STATS_SYSCTL = Path("/proc/sys/kernel/bpf_stats_enabled")


def daemon_prog_ids(pid: int) -> set[int]:
    """The ids of the BPF programs whose fds process pid holds (``prog_id:`` in /proc/PID/fdinfo)."""
    ids = set()
    fdinfo = Path(f"/proc/{pid}/fdinfo")
    for f in fdinfo.iterdir():
        try:
            text = f.read_text()
        except OSError:      # the fd was closed meanwhile
            continue
        for line in text.splitlines():
            if line.startswith("prog_id:"):
                ids.add(int(line.split()[1]))
    return ids


def prog_stats(ids: set[int]) -> dict[str, tuple[int, int]]:
    """name -> (run_time_ns, run_cnt) summed over the programs with these ids (bpftool prog show --json)."""
    progs = json.loads(subprocess.run(["bpftool", "prog", "show", "--json"], check=True,
                                      capture_output=True, text=True).stdout)
    out: dict[str, tuple[int, int]] = {}
    for p in progs:
        if p["id"] in ids:
            ns, cnt = out.get(p.get("name", str(p["id"])), (0, 0))
            out[p.get("name", str(p["id"]))] = (ns + p.get("run_time_ns", 0), cnt + p.get("run_cnt", 0))
    return out


def run_workload(argv: list[str]) -> float:
    """Run argv to completion; its CPU time (user + sys, s) from the children's rusage."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


#: --no-kfuncs: a sitecustomize for the daemon's interpreter that makes tracer.kld_support answer
#: "no kfuncs", as on a kernel before 6.2: the BPF side is compiled with -DNO_KFUNCS and every
#: KLD load is a bpf_probe_read_kernel (bpf/kfuncs.h).
NO_KFUNCS_SITE = """
import buildidd.kernel.tracer as _tracer
_tracer.kld_support = lambda btf: ({}, ())
"""


def measure(tree: Path, argv: list[str], comms: set[str], workdir: Path, site: Path | None = None) -> dict:
    """One daemon run from tree around one workload run: per-program and total ns per event.
    site: a directory put first on the daemon's PYTHONPATH (its sitecustomize runs first)."""
    env = {"PYTHONPATH": os.pathsep.join(([str(site)] if site else []) + [str(tree / "daemon")])}
    d = Buildidd(workdir, env=env)
    try:
        time.sleep(0.3)
        ids = daemon_prog_ids(d.proc.pid)
        s0 = prog_stats(ids)
        cpu = run_workload(argv)
        time.sleep(0.2)
        s1 = prog_stats(ids)
        records = d.stop()
    finally:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()
        d.cleanup()
    events = sum(1 for r in records if r.get("type") in ("mmap", "exec") and r.get("origin") != "synthesized"
                 and r.get("comm") in comms)
    progs = {}
    for name, (ns1, cnt1) in s1.items():
        ns0, cnt0 = s0.get(name, (0, 0))
        if cnt1 > cnt0:
            progs[name] = {"runs": cnt1 - cnt0, "ns_per_run": round((ns1 - ns0) / (cnt1 - cnt0), 1),
                           "ns": ns1 - ns0}
    total = sum(p["ns"] for p in progs.values())
    return {"events": events, "programs": progs, "kernel_ns_total": total,
            "kernel_ns_per_event": round(total / events, 1) if events else None, "workload_cpu_s": cpu}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", type=Path, default=HERE.parent, help="source tree whose daemon/ to run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--storms", default="exec,dlopen,mmap", help="which storms, comma-separated")
    ap.add_argument("--exec-n", type=int, default=2000)
    ap.add_argument("--dlopen-libs", type=int, default=50)
    ap.add_argument("--dlopen-rounds", type=int, default=200)
    ap.add_argument("--mmap-n", type=int, default=200_000)
    ap.add_argument("--perf", action="store_true", help="also the workload's CPU time with perf / nothing attached")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--no-kfuncs", action="store_true",
                    help="the fallback of kernels without bpf_rdonly_cast: compiled with -DNO_KFUNCS")
    ap.add_argument("--smoke", action="store_true", help="tiny storms, one repetition, perf beside")
    args = ap.parse_args(argv)
    if args.smoke:
        args.reps, args.exec_n, args.dlopen_libs, args.dlopen_rounds, args.mmap_n = 1, 50, 4, 3, 2000
        args.perf = True
    if os.geteuid() != 0:
        print("bench_kernel_ns: must run as root", file=sys.stderr)
        return 2
    if not args.smoke:          # a smoke run asserts no figure: it may run beside other work
        require_quiet_host("bench_kernel_ns")
    if args.tree.resolve() != HERE.parent:
        link_bpf_sources(args.tree)
    old = STATS_SYSCTL.read_text().strip()
    STATS_SYSCTL.write_text("1")
    workdir = Path(tempfile.mkdtemp(prefix="buildidd-kns-"))
    out = {"tree": str(args.tree), "load_avg": os.getloadavg(), "scenarios": {}}
    try:
        w = build.build(workdir / "bin", n_libs=args.dlopen_libs)
        site = None
        if args.no_kfuncs:
            site = workdir / "site"
            site.mkdir()
            (site / "sitecustomize.py").write_text(NO_KFUNCS_SITE)
            out["no_kfuncs"] = True
        storm = storm_argv(w, args.exec_n, args.dlopen_libs, args.dlopen_rounds, args.mmap_n)
        for name, (cmd, comms) in storm.items():
            if name not in args.storms.split(","):
                continue
            runs = [measure(args.tree, cmd, comms, workdir, site) for _ in range(args.reps)]
            row = {"runs": runs, "kernel_ns_per_event": statistics.median(r["kernel_ns_per_event"] or 0 for r in runs)}
            events = statistics.median(r["events"] for r in runs)
            if args.perf and events:
                none, perf = [], []
                for _ in range(args.reps):
                    none.append(run_workload(cmd))
                    p = PerfRecorder(workdir / "perf.data")
                    perf.append(run_workload(cmd))
                    p.finish()
                base = statistics.median(none)
                row["workload_cpu_ns_per_event"] = {
                    "perf": round((statistics.median(perf) - base) * 1e9 / events, 1),
                    "buildidd": round((statistics.median(r["workload_cpu_s"] for r in runs) - base) * 1e9 / events, 1)}
            out["scenarios"][name] = row
            print(f"{name}: {events:.0f} events, host-wide kernel ns/event (median of {args.reps}) "
                  f"{row['kernel_ns_per_event']:.0f}", flush=True)
            for prog, p in runs[-1]["programs"].items():
                print(f"    {prog:<24} runs {p['runs']:>9}  ns/run {p['ns_per_run']:>8.0f}")
            if "workload_cpu_ns_per_event" in row:
                c = row["workload_cpu_ns_per_event"]
                print(f"    workload CPU ns/event over nothing: perf {c['perf']:.0f}, buildidd {c['buildidd']:.0f}")
        print(f"load average {os.getloadavg()}")
        if args.json:
            args.json.write_text(json.dumps(out, indent=2))
    finally:
        STATS_SYSCTL.write_text(old)
        remove_tree(workdir)
    return 0

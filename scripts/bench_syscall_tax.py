"""What every syscall pays while buildidd records, beside perf: the floor of a raw_syscalls hook.

Run as root after scripts/setup:  scripts/bench --scenarios syscall-tax [--reps 4]

buildidd sees mmap, mprotect and pkey_mprotect (native and i386) at one raw
``sys_exit`` tracepoint program (bpf/buildidd.bpf.c on_sys_exit): kprobes and
fentry cannot attach on this kernel, and no other tracepoint sees an
in-place mprotect or a compat syscall.  A program attached there runs at the
exit of every syscall of every task, and attaching any raw_syscalls program
puts every task on the syscall slow path (SYSCALL_WORK_SYSCALL_TRACEPOINT).
``perf record --buildid-mmap`` pays nothing per syscall: its work is inside
perf_event_mmap(), on mappings only.

Measured here, by the workload's task-clock (``perf stat``), interleaved, median
of --reps:

- a loop of getppid(2) (5 M calls): ns per syscall with nothing attached,
  with perf, with a BPF program that returns at once on raw sys_exit (the
  floor: slow path plus program dispatch), with one that also reads
  orig_ax as on_sys_exit does, and with buildidd;
- the mmap storm of scripts/workloads (an mmap and a munmap per mapping): ns
  per mapping over nothing, for perf and buildidd, and the part of
  buildidd's excess over perf that the two syscalls' tax explains.

An empty program is also attached to syscalls:sys_exit_mmap (a classic
syscall tracepoint: the same slow path, but the kernel tests the syscall's
number against a bitmap before it runs anything, where a raw_syscalls
program runs at every syscall): the difference splits the floor into the
slow path, which every syscall hook pays, and the raw program's dispatch.
The empty program is also attached to maple_tree:ma_write, the one hook that
fires only when a VMA tree changes (the alternative to a per-syscall hook
for mmap; it runs about 3 times per mapping in this storm, sys_exit twice):
its cost per syscall and per mapping is printed beside, and that of the pair a
capture without syscall hooks would need: ma_write for the new VMA and
mmap_lock:mmap_lock_released to learn that its syscall is over (the address
mmap returns is not known before).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

from benchlib import Buildidd, build, remove_tree  # noqa: E402
from perfcompare import PerfRecorder, require_quiet_host  # noqa: E402
from buildidd.kernel.attach import ensure_tracefs  # noqa: E402

#: The BPF programs of the comparison (BCC C): -DTAX_SYSCALL_TP an empty program on the classic
#: syscalls:sys_exit_mmap tracepoint (BCC attaches it when it loads); -DTAX_ORIG_AX on_exit reading
#: pt_regs->orig_ax (-DORIG_AX=offset from BTF); neither: an empty on_exit, attached to raw tracepoints.
TAX_PROGS = HERE / "workloads" / "syscall_tax.bpf.c"


#: The conditions that attach the empty on_exit (the orig_ax one for "orig_ax prog") to raw tracepoints.
#: "empty lock+ma_write" is the pair a capture without syscall hooks would need (ma_write for
#: the new VMA, mmap_lock_released to learn that its syscall is over).
RAW_TP = {"empty prog": ("sys_exit",), "orig_ax prog": ("sys_exit",), "empty ma_write": ("ma_write",),
          "empty lock+ma_write": ("mmap_lock_released", "ma_write")}


def task_clock_ms(argv: list[str]) -> float:
    """The task-clock (ms) of argv run to completion, from `perf stat -x,`."""
    r = subprocess.run(["perf", "stat", "-x,", "-e", "task-clock", "--", *argv],
                       capture_output=True, text=True, check=True)
    return float(r.stderr.strip().splitlines()[-1].split(",")[0])


class Condition:
    """One condition of the comparison, as a context manager: nothing, perf, a BPF program, buildidd."""

    def __init__(self, kind: str, workdir: Path, cflags: list[str]):
        self.kind, self.workdir, self.cflags = kind, workdir, cflags

    def __enter__(self):
        if self.kind == "perf":
            self.h = PerfRecorder(self.workdir / "perf.data")
        elif self.kind == "buildidd":
            self.h = Buildidd(self.workdir)
            time.sleep(0.3)
        elif self.kind == "empty sys_exit_mmap":
            from bcc import BPF
            ensure_tracefs()
            self.h = BPF(src_file=str(TAX_PROGS), cflags=["-DTAX_SYSCALL_TP"])
        elif self.kind in RAW_TP:
            from bcc import BPF
            extra = ["-DTAX_ORIG_AX"] if self.kind == "orig_ax prog" else []
            self.h = BPF(src_file=str(TAX_PROGS), cflags=[*self.cflags, *extra])
            for tp in RAW_TP[self.kind]:
                self.h.attach_raw_tracepoint(tp=tp, fn_name="on_exit")
        return self

    def __exit__(self, *exc):
        if self.kind == "perf":
            self.h.finish()
        elif self.kind == "buildidd":
            self.h.stop()
            self.h.cleanup()
        elif self.kind != "nothing":
            self.h.cleanup()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--syscalls", type=int, default=5_000_000)
    ap.add_argument("--mappings", type=int, default=200_000)
    ap.add_argument("--smoke", action="store_true", help="one repetition of short loops")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    if args.smoke:
        args.reps, args.syscalls, args.mappings = 1, 200_000, 5_000
    if os.geteuid() != 0:
        print("bench_syscall_tax: must run as root", file=sys.stderr)
        return 2
    if not args.smoke:          # a smoke run asserts no figure: it may run beside other work
        require_quiet_host("bench_syscall_tax")
    from buildidd.kernel.btf import Btf
    orig_ax = Btf.load().offsetof("pt_regs", "orig_ax")
    work = Path(tempfile.mkdtemp(prefix="buildidd-tax-"))
    try:
        w = build.build(work / "bin", n_libs=1)
        sysloop = w["sysloop"]
        storm = [str(w["mmap_storm"]), str(w["lib0"]), str(args.mappings)]
        kinds = ["nothing", "perf", "empty prog", "orig_ax prog", "empty sys_exit_mmap", "empty ma_write",
                 "empty lock+ma_write", "buildidd"]
        loop: dict[str, list[float]] = {k: [] for k in kinds}
        maps: dict[str, list[float]] = {k: [] for k in ("nothing", "perf", "empty prog", "empty ma_write",
                                                         "empty lock+ma_write", "buildidd")}
        for _ in range(args.reps):
            for kind in kinds:
                with Condition(kind, work, [f"-DORIG_AX={orig_ax}"]):
                    loop[kind].append(task_clock_ms([str(sysloop), str(args.syscalls)]))
                    if kind in maps:
                        maps[kind].append(task_clock_ms(storm))
        ns_call = {k: statistics.median(v) * 1e6 / args.syscalls for k, v in loop.items()}
        print(f"getppid loop, {args.syscalls} calls, task-clock median of {args.reps}:")
        for k in kinds:
            print(f"    {k:<19} {ns_call[k]:6.1f} ns/syscall  (+{ns_call[k] - ns_call['nothing']:5.1f} over nothing)")
        ns_map = {k: statistics.median(v) * 1e6 / args.mappings for k, v in maps.items()}
        over = {k: ns_map[k] - ns_map["nothing"] for k in ("perf", "buildidd")}
        tax = 2 * (ns_call["buildidd"] - ns_call["nothing"])
        print(f"mmap storm, {args.mappings} mappings (mmap + munmap each), task-clock median of {args.reps}:")
        print(f"    ns/mapping over nothing: perf {over['perf']:.0f}, buildidd {over['buildidd']:.0f} "
              f"(ratio of totals {ns_map['buildidd'] / ns_map['perf']:.3f})")
        print(f"    buildidd's excess over perf {over['buildidd'] - over['perf']:.0f} ns/mapping, of which "
              f"the two syscalls' tax {tax:.0f} ns")
        print(f"    an empty program on raw sys_exit {ns_map['empty prog'] - ns_map['nothing']:.0f} ns/mapping, "
              f"on maple_tree:ma_write {ns_map['empty ma_write'] - ns_map['nothing']:.0f}, "
              f"on mmap_lock_released and ma_write {ns_map['empty lock+ma_write'] - ns_map['nothing']:.0f}")
        if args.json:
            args.json.write_text(json.dumps({"ns_per_syscall": ns_call, "ns_per_mapping": ns_map}, indent=2))
    finally:
        remove_tree(work)
    return 0

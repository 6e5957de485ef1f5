"""Memory and load time of buildidd's BPF program: loaded through kernel.loader (BCC in a
child) against BCC in the recording process (kernel.tracer.Tracer, as today).

Run as root after scripts/setup:  .venv/bin/python scripts/bench_loader.py [--reps 5]

Each measurement is a fresh interpreter that imports buildidd, loads
bpf/buildidd.bpf.c with the cflags Tracer builds (BTF layout, ring pages, ...),
attaches every program, then reports RSS and USS (psutil memory_full_info) and
whether libLLVM/libclang/libbcc are mapped.  Modes alternate within each
repetition.  ``baseline`` loads nothing (the interpreter and buildidd's imports).
Load time counts what Tracer() counts: BTF parse, layout, compile, load, attach.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

#: Runs in a fresh interpreter: argv[1] is the mode, argv[2] the bytes of each ring.
MEASURE = r"""
import json, os, sys, time
import psutil
mode, ring_bytes = sys.argv[1], int(sys.argv[2])
from buildidd.kernel import tracer
from buildidd.kernel.btf import Btf
from buildidd.kernel.loader import load
out = {"mode": mode}
t0 = time.monotonic()
if mode == "bcc":
    t = tracer.Tracer(ring_bytes=ring_bytes)
    out["compile_s"], out["attach_s"] = t.compile_s, t.attach_s
elif mode == "loader":
    btf = Btf.load()
    spec = tracer.load_spec(tracer.kernel_layout(btf), ring_bytes,
                            max(1, min(tracer.MAX_RINGS, os.cpu_count() or 1)), tracer.kld_support(btf))
    t = load(spec)
    out["compile_s"], out["attach_s"], out["child_s"] = t.compile_s, t.attach_s, t.load_s
    out["maps"], out["links"] = len(t.maps), len(t.links)
out["load_s"] = time.monotonic() - t0
m = psutil.Process().memory_full_info()
out["rss_mib"], out["uss_mib"] = m.rss / 2**20, m.uss / 2**20
out["compiler_mapped"] = sorted({l.split()[-1].rsplit("/", 1)[-1] for l in open("/proc/self/maps")
                                 if any(s in l for s in ("libLLVM", "libclang", "libbcc"))})
out["bcc_imported"] = "bcc" in sys.modules
print(json.dumps(out))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ring-bytes", type=int, default=2 << 20, help="bytes of each ring (one per CPU)")
    ap.add_argument("--json", help="write the runs here")
    args = ap.parse_args(argv)
    modes = ("baseline", "loader", "bcc")
    runs = []
    for _ in range(args.reps):
        for mode in modes:
            r = subprocess.run([sys.executable, "-c", MEASURE, mode, str(args.ring_bytes)],
                               capture_output=True, text=True, timeout=300)
            if r.returncode:
                raise SystemExit(f"{mode} failed:\n{r.stderr}")
            row = json.loads(r.stdout.splitlines()[-1])
            print(json.dumps(row), flush=True)
            runs.append(row)
    print(f"\nmedians of {args.reps} runs (MiB, s)")
    print(f"{'mode':<9} {'RSS':>7} {'USS':>7} {'load':>6} {'compile':>8}  compiler mapped")
    for mode in modes:
        sel = [r for r in runs if r["mode"] == mode]
        med = {k: statistics.median(r.get(k, 0.0) for r in sel) for k in ("rss_mib", "uss_mib", "load_s", "compile_s")}
        print(f"{mode:<9} {med['rss_mib']:>7.1f} {med['uss_mib']:>7.1f} {med['load_s']:>6.2f} "
              f"{med['compile_s']:>8.2f}  {sel[-1]['compiler_mapped'] or '-'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

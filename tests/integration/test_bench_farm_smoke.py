"""scripts/bench --smoke --scenarios farm: the build farm runs, every program is stored and named (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_farm_smoke(bpf, tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--smoke", "--scenarios", "farm",
                        "--farm-n", "40", "--farm-rename-every", "4", "--json", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    farm = json.loads(out.read_text())["farm"]
    assert farm["programs"] == 40
    modes = farm["modes"]
    assert set(modes) == {"perf", "warm", "cold"}, modes
    for name in ("warm", "cold"):
        m = modes[name]
        assert m["held_min"] == 40 and m["named_min"] == 40 and m["lost"] == 0, (name, m)
        assert m["cpu_us_per_program"] > 0 and m["threads_us_per_program"], (name, m)
    # perf's MMAP2 records carry the build-id of every program it saw exec'd (the pages were just written)
    assert modes["perf"]["named_min"] == 40 and modes["perf"]["cpu_us_per_program"] > 0, modes["perf"]
    assert "build farm, 40 new programs" in r.stdout and "goal: cold store" in r.stdout, r.stdout[-2000:]

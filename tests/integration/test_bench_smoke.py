"""scripts/bench --smoke: the benchmark still runs, completely and without losses (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_smoke(bpf, tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--smoke", "--json", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads(out.read_text())
    names = [s["scenario"] for s in data["scenarios"]]
    assert len(names) == 5 and any("exec storm" in n for n in names)
    assert any("cold store" in n for n in names), names
    for s in data["scenarios"]:
        assert s["losses"] == 0, s
        c = s["completeness"]
        assert c["wrong"] == 0 and c["match_rate"] == 1.0 and c["perf_with_build_id"] > 0, s
        assert s["ready_s"]["buildidd"] is not None
    assert data["ramp"] and all(row["losses"] == 0 for row in data["ramp"])
    assert data["profile"], "no profile summary"
    idle = data["idle"]
    assert set(idle) == {"buildidd", "perf"} and all(v["cpu_ms_per_s"] >= 0 for v in idle.values()), idle

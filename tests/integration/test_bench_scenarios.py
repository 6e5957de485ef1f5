"""scripts/bench --smoke, one case per module of the bench's tables: every scenario and micro-benchmark
still runs and prints its figures, perf's beside them where it compares with perf (no timing asserted).

SMOKE names, per module, the command's extra options, the lines its output must hold, and a check of
its JSON figures.  A scenario added to scripts/bench.py without a case here fails
test_every_scenario_has_a_smoke_case.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import bench  # noqa: E402


def _storms(r: dict) -> None:
    """Losses and completeness are judged only when no other tracer ran beside the smoke (``beside``: a bench
    beside the suite fills every tracer's rings and takes the CPUs); a wrong build-id never passes."""
    names = [s["scenario"] for s in r["scenarios"]]
    assert len(names) == 5 and any("cold store" in n for n in names), names
    quiet = not r["beside"]
    if not quiet:
        print(f"\nlosses, completeness and the farm's counts not judged: other tracers ran beside: {r['beside']}")
    for s in r["scenarios"]:
        c = s["completeness"]
        assert c["wrong"] == 0 and c["perf_with_build_id"] > 0, s
        assert not quiet or (s["losses"] == 0 and c["match_rate"] == 1.0), s
        assert s["ready_s"]["buildidd"] is not None and s["ready_s"]["perf"] is not None, s
    assert r["ramp"] and all(row["perf_cpu_us_per_event"] >= 0 for row in r["ramp"])
    assert not quiet or all(row["losses"] == 0 for row in r["ramp"]), r["ramp"]
    assert r["profile"], "no profile summary"
    assert set(r["idle"]) == {"buildidd", "perf"} and all(v["cpu_ms_per_s"] >= 0 for v in r["idle"].values())
    farm = r["farm"]
    assert set(farm["modes"]) == {"perf", "warm", "cold"}, farm["modes"]
    for name in ("warm", "cold"):
        m = farm["modes"][name]
        assert not quiet or (m["held_min"] == farm["programs"] and m["named_min"] == farm["programs"]
                             and m["lost"] == 0), m
    # perf's MMAP2 records carry the build-id of every program it saw exec'd (the pages were just written)
    assert not quiet or farm["modes"]["perf"]["named_min"] == farm["programs"], farm["modes"]["perf"]
    return True


def _fleet_goals(r: dict) -> bool:
    """Issue 44's goals at the smoke's size (three hosts, a 5 MiB program, a 3 s outage, a host gone)."""
    lat, out, gone, dd = r["latency"], r["outage"], r["gone"], r["dedup"]
    assert lat["in_bucket"] == lat["programs"] == 3 and lat["p99_s"] <= 10.0, lat
    assert not out["programs_missing"] and not out["segments_lost"], out
    assert out["drain_s"] is not None and out["drain_s"] <= 60, out
    assert gone["fetched"] == gone["wanted"] and not gone["not_fetched"], gone
    assert gone["gdb_ok"] and gone["pull_rc"] == 0 and gone["resolve_ok"], gone
    assert dd["steady"]["wire_bytes"] / dd["steady"]["unique_bytes"] <= 1.05, dd
    return True


#: module -> (extra options, lines the output holds, check of its JSON figures)
SMOKE = {
    "bench_storms": (["--farm-n", "20", "--farm-rename-every", "4"],
                     ["buildidd against perf in the same repetition", "| perf: achieved", "idle host",
                      "build farm, 20 new programs", "goal: cold store"], _storms),
    "bench_first_storm": ([], ["  perf  ", "  buildidd  ", "buildidd, no store"],
                          lambda r: set(r["storm_s"]) == {"perf", "buildidd", "buildidd, no store"}),
    "bench_rings": ([], ["ring KiB/CPU", "smallest size with 0 lost"],
                    lambda r: r[0]["made"] > 0 and r[0]["recorded"] + r[0]["lost"] > 0),
    "bench_syscall_tax": ([], ["ns/syscall", "perf ", "ns/mapping over nothing: perf"],
                          lambda r: {"nothing", "perf", "buildidd"} <= set(r["ns_per_syscall"])),
    "bench_kernel_ns": ([], ["host-wide kernel ns/event", "workload CPU ns/event over nothing: perf"],
                        lambda r: set(r["scenarios"]) == {"exec", "dlopen", "mmap"}
                        and all(s["kernel_ns_per_event"] > 0 for s in r["scenarios"].values())),
    "soak": ([], ["RSS MiB", "RSS after the first"], lambda r: len(r) >= 2 and r[-1]["events"] > 0),
    "bench_upgrade_race": ([], ["perf record --buildid-all", "buildidd, warm store", "buildidd, fresh store"],
                           lambda r: [x["mode"] for x in r][-1] == "perf record --buildid-all"
                           and all(x.get("unnamed", 0) == 0 for x in r)),
    "bench_footprint": ([], ["READY by kind of start", "| perf"],
                        lambda r: r["ready_by_start"]["perf"] > 0 and r["rss_vs_dsos"] and r["cpu_vs_rate"]),
    "bench_inject": ([], ["perf inject --buildid-all", "buildidd inject"],
                     lambda r: r["records"] > 0 and r["perf"]["exit"] == 0),
    "bench_handoff": ([], ["miss (new identity", "hit (fast path)"],
                      lambda r: r["hit_us_per_event"] > 0 and r["miss_us_per_event"] > 0),
    "bench_segment_format": ([], ["raw / json"], lambda r: r["json"]["bytes"] > r["raw"]["zstd_bytes"] > 0),
    "bench_htlhash": ([], ["htlhash (added)"], lambda r: all(v["mean_us"] > 0 for v in r.values())),
    "bench_pagecache": ([], ["build-id read: median", "verifier:"], lambda r: r["verified_insns"] > 0),
    "bench_fleet": ([], ["exec → bucket: 3/3 programs", "host gone:", "uploaded / unique:", "  outage "],
                    lambda r: _fleet_goals(r)),
}


def _names(module: str) -> tuple[str, str]:
    """(--scenarios or --micro, the names of module's entries in that table)."""
    for flag, table in (("--scenarios", bench.SCENARIOS), ("--micro", bench.MICRO)):
        names = [n for n, (m, _) in table.items() if m == module]
        if names:
            return flag, ",".join(names)
    raise AssertionError(f"{module} is in no table of scripts/bench.py")


def test_every_scenario_has_a_smoke_case():
    modules = {m for table in (bench.SCENARIOS, bench.MICRO) for m, _ in table.values()}
    assert modules == set(SMOKE), (modules ^ set(SMOKE))


def test_unknown_names_are_refused():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--scenarios", "exec,nosuch"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "unknown nosuch" in r.stderr, r.stderr


@pytest.mark.parametrize("module", list(SMOKE))
def test_smoke(bpf, tmp_path, module):
    extra, lines, check = SMOKE[module]
    flag, names = _names(module)
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), flag, names, "--smoke",
                        "--json", str(out), *extra], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for line in lines:
        assert line in r.stdout, (line, r.stdout[-3000:])
    figures = json.loads(out.read_text())["results"][module]
    assert check(figures), figures

"""A user's flood of fresh build-ids from a deep path costs that user's own ledger entries, no one else's.

A real recorder with a store records while a real unprivileged user (conftest
``attacker``) maps thousands of fresh ELF files, each with its own build-id,
PROT_EXEC, from a directory ~3,760 characters deep, unlinking each.  Copies
run at 64 KiB/s with no stop budget, so root's start-up mappings end as gaps
too.  The end record stays within 64 KiB and is read back by ``buildidd show
--type end``; it names root's gaps first and counts the user's flood as its
own (untracked by uid); the gap file beside the segments is read by ``buildidd
show --type gap`` and ``buildidd sessions``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from buildidd.capture.report import END_RECORD_MAX_BYTES

from conftest import as_user_popen, gcc, readelf_build_id, session_records

FLOOD_FILES = 3000

#: Run as the user: copy the template with a fresh build-id into DIR, map it PROT_EXEC, unlink it.
FLOOD = r"""
import mmap, os, sys
tpl, off, n, top = open(sys.argv[1], "rb").read(), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
d = os.path.join(top, *["d" * 250] * 15)
os.makedirs(d)
for i in range(n):
    p = f"{d}/f{i}.so"
    fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, tpl[:off] + os.urandom(20) + tpl[off + 20:])
    m = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_EXEC)
    os.close(fd)
    os.unlink(p)
    m.close()
print(len(d))
"""


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "buildidd.cli", *args], capture_output=True, text=True)


def test_a_deep_path_flood_leaves_a_small_readable_end_record_and_a_gap_file(recorder, attacker,
                                                                             public_tmp_factory, tmp_path):
    uid = attacker[0]
    work = public_tmp_factory()
    lib = gcc("int f(void) { return 42; }\n", work / "lib.so", "-shared", "-fPIC", "-Wl,--build-id=sha1")
    tpl = lib.read_bytes()
    off = tpl.find(bytes.fromhex(readelf_build_id(lib)))
    assert off > 0
    flood_dir = work / "flood"
    flood_dir.mkdir()
    os.chown(flood_dir, uid, attacker[1])
    budget = 1 << 20
    rec = recorder(store_root=str(tmp_path / "store"), snapshot_rate_bytes_per_s=65536, snapshot_stop_budget_s=0,
                   coverage_max_bytes=budget, coverage_uid_share=0.25,
                   uid_record_rate_bytes_per_s=0)     # every record reaches the ledger: its bound is tested
    proc = as_user_popen(attacker, [sys.executable, "-c", FLOOD, str(lib), str(off), str(FLOOD_FILES),
                                    str(flood_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        rec.step()
        time.sleep(0.005)
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert int(out) >= 3750
    for _ in range(20):
        rec.step()
        time.sleep(0.02)
    session = rec.session_dir
    rec.close()

    shown = _cli("show", str(session), "--type", "end", "--json")
    assert shown.returncode == 0 and "torn" not in shown.stderr, shown.stderr
    (line,) = shown.stdout.splitlines()
    end = json.loads(line)
    cov = end["store_coverage"]
    mine = cov["by_uid"][str(uid)]
    print(f"\nend record {len(line.encode())} bytes; ledger {cov['ledger']['bytes']} of {budget} bytes; "
          f"user: {mine}; root: {cov['by_uid'].get('0')}; {cov['gaps_total']} gaps, "
          f"{cov['missing_listed']} listed inline; gap file {cov['gaps_file']}")
    assert len(line.encode()) <= END_RECORD_MAX_BYTES
    assert end == [r for r in session_records(session) if r["type"] == "end"][0]
    assert cov["ledger"]["bytes"] <= budget
    assert mine["named"] + mine["untracked"] >= FLOOD_FILES // 2      # the flood was seen, and charged to the user
    assert mine["untracked"] > 0
    top = {u["uid"]: u for u in cov["ledger"]["top_uids"]}
    assert top[uid]["bytes"] <= cov["ledger"]["uid_share_bytes"]
    root_gaps = sum(cov["by_uid"]["0"]["gaps"].values())
    assert root_gaps > 0 and cov["by_uid"]["0"]["untracked"] == 0
    uids = [m["uid"] for m in cov["missing"]]
    assert uids[0] == 0 and uids[:root_gaps] == [0] * min(root_gaps, len(uids))   # root's named first

    gaps = _cli("show", str(session), "--type", "gap", "--json")
    assert gaps.returncode == 0, gaps.stderr
    records = [json.loads(x) for x in gaps.stdout.splitlines()]
    assert len(records) == cov["gaps_file"]["gaps"] and cov["gaps_file"]["name"] == "gaps.jsonl.zst"
    assert (session / "gaps.jsonl.zst").is_file()
    assert sum(1 for r in records if r["uid"] == 0) == root_gaps              # every one of root's, named
    assert sum(1 for r in records if r["uid"] == uid) == sum(mine["gaps"].values())
    assert records[:len(cov["missing"])] == [{"type": "gap", **m} for m in cov["missing"]]
    text = _cli("show", str(session), "--type", "gap")
    assert text.returncode == 0 and len(text.stdout.splitlines()) == len(records)
    listing = _cli("sessions", "--json", "--session-root", str(Path(session).parent), "--store-root", "")
    assert listing.returncode == 0, listing.stderr
    (row,) = [json.loads(x) for x in listing.stdout.splitlines()]
    assert row["gaps"] == cov["gaps_total"] and row["gaps_in_file"] == len(records)

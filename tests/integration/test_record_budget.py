"""The per-user record budget (kernel/budget.py, bpf/buildidd.bpf.c over_budget): a real unprivileged
user's flood of mappings costs that user's own records, each one recorded or counted in a
``throttled`` record of its uid, while root's mappings, made at the same time, are all recorded."""

from __future__ import annotations

import shutil
import subprocess
import time

from conftest import as_user_popen, session_records
from perfcompare import TracerWatch

N = 4000


def _public_copy(src, make_dir, mode=0o755):
    d = make_dir("buildidd-budget-")
    dst = d / src.name
    shutil.copy(src, dst)
    dst.chmod(mode)
    return dst


def test_one_users_flood_is_held_back_and_counted_roots_is_not(recorder, attacker, workloads,
                                                               public_tmp_factory):
    storm = _public_copy(workloads["mmap_storm"], public_tmp_factory)
    lib = _public_copy(workloads["lib0"], public_tmp_factory, 0o644)
    # 64 KiB at once, 64 KiB/s after: a few hundred of the user's records, of thousands it makes.
    rec = recorder(uid_record_rate_bytes_per_s=64 << 10, uid_record_burst_bytes=64 << 10)
    # Nothing lost to a full ring is a quiet host's promise: another tracer's storms beside this one fill
    # every tracer's rings (its records go to each); then each mapping missed must be a counted loss.
    with TracerWatch() as watch:
        theirs = as_user_popen(attacker, [str(storm), str(lib), str(N)], stdout=subprocess.DEVNULL)
        mine = subprocess.Popen([str(storm), str(lib), str(N)], stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while (theirs.poll() is None or mine.poll() is None) and time.monotonic() < deadline:
            rec.step()
            time.sleep(0.01)
        assert theirs.wait(5) == 0 and mine.wait(5) == 0
    time.sleep(1.1)         # the next report of what budgets held back
    rec.step()
    rec.close()
    recs = session_records(rec.session_dir)
    ino = lib.stat().st_ino

    def maps_of(pid):
        return sum(1 for r in recs if r["type"] == "mmap" and r["pid"] == pid and r["ino"] == ino)

    uid = attacker[0]
    end = recs[-1]
    assert end["type"] == "end"
    quiet = not watch.seen
    lost = sum(end["lost"].values())
    assert set(end["lost"]) <= {"ringbuf_full"}, end["lost"]
    if quiet:
        assert lost == 0, end["lost"]                     # nothing lost to a full ring
    else:
        print(f"\nother tracers beside: {sorted(watch.seen)}; lost to full rings: {lost}")
    throttled = [r for r in recs if r["type"] == "throttled"]
    assert throttled and {r["uid"] for r in throttled} == {uid}, throttled
    held = sum(r["records"] for r in throttled)
    assert maps_of(mine.pid) + lost >= N and maps_of(mine.pid) <= N  # root: every mapping (or counted lost)
    theirs_recorded = maps_of(theirs.pid)
    assert theirs_recorded < N / 2                        # the user's flood: held back ...
    # ... and every mapping of theirs is either recorded or counted (their other records count too).
    user_recs = sum(1 for r in recs if r.get("uid") == uid and r["type"] in ("mmap", "exec"))
    print(f"user: {theirs_recorded} of {N} recorded, {held} held back; root: {maps_of(mine.pid)}")
    assert theirs_recorded + held + lost >= N
    assert user_recs + held + lost >= N
    assert end["throttled"]["by_uid"][str(uid)]["records"] == held

"""A user's flood of failing execs costs that user's exec pins only.

A real unprivileged user (conftest ``attacker``) loops ``execve(path,
(char **)1, NULL)`` over the root-owned executables under /usr
(scripts/workloads/failexec_flood.c): each call fails with EFAULT after the kernel
opened the file, so each costs a FAN_OPEN_EXEC event and a pin, with no
process made.  Meanwhile root, a second user (``bystander``) and the attacker
itself each run 20 fresh programs once and rename a new build over each the
moment it exits.  Pins are charged to the uid that exec'd (not the files'
owner, root), capped per uid, and a pin no exec record confirms is closed
once the recording thread has read past it: root's and the bystander's
programs are all stored, no pin of a failing exec outlives the recording
thread's pass, and a program of the attacker's own that was lost is named
``uid_pin_cap``.
"""

from __future__ import annotations

import os
import stat
import subprocess
import time
from pathlib import Path

from buildidd.control.client import ControlClient
from buildidd.store import Store
from buildidd.store.coverage import GAP_REASONS

from conftest import as_user_popen
from integration.test_keep_binaries import daemon  # noqa: F401  (the fixture)

from workloads.build import build_floods
from workloads.upgrade import build_race, race_script

#: The flood ends on a count, not a clock: it makes at least this many calls, and lasts while the
#: three users' programs run (test_hostile_battery.py runs it beside a bystander too).
FLOOD_CALLS = 20_000
FLOOD_MAX_S = 300      # bounds a hang only
PROGRAMS = 20


def _root_executables(limit: int = 2000) -> list[str]:
    """Regular files under /usr owned by root that anyone may execute (the flood's targets)."""
    out = []
    for top in ("/usr/bin", "/usr/sbin", "/usr/lib", "/usr/libexec"):
        for dirpath, _dirs, files in os.walk(top):
            for name in files:
                path = os.path.join(dirpath, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode) and st.st_uid == 0 and st.st_mode & 0o001:
                    out.append(path)
                    if len(out) >= limit:
                        return out
    return out


def _cpu_s(pid: int) -> float:
    """utime + stime of pid, all its threads (proc_pid_stat(5) fields 14 and 15), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _race_dir(public_tmp_factory, owner: tuple[int, int] | None) -> tuple[Path, list[str]]:
    """A 0755 directory of PROGRAMS fresh programs and their replacements (owner's, or root's)."""
    work = public_tmp_factory()
    bids = build_race(work, programs=PROGRAMS, libs=0)["exec"]
    if owner is not None:
        for p in [work, *work.rglob("*")]:
            os.chown(p, *owner)
    return work, bids


def _pins(sock: str) -> dict:
    with ControlClient(sock) as c:
        return c.request("status")["exec_pins"]


def test_a_failing_exec_flood_costs_only_the_flooding_users_pins(daemon, attacker, bystander,  # noqa: F811
                                                                 public_tmp_factory, tmp_path):
    targets = public_tmp_factory()
    tools = build_floods(targets)
    races = {"root": _race_dir(public_tmp_factory, None),
             "bystander": _race_dir(public_tmp_factory, bystander[:2]),
             "attacker": _race_dir(public_tmp_factory, attacker[:2])}
    store_root = tmp_path / "store"
    sock = str(tmp_path / "control.sock")
    d = daemon(store_root, socket=sock)

    flood = as_user_popen(attacker, [str(tools["failexec_flood"]), str(FLOOD_MAX_S), str(FLOOD_CALLS),
                                     *_root_executables()], stdout=subprocess.PIPE, text=True)
    assert flood.stdout.readline() == "ready\n"        # the flood at full rate first
    cpu0, t0 = _cpu_s(d.proc.pid), time.monotonic()
    runs = [subprocess.Popen(["sh", "-c", race_script(races["root"][0], PROGRAMS, 0, 0)]),
            as_user_popen(bystander, ["sh", "-c", race_script(races["bystander"][0], PROGRAMS, 0, 0)]),
            as_user_popen(attacker, ["sh", "-c", race_script(races["attacker"][0], PROGRAMS, 0, 0)])]
    assert [r.wait(timeout=120) for r in runs] == [0, 0, 0]
    during = _pins(sock)
    flood.terminate()                                   # it stops once it made its count
    calls, _other = map(int, flood.communicate(timeout=FLOOD_MAX_S + 60)[0].split())
    assert flood.returncode == 0 and calls >= FLOOD_CALLS
    cpu_s, wall_s = _cpu_s(d.proc.pid) - cpu0, time.monotonic() - t0
    print(f"\nflood: {calls} failing execs; daemon CPU {cpu_s:.1f} s over "
          f"{wall_s:.1f} s ({100 * cpu_s / wall_s:.0f}% of one CPU)")
    # The reader works through the queue's backlog (up to 16,384 events), then the recording
    # thread's pass plus pin_confirm_s closes what no exec record confirmed.
    deadline = time.monotonic() + 30.0
    while (after := _pins(sock))["by_uid"][str(attacker[0])]["unconfirmed"] and time.monotonic() < deadline:
        time.sleep(0.2)
    print(f"the flood's pins all closed {time.monotonic() - t0 - wall_s:.1f} s after it ended")
    records = d.stop()

    user, other = str(attacker[0]), str(bystander[0])
    print("pins during:", {k: during[k] for k in ("events", "pinned", "exec_failed", "uid_cap", "file_cap",
                                                  "overflow", "held")}, during["by_uid"])
    assert calls > 10_000
    # The flood was charged to the user who exec'd, and closed that user's pins only.
    assert during["by_uid"][user]["uid_cap"] + during["by_uid"][user]["exec_failed"] > 1000, during
    assert during["by_uid"][user]["held"] <= during["uid_max"]
    assert during["file_cap"] == 0 and during["overflow"] == 0, during
    for uid in ("0", other):
        assert during["by_uid"].get(uid, {}).get("uid_cap", 0) == 0, during["by_uid"]
    # No pin of a failing exec outlives the recording thread's pass.
    assert after["by_uid"][user]["unconfirmed"] == 0, after["by_uid"]
    assert after["by_uid"][user]["exec_failed"] >= 1      # the flood outruns confirm_s: most go at its cap

    store = Store(store_root)
    for who in ("root", "bystander"):
        missing = [b for b in races[who][1] if not store.contains(b)]
        assert not missing, f"{who}: {len(missing)} of {PROGRAMS} programs renamed over at exit not stored"
    cov = records[-1]["store_coverage"]
    listed = {m["build_id"]: m["reason"] for m in cov["missing"]}
    assert set(listed.values()) <= set(GAP_REASONS), listed
    lost = {b: listed.get(b) for b in races["attacker"][1] if not store.contains(b)}
    assert set(lost.values()) <= {"uid_pin_cap"}, lost      # the user's own, named for its cause
    print(f"the attacker's own programs: {PROGRAMS - len(lost)} of {PROGRAMS} stored, lost: {set(lost.values())}")

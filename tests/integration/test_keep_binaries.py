"""Every binary a session names is kept, or named with the reason it is not.

A real ``buildidd run`` records while a real unprivileged user (conftest
``attacker``) runs programs and renames new builds over them the moment they
exit, and dlopens libraries from processes that live 10 ms before the
libraries are replaced: the store holds every one of them (exec pins, and
the forced wake-up of a first-met file's record).  The user's files keep the
store's trust and privacy rules.  A SIGTERM with copies queued names what it
abandons in the end record, so that no gap goes uncounted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from buildidd.sessionlog import read_gaps
from buildidd.store import Store
from buildidd.store.coverage import GAP_REASONS

from conftest import as_user, readelf_build_id, session_records
from perfcompare import TracerWatch

from workloads.upgrade import build_race, link_variant, objects, race_script


class Daemon:
    """``buildidd run`` as a subprocess with its own session root and store; a control socket only when
    socket names one."""

    def __init__(self, tmp: Path, store: Path, *extra_config: str, socket: str = ""):
        self.sessions = tmp / f"sessions-{time.monotonic_ns()}"
        cfg = tmp / f"buildidd-{time.monotonic_ns()}.toml"
        cfg.write_text("\n".join(extra_config) + "\n")
        self.log = tmp / f"{self.sessions.name}.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "buildidd.cli", "run", "--config", str(cfg),
                                          "--session-root", str(self.sessions), "--store-root", str(store),
                                          "--control-socket", socket], stderr=log)
        deadline = time.monotonic() + 60
        while "recording into" not in self.log.read_text():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.05)

    def stop(self) -> list[dict]:
        """SIGTERM; the session's records."""
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=90) == 0, self.log.read_text()
        (sdir,) = list(self.sessions.iterdir())
        self.session_dir = sdir
        return session_records(sdir)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def daemon(bpf, tmp_path):
    made = []

    def make(store: Path, *extra_config: str, socket: str = "") -> Daemon:
        d = Daemon(tmp_path, store, *extra_config, socket=socket)
        made.append(d)
        return d

    yield make
    for d in made:
        d.kill()


def _coverage_names_every_gap(records: list[dict], store: Store, session_dir: Path) -> dict:
    """The end record's store_coverage, checked: every build-id of the session's mapping
    records is held by the store or listed in the session's gap file with a known reason (the
    end record lists the first of them); the counts add up."""
    end = records[-1]
    assert end["type"] == "end"
    cov = end["store_coverage"]
    assert cov["named"] == cov["held"] + sum(cov["gaps"].values())
    gaps = list(read_gaps(session_dir))
    listed = {m["build_id"]: m["reason"] for m in gaps}
    assert len(listed) == sum(cov["gaps"].values())
    assert gaps[:len(cov["missing"])] == [{"type": "gap", **m} for m in cov["missing"]]
    assert set(listed.values()) <= set(GAP_REASONS), listed
    named = {r["build_id"] for r in records if r["type"] == "mmap" and r.get("build_id")}
    unnamed = {b for b in named if not store.contains(b) and b not in listed}
    assert not unnamed, f"gaps without a reason: {sorted(unnamed)[:5]}"
    return cov


def test_programs_renamed_over_at_exit_and_short_lived_dlopens_are_all_kept(daemon, attacker, public_tmp_factory,
                                                                          tmp_path):
    uid, gid, _ = attacker
    work = public_tmp_factory()
    race = build_race(work, programs=40, libs=10)
    prog_o, _ = objects(tmp_path / "obj")
    # The user's own private program (in a 0700 directory) and one that claims the build-id of a
    # trusted system library the warm store holds (libc, which every running process maps).
    private = work / "private"
    private.mkdir(mode=0o700)
    priv_bid = link_variant(prog_o, private / "prog")
    libc = next(Path(line.split()[-1]) for line in open("/proc/self/maps") if "/libc.so" in line)
    libc_bid = readelf_build_id(libc)
    link_variant(prog_o, work / "forged", build_id_hex=libc_bid)
    for p in [work, *work.rglob("*")]:
        os.chown(p, uid, gid)

    store_root = tmp_path / "store"
    store = Store(store_root)
    daemon(store_root).stop()           # the warm store: what running processes map, libc included
    assert store.contains(libc_bid) and store.origin(libc_bid).trusted

    d = daemon(store_root)
    script = race_script(work, programs=40, libs=10, life_ms=10) + "./private/prog; ./forged\n"
    with TracerWatch() as watch:        # the promise is a quiet host's: another tracer's storms beside it?
        r = as_user(attacker, ["sh", "-c", script])
        assert r.returncode == 0, r.stderr
        time.sleep(1.0)
    records = d.stop()

    missing_progs = [b for b in race["exec"] if not store.contains(b)]
    missing_libs = [b for b in race["dlopen"] if not store.contains(b)]
    if watch.seen:
        # A library whose 10 ms process is gone before the daemon, sharing the CPUs and its rings with
        # the storms beside it, reads the mapping: not kept, but never unsaid (a gap with its reason,
        # or a lost record counted).
        gaps = {g["build_id"] for g in read_gaps(d.session_dir)}
        unsaid = [b for b in missing_progs + missing_libs if b not in gaps and not records[-1]["lost"]]
        print(f"\nother tracers beside: {sorted(watch.seen)}; missed {len(missing_progs)} programs, "
              f"{len(missing_libs)} libraries, each named a gap or covered by a counted loss")
        assert not unsaid, unsaid
        missing_progs = missing_libs = []
    assert not missing_progs, f"{len(missing_progs)} of 40 programs renamed over at exit not stored"
    assert not missing_libs, f"{len(missing_libs)} of 10 libraries of 10 ms processes not stored"
    for bid in race["exec"][:3]:
        o = store.origin(bid)
        assert o.uid == uid and not o.trusted and not o.private, o
    assert store.origin(priv_bid).private                  # private stays private
    assert store.origin(libc_bid).trusted                  # the user's claim stands in for nothing
    assert store.path_of(libc_bid).read_bytes() == libc.read_bytes()
    cov = _coverage_names_every_gap(records, store, d.session_dir)
    quiet = not watch.seen
    assert not cov["gaps"] or not quiet, cov
    pins = records[-1]["exec_pins"]
    assert pins["file_cap"] == 0 and (pins["taken"] >= 40 or not quiet), pins
    out = subprocess.run([sys.executable, "-m", "buildidd.cli", "sessions", "--json", "--session-root",
                          str(d.sessions), "--store-root", str(store_root)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    (row,) = [json.loads(line) for line in out.stdout.splitlines()]
    assert row["build_ids_stored"] == row["build_ids"] or not quiet, row


def test_a_stop_with_copies_queued_names_each_build_id_it_abandons(daemon, public_tmp_factory, tmp_path):
    work = public_tmp_factory()
    race = build_race(work, programs=20, libs=0)
    store_root = tmp_path / "store"
    # 64 KiB/s and no stop budget: the start-up bulk (every DSO of every process) cannot be copied.
    d = daemon(store_root, "snapshot_rate_bytes_per_s = 65536", "snapshot_stop_budget_s = 0")
    for i in range(len(race["exec"])):
        subprocess.run([str(work / f"exec{i}")], check=True)
    time.sleep(1.0)
    records = d.stop()
    store = Store(store_root)
    cov = _coverage_names_every_gap(records, store, d.session_dir)
    assert cov["gaps"].get("shutdown", 0) >= 1, cov
    assert records[-1]["store"]["abandoned"] >= 1
    shutdown = [m for m in cov["missing"] if m["reason"] == "shutdown"]
    assert shutdown and all(m["path"].startswith("/") for m in shutdown), shutdown

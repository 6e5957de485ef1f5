"""buildidd inject against the real perf: a daemon session and two ``perf record -a`` profiles of one set of
workloads (a program upgraded twice by rename mid-profile: three versions; a program upgraded once whose
function stays at the same address; a deleted program, two versions of one dlopen'd library, a program in
another mount namespace, a 32-bit program, a memfd-executed program); then perf report/script/annotate on the
injected files, with the session's store as --buildid-dir, gives each sample to its own version's symbol, and
each version is a DSO of its own name (PATH@BIDPREFIX) in perf report's default view.
Also: the README's round trip (archive, import, inject, report) and a per-process --no-buildid profile."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from buildidd.store import Store

from conftest import Background, gcc, need, readelf_build_id, upgrade_by_rename
from perfcompare import PerfRecorder, perf_record_lock

BUILDIDD = [sys.executable, "-m", "buildidd.cli"]

#: PAD (in the second versions) moves FN, as an upgrade does: perf report merges the entries of two functions
#: at one address range in DSOs of one name (its sort keys compare addresses and names, not build-ids).
SPIN = r"""
#include <stdlib.h>
#include <time.h>
static volatile unsigned long sink;
#ifdef PAD
__attribute__((noinline)) void pad(void) { for (int i = 0; i < PAD; i++) sink += i * 3; }
#endif
__attribute__((noinline)) void FN(void) { for (unsigned long i = 0; i < 200000; i++) sink += i; }
int main(int argc, char **argv) {
    struct timespec a, b;
    double s = argc > 1 ? atof(argv[1]) : 0.5;
    clock_gettime(CLOCK_MONOTONIC, &a);
    do { FN(); clock_gettime(CLOCK_MONOTONIC, &b); } while (b.tv_sec - a.tv_sec + (b.tv_nsec - a.tv_nsec) / 1e9 < s);
    return 0;
}
"""
LIB = r"""
static volatile unsigned long sink;
#ifdef PAD
__attribute__((noinline)) void pad(void) { for (int i = 0; i < PAD; i++) sink += i * 3; }
#endif
__attribute__((noinline)) void FN(void) { for (unsigned long i = 0; i < 200000; i++) sink += i; }
void work(void) { FN(); }
"""
DLOPENER = r"""
#include <dlfcn.h>
#include <stdlib.h>
#include <time.h>
int main(int argc, char **argv) {
    void *h = dlopen(argv[1], RTLD_NOW);
    if (!h) return 2;
    void (*work)(void) = (void (*)(void))dlsym(h, "work");
    struct timespec a, b;
    double s = atof(argv[2]);
    clock_gettime(CLOCK_MONOTONIC, &a);
    do { work(); clock_gettime(CLOCK_MONOTONIC, &b); } while (b.tv_sec - a.tv_sec + (b.tv_nsec - a.tv_nsec) / 1e9 < s);
    return 0;
}
"""
MEMFD_EXEC = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>
extern char **environ;
int main(int argc, char **argv) {
    int in = open(argv[1], O_RDONLY), fd = memfd_create("bidd_inject_memfd", 0);
    char buf[65536];
    ssize_t n;
    while ((n = read(in, buf, sizeof buf)) > 0) if (write(fd, buf, n) != n) return 3;
    close(in);
    fexecve(fd, argv + 1, environ);
    return 127;
}
"""
RUN_S = "0.8"


def _wait_mapped(p: subprocess.Popen, needle: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if needle in Path(f"/proc/{p.pid}/maps").read_text():
                return
        except OSError:
            pass
        time.sleep(0.01)
    raise AssertionError(f"pid {p.pid} never mapped {needle}")


def _run(cmd, **kw) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kw)
    assert r.returncode == 0, f"{cmd}: {r.stderr[-2000:]}"
    return r.stdout


def _perf_record(out: Path, base: tuple, perf: tuple) -> PerfRecorder:
    """perf record started under the host's perf record lock (perfcompare.perf_record_lock): while another
    session records with --buildid-mmap, the kernel flags this one's MMAP2 records as carrying build-ids
    (inject.flag_without_build_id) and perf record's own build-id pass aborts."""
    return PerfRecorder(out, base=base, perf=perf)


def _build(d: Path) -> dict:
    b = {}
    pads = {"spin_v2": ["-DPAD=7"], "spin_v3": ["-DPAD=13"]}
    for fn in ("spin_v1", "spin_v2", "spin_v3", "spin_deleted", "spin_ns", "spin_memfd", "same_old", "same_new"):
        b[fn] = gcc(SPIN, d / fn, f"-DFN={fn}", "-g", *pads.get(fn, []))
    assert _address(b["same_old"], "same_old") == _address(b["same_new"], "same_new")   # the premise
    b["spin_m32"] = gcc(SPIN, d / "spin_m32", "-DFN=spin_m32", "-g", "-m32")
    for fn in ("libspin_v1", "libspin_v2"):
        b[fn] = gcc(LIB, d / f"{fn}.so", f"-DFN={fn}", "-g", "-shared", "-fPIC",
                    *(["-DPAD=7"] if fn.endswith("v2") else []))
    b["dlopener"] = gcc(DLOPENER, d / "dlopener", "-ldl")
    b["memfd_exec"] = gcc(MEMFD_EXEC, d / "memfd_exec")
    return b


def _address(binary: Path, sym: str) -> str:
    return next(line.split()[0] for line in _run(["nm", str(binary)]).splitlines() if line.endswith(f" {sym}"))


#: The two ways perf records here: A the way most people run it (default build-id handling, -g), B with the
#: kernel's build-ids and the session's clock.  (Not both at once: see inject.flag_without_build_id.)
PERF_MODES = {"a": ("-e", "cpu-clock", "-a", "-g", "-N"),
              "b": ("-e", "cpu-clock", "-a", "-N", "--buildid-mmap", "-k", "boottime", "--no-buildid")}


@pytest.fixture(scope="module", params=sorted(PERF_MODES))
def world(request, bpf, tmp_path_factory, public_tmp_factory, workloads):
    """The workloads under a daemon session and one perf record -a (PERF_MODES), injected (JSON summary kept)."""
    need(shutil.which("perf") is not None, "perf missing")
    from buildidd.capture.recorder import Recorder
    from buildidd.config import Config

    tmp = tmp_path_factory.mktemp("inject")
    builds = _build(tmp)
    bids = {k: readelf_build_id(v) for k, v in builds.items() if k not in ("dlopener", "memfd_exec")}
    host = public_tmp_factory("buildidd-inject-")
    store_root = tmp / "store"
    rec = Recorder(Config(session_root=str(tmp / "sessions"), store_root=str(store_root),
                          snapshot_rate_bytes_per_s=0))
    rec.start()
    bg = Background(rec)
    empty = tmp / "empty-buildid-dir"
    empty.mkdir()
    perf = ("perf", "--buildid-dir", str(empty))
    pids: dict[str, int] = {}
    procs = []
    try:
        mode = request.param
        pa = _perf_record(tmp / "p.data", PERF_MODES[mode], perf)
        try:
            prog, lib, same = host / "prog", host / "libw.so", host / "same"
            upgrade_by_rename(builds["spin_v1"], prog)
            upgrade_by_rename(builds["libspin_v1"], lib)
            upgrade_by_rename(builds["same_old"], same)
            deleted = host / "doomed"
            upgrade_by_rename(builds["spin_deleted"], deleted)
            mnt = host / "nsmnt"
            mnt.mkdir()
            starts = {
                "v1": [str(prog), RUN_S],
                "lib1": [str(builds["dlopener"]), str(lib), RUN_S],
                "deleted": [str(deleted), RUN_S],
                "ns": ["unshare", "-m", "--propagation", "private", "sh", "-c",
                       f"mount -t tmpfs none {mnt} && cp {builds['spin_ns']} {mnt}/nsprog && exec {mnt}/nsprog {RUN_S}"],
                "m32": [str(builds["spin_m32"]), RUN_S],
                "memfd": [str(builds["memfd_exec"]), str(builds["spin_memfd"]), RUN_S],
                # four libraries dlopened and closed in turn, 20 rounds: mapped one after another at one
                # address (pid, vm_start and pgoff alike), tens of microseconds apart
                "dlopen_storm": [str(workloads["dlopen_storm"]), "20", *(str(workloads[f"lib{i}"]) for i in range(4))],
                "same_old": [str(same), RUN_S],
            }
            for name, argv in starts.items():
                procs.append(p := subprocess.Popen(argv))
                pids[name] = p.pid
            _wait_mapped(procs[0], str(prog))
            _wait_mapped(procs[1], str(lib))
            _wait_mapped(procs[2], str(deleted))
            _wait_mapped(procs[-1], str(same))
            os.unlink(deleted)                       # deleted while it runs
            upgrade_by_rename(builds["spin_v2"], prog)        # upgraded by rename mid-profile
            upgrade_by_rename(builds["libspin_v2"], lib)
            upgrade_by_rename(builds["same_new"], same)
            for name, argv in (("v2", [str(prog), RUN_S]), ("lib2", [str(builds["dlopener"]), str(lib), RUN_S]),
                               ("same_new", [str(same), RUN_S])):
                procs.append(p := subprocess.Popen(argv))
                pids[name] = p.pid
            _wait_mapped(procs[-3], str(prog))
            upgrade_by_rename(builds["spin_v3"], prog)        # and again: three versions of one path in the profile
            procs.append(p := subprocess.Popen([str(prog), RUN_S]))
            pids["v3"] = p.pid
            for p in procs:
                assert p.wait(timeout=30) == 0, p.args
        finally:
            pa.finish()
        assert pa.proc.returncode in (0, -2, 130), f"perf record failed: {pa.proc.stderr.read()[-500:]}"
        store = Store(store_root)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(store.contains(b) for b in bids.values()):
            time.sleep(0.05)
        assert all(store.contains(b) for b in bids.values()), "the store lacks a workload's build-id"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        bg.stop()
        rec.close()
    data = tmp / "p.data"
    before = data.read_bytes()
    summary = json.loads(_run([*BUILDIDD, "inject", str(data), str(rec.session_dir), "-o", str(tmp / "p.injected"),
                               "--json"]))
    assert data.read_bytes() == before                       # the input is never modified
    storm_libs = {str(workloads[f"lib{i}"]): readelf_build_id(workloads[f"lib{i}"]) for i in range(4)}
    return {"mode": mode, "tmp": tmp, "store": store_root, "bids": bids, "pids": pids, "summary": summary,
            "storm_libs": storm_libs,
            "prog": str(prog), "lib": str(lib), "same": str(same), "session": rec.session_dir}


def _symbols_by_pid(world, data: Path) -> dict[int, Counter]:
    """perf script (store as --buildid-dir): each user-space sample's symbol, counted per pid."""
    text = _run(["perf", "--buildid-dir", str(world["store"]), "script", "-i", str(data), "-F", "pid,ip,sym",
                 "--hide-call-graph"])
    by_pid: dict[int, Counter] = {}
    for line in text.splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3 and parts[0].isdigit() and int(parts[1], 16) < 1 << 63:     # not kernel space
            by_pid.setdefault(int(parts[0]), Counter())[parts[2].strip()] += 1
    return by_pid


def _share(c: Counter, sym: str) -> float:
    return c[sym] / max(1, sum(c.values()))


#: Each workload process (a key of world["pids"]) and the function it spins in (named after its build).
WANT = {"v1": "spin_v1", "v2": "spin_v2", "v3": "spin_v3", "lib1": "libspin_v1", "lib2": "libspin_v2",
        "deleted": "spin_deleted", "ns": "spin_ns", "m32": "spin_m32", "memfd": "spin_memfd",
        "same_old": "same_old", "same_new": "same_new"}
#: The paths that held several versions: their versions, each named PATH@BIDPREFIX by inject.
VERSIONS = {"prog": ("spin_v1", "spin_v2", "spin_v3"), "lib": ("libspin_v1", "libspin_v2"),
            "same": ("same_old", "same_new")}


def test_each_version_samples_go_to_its_own_symbols(world):
    pids, tmp, profile = world["pids"], world["tmp"], world["mode"]
    injected = _symbols_by_pid(world, tmp / "p.injected")
    want = WANT
    shares = {name: round(_share(injected.get(pids[name], Counter()), sym), 3) for name, sym in want.items()}
    print(f"profile {profile}: injected, share of each process's user-space samples in its own symbol: {shares}")
    for name, sym in want.items():
        c = injected.get(pids[name], Counter())
        assert sum(c.values()) >= 20, (name, c)
        assert _share(c, sym) >= 0.95, (name, c.most_common(5))
    if profile == "a":
        # perf alone, same store: the old version's samples go to the new version's symbols, the deleted
        # program and the one in the other mount namespace are not symbolized.
        alone = _symbols_by_pid(world, tmp / "p.data")
        print("perf alone, same shares:", {name: round(_share(alone.get(pids[name], Counter()), sym), 3)
                                           for name, sym in want.items()})
        c1 = alone.get(pids["v1"], Counter())
        print("perf alone, v1's samples:", c1.most_common(3), "lib1's:", alone.get(pids["lib1"]).most_common(3))
        assert _share(c1, "spin_v1") == 0 and _share(c1, "spin_v2") + _share(c1, "pad") >= 0.9    # v2's symbols
        assert _share(alone.get(pids["lib1"], Counter()), "libspin_v1") == 0
        assert _share(alone.get(pids["deleted"], Counter()), "spin_deleted") == 0
        assert _share(alone.get(pids["ns"], Counter()), "spin_ns") == 0


def _report(world, data: Path, *sort: str) -> list[tuple[float, str, str]]:
    """perf report --stdio (the store as --buildid-dir; sort keys as given, perf's default without): each
    user-space line as (self %, DSO column, symbol).  -g none only leaves the call chains unprinted."""
    text = _run(["perf", "--buildid-dir", str(world["store"]), "report", "-i", str(data), "--stdio", "-g", "none",
                 *sort])
    out = []
    for line in text.splitlines():
        left, sep, sym = line.partition(" [.] ")
        if not sep or left.lstrip().startswith("#"):
            continue
        cols = left.split()
        pcts = [c for c in cols if c.endswith("%")]
        out.append((float(pcts[-1].rstrip("%")), cols[-1], sym.strip()))
    return out


def _versions(world) -> dict[str, str]:
    """Each version's expected DSO name (PATH@BIDPREFIX) → its function."""
    return {f"{world[key]}@{world['bids'][b][:8]}": b for key, builds in VERSIONS.items() for b in builds}


@pytest.mark.parametrize("sort", [(), ("--sort", "dso,sym")], ids=["default", "dso_sym"])
def test_report_shows_each_version_apart(world, sort):
    """perf report's default view (comm,dso,sym) and --sort dso,sym: each version of a path is a DSO of its own
    name carrying only its own function, two versions whose function sits at the same address included (before,
    both folded into one line with one version's symbol)."""
    rows = _report(world, world["tmp"] / "p.injected", *sort)
    versions = _versions(world)
    funcs = set(versions.values())
    shares = {}
    for name, fn in versions.items():
        base = os.path.basename(name)
        mine = [(pct, sym) for pct, dso, sym in rows if dso == base]
        shares[base] = round(sum(pct for pct, sym in mine if sym == fn), 2)
        assert shares[base] >= 0.5, (base, fn, mine, rows[:30])
        assert not [sym for _pct, sym in mine if sym in funcs - {fn}], (base, mine)
    assert not [r for r in rows if r[1] in ("prog", "libw.so", "same") and r[2] in funcs], rows[:30]
    print(f"profile {world['mode']}, perf report {' '.join(sort) or '(default)'}: self % per version: {shares}")


def test_script_and_annotate_show_each_version_apart(world):
    """perf script -F dso names each sample's version, and perf annotate disassembles each of the two versions
    whose function sits at the same address from its own binary."""
    data, store, pids = world["tmp"] / "p.injected", str(world["store"]), world["pids"]
    text = _run(["perf", "--buildid-dir", store, "script", "-i", str(data), "-F", "pid,ip,sym,dso",
                 "--hide-call-graph"])
    by_pid: dict[int, Counter] = {}
    for line in text.splitlines():
        m = re.match(r"\s*(\d+)\s+([0-9a-f]+)\s+(\S+)\s+\((.*)\)\s*$", line)
        if m:
            by_pid.setdefault(int(m[1]), Counter())[(m[3], m[4])] += 1
    for name, fn in _versions(world).items():
        proc = next(p for p, sym in WANT.items() if sym == fn)
        c = by_pid.get(pids[proc], Counter())
        assert c[(fn, name)] >= 0.9 * sum(n for (sym, _d), n in c.items() if sym in WANT.values()) > 0, (name, c)
    for fn in ("same_old", "same_new"):
        name = next(n for n, f in _versions(world).items() if f == fn)
        out = _run(["perf", "--buildid-dir", store, "annotate", "-i", str(data), "--stdio", fn])
        head = re.search(r"Disassembly of (\S+) for \S+ \((\d+) samples", out)
        assert head and head[1] == os.path.basename(name) and int(head[2]) >= 20, (fn, out[:1500])
        assert f"<{fn}>:" in out and f"<{({'same_old', 'same_new'} - {fn}).pop()}>" not in out, out[:1500]


def test_every_workload_mapping_carries_its_build_id(world):
    """perf script --show-mmap-events (this perf has no -F build_id): the MMAP2 of each workload's mapping
    shows the build-id of the file that process mapped."""
    from perfcompare import parse_perf_script

    bids, pids = world["bids"], world["pids"]
    for profile in (world["mode"],):
        text = _run(["perf", "script", "-i", str(world["tmp"] / "p.injected"), "--show-mmap-events"])
        maps = [m for m in parse_perf_script(text) if "x" in m.perms]
        want = {name: bids[sym] for name, sym in WANT.items()}
        for name, bid in want.items():
            seen = {m.build_id for m in maps if m.pid == pids[name]}
            assert bid in seen, (profile, name, bid, seen)
        # Each version's mapping is named PATH@BIDPREFIX, and carries that version's build-id.
        progs = {pids[v]: want[v] for v in ("v1", "v2", "v3")}
        mine = [m for m in maps if m.pid in progs and m.path.split("@")[0] == world["prog"]]
        assert len(mine) >= 3 and all(m.path == f"{world['prog']}@{progs[m.pid][:8]}" and m.build_id == progs[m.pid]
                                      for m in mine), mine
        listed = _run(["perf", "buildid-list", "-i", str(world["tmp"] / "p.injected"), "--with-hits"])
        for bid in want.values():
            assert bid in listed, (profile, bid, listed)


def test_libraries_dlopened_in_turn_at_one_address_each_carry_their_own_build_id(world):
    """The dlopen storm's mappings: every MMAP2 of a library in the output carries that library's build-id
    (in mode b the kernel's, which the session's must agree with: test_summary_counts_and_header; in mode a
    the session's), though the libraries took turns at one vm_start."""
    from perfcompare import parse_perf_script

    libs, pid = world["storm_libs"], world["pids"]["dlopen_storm"]
    text = _run(["perf", "script", "-i", str(world["tmp"] / "p.injected"), "--show-mmap-events"])
    maps = [m for m in parse_perf_script(text) if m.pid == pid and "x" in m.perms and m.path in libs]
    assert len(maps) >= 4 * 20 * 0.9, (len(maps), maps[:8])               # perf -a may lose a few
    by_start = {}
    for m in maps:
        by_start.setdefault(m.start, set()).add(m.path)
    assert max(len(paths) for paths in by_start.values()) >= 2, by_start   # the premise: turns at one address
    wrong = [(m.path, m.start, m.build_id) for m in maps if m.build_id != libs[m.path]]
    assert not wrong, wrong[:8]


def test_summary_counts_and_header(world):
    s = world["summary"]
    print(f"summary {world['mode']}:", json.dumps({k: s[k] for k in ("matched", "agreed", "perf_only", "not_matched",
                                                                     "samples", "clock", "header_build_ids",
                                                                     "versions")}))
    assert s["disagreements"] == 0
    assert s["samples"]["resolved"] and s["samples"]["in_mapping_with_build_id"] > 0
    assert s["header_build_ids"]["written"] >= 8
    listed = _run(["perf", "buildid-list", "-i", str(world["tmp"] / "p.injected")])
    alone = _run(["perf", "buildid-list", "-i", str(world["tmp"] / "p.data")])
    if world["mode"] == "a":
        assert s["clock"] == "perf_clock" and s["matched"] >= 8 and s["agreed"] == 0
        assert world["bids"]["spin_v1"] not in alone          # perf's own header: only the path's last version
    else:
        # The kernel's build-ids (where it could read them): ours agree, and fill the rest; time joins the match.
        assert s["clock"] == "boottime" and s["agreed"] >= 1
    # The header maps each version's name to its build-id, and the path's own name to none of them (perf's
    # entry, read from the path after the upgrades, is dropped).
    lines = set(listed.splitlines())
    assert s["versions"]["paths"] >= len(VERSIONS) and s["versions"]["too_long"] == 0
    for key, builds in VERSIONS.items():
        path = world[key]
        for b in builds:
            bid = world["bids"][b]
            assert f"{bid} {path}@{bid[:8]}" in lines, (b, listed)
            assert f"{bid} {path}" not in lines, (b, listed)


@pytest.mark.parametrize("world", ["a"], indirect=True)       # one perf mode is enough for the round trip
def test_round_trip_archive_import_inject_report(world, tmp_path):
    """README's round trip: archive the session with its binaries, import it into empty directories, inject
    from the imported session, perf report with the imported tree as --buildid-dir."""
    archive = tmp_path / "host.tar.zst"
    _run([*BUILDIDD, "archive", str(world["session"]), "-o", str(archive), "--store-root", str(world["store"])])
    debug, sessions = tmp_path / "debug", tmp_path / "sessions"
    _run([*BUILDIDD, "import", str(archive), "--debug-dir", str(debug), "--session-root", str(sessions)])
    out = tmp_path / "exact.data"
    _run([*BUILDIDD, "inject", str(world["tmp"] / "p.data"), "latest", "--session-root", str(sessions), "-o", str(out)])
    report = _run(["perf", "--buildid-dir", str(debug), "report", "-i", str(out), "--stdio", "--sort", "dso,sym",
                   "-g", "none"])
    for sym in ("spin_v1", "spin_v2", "libspin_v1", "libspin_v2", "spin_deleted", "spin_m32"):
        assert re.search(rf"\] {sym}\s*$", report, re.M), (sym, report[:3000])


def test_per_process_profile_with_no_buildid(recorder, tmp_path, public_tmp_factory):
    """perf record --no-buildid -- PROGRAM (per process, no build-ids at all), the program upgraded by rename
    after the profile: perf alone cannot tell, inject gives every sample the version that ran."""
    need(shutil.which("perf") is not None, "perf missing")
    v1 = gcc(SPIN, tmp_path / "v1", "-DFN=spin_v1", "-g")
    v2 = gcc(SPIN, tmp_path / "v2", "-DFN=spin_v2", "-g", "-DPAD=7")
    store_root = tmp_path / "store"
    rec = recorder(store_root=str(store_root), snapshot_rate_bytes_per_s=0)
    bg = Background(rec)
    app = public_tmp_factory("buildidd-inject-pp-") / "app"
    upgrade_by_rename(v1, app)
    data = tmp_path / "pp.data"
    try:
        with perf_record_lock():
            _run(["perf", "record", "-q", "-N", "--no-buildid", "-e", "cpu-clock", "-o", str(data), "--", str(app),
                  "0.5"])
        upgrade_by_rename(v2, app)
        store = Store(store_root)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not store.contains(readelf_build_id(v1)):
            time.sleep(0.05)
    finally:
        bg.stop()
    rec.close()
    out = tmp_path / "pp.injected"
    summary = json.loads(_run([*BUILDIDD, "inject", str(data), str(rec.session_dir), "-o", str(out), "--json"]))
    assert summary["matched"] >= 3 and summary["disagreements"] == 0, summary

    def syms(p):
        text = _run(["perf", "--buildid-dir", str(store_root), "script", "-i", str(p), "-F", "ip,sym"])
        return Counter(line.split(None, 1)[1].strip() for line in text.splitlines()
                       if len(line.split(None, 1)) == 2 and int(line.split()[0], 16) < 1 << 63)
    injected, alone = syms(out), syms(data)
    print("per-process, --no-buildid: injected", injected.most_common(3), "perf alone", alone.most_common(3))
    assert _share(injected, "spin_v1") >= 0.95
    assert _share(alone, "spin_v1") == 0

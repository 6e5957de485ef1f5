"""The upgrade race's workload (scripts/bench_upgrade_race.py, tests/integration/test_keep_binaries.py).

build_race(dest, programs, libs) links, with gcc at run time, ``exec<i>`` and
its replacement ``exec.new<i>`` for i < programs, ``dlopen<i>`` and
``dlopen.new<i>`` (shared libraries) for i < libs, each with its own random
build-id, and ``dlopen_once``; race_script() is the sh script that runs each
program once and renames its replacement over it 0 ms after it exits, and
dlopens each library from a process that lives life_ms, replacing it after.
build_farm() and farm_script() are the build farm of scripts/bench_farm.py:
thousands of distinct programs, each run once, some renamed over after.
"""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _gcc(*args: str) -> None:
    r = subprocess.run(["gcc", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"gcc {' '.join(args)}: {r.stderr}")


def link_variant(obj: Path, dest: Path, *flags: str, build_id_hex: str | None = None) -> str:
    """Link obj to dest with the given (or a random) 20-byte build-id; returns it (hex)."""
    bid = build_id_hex or os.urandom(20).hex()
    _gcc(*flags, "-o", str(dest), str(obj), f"-Wl,--build-id=0x{bid}")
    return bid


def objects(dest: Path) -> tuple[Path, Path]:
    """The program's and the library's object files under dest (child.c and lib.c of this
    directory): (prog.o, lib.o)."""
    dest.mkdir(parents=True, exist_ok=True)
    _gcc("-O1", "-c", "-o", str(dest / "prog.o"), str(HERE / "child.c"))
    _gcc("-O1", "-fPIC", "-DLIB_ID=1", "-c", "-o", str(dest / "lib.o"), str(HERE / "lib.c"))
    return dest / "prog.o", dest / "lib.o"


def build_race(dest: Path, programs: int, libs: int) -> dict[str, list[str]]:
    """The race's files under dest (see the module docstring): {"exec": [build-id of exec<i>],
    "dlopen": [build-id of dlopen<i>]}.  Raises RuntimeError on a compiler error."""
    prog_o, lib_o = objects(dest / "obj")
    _gcc("-O1", "-o", str(dest / "dlopen_once"), str(HERE / "dlopen_once.c"), "-ldl")
    out: dict[str, list[str]] = {"exec": [], "dlopen": []}
    for kind, n, obj, flags in (("exec", programs, prog_o, ()), ("dlopen", libs, lib_o, ("-shared",))):
        for i in range(n):
            out[kind].append(link_variant(obj, dest / f"{kind}{i}", *flags))
            link_variant(obj, dest / f"{kind}.new{i}", *flags)
    return out


def build_farm(dest: Path, programs: int, rename_every: int, jobs: int | None = None) -> dict[str, list]:
    """A build farm's output under dest: ``prog<i>`` for i < programs, each prog.o linked again with
    its own random build-id, and ``prog<i>.new`` (another link) for every rename_every-th i (0: none),
    linked by jobs gccs at once (default: one per CPU).  Returns {"programs": [build-id hex of
    prog<i>], "renamed": [i with a .new]}.  Raises RuntimeError on a compiler error."""
    prog_o, _ = objects(dest / "obj")
    renamed = [i for i in range(programs) if rename_every and i % rename_every == rename_every - 1]
    jobs_list = [(dest / f"prog{i}", None) for i in range(programs)]
    jobs_list += [(dest / f"prog{i}.new", None) for i in renamed]
    with ThreadPoolExecutor(jobs or os.cpu_count() or 1) as pool:
        bids = list(pool.map(lambda job: link_variant(prog_o, job[0]), jobs_list))
    return {"programs": bids[:programs], "renamed": renamed}


def farm_script(dest: Path, programs: int) -> str:
    """The sh script that runs each of build_farm's programs once, in order, and renames its
    ``.new`` over it right after it exits, where there is one."""
    return (f"set -e; cd {dest}\n"
            f"i=0; while [ $i -lt {programs} ]; do ./prog$i; "
            f"if [ -e prog$i.new ]; then mv -f prog$i.new prog$i; fi; i=$((i+1)); done\n")


def race_script(dest: Path, programs: int, libs: int, life_ms: int) -> str:
    """The sh script of the race over build_race's files (run it as any user who owns them)."""
    return (f"set -e; cd {dest}\n"
            f"i=0; while [ $i -lt {programs} ]; do ./exec$i; mv -f exec.new$i exec$i; i=$((i+1)); done\n"
            f"i=0; while [ $i -lt {libs} ]; do ./dlopen_once {dest}/dlopen$i {life_ms}; "
            f"mv -f dlopen.new$i dlopen$i; i=$((i+1)); done\n")

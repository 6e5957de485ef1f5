"""The upgrade race's workload (scripts/bench_upgrade_race.py, tests/integration/test_keep_binaries.py).

build_race(dest, programs, libs) links, with gcc at run time, ``exec<i>`` and
its replacement ``exec.new<i>`` for i < programs, ``dlopen<i>`` and
``dlopen.new<i>`` (shared libraries) for i < libs, each with its own random
build-id, and ``dlopen_once``; race_script() is the sh script that runs each
program once and renames its replacement over it 0 ms after it exits, and
dlopens each library from a process that lives life_ms, replacing it after.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROG = "int main(void) { return 0; }\n"
LIB = "int libfn(void) { return 1; }\n"


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
    """The program's and the library's object files under dest: (prog.o, lib.o)."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "prog.c").write_text(PROG)
    (dest / "lib.c").write_text(LIB)
    _gcc("-O1", "-c", "-o", str(dest / "prog.o"), str(dest / "prog.c"))
    _gcc("-O1", "-fPIC", "-c", "-o", str(dest / "lib.o"), str(dest / "lib.c"))
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


def race_script(dest: Path, programs: int, libs: int, life_ms: int) -> str:
    """The sh script of the race over build_race's files (run it as any user who owns them)."""
    return (f"set -e; cd {dest}\n"
            f"i=0; while [ $i -lt {programs} ]; do ./exec$i; mv -f exec.new$i exec$i; i=$((i+1)); done\n"
            f"i=0; while [ $i -lt {libs} ]; do ./dlopen_once {dest}/dlopen$i {life_ms}; "
            f"mv -f dlopen.new$i dlopen$i; i=$((i+1)); done\n")

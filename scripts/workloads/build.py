"""Build the C workloads of the tests and benchmarks with gcc, at run time.

build(dest, n_libs) → dict of name → Path: child, storm, dlopen_storm,
mmap_storm, pagetouch (the machine's cost of memory after a sleep), sysloop (getppid in a loop), idle (linked with libm, libz-free libs: libdl and libpthread are in
libc on Debian 12, so idle links libm and n_libs of our own libraries), and
lib0..lib{n_libs-1}.so (distinct build-ids).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _gcc(out: Path, *args: str) -> Path:
    r = subprocess.run(["gcc", "-O1", "-Wl,--build-id=sha1", "-o", str(out), *args],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"gcc failed for {out.name}: {r.stderr}")
    return out


def program(dest: str | Path, name: str) -> Path:
    """One workload, NAME.c of this directory, compiled to dest/NAME (dest created).  Raises
    RuntimeError on a compiler error."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    return _gcc(dest / name, str(HERE / f"{name}.c"))


def shared_lib(dest: str | Path, lib_id: int) -> Path:
    """lib.c built as dest/libbidd{lib_id}.so, a shared library with a build-id of its own per
    lib_id (dest created).  Raises RuntimeError on a compiler error."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    return _gcc(dest / f"libbidd{lib_id}.so", "-shared", "-fPIC", f"-DLIB_ID={lib_id}", str(HERE / "lib.c"))


def build(dest: str | Path, n_libs: int = 8) -> dict[str, Path]:
    """Compile every workload into dest (created). Raises RuntimeError on a compiler error."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    out = {}
    for i in range(n_libs):
        out[f"lib{i}"] = shared_lib(dest, i)
    out["child"] = _gcc(dest / "bidd_child", str(HERE / "child.c"))
    out["storm"] = _gcc(dest / "bidd_storm", str(HERE / "storm.c"))
    out["dlopen_storm"] = _gcc(dest / "bidd_dlopen", str(HERE / "dlopen_storm.c"), "-ldl")
    out["mmap_storm"] = _gcc(dest / "bidd_mmap", str(HERE / "mmap_storm.c"))
    out["pagetouch"] = _gcc(dest / "bidd_pagetouch", str(HERE / "pagetouch.c"))
    out["sysloop"] = _gcc(dest / "bidd_sysloop", str(HERE / "sysloop.c"))
    libs = [f"-lbidd{i}" for i in range(min(n_libs, 4))]
    out["idle"] = _gcc(dest / "bidd_idle", str(HERE / "idle.c"), f"-L{dest}", f"-Wl,-rpath,{dest}",
                       "-Wl,--no-as-needed", *libs, "-lm")
    return out


def build_floods(dest: str | Path) -> dict[str, Path]:
    """The hostile battery's floods (tests/integration/test_hostile_battery.py), compiled into dest:
    failexec_flood (execve with a bad argv over given paths) and freshmap_flood (fresh ELF files
    mapped from a deep directory), see their sources.  Raises RuntimeError on a compiler error."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    return {name: _gcc(dest / name, str(HERE / f"{name}.c")) for name in ("failexec_flood", "freshmap_flood")}

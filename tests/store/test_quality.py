"""What each stored copy is good for (store.quality): real binaries built at test time, each kind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from buildidd.store import Store
from buildidd.store.quality import QUALITIES, best_quality, elf_quality, path_quality
from conftest import gcc, store_add

SRC = "int helper(int x) { return x * 3; }\nint main(int argc, char **argv) { return helper(argc); }\n"
GO_SRC = 'package main\n\nimport "fmt"\n\nfunc main() { fmt.Println("hi") }\n'


def _quality(path) -> str:
    fd = os.open(path, os.O_RDONLY)
    try:
        return elf_quality(fd)
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    d = tmp_path_factory.mktemp("quality")
    out = {"dwarf": gcc(SRC, d / "dwarf", "-g"), "symtab": gcc(SRC, d / "symtab")}
    out["dynsym"] = d / "dynsym"
    subprocess.run(["strip", "-s", "-o", str(out["dynsym"]), str(out["symtab"])], check=True)
    out["none"] = d / "none"
    static = gcc(SRC, d / "static", "-static")
    subprocess.run(["strip", "-s", "-o", str(out["none"]), str(static)], check=True)
    # MiniDebugInfo as Fedora makes it: the symbol table, xz-compressed, in .gnu_debugdata of a stripped file.
    mini = d / "mini.symtab"
    subprocess.run(["objcopy", "--only-keep-debug", "--remove-section=.debug*", str(out["symtab"]), str(mini)],
                   check=True)
    subprocess.run(["xz", "-f", "-k", str(mini)], check=True)
    out["minidebuginfo"] = d / "minidebuginfo"
    subprocess.run(["objcopy", "--add-section", f".gnu_debugdata={mini}.xz", str(out["dynsym"]),
                    str(out["minidebuginfo"])], check=True)
    if shutil.which("go"):
        (d / "hello.go").write_text(GO_SRC)
        env = {**os.environ, "GOCACHE": str(d / "gocache"), "GOPATH": str(d / "gopath"), "GO111MODULE": "off"}
        subprocess.run(["go", "build", "-ldflags=-s -w", "-o", str(d / "go_pclntab"), str(d / "hello.go")],
                       check=True, env=env, cwd=d)
        out["go_pclntab"] = d / "go_pclntab"
    return out


def test_each_kind_of_binary_gets_its_quality(builds):
    assert "go_pclntab" in builds, "go (golang-go, installed by scripts/setup) is needed"
    for quality, path in builds.items():
        assert _quality(path) == quality, (quality, path)
    assert _quality(sys.executable) in QUALITIES
    assert path_quality(builds["dwarf"].with_suffix(".missing")) is None


def test_not_elf_and_truncated_files_are_none(tmp_path, builds):
    text = tmp_path / "text"
    text.write_text("#!/bin/sh\n")
    cut = tmp_path / "cut"
    cut.write_bytes(builds["dwarf"].read_bytes()[:200])
    assert _quality(text) == "none" and _quality(cut) == "none"


def test_an_entry_is_as_good_as_its_best_file_and_the_store_says_so(builds, tmp_path):
    store = Store(tmp_path / "store", debug_root=tmp_path / "no-debug")
    bid = store_add(store, builds["dynsym"])
    assert store.quality(bid) == "dynsym"
    unstripped = store_add(store, builds["dwarf"])
    assert store.quality(unstripped) == "dwarf"
    assert store.quality("ab" * 20) is None
    assert best_quality("dynsym", None, "symtab") == "symtab" and best_quality(None) is None

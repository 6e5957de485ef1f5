"""The layout is the pipeline: layers checked by import-linter, sizes kept small.

The contract is in pyproject.toml ([tool.importlinter]); these tests fail on the
first import that runs back up the pipeline, on a module over MAX_FILE_LINES, a
class over MAX_CLASS_LINES, or a function with more than MAX_PARAMS parameters
(those take a dataclass instead).  The C fast path and the BPF program are C.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "daemon" / "buildidd"
MAX_FILE_LINES = 500
MAX_CLASS_LINES = 250
MAX_PARAMS = 6
STAGES = ("kernel", "resolve", "sessionlog", "store", "capture", "control", "offline", "cli")


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_lint_imports_keeps_every_contract():
    exe = Path(sys.executable).with_name("lint-imports")
    r = subprocess.run([str(exe), "--config", str(ROOT / "pyproject.toml")], cwd=ROOT / "daemon",
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "daemon")})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout or " broken" not in r.stdout, r.stdout


def test_every_stage_is_a_package_that_says_what_it_may_import():
    for stage in STAGES:
        init = PACKAGE / stage / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and "May import" in doc or stage == "cli" and doc, f"{init}: no role/imports docstring"


def test_no_module_is_too_long():
    long = {str(p.relative_to(PACKAGE)): n for p in _modules()
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, f"modules over {MAX_FILE_LINES} lines: {long}"


def test_no_class_is_too_long():
    long = {}
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                long[f"{p.relative_to(PACKAGE)}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert not long, f"classes over {MAX_CLASS_LINES} lines: {long}"


def test_no_function_takes_too_many_parameters():
    wide = {}
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
                if len(names) > MAX_PARAMS:
                    wide[f"{p.relative_to(PACKAGE)}:{node.lineno}:{node.name}"] = len(names)
    assert not wide, f"functions with more than {MAX_PARAMS} parameters: {wide}"


def test_the_size_checks_can_fail(tmp_path):
    """The walkers above see what they look for (a check that cannot fail is no check)."""
    src = "class Big:\n" + "    x = 1\n" * (MAX_CLASS_LINES + 1) + "def f(a, b, c, d, e, f, g):\n    pass\n"
    tree = ast.parse(src)
    classes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    funcs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    assert classes[0].end_lineno - classes[0].lineno + 1 > MAX_CLASS_LINES
    assert len(funcs[0].args.args) > MAX_PARAMS

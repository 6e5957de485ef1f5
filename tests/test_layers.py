"""The layout is the pipeline: layers checked by import-linter, sizes kept small.

The contract is in pyproject.toml ([tool.importlinter]); these tests fail on the
first import that runs back up the pipeline, on a module over MAX_FILE_LINES, a
function whose body is over MAX_FUNCTION_LINES (split by concept, not by a
class's length), a class over MAX_CLASS_LINES, or a function with more than
MAX_PARAMS parameters (those take a dataclass instead).  The C fast path and the BPF program are C.
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
MAX_FUNCTION_LINES = 65
MAX_PARAMS = 6
MAX_CLASS_LINES = 300
STAGES = ("kernel", "resolve", "sessionlog", "store", "capture", "control", "offline", "fleet", "cli")


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


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of a function's body, its docstring left out."""
    body = node.body
    first = body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        if len(body) == 1:
            return 0
        first = body[1]
    return node.end_lineno - first.lineno + 1


def test_no_function_is_too_long():
    """Split by concept: a function longer than MAX_FUNCTION_LINES (docstring aside) does several things."""
    long = {}
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _body_lines(node) > MAX_FUNCTION_LINES:
                long[f"{p.relative_to(PACKAGE)}:{node.name}"] = _body_lines(node)
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def _class_lines(node: ast.ClassDef) -> int:
    """Lines of a class's body (docstring and methods included), the ``class`` line left out."""
    return node.end_lineno - node.lineno


def test_no_class_is_too_long():
    """Split by concept: a class longer than MAX_CLASS_LINES holds several (issue 45's Snapshotter)."""
    long = {}
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef) and _class_lines(node) > MAX_CLASS_LINES:
                long[f"{p.relative_to(PACKAGE)}:{node.name}"] = _class_lines(node)
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
    src = ('def big():\n    """Doc."""\n' + "    x = 1\n" * (MAX_FUNCTION_LINES + 1)
           + 'def small():\n    """Doc\n    over\n    lines."""\n' + "    x = 1\n" * MAX_FUNCTION_LINES
           + "def f(a, b, c, d, e, f, g):\n    pass\n"
           + "class Big:\n" + "    x = 1\n" * (MAX_CLASS_LINES + 1) + "class Small:\n" + "    x = 1\n" * MAX_CLASS_LINES)
    funcs = {n.name: n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef)}
    classes = {n.name: n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ClassDef)}
    assert _class_lines(classes["Big"]) == MAX_CLASS_LINES + 1 and _class_lines(classes["Small"]) == MAX_CLASS_LINES
    assert _body_lines(funcs["big"]) == MAX_FUNCTION_LINES + 1
    assert _body_lines(funcs["small"]) == MAX_FUNCTION_LINES          # a docstring does not count
    assert len(funcs["f"].args.args) > MAX_PARAMS

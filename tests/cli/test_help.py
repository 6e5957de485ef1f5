"""Every argument and option of every verb has help; `buildidd --help` lists the verbs one line each; the man page."""

from __future__ import annotations

import argparse
import subprocess
import sys

from buildidd.cli.main import FAMILIES, build_parser

BUILDIDD = [sys.executable, "-m", "buildidd.cli"]


def _subparsers(parser: argparse.ArgumentParser):
    """(name, parser, its help line) for every verb, recursively (verbs of verbs too)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, sub, helps.get(name)
                yield from _subparsers(sub)


def test_every_verb_argument_and_option_has_help():
    verbs = list(_subparsers(build_parser()))
    assert len(verbs) >= len(FAMILIES)      # each family registers at least one verb
    missing = []
    for name, sub, line in verbs:
        if not line or not line.strip():
            missing.append(f"{name}: no one-line help")
        for action in sub._actions:
            if action.help is argparse.SUPPRESS or isinstance(action, argparse._SubParsersAction):
                continue
            if not action.help or not action.help.strip():
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, f"arguments without help: {missing}"


def test_top_level_help_lists_each_verb_on_one_line_with_exit_codes():
    r = subprocess.run([*BUILDIDD, "--help"], capture_output=True, text=True, env={"COLUMNS": "100"})
    assert r.returncode == 0
    lines = r.stdout.splitlines()
    for name, _sub, line in _subparsers(build_parser()):
        row = next((x for x in lines if x.split()[:1] == [name]), None)
        assert row is not None and line.split()[0] in row, (name, r.stdout)
    for code, meaning in (("3", "not running"), ("4", "permission denied"), ("2", "usage")):
        assert any(code in x and meaning in x for x in lines), (code, r.stdout)
    assert "{" not in lines[0]                       # usage says COMMAND, not a brace list


def test_help_man_renders_every_verb_as_roff():
    r = subprocess.run([*BUILDIDD, "help-man"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(".TH BUILDIDD") or ".TH" in r.stdout.split("\n", 5)[0] + r.stdout[:400]
    for name, _sub, _line in _subparsers(build_parser()):
        assert name.replace("-", "\\-") in r.stdout, name
    assert "\\-\\-since" in r.stdout and "\\-\\-decimal" in r.stdout


def test_the_manual_page_has_the_sections_of_a_section_8_page_in_order():
    r = subprocess.run([*BUILDIDD, "help-man"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    headings = [line[4:].split(" \\fI")[0] for line in r.stdout.splitlines() if line.startswith(".SH ")]
    order = ["NAME", "SYNOPSIS", "DESCRIPTION", "OPTIONS", "COMMAND", "EXIT STATUS", "FILES", "CONFIGURATION",
             "EXAMPLES", "SEE ALSO"]
    firsts = [headings.index(h) for h in order]
    assert firsts == sorted(firsts), headings
    assert "COMMENTS" not in headings                        # the exit status has its own section
    assert "/etc/buildidd/buildidd.toml" in r.stdout and ".BR debuginfod (8)" in r.stdout


def test_every_verb_has_a_description():
    missing = [name for name, sub, _line in _subparsers(build_parser()) if not (sub.description or "").strip()]
    assert not missing, f"verbs without a --help description: {missing}"

"""``buildidd show``: a session decoded for a terminal or as JSON lines."""

from __future__ import annotations

import json
import sys
import time

from buildidd import clock
from buildidd import config as configmod
from buildidd.cli.common import resolve_session
from buildidd.sessionlog import read_session


def _fmt(r: dict, offset_ns: int | None) -> str:
    t = r.get("type")
    if offset_ns is not None:
        wall = clock.wall_ns(r.get("time_ns", 0), offset_ns)
        ts = time.strftime("%H:%M:%S", time.localtime(wall // 10**9)) + f".{wall % 10**9 // 1000:06d}"
    else:
        ts = f"{r.get('time_ns', 0) / 1e9:.6f}"
    head = f"{ts:>15} {r.get('pid', ''):>7} {r.get('comm', ''):<16} {t:<6}"
    if t == "mmap":
        bid = r.get("build_id") or f"({r.get('error')})"
        return (f"{head} {r['start']:#x}+{r['len']:#x} @{r['pgoff']:#x} {r.get('origin')} "
                f"{r['path']} {bid}")
    if t == "exec":
        return f"{head} {r.get('filename')} {r.get('build_id') or '(' + str(r.get('error')) + ')'}"
    if t == "fork":
        return f"{head} parent {r.get('ppid')}"
    if t == "exit":
        return f"{head} code {r.get('exit_code')}"
    if t == "comm":
        return f"{head}"
    return f"{ts:>15} {t}: " + json.dumps({k: v for k, v in r.items() if k not in ('type', 'time_ns')})


def cmd_show(args) -> int:
    """`buildidd show SESSION`: decode a session (text or --json), filtered by --pid/--type."""
    cfg = configmod.Config()
    session = resolve_session(args.session, args.session_root or cfg.session_root)
    types = set(args.type) if args.type else None
    pids = set(args.pid) if args.pid else None
    torn = []
    out = sys.stdout
    offset_ns = None
    try:
        for r in read_session(session, on_torn=lambda seg, line: torn.append((seg, line))):
            if r.get("type") == "session":
                offset_ns = r.get("boot_to_wall_offset_ns")
            if types and r.get("type") not in types:
                continue
            if pids and r.get("pid") not in pids:
                continue
            out.write((json.dumps(r, separators=(",", ":")) if args.json else _fmt(r, offset_ns)) + "\n")
    except BrokenPipeError:
        return 0
    for seg, line in torn:
        print(f"buildidd: skipped a torn or corrupt record in {seg} line {line}", file=sys.stderr)
    return 0


def register(sub) -> None:
    """Add ``show`` to the subcommand parsers."""
    show = sub.add_parser("show", help="decode a session to the terminal")
    show.add_argument("session", help="session directory, its name under the session root, or 'latest'")
    show.add_argument("--session-root", help="where to look for a session name")
    show.add_argument("--pid", type=int, action="append", help="only this pid (repeatable)")
    show.add_argument("--type", action="append",
                      choices=["session", "mmap", "exec", "fork", "exit", "comm", "lost", "end"],
                      help="only records of this type (repeatable)")
    show.add_argument("--json", action="store_true", help="JSON lines instead of text")
    show.set_defaults(func=cmd_show)

"""Command line: ``buildidd run | record | show``."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

from . import __version__, clock
from . import config as configmod
from .errors import BuildiddError
from .sessionlog import read_session

log = logging.getLogger("buildidd")


def _config_from_args(args) -> configmod.Config:
    cfg = configmod.load(args.config, required=args.config != configmod.DEFAULT_CONFIG_PATH)
    return cfg.replace(session_root=args.session_root, segment_max_bytes=args.segment_max_bytes,
                       segment_max_age_s=args.segment_max_age,
                       compress=False if args.no_compress else None,
                       control_socket=getattr(args, "control_socket", None),
                       store_root=args.store_root)


def _add_session_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=configmod.DEFAULT_CONFIG_PATH,
                   help="TOML configuration file (default %(default)s; absent is fine)")
    p.add_argument("--session-root", help="directory of session directories "
                   f"(default {configmod.Config.session_root})")
    p.add_argument("--session-dir", help="exact directory for this session (overrides --session-root)")
    p.add_argument("--segment-max-bytes", type=int, help="rotate a segment at this size (bytes)")
    p.add_argument("--segment-max-age", type=float, help="rotate a segment at this age (seconds)")
    p.add_argument("--no-compress", action="store_true", help="keep closed segments uncompressed")
    p.add_argument("--store-root", help="build-id store for binary snapshots "
                   f"(default {configmod.Config.store_root}; '' disables snapshots)")


def cmd_run(args) -> int:
    """`buildidd run`: record the host until SIGTERM/SIGINT (or --duration); SIGHUP reloads and rotates."""
    from .daemon import Recorder
    from .service import Signals, Ticker, notify, watchdog_interval_s

    cfg = _config_from_args(args)
    signals = Signals()
    rec = Recorder(cfg, session_dir=args.session_dir)
    log.info("loading BPF programs and synthesizing running processes ...")
    rec.start()
    server = None
    if cfg.control_socket:
        from .control.handlers import make_handlers
        from .control.server import ControlServer
        server = ControlServer(cfg.control_socket, make_handlers(rec), group=cfg.control_group)
        server.start()
    notify(f"READY=1\nSTATUS=recording into {rec.session_dir}")
    log.info("recording into %s (ready in %.2f s, %d mappings synthesized)",
             rec.session_dir, rec.ready_s, rec.stats.synthesized)
    status = Ticker(2.0, lambda: notify(f"STATUS={rec.status_line()}"))
    watchdog = Ticker(watchdog_interval_s(), lambda: notify("WATCHDOG=1"))

    def tick():
        now = time.monotonic()
        status.poke(now)
        watchdog.poke(now)
        if signals.reload:
            signals.reload = False
            try:
                rec.reconfigure(_config_from_args(args))
                log.info("configuration reloaded")
            except BuildiddError as e:
                log.error("reload failed, keeping the old configuration: %s", e)
            rec.rotate()

    def should_stop():
        return signals.stop or (args.duration is not None
                                and time.monotonic() - rec.started_mono >= args.duration)

    profiler = None
    if args.profile:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    try:
        rec.run(should_stop, tick)
    finally:
        notify("STOPPING=1")
        if server is not None:
            server.stop()
        rec.close()
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(args.profile)
    log.info("session closed: %s", rec.session_dir)
    return 0


def cmd_record(args) -> int:
    """`buildidd record -- CMD`: a session around one command and its descendants; exits with its status."""
    from .daemon import Recorder

    if not args.command:
        log.error("record: give a command after --")
        return 2
    cfg = _config_from_args(args)
    rec = Recorder(cfg, session_dir=args.session_dir, follow=True)
    rec.start()
    try:
        child = subprocess.Popen(args.command)
    except OSError as e:
        rec.close()
        log.error("cannot run %s: %s", args.command[0], e)
        return 127
    rec.follow(child.pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the child gets it; we end with it
    # SIGTERM to us ends the command; the session then closes normally.
    signal.signal(signal.SIGTERM, lambda _s, _f: child.terminate())
    try:
        rec.run(lambda: child.poll() is not None)
    finally:
        child.wait()
        rec.close()
    summary = _dso_summary(rec.session_dir)
    print(f"buildidd: session {rec.session_dir}", file=sys.stderr)
    for path, bid, err in summary:
        print(f"  {bid or '-':<40}  {path}{'  (' + err + ')' if err else ''}", file=sys.stderr)
    return child.returncode if child.returncode >= 0 else 128 - child.returncode


def _dso_summary(session_dir: Path) -> list[tuple[str, str | None, str | None]]:
    seen = {}
    for r in read_session(session_dir):
        if r.get("type") == "mmap":
            seen.setdefault((r["path"], r["build_id"]), r.get("error"))
    return sorted((p, b, e) for (p, b), e in seen.items())


def _resolve_session(arg: str, root: str) -> Path:
    p = Path(arg)
    if p.is_dir():
        return p
    if arg == "latest":
        dirs = sorted(d for d in Path(root).iterdir() if d.is_dir()) if Path(root).is_dir() else []
        if dirs:
            return dirs[-1]
    elif (Path(root) / arg).is_dir():
        return Path(root) / arg
    raise BuildiddError(f"no session {arg!r} (looked in . and {root})")


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
    session = _resolve_session(args.session, args.session_root or cfg.session_root)
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


def _client(args):
    from .control.client import ControlClient
    return ControlClient(args.socket, timeout_s=args.timeout)


def _human_status(s: dict) -> str:
    lines = [f"session   {s['session']}  ({s['session_dir']})",
             f"uptime    {s['uptime_s']:.0f} s (ready in {s['ready_s']:.2f} s)"]
    ev, rate = s.get("events", {}), s.get("events_per_s", {})
    lines.append("events    " + ", ".join(f"{k} {v} ({rate.get(k, 0):.0f}/s)" for k, v in sorted(ev.items())))
    lost = s.get("lost") or {}
    lines.append(f"lost      {sum(lost.values())}" + (f" ({lost})" if lost else ""))
    ic = s.get("identity_cache", {})
    hr = ic.get("hit_rate")
    lines.append(f"identity  {ic.get('entries', 0)} cached, hit rate {hr * 100:.2f}%" if hr is not None
                 else f"identity  {ic.get('entries', 0)} cached")
    missing = s.get("build_ids_missing") or {}
    lines.append(f"build-ids {s.get('build_ids_resolved', 0)} resolved, {sum(missing.values())} missing"
                 + (f" ({', '.join(f'{k} {v}' for k, v in sorted(missing.items()))})" if missing else ""))
    snap = s.get("snapshots")
    if snap:
        lines.append(f"snapshots {snap.get('stored', 0)} stored, {snap.get('queued', 0)} queued, "
                     f"{snap.get('failed', 0)} failed; store {snap.get('store_bytes', 0) / 2**20:.1f} MiB"
                     f" of {snap.get('quota_bytes') and snap['quota_bytes'] / 2**20 or 'unlimited'} MiB")
    for e in s.get("last_errors") or []:
        lines.append(f"error     {e.get('error')}")
    return "\n".join(lines)


def cmd_status(args) -> int:
    """`buildidd status`: the daemon's status over the control socket."""
    with _client(args) as c:
        s = c.request("status")
    print(json.dumps(s, indent=2) if args.json else _human_status(s))
    return 0


def cmd_rotate(args) -> int:
    """`buildidd rotate`: close the daemon's current segment."""
    with _client(args) as c:
        r = c.request("rotate")
    print("rotated" + (f"; now writing {r['segment']}" if r.get("segment") else
                       "; the next segment opens with the next record"))
    return 0


def cmd_lookup(args) -> int:
    """`buildidd lookup PID ADDR`: the mapping, file, offset and build-id covering ADDR now."""
    with _client(args) as c:
        r = c.request("lookup", pid=args.pid, addr=int(args.addr, 0))
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print(f"{r['start']:#x}-{r['end']:#x} {r['perms']} +{r['file_offset']:#x} {r['path']}"
              f"{' (deleted)' if r['deleted'] else ''} {r['build_id'] or '(' + str(r['error']) + ')'}")
    return 0


def _add_client_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", default=configmod.Config.control_socket, help="control socket (default %(default)s)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the daemon")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of every subcommand."""
    p = argparse.ArgumentParser(prog="buildidd", description="Record executable mappings with exact build-ids.")
    p.add_argument("--version", action="version", version=f"buildidd {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="cmd", required=True)

    run = sub.add_parser("run", help="record this host in the foreground until SIGTERM/SIGINT")
    _add_session_options(run)
    run.add_argument("--duration", type=float, help="stop after this many seconds")
    run.add_argument("--profile", metavar="FILE", help="write a cProfile of the event loop to FILE")
    run.add_argument("--control-socket", help="control socket path ('' disables it)")
    run.set_defaults(func=cmd_run)

    rec = sub.add_parser("record", help="record one command and its descendants: record -- CMD ...")
    _add_session_options(rec)
    rec.add_argument("command", nargs=argparse.REMAINDER)
    rec.set_defaults(func=cmd_record)

    show = sub.add_parser("show", help="decode a session to the terminal")
    show.add_argument("session", help="session directory, its name under the session root, or 'latest'")
    show.add_argument("--session-root", help="where to look for a session name")
    show.add_argument("--pid", type=int, action="append", help="only this pid (repeatable)")
    show.add_argument("--type", action="append",
                      choices=["session", "mmap", "exec", "fork", "exit", "comm", "lost", "end"],
                      help="only records of this type (repeatable)")
    show.add_argument("--json", action="store_true", help="JSON lines instead of text")
    show.set_defaults(func=cmd_show)

    st = sub.add_parser("status", help="ask the running daemon what it is doing")
    _add_client_options(st)
    st.add_argument("--json", action="store_true", help="the same as JSON")
    st.set_defaults(func=cmd_status)
    ro = sub.add_parser("rotate", help="close the daemon's current segment")
    _add_client_options(ro)
    ro.set_defaults(func=cmd_rotate)
    lk = sub.add_parser("lookup", help="which mapping, file, offset and build-id cover PID's ADDR now")
    _add_client_options(lk)
    lk.add_argument("pid", type=int)
    lk.add_argument("addr", help="address (0x... hex or decimal)")
    lk.add_argument("--json", action="store_true")
    lk.set_defaults(func=cmd_lookup)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse, set up logging, run the subcommand; returns the exit status."""
    args = build_parser().parse_args(argv)
    if getattr(args, "command", None) and args.command[:1] == ["--"]:
        args.command = args.command[1:]
    from .service import setup_logging
    setup_logging(args.verbose)
    try:
        return args.func(args)
    except BuildiddError as e:
        log.error("%s", e)
        return 1
    except OSError as e:   # the control socket is absent or refused us
        log.error("%s", e)
        return 1


if __name__ == "__main__":
    sys.exit(main())

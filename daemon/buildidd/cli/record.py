"""``buildidd run`` and ``buildidd record``: the recording verbs."""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

from buildidd.cli.common import add_session_options, config_from_args
from buildidd.errors import BuildiddError
from buildidd.sessionlog import read_session

log = logging.getLogger("buildidd")


def cmd_run(args) -> int:
    """`buildidd run`: record the host until SIGTERM/SIGINT (or --duration); SIGHUP reloads and rotates."""
    from buildidd.capture.recorder import Recorder
    from buildidd.cli.service import Signals, Ticker, notify, watchdog_interval_s

    cfg = config_from_args(args)
    signals = Signals()
    rec = Recorder(cfg, session_dir=args.session_dir)
    log.info("loading BPF programs and synthesizing running processes ...")
    rec.start()
    server = None
    if cfg.control_socket:
        from buildidd.control.handlers import make_handlers
        from buildidd.control.server import ControlServer, ServerOptions
        server = ControlServer(cfg.control_socket, make_handlers(rec), ServerOptions(group=cfg.control_group))
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
                rec.reconfigure(config_from_args(args))
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
    from buildidd.capture.recorder import Recorder

    if not args.command:
        log.error("record: give a command after --")
        return 2
    cfg = config_from_args(args)
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


def register(sub) -> None:
    """Add ``run`` and ``record`` to the subcommand parsers."""
    run = sub.add_parser("run", help="record this host in the foreground until SIGTERM/SIGINT")
    add_session_options(run)
    run.add_argument("--duration", type=float, help="stop after this many seconds")
    run.add_argument("--profile", metavar="FILE", help="write a cProfile of the event loop to FILE")
    run.add_argument("--control-socket", help="control socket path ('' disables it)")
    run.set_defaults(func=cmd_run)

    rec = sub.add_parser("record", help="record one command and its descendants: record -- CMD ...")
    add_session_options(rec)
    rec.add_argument("command", nargs=argparse.REMAINDER)
    rec.set_defaults(func=cmd_record)

"""``buildidd run`` and ``buildidd record``: the recording verbs."""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
from pathlib import Path

from buildidd.cli.common import (add_session_options, config_from_args, duration_arg, listening_pid,
                                 require_recording_privileges)
from buildidd import heap
from buildidd.errors import BuildiddError, UsageError
from buildidd.sessionlog import read_session

log = logging.getLogger("buildidd")


def cmd_run(args) -> int:
    """`buildidd run`: record the host until SIGTERM/SIGINT (or --duration); SIGHUP reloads and rotates
    (the lifecycle: cli.daemon.Daemon)."""
    cfg = config_from_args(args)
    require_recording_privileges("run")
    heap.configure()       # before any worker thread allocates
    if cfg.control_socket and (pid := listening_pid(cfg.control_socket)) is not None:
        raise BuildiddError(f"another buildidd (pid {pid}) already listens on {cfg.control_socket}; stop it "
                            "first (systemctl stop buildidd), or give this one --control-socket PATH or ''")
    from buildidd.cli.daemon import Daemon
    daemon = Daemon(cfg, lambda: config_from_args(args), session_dir=args.session_dir, duration_s=args.duration)
    daemon.start()
    profiler = None
    if args.profile:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    try:
        daemon.run()
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(args.profile)
    log.info("session closed: %s", daemon.rec.session_dir)
    return 0


def cmd_record(args) -> int:
    """`buildidd record -- CMD`: a session around one command and its descendants; exits with its status."""
    if not args.command:
        raise UsageError("record: give the command after --: buildidd record -- make -j8")
    cfg = config_from_args(args)
    require_recording_privileges("record")
    heap.configure()       # before any worker thread allocates
    from buildidd.capture.recorder import Recorder
    rec = Recorder(cfg, session_dir=args.session_dir, follow=True)
    rec.start()
    try:
        child = subprocess.Popen(args.command)
    except OSError as e:
        rec.close()
        # As a shell: 127 command not found, 126 found but not executable.
        log.error("cannot run %s: %s", args.command[0], e.strerror or e)
        return 127 if isinstance(e, FileNotFoundError) else 126
    rec.follow(child.pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the child gets it; we end with it
    # SIGTERM to us ends the command; the session then closes normally.
    signal.signal(signal.SIGTERM, lambda _s, _f: child.terminate())
    try:
        rec.run(lambda: child.poll() is not None)
    except BuildiddError as e:  # the recording failed; the command's status is still ours
        log.error("recording stopped: %s; the command ran on unrecorded", e)
    finally:
        child.wait()
        rec.close()
    print(f"buildidd: session {rec.session_dir}", file=sys.stderr)
    for path, bid, err in _dso_summary(rec.session_dir):
        print(f"  {bid or '-':<40}  {path}{'  (' + err + ')' if err else ''}", file=sys.stderr)
    return exit_status(child.returncode)


def exit_status(returncode: int) -> int:
    """A Popen.returncode as a shell reports it: the exit code, or 128+N for a signal N (returncode -N)."""
    return returncode if returncode >= 0 else 128 - returncode


def _dso_summary(session_dir: Path) -> list[tuple[str, str | None, str | None]]:
    """(path, build-id hex or None, error or None) of each distinct mapped file, sorted by path.

    A path may appear with a build-id and without one (a file replaced between
    two runs, or unreadable once): None sorts before any string.
    """
    seen = {}
    for r in read_session(session_dir):
        if r.get("type") == "mmap":
            seen.setdefault((r.get("path") or "", r.get("build_id")), r.get("error"))
    return sorted(((p, b, e) for (p, b), e in seen.items()),
                  key=lambda t: (t[0], t[1] is not None, t[1] or "", t[2] or ""))


def register(sub) -> None:
    """Add ``run`` and ``record`` to the subcommand parsers."""
    run = sub.add_parser("run", help="record this host in the foreground until SIGTERM/SIGINT",
                         description="Record every executable mapping of this host into a new session until "
                                     "SIGTERM or SIGINT (or --duration); SIGHUP re-reads the configuration and "
                                     "rotates. What buildidd.service runs. Needs root (CAP_BPF, CAP_PERFMON, "
                                     "CAP_SYS_ADMIN).")
    add_session_options(run)
    run.add_argument("--duration", type=duration_arg, metavar="DURATION",
                     help="stop after this long (seconds, or with a unit: 10min)")
    run.add_argument("--profile", metavar="FILE", help="write a cProfile of the event loop to FILE")
    run.add_argument("--control-socket", metavar="PATH", help="control socket path ('' disables it)")
    run.set_defaults(func=cmd_run)

    rec = sub.add_parser("record", help="record one command and its descendants: record -- CMD ...",
                         description="Run CMD and record the executable mappings of it and its descendants "
                                     "into a new session; print the files mapped with their build-ids; exit "
                                     "with CMD's status (128+N if signal N ended it). Needs root.")
    add_session_options(rec)
    rec.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD [ARG ...]",
                     help="the command to run and its arguments, after --")
    rec.set_defaults(func=cmd_record)

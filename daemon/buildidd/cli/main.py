"""Command line: ``buildidd VERB``; each verb family is a module of this package with a register().

Exit status (README "Exit codes"; kept stable for scripts): 0 success, 1
failure, 2 usage error, 3 daemon not running, 4 permission denied; ``record``
exits with its command's status (128+N when a signal N ended it).  Errors are
one line on stderr naming the thing and the fix; ``-v`` adds the traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from buildidd import __version__
from buildidd.cli import analyze, archive, checkconfig, ctl, fleet, record, serve, show
from buildidd.cli.manpage import print_man
from buildidd.errors import BuildiddError

log = logging.getLogger("buildidd")

#: The verb families, in the order ``buildidd --help`` lists them.
FAMILIES = (record, show, ctl, checkconfig, serve, archive, analyze, fleet)

EXIT_STATUS = """\
exit status:
  0  success                    3  the daemon is not running (no control socket)
  1  failure                    4  permission denied (not root, not in the control group, a serve's 401/403)
  2  usage error                record: the command's own status (128+N for signal N)"""


class _TopHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``buildidd --help``: each command and its help on one line (room for long command names)."""

    def __init__(self, prog: str):
        super().__init__(prog, max_help_position=32)

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        if isinstance(action, argparse._SubParsersAction):  # argparse counts the commands one indent short
            longest = max((len(name) for name in action.choices), default=0)
            self._action_max_length = max(self._action_max_length, self._current_indent + 2 * self._indent_increment
                                          + longest)


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of every subcommand."""
    p = argparse.ArgumentParser(prog="buildidd", description="Record executable mappings with exact build-ids.",
                                epilog=EXIT_STATUS, formatter_class=_TopHelpFormatter)
    p.add_argument("--version", action="version", version=f"buildidd {__version__}",
                   help="print the version and exit")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging; tracebacks with errors")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND", title="commands")
    for family in FAMILIES:
        family.register(sub)
    man = sub.add_parser("help-man", help="print the manual page (roff) generated from this parser",
                         description="Print buildidd(8) in roff, generated from the argument parser: "
                                     "buildidd help-man | man -l -")
    man.set_defaults(func=lambda _args: print_man(p))
    return p


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


#: Options whose value may start with "-" (relative times as journalctl's: --since -1h, --time -40s).
_DASHED_VALUES = ("--since", "--until", "--time")


def _attach_dashed_values(argv: list[str]) -> list[str]:
    """``--since -1h`` → ``--since=-1h`` (argparse would take -1h for an option), up to a ``--``."""
    out = []
    i = 0
    while i < len(argv):
        if argv[i] == "--":
            return out + argv[i:]
        if argv[i] in _DASHED_VALUES and i + 1 < len(argv) and argv[i + 1][:2].lstrip("-+")[:1].isdigit():
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def _permission_hint(path) -> str:
    """What to do about a permission refused on path: run as root, or the option naming a directory of
    one's own when path lies under the system's session or store root."""
    from buildidd.config import Config
    path = str(path or "")
    for root, option in ((Config.session_root, "--session-root"), (Config.store_root, "--store-root")):
        if path == root or path.startswith(root.rstrip("/") + "/"):
            return f"run as root, or give {option} DIR (a directory of yours)"
    return "run as root"


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse, set up logging, run the subcommand; returns the exit status (see module doc).

    A reader of stdout that is gone (``buildidd status --json | head -c100``) has what it wanted:
    nothing is said, exit status 0.
    """
    try:
        return _main(argv)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # nothing more to flush at exit
        return 0


def _main(argv: list[str] | None) -> int:
    try:
        args = build_parser().parse_args(_attach_dashed_values(sys.argv[1:] if argv is None else list(argv)))
    except SystemExit:
        sys.stdout.flush()        # --help, --version: a reader gone is caught by main()
        raise
    if getattr(args, "command", None) and args.command[:1] == ["--"]:
        args.command = args.command[1:]
    from buildidd.cli.service import setup_logging
    setup_logging(args.verbose)
    try:
        rc = args.func(args)
        sys.stdout.flush()        # here, not at exit: a reader gone (`| head`) is then caught below
        return rc
    except BrokenPipeError:
        raise                     # main(): the reader is gone
    except BuildiddError as e:
        log.error("%s", _one_line(e), exc_info=args.verbose)
        return e.exit_code
    except PermissionError as e:
        log.error("%s; %s", _one_line(e), _permission_hint(getattr(e, "filename", None)), exc_info=args.verbose)
        return 4
    except OSError as e:
        log.error("%s", _one_line(e), exc_info=args.verbose)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a bug: still one line, the traceback with -v
        log.error("internal error: %s: %s (run with -v for the traceback)", type(e).__name__, _one_line(e),
                  exc_info=args.verbose)
        return 1


if __name__ == "__main__":
    sys.exit(main())

"""Command line: ``buildidd VERB``; each verb family is a module of this package with a register()."""

from __future__ import annotations

import argparse
import logging
import sys

from buildidd import __version__
from buildidd.cli import analyze, archive, ctl, record, serve, show
from buildidd.errors import BuildiddError

log = logging.getLogger("buildidd")

#: The verb families, in the order ``buildidd --help`` lists them.
FAMILIES = (record, show, ctl, serve, archive, analyze)


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of every subcommand."""
    p = argparse.ArgumentParser(prog="buildidd", description="Record executable mappings with exact build-ids.")
    p.add_argument("--version", action="version", version=f"buildidd {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="cmd", required=True)
    for family in FAMILIES:
        family.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse, set up logging, run the subcommand; returns the exit status."""
    args = build_parser().parse_args(argv)
    if getattr(args, "command", None) and args.command[:1] == ["--"]:
        args.command = args.command[1:]
    from buildidd.cli.service import setup_logging
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

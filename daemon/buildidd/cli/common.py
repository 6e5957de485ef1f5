"""What the verb families share: session and client options, config from arguments, SESSION names."""

from __future__ import annotations

import argparse
from pathlib import Path

from buildidd import config as configmod
from buildidd.errors import BuildiddError


def config_from_args(args) -> configmod.Config:
    """The Config of a run/record invocation: the config file, then the command-line overrides."""
    cfg = configmod.load(args.config, required=args.config != configmod.DEFAULT_CONFIG_PATH)
    return cfg.replace(session_root=args.session_root, segment_max_bytes=args.segment_max_bytes,
                       segment_max_age_s=args.segment_max_age,
                       compress=False if args.no_compress else None,
                       control_socket=getattr(args, "control_socket", None),
                       store_root=args.store_root)


def add_session_options(p: argparse.ArgumentParser) -> None:
    """--config, --session-root, --session-dir, segment limits, --no-compress, --store-root."""
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


def resolve_session(arg: str, root: str) -> Path:
    """SESSION as given: a session directory, a name under root, or ``latest``.

    Raises:
        BuildiddError: no such session.
    """
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


def add_client_options(p: argparse.ArgumentParser) -> None:
    """--socket and --timeout of the commands that talk to the daemon."""
    p.add_argument("--socket", default=configmod.Config.control_socket, help="control socket (default %(default)s)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the daemon")


def add_roots_options(p: argparse.ArgumentParser) -> None:
    """--config, --session-root, --store-root: the options every offline verb shares with ``run``."""
    p.add_argument("--config", default=configmod.DEFAULT_CONFIG_PATH,
                   help="TOML configuration file (default %(default)s; absent is fine)")
    p.add_argument("--session-root", help="directory of session directories "
                   f"(default from the config: {configmod.Config.session_root})")
    p.add_argument("--store-root", help="build-id store "
                   f"(default from the config: {configmod.Config.store_root})")


def roots_from_args(args) -> configmod.Config:
    """The Config of an offline verb: the config file, then --session-root/--store-root.

    Raises:
        ConfigError: the config file is invalid (or named and absent).
    """
    cfg = configmod.load(args.config, required=args.config != configmod.DEFAULT_CONFIG_PATH)
    return cfg.replace(session_root=args.session_root, store_root=args.store_root)

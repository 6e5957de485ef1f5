"""``buildidd check-config [FILE]``: a configuration checked as ``run`` and a reload (SIGHUP) would read it."""

from __future__ import annotations

import dataclasses
import os

from buildidd import config as configmod
from buildidd.cli.common import paragraph


def _shown(key: str, value) -> str:
    if key.endswith(("_bytes", "_bytes_per_s")) and isinstance(value, int):
        return configmod.format_size(value)
    return repr(value) if isinstance(value, str) else str(value)


def cmd_check_config(args) -> int:
    """`buildidd check-config [FILE]`: load FILE with the daemon's own loader (config.load).

    Prints ``FILE: valid`` and every key whose value differs from its default
    (``key = value (default D)``); exit 0.  An invalid file raises the loader's
    ConfigError (one line naming the file, the key and the fix; exit 1); a FILE
    named and absent is an error, the default path absent is valid (the
    defaults apply, as at start-up).
    """
    path = args.file or configmod.DEFAULT_CONFIG_PATH
    explicit = args.file is not None
    cfg = configmod.load(path, required=explicit)
    if not explicit and not os.path.exists(path):
        print(f"{path}: absent; the defaults apply (as buildidd run would start)")
        return 0
    changed = [(f.name, getattr(cfg, f.name), f.default) for f in dataclasses.fields(cfg)
               if getattr(cfg, f.name) != f.default]
    print(f"{path}: valid; {len(changed)} key(s) differ from the defaults"
          + ("" if not changed else ":"))
    for key, value, default in changed:
        print(f"  {key} = {_shown(key, value)}  (default {_shown(key, default)})")
    return 0


def register(sub) -> None:
    """Add ``check-config`` to the subcommand parsers."""
    p = sub.add_parser("check-config", help="check a configuration file before a reload or a start",
                       description=paragraph("Read FILE as buildidd run and systemctl reload buildidd (SIGHUP) "
                                             "read it: unknown keys (with the closest known ones), units, "
                                             "ranges. Prints the keys that differ from their defaults. "
                                             "Exit status 1 when the file would be refused."))
    p.add_argument("file", nargs="?", metavar="FILE",
                   help=f"the configuration file (default {configmod.DEFAULT_CONFIG_PATH})")
    p.set_defaults(func=cmd_check_config)

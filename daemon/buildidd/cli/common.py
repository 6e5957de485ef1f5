"""What the verb families share: options, config from arguments, SESSION names, the daemon client, privileges.

Errors raised here carry the command's exit status (``BuildiddError.exit_code``;
main() turns them into one line on stderr): 2 for a malformed argument, 3 when
no daemon answers, 4 for a missing capability or permission.
"""

from __future__ import annotations

import argparse
import os
import socket
import struct
import textwrap
from pathlib import Path

from buildidd import config as configmod
from buildidd.errors import BuildiddError, ConfigError, NotRunningError, PrivilegeError

#: Capabilities ``run`` and ``record`` need, by number (linux/capability.h):
#: loading and attaching BPF programs, and opening /proc/PID/map_files.
RECORDING_CAPABILITIES = {"CAP_SYS_ADMIN": 21, "CAP_PERFMON": 38, "CAP_BPF": 39}


def paragraph(text: str) -> str:
    """A --help description filled to 78 columns, for parsers whose epilog keeps its line breaks
    (argparse.RawDescriptionHelpFormatter)."""
    return textwrap.fill(text, 78)


def size_arg(text: str) -> int:
    """argparse type of a size option: bytes, or a number with K/M/G (config.parse_size)."""
    try:
        return configmod.parse_size(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def duration_arg(text: str) -> float:
    """argparse type of a duration option: seconds, or a number with a unit (config.parse_duration)."""
    try:
        return configmod.parse_duration(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


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
    p.add_argument("--session-root", metavar="DIR", help="directory of session directories "
                   f"(default {configmod.Config.session_root})")
    p.add_argument("--session-dir", metavar="DIR",
                   help="exact directory for this session (overrides --session-root)")
    p.add_argument("--segment-max-bytes", type=size_arg, metavar="SIZE",
                   help="rotate a segment at this size (bytes, or with K/M/G: 64M)")
    p.add_argument("--segment-max-age", type=duration_arg, metavar="DURATION",
                   help="rotate a segment at this age (seconds, or with a unit: 30min, 1h)")
    p.add_argument("--no-compress", action="store_true", help="keep closed segments uncompressed")
    p.add_argument("--store-root", metavar="DIR", help="build-id store for binary snapshots "
                   f"(default {configmod.Config.store_root}; '' disables snapshots)")


def user_session_root() -> str:
    """A non-root analyst's session root: ``$XDG_DATA_HOME/buildidd/sessions`` (XDG Base Directory
    Specification; ``~/.local/share`` when XDG_DATA_HOME is unset or not absolute)."""
    base = os.environ.get("XDG_DATA_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "buildidd", "sessions")


def effective_session_root(configured: str, given: str | None) -> str:
    """The session root of an offline verb: given (--session-root), else the configured one; for a user
    other than root, the configuration's default (the system's, root's) becomes :func:`user_session_root`."""
    if given:
        return given
    if os.geteuid() != 0 and configured == configmod.Config.session_root:
        return user_session_root()
    return configured


def session_roots(root: str) -> list[str]:
    """Where SESSION is looked for: root, then, for a user other than root whose root is their own
    (:func:`user_session_root`), the system's session root when they may read it."""
    roots = [root]
    system = configmod.Config.session_root
    if os.geteuid() != 0 and root == user_session_root() and os.access(system, os.R_OK | os.X_OK):
        roots.append(system)
    return roots


def is_session(path: Path) -> bool:
    """Whether path is a directory holding a session log (segment-NNNNNN.jsonl[.zst] files)."""
    from buildidd.sessionlog import SEGMENT_GLOB
    return path.is_dir() and next(path.glob(SEGMENT_GLOB), None) is not None


def resolve_session(arg: str, root: str) -> Path:
    """SESSION as given: a session directory, a name under root, or ``latest`` (the newest under root).

    Raises:
        BuildiddError: no such session, or the directory holds no session log.
    """
    p = Path(arg)
    roots = session_roots(root)
    looked = " and ".join(roots)
    if not p.is_dir():
        if arg == "latest":
            for r in roots:        # the newest of the first root that holds one
                dirs = sorted(d for d in Path(r).iterdir() if is_session(d)) if os.path.isdir(r) else []
                if dirs:
                    p = dirs[-1]
                    break
            else:
                raise BuildiddError(f"no session under {looked}{_whose(root)}; give a session directory or "
                                    "--session-root DIR")
        elif (found := next((Path(r) / arg for r in roots if (Path(r) / arg).is_dir()), None)) is not None:
            p = found
        else:
            raise BuildiddError(f"no session {arg!r} (looked in . and {looked}{_whose(root)}); "
                                "give a session directory, its name under --session-root, or 'latest'")
    if not is_session(p):
        raise BuildiddError(f"{p} is not a buildidd session (no segment-*.jsonl files in it); "
                            "give a session directory, its name under --session-root, or 'latest'")
    return p


def _whose(root: str) -> str:
    """For a user other than root, why root is theirs (and how to read the system's)."""
    if os.geteuid() == 0 or root != user_session_root():
        return ""
    system = configmod.Config.session_root
    return (f"; {root} is yours as you are not root (buildidd import puts sessions there)"
            + ("" if os.access(system, os.R_OK | os.X_OK) else f", {system} is not readable by you"))


def add_client_options(p: argparse.ArgumentParser) -> None:
    """--socket and --timeout of the commands that talk to the daemon."""
    p.add_argument("--socket", metavar="PATH", default=configmod.Config.control_socket,
                   help="the daemon's control socket (default %(default)s)")
    p.add_argument("--timeout", type=duration_arg, metavar="DURATION", default=10.0,
                   help="how long to wait for the daemon's answer (default %(default)s s)")


def daemon_request(args, cmd: str, **kwargs):
    """Send cmd with kwargs to the daemon on args.socket (timeout args.timeout s); its result.

    Raises:
        NotRunningError: nothing listens on the socket (absent or stale).
        PrivilegeError: the socket or the daemon refused this user.
        BuildiddError: no answer in time, or the daemon answered with an error
            (``.code`` of the ControlError kept as ``__cause__``).
    """
    from buildidd.control.client import ControlClient
    from buildidd.control.protocol import PERMISSION_DENIED, ControlError

    path = args.socket
    try:
        with ControlClient(path, timeout_s=args.timeout) as c:
            return c.request(cmd, **kwargs)
    except FileNotFoundError as e:
        raise NotRunningError(f"no buildidd listening on {path}; is buildidd.service running? "
                              "(systemctl start buildidd, or --socket PATH)") from e
    except ConnectionRefusedError as e:
        raise NotRunningError(f"no buildidd listening on {path} (a stale socket: the daemon that made it "
                              "is gone); is buildidd.service running? (systemctl restart buildidd)") from e
    except PermissionError as e:
        raise PrivilegeError(f"permission denied on {path}; run as root or as a member of group "
                             f"'{socket_group(path, getattr(args, 'config', None))}'") from e
    except TimeoutError as e:
        raise BuildiddError(f"buildidd on {path} did not answer within {args.timeout:g} s; "
                            "see systemctl status buildidd, or raise --timeout") from e
    except ControlError as e:
        if e.code == PERMISSION_DENIED:
            raise PrivilegeError(f"buildidd on {path} refused this user ({e.message}); run as root or as a "
                                 f"member of group '{configmod.Config.control_group}'") from e
        raise
    except OSError as e:
        raise BuildiddError(f"cannot talk to buildidd on {path}: {e.strerror or e}") from e


def socket_group(path: str, config_path: str | None = None) -> str:
    """The group whose members may use the control socket at path: the socket's own group when it grants
    its group access (the daemon gives it the configured ``control_group``, mode 0660), else the config
    file's ``control_group``, else the default's name."""
    import grp
    try:
        st = os.stat(path)
        if st.st_gid != 0 and st.st_mode & 0o060:
            return grp.getgrgid(st.st_gid).gr_name
    except (OSError, KeyError):
        pass
    try:
        return configmod.load(config_path).control_group if config_path else configmod.Config.control_group
    except (BuildiddError, OSError, AttributeError):
        return configmod.Config.control_group


def listening_pid(path: str) -> int | None:
    """The pid of the process listening on the unix socket path (SO_PEERCRED), or None when none does."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
        creds = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return struct.unpack("3i", creds)[0]
    except OSError:
        return None
    finally:
        probe.close()


def missing_capabilities(names: dict[str, int] = RECORDING_CAPABILITIES, status: str = "/proc/self/status") -> list[str]:
    """Which of the named capabilities (name → number) this process's effective set (CapEff) lacks.

    Raises:
        BuildiddError: /proc/self/status unreadable or without CapEff.
    """
    try:
        with open(status, encoding="ascii", errors="replace") as f:
            cap_eff = next((int(line.split()[1], 16) for line in f if line.startswith("CapEff:")), None)
    except (OSError, ValueError, IndexError) as e:
        raise BuildiddError(f"cannot read the capabilities in {status}: {e}") from e
    if cap_eff is None:
        raise BuildiddError(f"{status} has no CapEff line")
    return [name for name, bit in sorted(names.items(), key=lambda kv: kv[1]) if not cap_eff >> bit & 1]


def require_recording_privileges(verb: str) -> None:
    """Raise PrivilegeError naming what is missing when this process cannot load BPF programs."""
    missing = missing_capabilities()
    if missing:
        raise PrivilegeError(f"{verb} needs {', '.join(RECORDING_CAPABILITIES)}; this process lacks "
                             f"{', '.join(missing)}: run it as root (sudo buildidd {verb} ...)")


DEFAULT_DEBUG_DIR = "~/.debug"
"""The analyst's store: where ``import`` and ``pull`` install, and perf's default build-id cache
(perf's ``buildid.dir``; perf ignores PERF_BUILDID_DIR), for root and every other user alike."""


def add_roots_options(p: argparse.ArgumentParser) -> None:
    """--config, --session-root, --store-root, --debug-dir: the options every offline verb shares."""
    p.add_argument("--config", default=configmod.DEFAULT_CONFIG_PATH,
                   help="TOML configuration file (default %(default)s; absent is fine)")
    p.add_argument("--session-root", metavar="DIR", help="directory of session directories "
                   f"(default from the config: {configmod.Config.session_root}; for a user other than root: "
                   "$XDG_DATA_HOME/buildidd/sessions, then the system's when readable)")
    p.add_argument("--store-root", metavar="DIR", help="the host's build-id store, read first "
                   f"(default from the config: {configmod.Config.store_root}, when it exists and you may read "
                   "it; '' for none). Given alone, the only store read")
    p.add_argument("--debug-dir", metavar="DIR", help="the analyst's store: where import and pull install, "
                   f"read after --store-root (default {DEFAULT_DEBUG_DIR}, perf's build-id cache; not read "
                   "by default when --store-root is given)")


def roots_from_args(args) -> configmod.Config:
    """The Config of an offline verb: the config file, then --session-root/--store-root.

    Raises:
        ConfigError: the config file is invalid (or named and absent).
    """
    cfg = configmod.load(args.config, required=args.config != configmod.DEFAULT_CONFIG_PATH)
    return cfg.replace(session_root=effective_session_root(cfg.session_root, args.session_root),
                       store_root=args.store_root)


def debug_dir(args) -> str:
    """The analyst's store of an offline verb: --debug-dir, else :data:`DEFAULT_DEBUG_DIR`, ``~`` expanded."""
    return os.path.expanduser(getattr(args, "debug_dir", None) or DEFAULT_DEBUG_DIR)


def store_roots(cfg: configmod.Config, args) -> list[str]:
    """The stores an offline verb reads, in order, each a directory this user may list (the others,
    absent or closed to them, are left out): the host's (cfg.store_root: --store-root or the
    config's), then the analyst's (:func:`debug_dir`: what import wrote), which is left out when
    --store-root was given without --debug-dir.  The same for root and every other user."""
    wanted = [cfg.store_root]
    if getattr(args, "debug_dir", None) is not None or getattr(args, "store_root", None) is None:
        wanted.append(debug_dir(args))
    roots: list[str] = []
    for root in wanted:
        if root and os.path.isdir(root) and os.access(root, os.R_OK | os.X_OK) and \
                os.path.realpath(root) not in map(os.path.realpath, roots):
            roots.append(root)
    return roots


def open_stores(cfg: configmod.Config, args):
    """A :class:`buildidd.store.StoreChain` over :func:`store_roots`, or None when there is none."""
    from buildidd.store import Store, StoreChain

    roots = store_roots(cfg, args)
    return StoreChain([Store(r) for r in roots]) if roots else None

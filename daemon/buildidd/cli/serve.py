"""``buildidd serve`` and ``buildidd pull``: the store and sessions over HTTP (debuginfod protocol), and back."""

from __future__ import annotations

import logging
import sys

from buildidd.cli.common import add_roots_options, roots_from_args

log = logging.getLogger("buildidd")

STATUS_TIMEOUT_S = 2.0
"""Seconds ``/metrics`` waits for the recording daemon's status."""


def _status_fn(socket_path: str):
    """A callable returning the daemon's status over its control socket (offline never imports control)."""
    if not socket_path:
        return None

    def status() -> dict:
        from buildidd.control.client import ControlClient
        with ControlClient(socket_path, timeout_s=STATUS_TIMEOUT_S) as c:
            return c.request("status")

    return status


def cmd_serve(args) -> int:
    """`buildidd serve`: serve the store (debuginfod protocol), the sessions and metrics until SIGTERM."""
    from buildidd.offline.serve import DEFAULT_LISTEN, ServeOptions, parse_listen, read_token, run

    cfg = roots_from_args(args)
    host, port = parse_listen(args.listen or DEFAULT_LISTEN)
    opts = ServeOptions(host=host, port=port, store_root=cfg.store_root, session_root=cfg.session_root,
                        token=read_token(args.token_file) if args.token_file else None,
                        tls_cert=args.tls_cert, tls_key=args.tls_key, idle_timeout_s=args.idle_timeout,
                        spool_dir=args.spool_dir, share_private=cfg.store_share_private,
                        status_fn=_status_fn(args.socket if args.socket is not None else cfg.control_socket))

    def listening(bound_host: str, bound_port: int) -> None:
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        print(f"listening on {'https' if args.tls_cert else 'http'}://{shown}:{bound_port}", flush=True)

    run(opts, listening)
    return 0


def cmd_pull(args) -> int:
    """`buildidd pull URL [SESSION...]`: fetch sessions' archives from a serve and import them."""
    from buildidd.offline.pull import PullOptions, pull
    from buildidd.offline.serve import read_token

    cfg = roots_from_args(args)
    opts = PullOptions(url=args.url, sessions=tuple(args.sessions),
                       token=read_token(args.token_file) if args.token_file else None,
                       debug_dir=args.debug_dir, session_root=cfg.session_root, work_dir=args.work_dir,
                       timeout_s=args.timeout, cafile=args.cafile)
    for result in pull(opts, progress=sys.stderr.isatty()):
        print(f"{result.name}: imported into {result.session_dir} ({result.archive_bytes} bytes"
              f"{', resumed' if result.resumed else ''})")
    return 0


def register(sub) -> None:
    """Add ``serve`` and ``pull`` to the subcommand parsers."""
    sv = sub.add_parser("serve", help="serve the build-id store over the debuginfod protocol (and sessions, metrics)")
    add_roots_options(sv)
    sv.add_argument("--listen", metavar="HOST:PORT", help="an IP address and port ([V6]:PORT); default "
                    "127.0.0.1:8002; off loopback needs --token-file")
    sv.add_argument("--token-file", help="file holding the bearer token clients must send")
    sv.add_argument("--tls-cert", help="PEM certificate (chain) for HTTPS")
    sv.add_argument("--tls-key", help="PEM private key for HTTPS")
    sv.add_argument("--idle-timeout", type=float, default=15.0,
                    help="seconds a connection may take to send a request or stay idle (default %(default)s)")
    sv.add_argument("--spool-dir", help="where archives are built while sent (default: a private temporary "
                    "directory, removed at exit)")
    sv.add_argument("--socket", help="the recording daemon's control socket for /metrics "
                    "(default from the config; '' disables)")
    sv.set_defaults(func=cmd_serve)

    pl = sub.add_parser("pull", help="fetch session archives from a buildidd serve and import them")
    add_roots_options(pl)
    pl.add_argument("url", help="the serve's base URL, e.g. http://host:8002")
    pl.add_argument("sessions", nargs="*", metavar="SESSION", help="session names (default: all it lists)")
    pl.add_argument("--token-file", help="file holding the bearer token to send")
    pl.add_argument("--debug-dir", help="perf build-id cache to install binaries into (default ~/.debug)")
    pl.add_argument("--work-dir", help="where partial downloads are kept to be resumed "
                    "(default ~/.cache/buildidd/pull)")
    pl.add_argument("--timeout", type=float, default=60.0, help="seconds without progress before a retry")
    pl.add_argument("--cafile", help="CA certificate(s) to trust for an https URL")
    pl.set_defaults(func=cmd_pull)

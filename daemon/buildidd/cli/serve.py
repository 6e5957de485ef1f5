"""``buildidd serve`` and ``buildidd pull``: the store and sessions over HTTP (debuginfod protocol), and back."""

from __future__ import annotations

import logging
import sys

from buildidd.cli.common import add_roots_options, debug_dir, roots_from_args, store_roots
from buildidd.cli.leftout import add_list_option
from buildidd.errors import BuildiddError

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
    from buildidd.offline.serve.guard import GuardLimits
    from buildidd.store.store import group_id

    cfg = roots_from_args(args)
    roots = store_roots(cfg, args)
    if not roots:
        looked = " nor ".join(r for r in (cfg.store_root, debug_dir(args)) if r)
        raise BuildiddError(f"serve: no build-id store to serve: neither {looked} is a directory you may read; "
                            "buildidd import an archive first, or give --store-root DIR or --debug-dir DIR")
    host, port = parse_listen(args.listen or DEFAULT_LISTEN)
    limits = GuardLimits(max_connections=args.max_connections, max_streams=args.max_streams,
                         max_streams_per_peer=args.max_streams_per_peer, send_timeout_s=args.send_timeout)
    opts = ServeOptions(host=host, port=port, store_root=roots[0], more_store_roots=tuple(roots[1:]),
                        session_root=cfg.session_root,
                        token=read_token(args.token_file) if args.token_file else None,
                        tls_cert=args.tls_cert, tls_key=args.tls_key, idle_timeout_s=args.idle_timeout,
                        spool_dir=args.spool_dir, share_private=cfg.store_share_private,
                        status_fn=_status_fn(args.socket if args.socket is not None else cfg.control_socket),
                        limits=limits, unix_socket=args.unix_socket or "", group_gid=group_id(cfg.control_group),
                        metrics_public=cfg.serve_metrics_public)

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
                       debug_dir=debug_dir(args), session_root=cfg.session_root, work_dir=args.work_dir,
                       timeout_s=args.timeout, cafile=args.cafile, max_bytes=args.max_bytes,
                       deadline_s=args.deadline, untrusted=args.untrusted)
    from buildidd.cli.leftout import by_reason, left_out_lines, untrusted_lines
    for result in pull(opts, progress=sys.stderr.isatty()):
        r = result.report
        print(f"{result.name}: imported into {result.session_dir} ({result.archive_bytes} bytes"
              f"{', resumed' if result.resumed else ''}); build-ids: {len(r.installed)} installed, "
              f"{len(r.present)} already present, {len(r.upstream)} upstream, {len(r.missing)} missing"
              + by_reason(r.manifest))
        for line in left_out_lines(r.manifest, full=args.list_left_out) + untrusted_lines(
                r.manifest, r.untrusted, args.untrusted, debug_dir(args)):
            print(line)
    return 0


def register(sub) -> None:
    """Add ``serve`` and ``pull`` to the subcommand parsers."""
    sv = sub.add_parser("serve", help="serve the build-id store over the debuginfod protocol (and sessions, metrics)",
                        description="Serve the build-id store read-only over HTTP as a debuginfod server "
                                    "(/buildid/HEX/executable, debuginfo, section/NAME); the sessions' archives, "
                                    "/metrics (unless serve_metrics_public) and whether a build-id is held but "
                                    "private to callers with rights (a token, or root or the control group on the "
                                    "unix socket); to anyone else a private build-id is answered as one not held.  "
                                    "Loopback by default; any other address needs --token-file.  Slow and "
                                    "flooding clients are capped and cut.")
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
    sv.add_argument("--unix-socket", help="also listen on this unix socket: root and members of the control group "
                    "have rights there without a token (SO_PEERCRED): the session logs, /metrics, private build-ids")
    sv.add_argument("--send-timeout", type=float, default=30.0,
                    help="seconds a client may take no byte of its answer before it is cut "
                    "(default %(default)s)")
    sv.add_argument("--max-connections", type=int, default=0,
                    help="connections kept at most (default 0: from the descriptor limit)")
    sv.add_argument("--max-streams", type=int, default=64, help="answers in progress at most (default %(default)s)")
    sv.add_argument("--max-streams-per-peer", type=int, default=16,
                    help="answers in progress at most per peer address or uid (default %(default)s)")
    sv.set_defaults(func=cmd_serve)

    pl = sub.add_parser("pull", help="fetch session archives from a buildidd serve and import them",
                        description="Download the archives of SESSIONs (default: every session it lists) from a "
                                    "buildidd serve, resuming with Range, within --max-bytes and --deadline, and "
                                    "import each as buildidd import does.  The token goes only to the URL's own "
                                    "scheme, host and port.")
    add_roots_options(pl)
    pl.add_argument("url", help="the serve's base URL, e.g. http://host:8002")
    pl.add_argument("sessions", nargs="*", metavar="SESSION", help="session names (default: all it lists)")
    pl.add_argument("--token-file", help="file holding the bearer token to send")
    pl.add_argument("--work-dir", help="where partial downloads are kept to be resumed "
                    "(default ~/.cache/buildidd/pull)")
    pl.add_argument("--timeout", type=float, default=60.0, help="seconds without progress before a retry")
    pl.add_argument("--cafile", help="CA certificate(s) to trust for an https URL")
    pl.add_argument("--max-bytes", type=int, default=64 << 30,
                    help="refuse an archive larger than this many bytes (default %(default)s, also the ceiling)")
    pl.add_argument("--deadline", type=float, default=3600.0,
                    help="seconds one archive's download may take, retries included (default %(default)s)")
    pl.add_argument("--untrusted", choices=("mark", "skip", "refuse"), default="mark",
                    help="entries whose provenance is not 'trusted': install marked (default), skip, or refuse")
    add_list_option(pl)
    pl.set_defaults(func=cmd_pull)

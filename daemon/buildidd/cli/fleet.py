"""``buildidd push``: the store and closed sessions to an S3-compatible bucket (once, or as a service)."""

from __future__ import annotations

import json
import sys

from buildidd.cli.common import add_roots_options, debug_dir, roots_from_args
from buildidd.errors import UsageError


def _config(args):
    cfg = roots_from_args(args)
    return cfg.replace(push_bucket=args.bucket, push_endpoint_url=args.endpoint_url, push_prefix=args.prefix,
                       push_host=args.host, push_state_dir=args.state_dir, push_untrusted=args.untrusted)


def _print_status(status: dict, as_json: bool) -> None:
    if as_json:
        json.dump(status, sys.stdout, indent=1, sort_keys=True)
        print()
        return
    last = status.get("last_pass") or {}
    backlog = status.get("backlog") or {}
    totals = status.get("totals") or {}
    print(f"bucket {status.get('bucket')} prefix {status.get('prefix')!r} host {status.get('host')} "
          f"endpoint {status.get('endpoint') or '(AWS)'}")
    print(f"backlog: {backlog.get('entries', 0)} binaries ({backlog.get('entry_bytes', 0)} bytes), "
          f"{backlog.get('segments', 0)} segments ({backlog.get('segment_bytes', 0)} bytes); oldest unpushed: "
          f"{status.get('oldest_unpushed_age_s')} s")
    print(f"last pass: {last.get('duration_s')} s, {last.get('error') or 'ok'}; {last.get('counts')}")
    errors = {k[len('errors_'):]: v for k, v in totals.items() if k.startswith("errors_")}
    print(f"totals: {totals.get('sent_bytes', 0)} bytes sent, {totals.get('objects', 0)} objects, "
          f"{totals.get('uploaded', 0)} binaries uploaded, {totals.get('present', 0)} present, "
          f"{totals.get('conflicts_kept_aside', 0)} conflicts kept aside; errors by cause: {errors or 'none'}")


def cmd_push(args) -> int:
    """`buildidd push`: one pass (default), the service loop (--service), or the last status (--status)."""
    cfg = _config(args)
    if args.status:
        from buildidd.fleet.status import read_status
        _print_status(read_status(cfg.push_state_dir), args.json)
        return 0
    from buildidd.fleet.push import Pusher
    pusher = Pusher(cfg)
    try:
        if args.service:
            from buildidd.fleet.service import run_service
            return run_service(pusher)
        report = pusher.run_pass()
        _print_status(pusher.status(), args.json)
        return 1 if report.failed or report.abandoned else 0
    finally:
        pusher.close()


def _bucket(args):
    from buildidd.fleet.bucket import Bucket, BucketOptions
    cfg = _config(args)
    return cfg, Bucket(BucketOptions.from_config(cfg))


def cmd_fleet_sessions(args) -> int:
    """`buildidd fleet sessions [HOST]`: the hosts and sessions the bucket holds."""
    from buildidd.fleet.fetch import list_sessions
    cfg, bucket = _bucket(args)
    try:
        found, refused = list_sessions(bucket, cfg.push_prefix, args.from_host)
    except ValueError as e:
        raise UsageError(f"fleet sessions: {e}") from e
    if args.json:
        json.dump({"sessions": [{"host": s.host, "name": s.name, "closed": s.closed} for s in found],
                   "refused_names": refused}, sys.stdout)
        print()
        return 0
    for s in found:
        print(f"{s.host}/{s.name}" + ("" if s.closed else "  (open: more may come)"))
    if refused:
        print(f"{refused} malformed name(s) in the bucket left out", file=sys.stderr)
    return 0


def cmd_fleet_pull(args) -> int:
    """`buildidd fleet pull HOST/SESSION`: a session and its binaries from the bucket, installed as import does."""
    from buildidd.fleet.fetch import Target, fetch_session
    host, _, session = args.session.partition("/")
    if not session:
        raise UsageError("fleet pull: give HOST/SESSION (buildidd fleet sessions lists them)")
    cfg, bucket = _bucket(args)
    try:
        r = fetch_session(bucket, cfg.push_prefix, host, session,
                          Target(debug_dir(args), cfg.session_root, args.untrusted_policy))
    except ValueError as e:
        raise UsageError(f"fleet pull: {e}") from e
    if args.json:
        json.dump({"session_dir": str(r.session_dir), "session_new": r.session_new, "debug_dir": debug_dir(args),
                   "installed": r.installed, "present": r.present, "missing": r.missing,
                   "untrusted": r.untrusted, "bytes": r.bytes}, sys.stdout)
        print()
        return 0
    print(f"session {host}/{session} -> {r.session_dir}" + ("" if r.session_new else " (already there)"))
    print(f"build-ids -> {debug_dir(args)}: {len(r.installed)} installed ({r.bytes} bytes), "
          f"{len(r.present)} already present, {len(r.missing)} missing, {len(r.untrusted)} not trusted")
    return 0


def _register_fleet(sub) -> None:
    p = sub.add_parser("fleet", help="read the bucket push fills: list sessions, pull one with its binaries",
                       description="Read back what buildidd push put in the bucket (push_bucket, push_prefix): "
                                   "the sessions of every host, and one session with the binaries it names, "
                                   "also of a host that no longer exists.")
    verbs = p.add_subparsers(dest="fleet_verb", required=True)
    ls = verbs.add_parser("sessions", help="the hosts and sessions in the bucket",
                          description="List PREFIX/sessions/HOST/SESSION/ as HOST/SESSION, one a line; a session "
                                      "without its .closed marker is marked open (more segments may come).")
    ls.add_argument("from_host", nargs="?", metavar="HOST", help="only this host's sessions")
    ls.set_defaults(func=cmd_fleet_sessions)
    pull = verbs.add_parser("pull", help="fetch HOST/SESSION and the binaries it names into the session root "
                            "and the analyst's store (--debug-dir), verified as import verifies an archive",
                            description="Fetch a session's manifest, segments and .closed marker, and each binary "
                                        "its manifest holds (trusted ones from PREFIX/buildid/HEX/, others from "
                                        "PREFIX/hosts/HOST/buildid/HEX/), staged and verified (each file's "
                                        "build-id or htlhash) before anything is installed, into the session root "
                                        "and the analyst's store as import lays them out; then resolve, which and "
                                        "inject work on it offline.")
    pull.add_argument("session", metavar="HOST/SESSION", help="the session, as fleet sessions lists it")
    pull.add_argument("--untrusted-policy", choices=("mark", "skip", "refuse"), default="mark",
                      help="build-ids the host did not trust (read from hosts/HOST/): as import --untrusted")
    pull.set_defaults(func=cmd_fleet_pull)
    for q in (ls, pull):
        add_roots_options(q)
        q.add_argument("--bucket", help="the bucket (default: push_bucket from the config)")
        q.add_argument("--endpoint-url", help="the S3 endpoint URL (default: push_endpoint_url)")
        q.add_argument("--prefix", help="the key prefix (default: push_prefix)")
        q.add_argument("--json", action="store_true", help="the answer as JSON")
        q.set_defaults(host=None, state_dir=None, untrusted=None)


def register(sub) -> None:
    """Add ``push`` and ``fleet`` (sessions, pull) to the subcommand parsers."""
    _register_fleet(sub)
    p = sub.add_parser("push", help="push the store and closed sessions to an S3-compatible bucket",
                       description="Push every store entry (in debuginfod's URL space: PREFIX/buildid/HEX/"
                                   "executable and debuginfo; trusted entries only at those canonical keys, "
                                   "never overwriting one) and every closed session segment with its manifest "
                                   "(PREFIX/sessions/HOST/SESSION/) to the bucket push_bucket.  What the bucket "
                                   "holds is remembered under push_state_dir, so a second push uploads only what "
                                   "is new.  Credentials come from the standard AWS chain.  Exit 1 when the "
                                   "bucket failed (what was not pushed stays queued).")
    add_roots_options(p)
    p.add_argument("--bucket", help="the bucket (default: push_bucket from the config)")
    p.add_argument("--endpoint-url", help="the S3 endpoint URL (default: push_endpoint_url)")
    p.add_argument("--prefix", help="the key prefix (default: push_prefix)")
    p.add_argument("--host", help="this host's name in the bucket (default: push_host, else uname -n)")
    p.add_argument("--state-dir", help="where what was pushed is remembered (default: push_state_dir)")
    p.add_argument("--untrusted", choices=("host", "skip"), help="untrusted entries: under hosts/HOST/, "
                   "or not at all (default: push_untrusted)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--service", action="store_true",
                      help="push every push_interval_s until SIGTERM (buildidd-push.service)")
    mode.add_argument("--status", action="store_true", help="print the last status a push wrote and exit")
    p.add_argument("--json", action="store_true", help="the status as JSON")
    p.set_defaults(func=cmd_push)

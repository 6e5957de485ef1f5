"""``buildidd push``: the store and closed sessions to an S3-compatible bucket (once, or as a service)."""

from __future__ import annotations

import json
import sys

from buildidd.cli.common import add_roots_options, roots_from_args


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
        from buildidd.fleet.push import read_status
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


def register(sub) -> None:
    """Add ``push`` to the subcommand parsers."""
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

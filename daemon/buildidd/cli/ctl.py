"""``buildidd status``, ``rotate`` and ``lookup``: questions to the running daemon."""

from __future__ import annotations

import argparse
import json
import re

from buildidd import clock
from buildidd.cli.common import add_client_options, daemon_request, paragraph
from buildidd.config import Config, format_size
from buildidd.errors import BuildiddError, PrivilegeError
from buildidd.inputs import parse_address

#: What helps against a loss, by cause (the ``lost`` counts of status and the session's lost records).
LOSS_HINTS = {"ringbuf_full": "raise ring_bytes{ring_bytes}, or lower recording_nice{recording_nice}",
              "pending_full": "syscalls in flight beyond the BPF pending map; no key: report it",
              "no_vma": "the mapping was gone before the BPF program looked; recovered by a rescan",
              "read_failed": "the kernel could not read the mapping's fields; recovered by a rescan",
              "disk_full": "free space under the session root; pending_lines_max_bytes{pending_lines_max_bytes} "
                           "bounds what waits in memory",
              "io_error": "the session log's disk failed; see the journal"}
#: What makes a skipped copy fit, by StoreRefusedError.reason.
SKIP_HINTS = {"quota": "raise store_quota_bytes{store_quota_bytes}",
              "too_large": "raise store_file_max_bytes{store_file_max_bytes}",
              "uid_share": "raise store_uid_share{store_uid_share}",
              "alt_limit": "too many contents under one build-id; no key"}


def _mib(n) -> str:
    """Bytes for a reader: KiB below a MiB, MiB below a GiB, else GiB (one decimal)."""
    n = n or 0
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n / 1024:.1f} KiB"


def _hint(table: dict, key: str, limits: dict) -> str:
    """The hint for key, with the daemon's value of each config key it names (``(now 2M)``)."""
    text = table.get(key)
    if text is None:
        return ""
    now = {}
    for name in re.findall(r"\{(\w+)\}", text):
        v = limits.get(name)
        now[name] = "" if v is None else f" (now {format_size(v) if name.endswith('_bytes') else v})"
    return f": {text.format(**now)}"


def _by_cause(counts: dict, table: dict, limits: dict) -> str:
    return "; ".join(f"{k} {v}{_hint(table, k, limits)}" for k, v in sorted(counts.items()))


def _ago(time_ns) -> str:
    return f"{max(0, clock.boot_ns() - time_ns) / 1e9:.0f} s ago" if isinstance(time_ns, int) else "at an unknown time"


def _log_lines(s: dict, limits: dict) -> list[str]:
    """The session log's and the sessions' lines: bytes against their limits, write failures."""
    out = []
    lg = s.get("log")
    if lg:
        line = (f"log       {lg.get('records_written', 0)} records, {_mib(lg.get('bytes_written'))} written, "
                f"{lg.get('segments_closed', 0)} segments closed (segment_max_bytes "
                f"{format_size(limits.get('segment_max_bytes', 0))}); {lg.get('write_errors', 0)} write errors")
        if lg.get("failing"):
            line += f"; FAILING ({lg['failing']}) since {_ago(lg.get('failing_since_ns'))}: {lg.get('last_write_error')}"
        if lg.get("records_lost"):
            line += f"; records lost: {_by_cause(lg['records_lost'], LOSS_HINTS, limits)}"
        out.append(line)
    ss = s.get("sessions")
    if ss:
        cap = limits.get("session_max_total_bytes")
        age = limits.get("session_max_age_s")
        out.append(f"sessions  {ss.get('count', 0)} under {ss.get('root')}: {_mib(ss.get('bytes'))} of "
                   + (f"{_mib(cap)} (session_max_total_bytes)" if cap else "no limit (session_max_total_bytes 0)")
                   + (f", each kept {age / 86400:g} d (session_max_age_s)" if age else ""))
    return out


def _store_lines(snap: dict, limits: dict) -> list[str]:
    """The snapshots' lines: stored and skipped copies by reason with the key that helps, coverage."""
    quota = snap.get("quota_bytes")
    out = [f"snapshots {snap.get('stored', 0)} stored, {snap.get('queued', 0)} queued, "
           f"{snap.get('failed', 0)} failed; store {_mib(snap.get('store_bytes'))}"
           f" of {_mib(quota) + ' (store_quota_bytes)' if quota else 'unlimited'}"]
    skipped = snap.get("skipped") or {}
    if skipped:
        quiet = sum((snap.get("log_lines_suppressed") or {}).values())
        out.append(f"skipped   {sum(skipped.values())} copies: {_by_cause(skipped, SKIP_HINTS, limits)}"
                   + (f" ({quiet} of their log lines not logged one by one)" if quiet else ""))
    if snap.get("last_error"):
        out.append(f"store     last error: {snap['last_error']}")
    queue = snap.get("queue")
    if queue and (queue.get("jobs") or queue.get("refused_by_uid")):
        out.append(_queue_line(queue))
    cov = snap.get("coverage")
    if cov:
        gaps = cov.get("gaps") or {}
        out.append(f"coverage  the store holds {cov.get('held', 0)} of the {cov.get('named', 0)} build-ids "
                   f"this session named" + (f"; lacking: {', '.join(f'{k} {v}' for k, v in sorted(gaps.items()))}"
                                            if gaps else ""))
        ledger = cov.get("ledger")
        if isinstance(ledger, dict):
            top = ", ".join(f"uid {u.get('uid')} {_mib(u.get('bytes'))} ({u.get('entries', 0)} tracked"
                            + (f", {u['untracked']} untracked" if u.get("untracked") else "") + ")"
                            for u in (ledger.get("top_uids") or [])[:4] if isinstance(u, dict))
            out.append(f"ledger    {_mib(ledger.get('bytes'))} of {_mib(ledger.get('budget_bytes'))} "
                       f"(coverage_max_bytes; {_mib(ledger.get('uid_share_bytes'))} per uid but root)"
                       + (f"; {cov.get('untracked')} build-ids untracked" if cov.get("untracked") else "")
                       + (f"; top: {top}" if top else ""))
    return out


def _queue_line(queue: dict) -> str:
    """The copy queue's use by uid (store.copyqueue.CopyQueue.status): the uids holding most, the refused."""
    fds = queue.get("fds_by_uid") or {}
    held = ", ".join(f"uid {u} {n} jobs/{fds.get(u, 0)} fds" for u, n in (queue.get("jobs_by_uid") or {}).items())
    refused = queue.get("refused_by_uid") or {}
    return (f"queue     {queue.get('jobs', 0)} copies, {queue.get('fds', 0)} descriptors held"
            + (f"; most: {held}" if held else "")
            + (f"; refused (queue_uid_share, snapshot_queue_max): "
               f"{', '.join(f'uid {u} {n}' for u, n in refused.items())}" if refused else ""))


def _handover_refusals(res: dict) -> str:
    """``(uid U N, ...)``: hand-overs refused by uid, both pools summed (workers.WorkerPool.status)."""
    by: dict[str, int] = {}
    for pool in (res.get("handover_pool") or {}, res.get("bulk_handover_pool") or {}):
        for uid, n in (pool.get("refused_by_uid") or {}).items():
            by[uid] = by.get(uid, 0) + n
    return f" ({', '.join(f'uid {u} {n}' for u, n in sorted(by.items(), key=lambda kv: -kv[1]))})" if by else ""


def _error_counts(s: dict) -> str | None:
    """Every non-zero error counter of status, or None."""
    parts = [f"{name} {v}" for name, v in (("decode errors", s.get("decode_errors")),
                                            ("log write errors", s.get("log_write_errors")),
                                            ("log lines dropped", s.get("log_lines_dropped")),
                                            ("resolve timeouts", s.get("resolve_timeouts")),
                                            ("live pids dropped", s.get("live_pids_dropped"))) if v]
    parts += [f"{k} {v}" for k, v in sorted((s.get("loop_errors") or {}).items())]
    parts += [f"{k} {v}" for k, v in sorted((s.get("event_errors") or {}).items())]
    return f"errors    {', '.join(parts)}" if parts else None


def _human_status(s: dict) -> str:
    limits = s.get("limits") or {}
    step = s.get("last_step_s_ago")
    lines = [f"session   {s['session']}  ({s['session_dir']})",
             f"uptime    {s['uptime_s']:.0f} s (ready in {s['ready_s']:.2f} s)"
             + (f"; last step {step:.1f} s ago" if isinstance(step, (int, float)) else "")]
    ev, rate = s.get("events", {}), s.get("events_per_s", {})
    lines.append("events    " + ", ".join(f"{k} {v} ({rate.get(k, 0):.0f}/s)" for k, v in sorted(ev.items())))
    lost = s.get("lost") or {}
    lines.append(f"lost      {sum(lost.values())}" + (f": {_by_cause(lost, LOSS_HINTS, limits)}" if lost else ""))
    held = s.get("throttled") or {}
    if held.get("records"):
        top = ", ".join(f"uid {u} {v['records']}" for u, v in list(held.get("by_uid", {}).items())[:5])
        lines.append(f"throttled {held['records']} records held back by per-user budgets ({top}; "
                     "uid_record_rate_bytes_per_s)")
    ic = s.get("identity_cache", {})
    hr = ic.get("hit_rate")
    lines.append(f"identity  {ic.get('entries', 0)} cached, hit rate {hr * 100:.2f}%" if hr is not None
                 else f"identity  {ic.get('entries', 0)} cached")
    missing = s.get("build_ids_missing") or {}
    lines.append(f"build-ids {s.get('build_ids_resolved', 0)} resolved, {sum(missing.values())} missing"
                 + (f" ({', '.join(f'{k} {v}' for k, v in sorted(missing.items()))})" if missing else ""))
    kp, km = s.get("kernel_build_id_path") or {}, s.get("kernel_build_id_memo")
    if kp:
        line = "kernel    build-ids read in BPF" if kp.get("enabled") else f"kernel    off: {kp.get('reason')}"
        if kp.get("enabled") and km:
            line += (f"; memo {km['hits']} hits, {km['fills']} filled, {km['confirms']} confirmed, "
                     f"{km['writer_skips']} skipped (file open for writing)")
        lines.append(line)
    res = s.get("resolve")
    if res:
        lines.append(f"resolve   {res.get('threads', 0)} workers ({res.get('stuck', 0)} stuck on a slow file, "
                     f"{res.get('queued', 0)} queued), deadline {res.get('deadline_s', 0):g} s (resolve_deadline_s): "
                     f"{res.get('timeouts', 0)} timed out, {res.get('pending', 0)} answers pending; hand-overs "
                     f"{res.get('handovers_dropped', 0)} dropped{_handover_refusals(res)}")
    lines += _log_lines(s, limits)
    snap = s.get("snapshots")
    if snap:
        lines += _store_lines(snap, limits)
    pins = s.get("exec_pins")
    if pins:
        lines.append(f"exec pins {pins.get('held', 0)} held of {pins.get('max_files', 0)} (pin_max_files), "
                     f"{pins.get('taken', 0)} taken, {pins.get('file_cap', 0)} closed at the cap, "
                     f"{pins.get('overflow', 0)} queue overflows; {pins.get('marked', 0)} file systems marked")
    reload = s.get("last_reload")
    if reload:
        lines.append(f"reload    ok {_ago(reload.get('time_ns'))}" if reload.get("ok") else
                     f"reload    FAILED {_ago(reload.get('time_ns'))}, the previous configuration runs: "
                     f"{reload.get('error')}")
    if (errors := _error_counts(s)) is not None:
        lines.append(errors)
    for e in s.get("last_errors") or []:
        lines.append(f"error     {e.get('error')}")
    return "\n".join(lines)


def cmd_status(args) -> int:
    """`buildidd status`: the daemon's status over the control socket."""
    s = daemon_request(args, "status")
    push = _push_status(args.push_state_dir)
    if args.json:
        print(json.dumps({**s, "push": push}, indent=2))
        return 0
    print(_human_status(s))
    if push is not None:
        print(push_line(push))
    return 0


def push_line(push: dict) -> str:
    """The ``push`` line of ``buildidd status``: the backlog, oldest unpushed age and errors by cause of the
    push service's status (fleet.push's status.json)."""
    backlog = push.get("backlog") or {}
    errors = {k[len("errors_"):]: v for k, v in (push.get("totals") or {}).items() if k.startswith("errors_")}
    return (f"push      backlog {backlog.get('entries', '?')} binaries ({backlog.get('entry_bytes', '?')} bytes), "
            f"{backlog.get('segments', '?')} segments ({backlog.get('segment_bytes', '?')} bytes); oldest "
            f"unpushed {push.get('oldest_unpushed_age_s')} s; errors by cause "
            f"{', '.join(f'{k} {v}' for k, v in sorted(errors.items())) or 'none'} (buildidd push --status)")


def _push_status(state_dir: str) -> dict | None:
    """The push service's last status (fleet.status.read_status), or None: push never ran there, or this
    user may not read its state directory (root's, 0700)."""
    from buildidd.errors import PushError
    from buildidd.fleet.status import read_status
    try:
        return read_status(state_dir)
    except PushError:
        return None


def cmd_rotate(args) -> int:
    """`buildidd rotate`: close the daemon's current segment."""
    r = daemon_request(args, "rotate")
    if args.json:
        print(json.dumps(r))
        return 0
    closed = f": closed {r['closed']} (compressed in the background)" if r.get("closed") else ": no segment was open"
    print("rotated" + closed + (f"; the next record goes to {r['segment']}" if r.get("segment") else ""))
    return 0


def cmd_lookup(args) -> int:
    """`buildidd lookup PID ADDR`: the mapping, file, offset and build-id covering ADDR now."""
    from buildidd.control.protocol import ControlError

    addr = parse_address(args.addr, decimal=args.decimal)
    try:
        r = daemon_request(args, "lookup", pid=args.pid, addr=addr)
    except ControlError as e:
        if e.code == "not_found" and "no mapping" in e.message:
            raise BuildiddError(f"process {args.pid} has no mapping at {addr:#x} (see /proc/{args.pid}/maps)") from e
        if e.code == "not_permitted":
            raise PrivilegeError(f"lookup {args.pid}: permission denied (only root and the process's own user "
                                 f"may read its mappings, as with /proc/{args.pid}/maps)") from e
        if e.code == "not_found":
            raise BuildiddError(f"no process {args.pid} (it exited, or it lives in another PID namespace "
                                "than the daemon's)") from e
        raise BuildiddError(f"lookup {args.pid} {addr:#x}: {e.message}") from e
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print(f"{r['start']:#x}-{r['end']:#x} {r['perms']} +{r['file_offset']:#x} {r['path']}"
              f"{' (deleted)' if r['deleted'] else ''} {r['build_id'] or '(' + str(r['error']) + ')'}")
    return 0


def register(sub) -> None:
    """Add ``status``, ``rotate`` and ``lookup`` to the subcommand parsers."""
    st = sub.add_parser("status", help="ask the running daemon what it is doing",
                        description="The running daemon's session, event rates, losses, caches and snapshots. "
                                    "Exit status 3 when no daemon listens on the socket.")
    add_client_options(st)
    st.add_argument("--json", action="store_true", help="the same as one JSON object")
    st.add_argument("--push-state-dir", metavar="PATH", default=Config.push_state_dir,
                    help="where buildidd-push.service writes its status.json: its backlog is shown (default "
                         "%(default)s; nothing when absent or unreadable)")
    st.set_defaults(func=cmd_status)
    ro = sub.add_parser("rotate", help="close the daemon's current segment",
                        description="Close the daemon's current segment (it is compressed); the next record "
                                    "opens a new one. The same as systemctl reload buildidd without re-reading "
                                    "the configuration.")
    add_client_options(ro)
    ro.add_argument("--json", action="store_true", help="the answer as one JSON object")
    ro.set_defaults(func=cmd_rotate)
    lk = sub.add_parser("lookup", help="which mapping, file, offset and build-id cover PID's ADDR now",
                        description=paragraph("Ask the daemon which mapping of process PID covers address ADDR now, "
                                    "and print: start-end perms +file_offset path build-id."),
                        epilog="examples:\n  buildidd lookup 1234 7f3c75c44000      (as /proc/1234/maps and perf "
                               "print it)\n  buildidd lookup 1234 0x7f3c75c44a10\n"
                               "  buildidd lookup --decimal 1234 139897406210576",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_client_options(lk)
    lk.add_argument("pid", type=int, metavar="PID", help="process id (tgid) as the daemon sees it")
    lk.add_argument("addr", metavar="ADDR", help="virtual address in PID: hex, with or without 0x "
                    "(7f3c75c44000 as in /proc/PID/maps), or decimal with --decimal")
    lk.add_argument("--decimal", action="store_true", help="read ADDR as decimal (0x... is still hex)")
    lk.add_argument("--json", action="store_true", help="the answer as one JSON object")
    lk.set_defaults(func=cmd_lookup)

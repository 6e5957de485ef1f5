"""``buildidd status``, ``rotate`` and ``lookup``: questions to the running daemon."""

from __future__ import annotations

import argparse
import json

from buildidd.cli.common import add_client_options, daemon_request, paragraph
from buildidd.errors import BuildiddError, PrivilegeError
from buildidd.inputs import parse_address

def _human_status(s: dict) -> str:
    lines = [f"session   {s['session']}  ({s['session_dir']})",
             f"uptime    {s['uptime_s']:.0f} s (ready in {s['ready_s']:.2f} s)"]
    ev, rate = s.get("events", {}), s.get("events_per_s", {})
    lines.append("events    " + ", ".join(f"{k} {v} ({rate.get(k, 0):.0f}/s)" for k, v in sorted(ev.items())))
    lost = s.get("lost") or {}
    lines.append(f"lost      {sum(lost.values())}" + (f" ({lost})" if lost else ""))
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
    snap = s.get("snapshots")
    if snap:
        lines.append(f"snapshots {snap.get('stored', 0)} stored, {snap.get('queued', 0)} queued, "
                     f"{snap.get('failed', 0)} failed; store {snap.get('store_bytes', 0) / 2**20:.1f} MiB"
                     f" of {snap.get('quota_bytes') and snap['quota_bytes'] / 2**20 or 'unlimited'} MiB")
        cov = snap.get("coverage")
        if cov:
            gaps = cov.get("gaps") or {}
            lines.append(f"coverage  the store holds {cov.get('held', 0)} of the {cov.get('named', 0)} build-ids "
                         f"this session named" + (f"; lacking: {', '.join(f'{k} {v}' for k, v in sorted(gaps.items()))}"
                                                  if gaps else ""))
    pins = s.get("exec_pins")
    if pins:
        lines.append(f"exec pins {pins.get('held', 0)} held of {pins.get('max_files', 0)} (pin_max_files), "
                     f"{pins.get('taken', 0)} taken, {pins.get('file_cap', 0)} closed at the cap, "
                     f"{pins.get('overflow', 0)} queue overflows; {pins.get('marked', 0)} file systems marked")
    for e in s.get("last_errors") or []:
        lines.append(f"error     {e.get('error')}")
    return "\n".join(lines)


def cmd_status(args) -> int:
    """`buildidd status`: the daemon's status over the control socket."""
    s = daemon_request(args, "status")
    print(json.dumps(s, indent=2) if args.json else _human_status(s))
    return 0


def cmd_rotate(args) -> int:
    """`buildidd rotate`: close the daemon's current segment."""
    r = daemon_request(args, "rotate")
    if args.json:
        print(json.dumps(r))
        return 0
    print("rotated" + (f"; now writing {r['segment']}" if r.get("segment") else
                       "; the next segment opens with the next record"))
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

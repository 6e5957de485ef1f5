"""``buildidd status``, ``rotate`` and ``lookup``: questions to the running daemon."""

from __future__ import annotations

import json

from buildidd.cli.common import add_client_options


def _client(args):
    from buildidd.control.client import ControlClient
    return ControlClient(args.socket, timeout_s=args.timeout)


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
    snap = s.get("snapshots")
    if snap:
        lines.append(f"snapshots {snap.get('stored', 0)} stored, {snap.get('queued', 0)} queued, "
                     f"{snap.get('failed', 0)} failed; store {snap.get('store_bytes', 0) / 2**20:.1f} MiB"
                     f" of {snap.get('quota_bytes') and snap['quota_bytes'] / 2**20 or 'unlimited'} MiB")
    for e in s.get("last_errors") or []:
        lines.append(f"error     {e.get('error')}")
    return "\n".join(lines)


def cmd_status(args) -> int:
    """`buildidd status`: the daemon's status over the control socket."""
    with _client(args) as c:
        s = c.request("status")
    print(json.dumps(s, indent=2) if args.json else _human_status(s))
    return 0


def cmd_rotate(args) -> int:
    """`buildidd rotate`: close the daemon's current segment."""
    with _client(args) as c:
        r = c.request("rotate")
    print("rotated" + (f"; now writing {r['segment']}" if r.get("segment") else
                       "; the next segment opens with the next record"))
    return 0


def cmd_lookup(args) -> int:
    """`buildidd lookup PID ADDR`: the mapping, file, offset and build-id covering ADDR now."""
    with _client(args) as c:
        r = c.request("lookup", pid=args.pid, addr=int(args.addr, 0))
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print(f"{r['start']:#x}-{r['end']:#x} {r['perms']} +{r['file_offset']:#x} {r['path']}"
              f"{' (deleted)' if r['deleted'] else ''} {r['build_id'] or '(' + str(r['error']) + ')'}")
    return 0


def register(sub) -> None:
    """Add ``status``, ``rotate`` and ``lookup`` to the subcommand parsers."""
    st = sub.add_parser("status", help="ask the running daemon what it is doing")
    add_client_options(st)
    st.add_argument("--json", action="store_true", help="the same as JSON")
    st.set_defaults(func=cmd_status)
    ro = sub.add_parser("rotate", help="close the daemon's current segment")
    add_client_options(ro)
    ro.set_defaults(func=cmd_rotate)
    lk = sub.add_parser("lookup", help="which mapping, file, offset and build-id cover PID's ADDR now")
    add_client_options(lk)
    lk.add_argument("pid", type=int)
    lk.add_argument("addr", help="address (0x... hex or decimal)")
    lk.add_argument("--json", action="store_true")
    lk.set_defaults(func=cmd_lookup)

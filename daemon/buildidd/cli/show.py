"""``buildidd show``: a session decoded for a terminal or as JSON lines, filtered.

Times are printed as wall-clock ISO 8601 with the zone (the session record's
boot-to-wall offset applied to each record's time_ns; ``--utc``, or
``--boot-time`` for the raw ns since boot).  ``--since``/``--until`` read only
the segments whose time range overlaps: a segment's range runs from its first
record's time_ns to the next segment's first (segments are written in time
order), widened by :data:`SEGMENT_SLACK_NS` for records that reach the log out
of order; finding it decompresses only the head of each segment.

``--type gap`` reads the session's gap file (sessionlog.gapfile: every
build-id the store lacked at the session's end, with its reason and uid),
after the segments when other types are asked for too; only the path and
build-id filters apply to its records (they have no pid or time).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import zstandard

from buildidd import config as configmod
from buildidd.cli.common import effective_session_root, paragraph, resolve_session
from buildidd.errors import SessionLogError, UsageError
from buildidd.inputs import SessionClock
from buildidd.sessionlog import list_segments, read_gaps, read_session

#: Record types ``--type`` accepts (sessionlog/records.py; ``resolution``: offline/resolutions.py;
#: ``gap``: the gap file, sessionlog/gapfile.py).
RECORD_TYPES = ("session", "mmap", "exec", "fork", "exit", "comm", "lost", "throttled", "end", "resolution", "gap")
#: How far past the next segment's first record a segment's records may reach
#: (records of different CPUs reach the log up to a few drain intervals apart).
SEGMENT_SLACK_NS = 2 * 10**9
#: Bytes of a segment's head decoded to find its first time_ns.
_HEAD_BYTES = 64 << 10
_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0x20), 0x7f, *range(0x80, 0xa0)]}
_BUILD_ID_RE = re.compile(r"[0-9a-fA-F]{1,128}")


@dataclass(frozen=True)
class Filters:
    """What ``show`` keeps: each set None means "any"; times are ns since boot, inclusive."""

    types: frozenset[str] | None = None
    pids: frozenset[int] | None = None
    comms: tuple[str, ...] | None = None       # globs
    paths: tuple[str, ...] | None = None       # globs on path (mmap) or filename/path (exec)
    build_ids: tuple[str, ...] | None = None   # lower-case hex prefixes
    since_ns: int | None = None
    until_ns: int | None = None

    def match(self, r: dict) -> bool:
        """Whether record r passes every filter."""
        if self.types is not None and r.get("type") not in self.types:
            return False
        if self.pids is not None and r.get("pid") not in self.pids:
            return False
        if self.since_ns is not None or self.until_ns is not None:
            t = r.get("time_ns")
            if not isinstance(t, int) or (self.since_ns is not None and t < self.since_ns) \
                    or (self.until_ns is not None and t > self.until_ns):
                return False
        if self.comms is not None and not _glob_any(r.get("comm"), self.comms):
            return False
        if self.paths is not None and not (_glob_any(r.get("path"), self.paths)
                                           or _glob_any(r.get("filename"), self.paths)):
            return False
        if self.build_ids is not None:
            bid = r.get("build_id")
            if not isinstance(bid, str) or not bid.startswith(self.build_ids):
                return False
        return True


def _glob_any(value, globs: tuple[str, ...]) -> bool:
    return isinstance(value, str) and any(fnmatch.fnmatchcase(value, g) for g in globs)


# -- segments and their time ranges --------------------------------------------------------------


def segment_head_records(path: Path) -> list[dict]:
    """The complete records in the first :data:`_HEAD_BYTES` of a segment (decoding only that much).

    Lines that are not JSON objects are left out; [] for an empty, torn or corrupt head.

    Raises:
        SessionLogError: the segment cannot be opened or read.
    """
    try:
        with open(path, "rb") as f:
            if path.name.endswith(".zst"):
                with zstandard.ZstdDecompressor().stream_reader(f) as z:
                    head = _read_up_to(z, _HEAD_BYTES)
            else:
                head = f.read(_HEAD_BYTES)
    except zstandard.ZstdError:
        return []
    except FileNotFoundError:   # compressed meanwhile: the .zst holds the same records
        if path.suffix != ".jsonl":
            raise SessionLogError(f"{path}: segment vanished while being read") from None
        return segment_head_records(path.with_name(path.name + ".zst"))
    except OSError as e:
        raise SessionLogError(f"{path}: cannot read segment: {e.strerror}") from e
    records = []
    for line in head.split(b"\n")[:-1]:
        try:
            r = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(r, dict):
            records.append(r)
    return records


def segment_first_time_ns(path: Path) -> int | None:
    """time_ns of the first record in the segment's head that has one (None: none there).

    Raises:
        SessionLogError: the segment cannot be opened or read.
    """
    return next((r["time_ns"] for r in segment_head_records(path) if isinstance(r.get("time_ns"), int)), None)


def _read_up_to(stream, limit: int) -> bytes:
    out = bytearray()
    while len(out) < limit and (chunk := stream.read(min(65536, limit - len(out)))):
        out += chunk
    return bytes(out)


def segments_in_range(segments: list[Path], since_ns: int | None, until_ns: int | None,
                      first_time: Callable[[Path], int | None] = segment_first_time_ns) -> list[Path]:
    """The segments whose records may fall within [since_ns, until_ns] (ns since boot, None: open).

    Segment i spans [first(i), first(i+1) + SEGMENT_SLACK_NS]; the last has no
    end; a segment whose first time is unknown is kept.  Segments are in
    number order, which is time order.
    """
    if since_ns is None and until_ns is None:
        return list(segments)
    firsts = [first_time(s) for s in segments]
    keep = []
    for i, seg in enumerate(segments):
        start = firsts[i]
        end = next((t for t in firsts[i + 1:] if t is not None), None)
        if until_ns is not None and start is not None and start > until_ns:
            continue
        if since_ns is not None and end is not None and end + SEGMENT_SLACK_NS < since_ns:
            continue
        keep.append(seg)
    return keep


def read_segments(session: Path, segments: list[Path], on_torn: Callable[[str, int], None]) -> Iterator[dict]:
    """The records of some segments of session, through the session log's reader.

    read_session reads a whole directory; it is given a private directory of
    links to the chosen segments (a live ``.jsonl`` also gets a link to the
    ``.zst`` it may become while being read).
    """
    if segments == list_segments(session):
        yield from read_session(session, on_torn=on_torn)
        return
    with tempfile.TemporaryDirectory(prefix="buildidd-show-") as tmp:
        for seg in segments:
            os.symlink(seg.resolve(), Path(tmp, seg.name))
            if seg.suffix == ".jsonl":
                os.symlink(seg.resolve().with_name(seg.name + ".zst"), Path(tmp, seg.name + ".zst"))
        for r in read_session(tmp, on_torn=lambda p, n: on_torn(str(session / Path(p).name), n)):
            yield r


# -- output ----------------------------------------------------------------------------------------


def escape(value) -> str:
    """A field for a terminal: control characters (C0, DEL, C1) as \\xNN, undecodable bytes as \\xNN."""
    text = str(value)
    if text.isprintable():
        return text
    text = text.translate(_CONTROL)
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


@dataclass
class Style:
    """How text lines look: time format and colours."""

    clock: SessionClock             # the session's offset and zone (inputs.SessionClock)
    boot_time: bool = False
    color: bool = False

    def time(self, time_ns) -> str:
        """A record's time: ISO 8601 with zone, or raw boot ns."""
        if not isinstance(time_ns, int):
            return "-"
        if self.boot_time or self.clock.offset_ns is None:
            return str(time_ns)
        return self.clock.format(time_ns)

    def paint(self, text: str, code: str) -> str:
        """text in SGR colour code when colour is on."""
        return f"\033[{code}m{text}\033[0m" if self.color else text


def format_record(r: dict, style: Style) -> str:
    """One record as a text line: TIME PID COMM TYPE details (path last)."""
    t = str(r.get("type"))
    when = style.paint(f"{style.time(r.get('time_ns')):<31}", "2")
    head = f"{when} {r.get('pid', ''):>7} {escape(r.get('comm', '')):<16} {style.paint(f'{escape(t):<6}', '1')}"
    bid = r.get("build_id")
    shown_bid = bid if bid else style.paint(f"({escape(r.get('error') or 'no build-id')})", "31")
    if t == "mmap":
        return (f"{head} {_hex(r.get('start'))}+{_hex(r.get('len'))} @{_hex(r.get('pgoff'))} "
                f"{escape(r.get('origin', '')):<11} {shown_bid:<40} {escape(r.get('path', ''))}")
    if t == "exec":
        ran = r.get("path")
        return (f"{head} {shown_bid:<40} {escape(r.get('filename', ''))}"
                + (f" -> {escape(ran)}" if ran and ran != r.get("filename") else ""))
    if t == "fork":
        return f"{head} parent {r.get('ppid')}"
    if t == "exit":
        return f"{head} code {r.get('exit_code')}"
    if t == "comm":
        return head
    if t == "gap":
        cut = " (path cut: its end)" if r.get("path_cut") else ""
        return (f"{head} {escape(r.get('reason', '')):<20} uid {escape(r.get('uid', '?')):<6} "
                f"{escape(r.get('build_id', '')):<40} {escape(r.get('path', ''))}{cut}")
    rest = {k: v for k, v in r.items() if k not in ("type", "time_ns", "pid", "comm")}
    return f"{head} {escape(json.dumps(rest, separators=(',', ':')))}"


def _hex(value) -> str:
    return f"{value:#x}" if isinstance(value, int) else "?"


def _use_color(stream) -> bool:
    return stream.isatty() and "NO_COLOR" not in os.environ and os.environ.get("TERM") != "dumb"


# -- the verb ------------------------------------------------------------------------------------


def _session_head(segments: list[Path]) -> dict | None:
    """The session record (first record of the first segment), reading only its head."""
    head = segment_head_records(segments[0]) if segments else []
    return head[0] if head and head[0].get("type") == "session" else None


def filters_from_args(args, offset_ns: int | None, now_wall_ns: int) -> Filters:
    """The Filters of a show invocation; --since/--until converted to boot ns with the session's offset.

    Raises:
        UsageError: a malformed time or build-id, an empty or inverted time range, or a wall-clock
            time on a session without a clock offset.
    """
    for b in args.build_id or ():
        if not _BUILD_ID_RE.fullmatch(b):
            raise UsageError(f"--build-id {b[:40]!r}: give a hex prefix of a build-id")
    since_ns, until_ns = SessionClock(offset_ns, now_wall_ns).parse_range(args.since, args.until)
    return Filters(types=frozenset(args.type) if args.type else None,
                   pids=frozenset(args.pid) if args.pid else None,
                   comms=tuple(args.comm) if args.comm else None,
                   paths=tuple(args.path) if args.path else None,
                   build_ids=tuple(b.lower() for b in args.build_id) if args.build_id else None,
                   since_ns=since_ns, until_ns=until_ns)


def _records(session: Path, segments: list[Path], types: frozenset[str] | None,
             on_torn: Callable[[str, int], None]) -> Iterator[dict]:
    """The segments' records (unless only ``gap`` is asked for), then the gap file's when ``gap`` is."""
    if types is None or types - {"gap"}:
        yield from read_segments(session, segments, on_torn)
    if types is not None and "gap" in types:
        yield from read_gaps(session, on_torn=on_torn)


def cmd_show(args) -> int:
    """`buildidd show SESSION`: decode a session (text or --json), filtered; see register() for the options.

    Raises:
        BuildiddError: not a session; UsageError: a malformed filter.
    """
    cfg = configmod.load(args.config, required=args.config != configmod.DEFAULT_CONFIG_PATH)
    session = resolve_session(args.session, effective_session_root(cfg.session_root, args.session_root))
    all_segments = list_segments(session)
    head = _session_head(all_segments)
    offset_ns = head.get("boot_to_wall_offset_ns") if head else None
    filters = filters_from_args(args, offset_ns, time.time_ns())
    segments = segments_in_range(all_segments, filters.since_ns, filters.until_ns)
    style = Style(SessionClock(offset_ns, utc=args.utc), boot_time=args.boot_time, color=_use_color(sys.stdout))
    torn: list[tuple[str, int]] = []
    shown = 0
    out = sys.stdout
    try:
        for r in _records(session, segments, filters.types, lambda seg, line: torn.append((seg, line))):
            if not filters.match(r):
                continue
            shown += 1
            out.write((json.dumps(r, separators=(",", ":")) if args.json else format_record(r, style)) + "\n")
        out.flush()
    except BrokenPipeError:   # `| head`: the reader is gone; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    for seg, line in torn:
        print(f"buildidd: skipped a torn or corrupt record in {seg} line {line}", file=sys.stderr)
    if not shown:
        print("-- no records --", file=sys.stderr)
    return 0


def register(sub) -> None:
    """Add ``show`` to the subcommand parsers."""
    show = sub.add_parser(
        "show", help="print a session's records, filtered (text or JSON lines)",
        description=paragraph("Print the records of a session: wall-clock time with zone, pid, comm, type, then the "
                    "mapping (start+len @pgoff origin build-id path) or the exec (build-id filename -> path "
                    "run). Filters combine with AND; a repeated filter matches any of its values."),
        epilog="examples:\n  buildidd show latest --since -1h --path '*/libc.so*'\n"
               "  buildidd show latest --type exec --json | jq -r .filename\n"
               "  buildidd show 20261123T005821 --build-id 93ac61ec --utc",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    show.add_argument("session", metavar="SESSION",
                      help="session directory, its name under the session root, or 'latest'")
    show.add_argument("--config", default=configmod.DEFAULT_CONFIG_PATH,
                      help="TOML configuration file giving session_root (default %(default)s; absent is fine)")
    show.add_argument("--session-root", metavar="DIR", help="where to look for a session name "
                      "(default from the config: %s; for a user other than root: $XDG_DATA_HOME/buildidd/sessions, "
                      "then the system's when readable)" % configmod.Config.session_root)
    show.add_argument("--since", metavar="TIME", help="only records at or after TIME: ns since boot, perf's "
                      "sec.usec, ISO 8601 (2026-11-23T14:05, local unless a zone is given), HH:MM[:SS] today, "
                      "now/today/yesterday, or relative: -40s, -30min, -1h")
    show.add_argument("--until", metavar="TIME", help="only records at or before TIME (forms as --since)")
    show.add_argument("--pid", type=int, action="append", metavar="PID", help="only this pid (repeatable)")
    show.add_argument("--comm", action="append", metavar="GLOB", help="only tasks whose comm matches (repeatable)")
    show.add_argument("--path", action="append", metavar="GLOB",
                      help="only mappings/execs whose path or filename matches, e.g. '*/libc.so*' (repeatable)")
    show.add_argument("--build-id", action="append", metavar="HEX", help="only build-ids starting with HEX (repeatable)")
    show.add_argument("--type", action="append", choices=RECORD_TYPES, metavar="TYPE",
                      help=f"only records of this type: {', '.join(RECORD_TYPES)} (repeatable); gap: the "
                           "session's gap file, every build-id the store lacked at its end with the reason "
                           "and the uid that mapped it")
    show.add_argument("--json", action="store_true", help="JSON lines, the records as stored")
    when = show.add_mutually_exclusive_group()
    when.add_argument("--utc", action="store_true", help="times in UTC instead of the local zone")
    when.add_argument("--boot-time", action="store_true", help="raw time_ns (ns since boot) instead of wall-clock")
    show.set_defaults(func=cmd_show)

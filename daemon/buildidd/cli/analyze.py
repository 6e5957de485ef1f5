"""``buildidd buildid-list``, ``resolve``, ``export`` and ``inject``: a recorded session analysed away from its host."""

from __future__ import annotations

import json
import sys

from buildidd.cli.common import add_roots_options, open_stores, resolve_session, roots_from_args
from buildidd.errors import UsageError
from buildidd.inputs import SessionClock, parse_address
from buildidd.store import KALLSYMS_DSO


def _session_arg(p) -> None:
    p.add_argument("session", help="session directory, its name under the session root, or 'latest'")


# -- buildid-list ----------------------------------------------------------------------


def cmd_which(args) -> int:
    """`buildidd which PATH`: every build-id PATH had in the sessions (debuginfod's /metadata answer)."""
    from buildidd.offline.metadata import metadata

    cfg = roots_from_args(args)
    store = open_stores(cfg, args)
    answer = metadata(cfg.session_root, "glob" if args.glob else "file", args.path,
                      held=store.contains if store is not None else None)
    if args.json:
        print(json.dumps(answer))
    for r in answer["results"] if not args.json else ():
        held = "" if "held" not in r else ("  held" if r["held"] else "  not held")
        print(f"{r['buildid']}  {r['file']}  {r['first_seen'] or '-'} .. {r['last_seen'] or '-'}  "
              f"{r['host'] or '-'}{held}")
    if not answer["complete"]:
        print("-- incomplete: more sessions or results than one answer holds --", file=sys.stderr)
    if not answer["results"]:
        print(f"buildidd: {_which_none(args, cfg.session_root)}", file=sys.stderr)
        return 1
    return 0


#: Paths named at most in which's hint for a bare file name.
WHICH_HINT_PATHS_MAX = 5


def _which_none(args, session_root: str) -> str:
    """Why ``which`` found nothing, and what to try: a bare file name is matched as ``--glob '*/NAME'``
    and the recorded paths ending in it are named (at most WHICH_HINT_PATHS_MAX)."""
    from buildidd.offline.metadata import metadata

    what = "no path matching" if args.glob else "no build-id recorded for"
    text = f"{what} {args.path} in the sessions under {session_root}"
    if args.glob:
        return text + " ('*' also crosses '/'; a pattern matches the whole path)"
    if "/" in args.path:
        return text + "; the path must be as the mapping named it (--glob PATTERN matches by pattern)"
    pattern = f"*/{args.path}"
    paths = sorted({r["file"] for r in metadata(session_root, "glob", pattern)["results"]})
    if not paths:
        return (text + f"; {args.path} is a file name and which takes the full path: no recorded path ends in it "
                       f"either (buildidd which --glob '{pattern}')")
    shown = ", ".join(paths[:WHICH_HINT_PATHS_MAX]) + (", ..." if len(paths) > WHICH_HINT_PATHS_MAX else "")
    return (text + f"; {args.path} is a file name and which takes the full path: recorded paths ending in it: "
                   f"{shown} (buildidd which --glob '{pattern}' gives their build-ids)")


def cmd_buildid_list(args) -> int:
    """`buildidd buildid-list SESSION`: build-id and path of every DSO, kernel first (as ``perf buildid-list``).

    DSOs come from mmap records (their ``path``) and exec records (their ``path``:
    the ELF the kernel ran, which for a ``#!`` script is the interpreter, not
    the ``filename`` passed to execve).  A record with the error ``timeout``
    takes the build-id of the session's later ``resolution`` record for the
    same file (offline.resolutions).  Text lists DSOs with a build-id
    (``BUILDID PATH``); ``--json`` also lists those without one, with the
    reason (``error``), and for exec records the ``filename``, and each DSO's ``file_id`` (htlhash,
    joined from the ``file_id`` records) and ``go_build_id`` when known.  Each build-id (or htlhash) the
    store holds carries its provenance (``Store.provenance``: trusted, untrusted,
    conflict, unknown; ``null`` when not stored) and its quality
    (``Store.quality``: dwarf, symtab, minidebuginfo, go_pclntab, dynsym,
    none): JSON fields, and with ``--provenance`` / ``--quality`` further text
    columns (``-`` when not stored).
    """
    from buildidd.offline.resolutions import LateResolutions
    from buildidd.sessionlog import read_session

    cfg = roots_from_args(args)
    session = resolve_session(args.session, cfg.session_root)
    pids = set(args.pid) if args.pid else None
    comms = set(args.comm) if args.comm else None
    late = LateResolutions.scan(session)
    seen: dict[tuple, dict] = {}
    kernel = None
    for r in read_session(session):
        kind = r.get("type")
        if kind == "session":
            kernel = r.get("kernel_build_id")
            continue
        if kind not in ("mmap", "exec") or (pids and r.get("pid") not in pids) or \
                (comms and r.get("comm") not in comms):
            continue
        r = late.complete(r)
        if kind == "exec" and r.get("build_id") is None and r.get("error") is None:
            continue                  # an exec record of an older format: no facts about the ELF that ran
        path = r.get("path") if kind == "mmap" else r.get("path") or r.get("filename")
        key = (r.get("build_id"), path)
        if key not in seen:
            seen[key] = {"build_id": r.get("build_id"), "path": path, "error": r.get("error"), "pids": set()}
        for name in ("file_id", "go_build_id"):
            if r.get(name) and name not in seen[key]:
                seen[key][name] = r[name]
        if kind == "exec" and r.get("filename") not in (None, path):
            seen[key].setdefault("filenames", set()).add(r.get("filename"))
        seen[key]["pids"].add(r.get("pid"))
    rows = [{"build_id": kernel, "path": KALLSYMS_DSO, "error": None, "pids": set()}] if kernel else []
    rows += seen.values()
    store = open_stores(cfg, args)
    out = sys.stdout
    for row in rows:
        held_as = row["build_id"] or row.get("file_id")       # a file without a GNU build-id: its htlhash
        row["provenance"] = _held_fact(store, held_as, "provenance")
        row["quality"] = _held_fact(store, held_as, "quality")
        if args.json:
            row = dict(row, pids=sorted(p for p in row["pids"] if isinstance(p, int)))
            if "filenames" in row:
                row["filenames"] = sorted(str(f) for f in row["filenames"])
            out.write(json.dumps(row, separators=(",", ":")) + "\n")
        elif row["build_id"]:
            tail = (f" {row['provenance'] or '-'}" if args.provenance else "") + \
                (f" {row['quality'] or '-'}" if args.quality else "")
            out.write(f"{row['build_id']} {row['path']}{tail}\n")
    return 0


def _held_fact(store, bid: str | None, fact: str) -> str | None:
    """The store's ``provenance`` or ``quality`` of bid (Store.provenance, Store.quality), None when not
    stored or no store."""
    if store is None or not bid:
        return None
    try:
        return getattr(store, fact)(bid)
    except ValueError:     # not a build-id the store's layout can hold
        return None


# -- resolve ---------------------------------------------------------------------------


class _Output:
    """How answers are printed: JSON or text, with or without symbols; where binaries are now (cached)."""

    def __init__(self, as_json: bool, store, symbolizer, clock, demangler=None):
        self.json = as_json
        self.clock = clock              # inputs.SessionClock: times shown as wall-clock with zone
        self.store = store
        self.symbolizer = symbolizer
        self.demangler = demangler      # offline.demangle.Demangler, or None: names as in the table
        self._store_paths: dict[str, str | None] = {}
        self._dso_text: dict[object, str] = {}

    def store_path(self, bid: str | None) -> str | None:
        """Where the binary with that build-id is in the store now (``Store.best``: the trusted copy first),
        or ``None``."""
        if not bid or self.store is None:
            return None
        if bid not in self._store_paths:
            try:
                p = self.store.best(bid, "elf")
            except ValueError:   # not a build-id in hex: nothing stored under it
                p = None
            self._store_paths[bid] = str(p) if p is not None else None
        return self._store_paths[bid]

    def symbol(self, bid: str | None, file_offset: int):
        """The Symbol at file_offset, and the reason when there is none (``None`` without --symbolize)."""
        sym = self.symbolizer.symbolize(bid, file_offset) if bid else None
        return sym, (None if sym else self.symbolizer.errors.get(bid, "no_symbol") if bid else "no_build_id")

    def demangled(self, name: str) -> str:
        """name as C++ source spells it (``foo::bar(int)``), or as given without a demangler or when not C++."""
        return self.demangler.demangle(name) if self.demangler is not None else name

    def line(self, a) -> str:
        """One answer as ``resolve`` prints it: JSON, or ``PID ADDR PATH BUILD-ID +OFFSET [SYMBOL] STORE-PATH``."""
        if self.json:
            return json.dumps(self.as_dict(a), separators=(",", ":"))
        q, m = a.query, a.mapping
        if m is None:
            exited = f" (process exited at {self.clock.format(a.exited_ns)})" if a.exited_ns is not None else ""
            return f"{q.pid} {q.addr:#x} - ({a.reason}){exited}"
        dso = m.dso
        text = self._dso_text.get(dso)
        if text is None:
            text = self._dso_text[dso] = (f"{dso.path} {dso.build_id or f'({dso.error})'}",
                                          self.store_path(dso.build_id) or "(not in store)")
        parts = [f"{q.pid} {q.addr:#x} {text[0]} +{a.file_offset:#x}"]
        if self.symbolizer is not None:
            sym, why = self.symbol(dso.build_id, a.file_offset)
            parts.append(f"{self.demangled(sym.name)}+{sym.offset:#x}" if sym else f"?({why})")
        parts.append(text[1])
        if a.via:
            parts.append(f"(inherited from pid {m.pid})")
        if a.exec_path is not None and a.exec_path != dso.path:
            parts.append(f"(running {a.exec_path})")
        if a.exited_ns is not None:
            parts.append(f"(process exited at {self.clock.format(a.exited_ns)})")
        return " ".join(parts)

    def as_dict(self, a) -> dict:
        """An Answer as the JSON object ``resolve --json`` prints."""
        q, m = a.query, a.mapping
        d = {"pid": q.pid, "addr": f"{q.addr:#x}", "time_ns": q.time_ns, "exec_path": a.exec_path}
        if m is None:
            d.update(reason=a.reason, exited_ns=a.exited_ns)
            return d
        bid = m.dso.build_id
        d.update(path=m.dso.path, build_id=bid, build_id_error=m.dso.error, deleted=m.dso.deleted,
                 file_offset=a.file_offset, store_path=self.store_path(bid),
                 mapping={"start": f"{m.start:#x}", "end": f"{m.end:#x}", "pgoff": m.pgoff,
                          "time_ns": m.time_ns, "origin": m.origin, "pid": m.pid},
                 via=list(a.via), exited_ns=a.exited_ns)
        if self.symbolizer is not None:
            sym, why = self.symbol(bid, a.file_offset)
            d["symbol"] = ({"name": sym.name, "demangled": self.demangled(sym.name), "offset": sym.offset,
                            "size": sym.size, "source": sym.source} if sym else None)
            if why:
                d["symbol_error"] = why
        return d


def _queries_from_stdin(stream, default_ns: int, clock, decimal: bool):
    """(line number, Query or error message) per non-empty, non-comment line ``PID ADDR [TIME]``
    (ADDR and TIME in any form of :mod:`buildidd.inputs`; TIME as perf script prints it may end in ``:``)."""
    from buildidd.offline.replay import Query

    for n, line in enumerate(stream, 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        try:
            if len(fields) not in (2, 3) or not fields[0].isdigit():
                raise UsageError(f"expected 'PID ADDR [TIME]', got {line.strip()[:200]!r}")
            t = clock.parse(fields[2]) if len(fields) == 3 else default_ns
            yield n, Query(int(fields[0]), parse_address(fields[1], decimal=decimal), t)
        except UsageError as e:
            yield n, str(e)


def cmd_resolve(args) -> int:
    """`buildidd resolve SESSION PID ADDR` (or ``PID ADDR [TIME]`` lines on stdin): the covering mapping.

    Exit status: 0 when every query was understood (on the command line: and
    answered with a mapping), 1 when the one query found no mapping, 2 for bad
    input; a stdin batch names each line it could not read, answers the others,
    and ends with their count (then exit 2).
    """
    from buildidd.offline.demangle import Demangler
    from buildidd.offline.replay import Replay
    from buildidd.offline.symbols import Symbolizer

    cfg = roots_from_args(args)
    session = resolve_session(args.session, cfg.session_root)
    from_stdin = args.pid in (None, "-")
    if not from_stdin and args.addr is None:
        raise UsageError("resolve: give PID and ADDR, or neither (or '-') to read 'PID ADDR [TIME]' lines from stdin")
    if not from_stdin and not args.pid.isdigit():
        raise UsageError(f"resolve: PID must be a decimal number, got {args.pid!r}")
    addr = None if from_stdin else parse_address(args.addr, decimal=args.decimal)
    replay = Replay.load(session)
    clock = SessionClock(replay.session.get("boot_to_wall_offset_ns"))
    default_ns = clock.parse(args.time) if args.time else replay.end_ns
    store = open_stores(cfg, args)
    demangler = Demangler() if args.symbolize and not args.no_demangle else None
    out = _Output(args.json, store, Symbolizer(store) if args.symbolize else None, clock, demangler)
    try:
        return _resolve_all(args, replay, out, default_ns, clock, addr)
    finally:
        if demangler is not None:
            demangler.close()


def _resolve_all(args, replay, out, default_ns: int, clock, addr) -> int:
    """The queries of cmd_resolve answered and printed; its exit status."""
    from buildidd.offline.replay import Query

    from_stdin = addr is None
    lines = bad = 0
    if from_stdin:
        queries = []
        for n, q in _queries_from_stdin(sys.stdin, default_ns, clock, args.decimal):
            lines += 1
            if isinstance(q, str):
                print(f"buildidd: stdin line {n}: {q}", file=sys.stderr)
                bad += 1
            else:
                queries.append(q)
    else:
        queries = [Query(int(args.pid), addr, default_ns)]
    found = 0
    write = sys.stdout.write
    for a in replay.resolve_many(queries):
        found += a.mapping is not None
        write(out.line(a) + "\n")
    if bad:
        print(f"buildidd: resolve: {bad} of {lines} stdin lines not understood (named above), "
              f"{len(queries)} answered, {found} with a mapping", file=sys.stderr)
        return 2
    return 0 if found or from_stdin else 1


# -- export ----------------------------------------------------------------------------


def cmd_export(args) -> int:
    """`buildidd export SESSION -o FILE`: the session's mapping history as perf.data (the one format;
    ``--perf`` is accepted and changes nothing)."""
    from buildidd.offline.perfdata import export_perf

    cfg = roots_from_args(args)
    session = resolve_session(args.session, cfg.session_root)
    stats = export_perf(session, args.output)
    recs = ", ".join(f"{k} {v}" for k, v in stats.records.items())
    print(f"{args.output}: {stats.size_bytes} bytes; {recs}; {len(stats.build_ids)} build-ids", file=sys.stderr)
    if stats.build_ids_too_long:
        print(f"buildidd: {stats.build_ids_too_long} build-ids over 20 bytes do not fit in perf.data "
              "(their mappings carry dev/ino instead)", file=sys.stderr)
    if stats.skipped:
        print(f"buildidd: {stats.skipped} malformed records skipped", file=sys.stderr)
    return 0


# -- inject ----------------------------------------------------------------------------


def cmd_inject(args) -> int:
    """`buildidd inject PROFILE [SESSION] -o OUT`: the profile with the session's build-id on every mapping.

    Prints the summary (offline.inject.InjectStats) on stderr, or as one JSON object on stdout with --json.
    """
    from buildidd.offline.inject import inject

    cfg = roots_from_args(args)
    session = resolve_session(args.session, cfg.session_root)
    stats = inject(args.profile, session, args.output)
    if args.json:
        print(json.dumps(dict(stats.to_json(), input=args.profile, output=args.output, session=str(session)),
                         separators=(",", ":")))
        return 0
    d = stats.to_json()
    err = sys.stderr
    print(f"{args.output}: {d['records']} records, {d['user_mappings']} user-space mappings: "
          f"{d['matched']} given the session's build-id, {d['agreed']} already had the same, "
          f"{d['perf_only']} kept perf's (no session answer), {d['disagreements']} disagreements", file=err)
    if d["not_matched"]:
        reasons = ", ".join(f"{k} {v}" for k, v in d["not_matched"].items())
        print(f"buildidd: not matched: {reasons}", file=err)
    s = d["samples"]
    if s.get("resolved"):
        print(f"buildidd: samples: {s['total']}, user-space {s['user']}: {s['in_mapping_with_build_id']} in "
              f"mappings with a build-id, {s['in_mapping_without_build_id']} without, "
              f"{s['outside_known_mappings']} outside known mappings", file=err)
    print(f"buildidd: clock: {d['clock']} ({'time joins the match' if d['clock'] == 'boottime' else 'time not used'})"
          f"; HEADER_BUILD_ID: {d['header_build_ids']['written']} entries", file=err)
    v = d["versions"]
    if v["paths"]:
        long_ = f", {v['too_long']} left under the path's name (too long)" if v["too_long"] else ""
        print(f"buildidd: {v['paths']} paths held several build-ids: {v['named']} versions named PATH@BIDPREFIX, "
              f"a DSO each in perf report{long_}; {len(v['names'])} shown:", file=err)
        for n in v["names"]:
            print(f"buildidd:   {n['name']}  {n['build_id']}", file=err)
    for ex in d["disagreement_examples"]:
        print(f"buildidd: disagreement: pid {ex['pid']} {ex['start']} {ex['path']}: perf {ex['perf']}, "
              f"session {ex['session']} (perf's kept)", file=err)
    for w in d["warnings"]:
        print(f"buildidd: warning: {w}", file=err)
    return 0


def register(sub) -> None:
    """Add ``buildid-list``, ``which``, ``resolve``, ``export`` and ``inject`` to the subcommand parsers."""
    p = sub.add_parser("which", help="every build-id a path had in the recorded sessions, and when",
                       description="Print each build-id PATH was mapped or executed with in the sessions, with "
                                   "when it was first and last seen (UTC), the host, and whether the store holds "
                                   "it: debuginfod's /metadata answer, which buildidd serve gives too.  --glob "
                                   "takes PATH as a glob ('*' also crosses '/').  Exit status 1 when nothing "
                                   "matches.")
    p.add_argument("path", metavar="PATH", help="a path as the mapping named it, or a glob with --glob")
    p.add_argument("--glob", action="store_true", help="PATH is a glob pattern")
    p.add_argument("--json", action="store_true", help="the /metadata JSON answer")
    add_roots_options(p)
    p.set_defaults(func=cmd_which)
    p = sub.add_parser("buildid-list", help="build-id and path of every DSO in a session (like perf buildid-list)",
                       description="Print each build-id the session names with the path it was mapped from, as "
                                   "perf buildid-list prints a perf.data's, the kernel's line included; --pid and "
                                   "--comm keep the DSOs of some processes; --json adds each entry's provenance "
                                   "in the store.")
    _session_arg(p)
    add_roots_options(p)
    p.add_argument("--pid", type=int, action="append", help="only DSOs this pid mapped (repeatable)")
    p.add_argument("--comm", action="append", help="only DSOs mapped by a task of this comm (repeatable)")
    p.add_argument("--json", action="store_true", help="JSON lines, DSOs without a build-id included")
    p.add_argument("--provenance", action="store_true", help="a third column: the store copy's provenance "
                   "(trusted, untrusted, conflict, unknown; - when not stored)")
    p.add_argument("--quality", action="store_true", help="a column: what the stored copy is good for "
                   "(dwarf, symtab, minidebuginfo, go_pclntab, dynsym, none; - when not stored)")
    p.set_defaults(func=cmd_buildid_list)

    _register_resolve(sub)

    p = sub.add_parser("export", help="a session's mapping history as perf.data",
                       description="Write the session's mappings as a perf.data file: a PERF_RECORD_MMAP2 with the "
                                   "build-id for each mapping, the task records, and HEADER_BUILD_ID, so that perf "
                                   "script and perf buildid-list read the session.  To give a profile of your own "
                                   "the session's build-ids, use buildidd inject.")
    _session_arg(p)
    add_roots_options(p)
    p.add_argument("--perf", action="store_true", help="write perf.data: the one format and the default")
    p.add_argument("-o", "--output", required=True, help="output file")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("inject", help="a perf.data profile with the session's build-id on every mapping",
                       description="Rewrites PROFILE's PERF_RECORD_MMAP/MMAP2 records as MMAP2 carrying the "
                                   "build-id the session recorded for that mapping (matched by pid, start, pgoff "
                                   "and dev/inode/generation), HEADER_BUILD_ID to agree, each version of a path with "
                                   "several named PATH@BIDPREFIX.  Then: perf --buildid-dir STORE report -i OUT "
                                   "(--buildid-dir is an option of perf itself, before report).")
    p.add_argument("profile", help="perf.data written by perf record")
    p.add_argument("session", nargs="?", default="latest",
                   help="session directory, its name under the session root, or 'latest' (default)")
    add_roots_options(p)
    p.add_argument("-o", "--output", required=True, help="output perf.data (never the input)")
    p.add_argument("--json", action="store_true", help="the summary as one JSON object on stdout")
    p.set_defaults(func=cmd_inject)


def _register_resolve(sub) -> None:
    """Add ``resolve`` to the subcommand parsers."""
    p = sub.add_parser("resolve", help="the mapping (file, build-id, offset, symbol) that covered ADDR in PID",
                       description="Replays the session's exec/mmap/fork/exit records as perf report rebuilds "
                                   "its machine state.  Without PID and ADDR (or with PID '-'), reads "
                                   "'PID ADDR [TIME]' lines from stdin.")
    _session_arg(p)
    p.add_argument("pid", nargs="?", help="process id (tgid), or '-' for stdin")
    p.add_argument("addr", nargs="?", help="address: hex with or without 0x (as /proc/PID/maps and perf print "
                   "it), a maps range START-END (its start), or decimal with --decimal")
    add_roots_options(p)
    p.add_argument("--decimal", action="store_true", help="read addresses as decimal (0x... is still hex)")
    p.add_argument("--time", metavar="TIME", help="when: ns since boot, perf's sec.usec, ISO 8601, HH:MM[:SS] "
                   "today, or relative like -40s, -2min (default: the end of the session)")
    p.add_argument("--symbolize", action="store_true", help="symbol+offset from the stored binary (C++ names "
                   "demangled by binutils' c++filt, as perf and gdb show them)")
    p.add_argument("--no-demangle", action="store_true", help="with --symbolize: C++ names as in the symbol table")
    p.add_argument("--json", action="store_true", help="one JSON object per answer")
    p.set_defaults(func=cmd_resolve)

"""``buildidd archive``, ``import`` and ``sessions``: moving sessions and their binaries between hosts."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from pathlib import Path

from buildidd.cli.common import (add_roots_options, debug_dir as import_dir, open_stores, resolve_session,
                                 roots_from_args, session_roots)
from buildidd.cli.leftout import add_list_option, by_reason, left_out_lines, untrusted_lines
from buildidd.errors import PrivilegeError, UsageError

def _store(cfg):
    """The config's store, or ``None`` when none is configured or it does not exist (never created here)."""
    from buildidd.store import Store

    if not cfg.store_root or not os.path.isdir(cfg.store_root):
        return None
    return Store(cfg.store_root)


def _progress_bar(total_hint: str):
    """A tqdm bar on stderr when it is a terminal, else ``(None, None)``."""
    if not sys.stderr.isatty():
        return None, None
    from tqdm import tqdm

    bar = tqdm(total=0, unit="B", unit_scale=True, unit_divisor=1024, desc=total_hint, file=sys.stderr)

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    return bar, progress


def _summary(manifest) -> str:
    """``143 archived, 0 upstream, 2 missing (2 private)``: the counts, the missing ones by reason."""
    return ", ".join(f"{n} {status}" for status, n in manifest.counts().items()) + by_reason(manifest)


def _create(tmp: Path, out: Path, mode: int):
    """Open tmp (the hidden name the archive is written under) for writing, with exactly mode
    (offline.archive.create_archive_file); an error names out and its directory.

    Raises:
        PrivilegeError: the directory is not writable by this user (exit 4).
        ArchiveError: ``cannot_write``: another error (a read-only file system, no space).
    """
    from buildidd.errors import ArchiveError
    from buildidd.offline.archive import create_archive_file

    try:
        return create_archive_file(tmp, mode)
    except PermissionError as e:
        raise PrivilegeError(f"-o {out}: cannot create a file in {out.parent}: {e.strerror}; "
                             "name a file in a directory you can write") from e
    except OSError as e:
        raise ArchiveError("cannot_write", f"-o {out}: cannot create a file in {out.parent}: {e.strerror}") from e


def _mode_arg(text: str) -> int:
    """argparse type of --mode (offline.archive.parse_mode)."""
    from buildidd.offline.archive import parse_mode
    try:
        return parse_mode(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def cmd_archive(args) -> int:
    """`buildidd archive SESSION -o FILE`: the session and its binaries in one tar + zstd file.

    Written to ``FILE.part-XXXX`` next to FILE and renamed when complete, so a
    failed archive leaves no partial FILE.
    """
    from buildidd.offline.archive import ARCHIVE_MODE, write_archive

    mode = ARCHIVE_MODE if args.mode is None else args.mode
    cfg = roots_from_args(args)
    session = resolve_session(args.session, cfg.session_root)
    out = Path(args.output)
    if out.is_dir():
        raise UsageError(f"-o {out}: is a directory; name the archive file")
    if not out.parent.is_dir():
        raise UsageError(f"-o {out}: no directory {out.parent}; create it first (mkdir -p {out.parent}) "
                         "or name a file in an existing one")
    tmp = out.with_name(f".{out.name}.part-{secrets.token_hex(4)}")
    bar, progress = _progress_bar(session.name)
    try:
        with _create(tmp, out, mode) as f:
            manifest = write_archive(session, _store(cfg), f, exclude_upstream=args.exclude_upstream,
                                     progress=progress,
                                     share_private=cfg.store_share_private or args.share_private)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        if bar is not None:
            bar.close()
        if tmp.exists():
            tmp.unlink()
    # An unreachable --exclude-upstream was logged (stderr) by write_archive and is in the manifest.
    print(f"{out}: session {session.name}, {len(manifest.segments)} segment(s), build-ids: "
          f"{_summary(manifest)}, {out.stat().st_size} bytes, mode {mode:04o}")
    for line in left_out_lines(manifest, full=args.list_left_out):
        print(line)
    return 0


def cmd_import(args) -> int:
    """`buildidd import FILE`: verify an archive and install it into a build-id cache and the session root."""
    from buildidd.offline.importer import import_archive

    cfg = roots_from_args(args)
    debug_dir = import_dir(args)
    try:
        r = import_archive(args.file, debug_dir=debug_dir, session_root=cfg.session_root,
                           untrusted=args.untrusted)
    except PermissionError as e:
        where = str(e.filename or "")
        option = ("--session-root DIR" if where.startswith(os.path.abspath(cfg.session_root)) else
                  "--debug-dir DIR" if where.startswith(os.path.abspath(debug_dir)) else None)
        if option is None:
            raise
        raise PrivilegeError(f"import: cannot write {where}: {e.strerror}; run as root, or give {option} "
                             "(a directory of yours)") from e
    if args.json:
        json.dump({"session_dir": str(r.session_dir), "session_new": r.session_new, "debug_dir": debug_dir,
                   "installed": r.installed, "present": r.present, "upstream": r.upstream,
                   "missing": r.missing, "untrusted": r.untrusted, "bytes": r.bytes}, sys.stdout)
        print()
        return 0
    print(f"session {r.manifest.session['name']} -> {r.session_dir}" + ("" if r.session_new else " (already there)"))
    print(f"build-ids -> {debug_dir}: {len(r.installed)} installed ({r.bytes} bytes), {len(r.present)} already "
          f"present, {len(r.upstream)} upstream, {len(r.missing)} missing" + by_reason(r.manifest))
    for line in left_out_lines(r.manifest, full=args.list_left_out):
        print(line)
    for line in untrusted_lines(r.manifest, r.untrusted, args.untrusted, debug_dir):
        print(line)
    return 0


def _time(info, time_ns) -> str:
    from datetime import datetime, timezone

    wall = info.wall_ns(time_ns)
    if wall is None:
        return "-" if time_ns is None else f"{time_ns / 1e9:.3f}s"
    return datetime.fromtimestamp(wall / 1e9, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _closed(info) -> str:
    """The CLOSED column: ``clean`` (the daemon closed it), ``sealed`` (killed or crashed, sealed at the
    next start), ``unclean`` (an end record or marker saying not clean, without the sealing's mark), ``open``
    (live, or killed and not sealed yet)."""
    if not info.closed:
        return "open"
    if info.clean is False:
        return "sealed" if info.sealed else "unclean"
    return "clean"


def cmd_sessions(args) -> int:
    """`buildidd sessions`: every session under the session root (name, host, time range, size, records,
    build-ids, stored, gaps, lost, how it was closed); ``--json``: one JSON object per line (``closed``,
    ``clean``, ``sealed``, ``gaps``, ``gaps_by_uid``, ``gaps_file``, ``gaps_in_file``)."""
    from buildidd.offline.sessions import list_sessions

    cfg = roots_from_args(args)
    holds = _store_holds(open_stores(cfg, args))
    roots = session_roots(cfg.session_root)
    _check_roots(roots)
    infos = [i for root in roots if os.path.isdir(root) for i in list_sessions(root, holds=holds)]
    if args.json:
        for info in infos:
            print(json.dumps(info.to_json()))
        return 0
    print(f"{'NAME':<34} {'HOST':<16} {'FIRST':<20} {'LAST':<20} {'BYTES':>10} {'RECORDS':>8} "
          f"{'BUILDIDS':>8} {'STORED':>7} {'GAPS':>6} {'LOST':>6} {'HELD':>6} CLOSED")
    for i in infos:
        stored = "-" if i.build_ids_stored is None else i.build_ids_stored
        gaps = "-" if i.gaps is None else i.gaps
        print(f"{i.name:<34} {(i.host or '-'):<16} {_time(i, i.first_time_ns):<20} {_time(i, i.last_time_ns):<20} "
              f"{i.size_bytes:>10} {sum(i.records.values()):>8} {i.build_ids:>8} {stored:>7} {gaps:>6} {i.lost:>6} "
              f"{i.throttled:>6} {_closed(i)}")
    return 0


def _check_roots(roots: list[str]) -> None:
    """Refuse a listing of session roots none of which exists (an empty table would say "no sessions" where
    the truth is "wrong place"), or one this user may not read.

    Raises:
        SessionLogError: no root exists (exit 1).
        PrivilegeError: a root exists but cannot be listed (exit 4).
    """
    from buildidd.errors import SessionLogError

    for root in roots:
        if os.path.isdir(root) and not os.access(root, os.R_OK | os.X_OK):
            raise PrivilegeError(f"sessions: cannot read the session root {root}; run as root, or give "
                                 "--session-root DIR")
    if not any(os.path.isdir(r) for r in roots):
        raise SessionLogError(f"sessions: no session root at {' or '.join(roots)}: nothing was recorded or "
                              "imported there; give --session-root DIR (the daemon's session_root, or where "
                              "buildidd import put them)")


def _store_holds(store):
    """contains() of the stores (a StoreChain), or None when there is none to ask: the listing then
    shows no STORED count."""
    if store is None:
        return None

    def holds(bid: str) -> bool:
        try:
            return store.contains(bid)
        except (OSError, ValueError):
            return False
    return holds


def register(sub) -> None:
    """Add ``archive``, ``import`` and ``sessions`` to the subcommands."""
    p = sub.add_parser("archive", help="a session and every binary it references, in one tar+zstd file",
                       description="Write SESSION, its manifest and the store entries of every build-id it "
                                   "references to one tar + zstd file (extract with tar --zstd; install with "
                                   "buildidd import).")
    p.add_argument("session", help="session directory, its name under the session root, or 'latest'")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="the archive to write")
    p.add_argument("--share-private", action="store_true",
                   help="include binaries the store marked private (their source was not readable by every "
                        "user); the default leaves them out and names each (store_share_private does the same)")
    p.add_argument("--mode", type=_mode_arg, metavar="OCTAL",
                   help="the archive file's permission bits (default 0600: its owner's alone, as it carries the "
                        "host's exec history; e.g. 0640 for the owner's group too)")
    p.add_argument("--exclude-upstream", metavar="URL",
                   help="leave out the binaries this debuginfod server already serves (listed as 'upstream')")
    add_list_option(p)
    add_roots_options(p)
    p.set_defaults(func=cmd_archive)

    p = sub.add_parser("import", help="verify an archive and install it into a perf build-id cache",
                       description="Verify FILE (manifest, sizes, build-ids), then install its binaries into "
                                   "the analyst's store, --debug-dir (default ~/.debug: perf's build-id cache, "
                                   "which every offline verb reads too), with gdb's tree for cores beside it "
                                   "(gdb -iex 'set debug-file-directory ~/.debug/.gdb' -c CORE), and its "
                                   "session under the session root. Files keep the host's mtime.")
    p.add_argument("file", help="an archive written by buildidd archive")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--untrusted", choices=("mark", "skip", "refuse"), default="mark",
                   help="entries whose provenance is not 'trusted' (not a root-owned system file on the host): "
                        "install them marked (default), skip them, or refuse the archive")
    add_list_option(p)
    add_roots_options(p)
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("sessions", help="list the recorded sessions",
                       description="List sessions: name, host, time range (UTC), size, records, build-ids "
                                   "(and how many the store holds: STORED), the build-ids the store lacked at the end "
                                   "(GAPS; each listed in the gap file: buildidd show SESSION --type gap), lost events, records held back by the per-user budgets (HELD: the throttled records), and how each was closed (clean; sealed: the daemon was killed "
                                   "or crashed and the next start sealed it; open: live or not sealed yet).")
    p.add_argument("--json", action="store_true", help="one JSON object per session and line")
    add_roots_options(p)
    p.set_defaults(func=cmd_sessions)

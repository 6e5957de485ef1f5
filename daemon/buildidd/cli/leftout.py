"""What an archive left out, as ``archive``, ``import`` and ``pull`` print it: a summary by directory and owner;
and what import did with copies that are not trusted, each with its path and why.

A host with a Python under root's 0700 home leaves out the interpreter, libpython and every extension module:
dozens of build-ids with one cause.  So the default report is one line per reason (with what to do) and, under
it, one line per cause: the directory that made the files private (``/root (mode 0700) made 37 files of root
private``), or for the other reasons the directory the files were mapped from.  ``--list-left-out`` adds each
build-id with its path; the archive's manifest lists them all.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:      # the CLI imports the offline stage only when a verb runs
    from buildidd.offline.manifest import BuildIdRef

__all__ = ["left_out_lines", "by_reason", "untrusted_lines", "add_list_option", "GROUPS_SHOWN_MAX"]

#: Cause lines shown per reason; the rest are counted in one line.
GROUPS_SHOWN_MAX = 20

#: What to do about private files, said once under the ``private`` reason.
SHARE_HINT = ("to share them: open up that directory on the recording host, or archive there with --share-private "
              "(serve, and so pull: store_share_private = true)")

LIST_HINT = ("each left-out build-id with its path: --list-left-out (the archive's manifest.json lists them all: "
             "tar --zstd -xOf ARCHIVE manifest.json)")


def by_reason(manifest) -> str:
    """`` (37 private, 4 not_in_store)`` after the counts, or "" when nothing is missing."""
    groups = manifest.missing_by_reason()
    return (" (" + ", ".join(f"{len(refs)} {reason}" for reason, refs in sorted(groups.items())) + ")"
            if groups else "")


def _files(n: int) -> str:
    return f"{n} file{'' if n == 1 else 's'}"


def _mode(mode: int | None) -> str:
    return f"mode {mode:04o}" if mode is not None else "mode unknown"


def _private_key(ref: BuildIdRef) -> tuple:
    """What a private build-id is grouped by: the cause, and the owner of its source."""
    path = ref.paths[0] if ref.paths else ""
    owner = ref.owner or "an unknown user"
    if ref.private_by is None:
        return ("unrecorded", os.path.dirname(path) or "-", None, owner)
    if ref.private_by.startswith("/memfd:") or not ref.private_by.startswith("/"):
        return ("memfd", "", None, owner)
    if ref.private_by in ref.paths:
        return ("own_mode", os.path.dirname(ref.private_by) or "/", None, owner)
    return ("dir", ref.private_by, ref.private_by_mode, owner)


def _private_line(key: tuple, refs: list[BuildIdRef]) -> str:
    kind, where, mode, owner = key
    n, example = _files(len(refs)), refs[0].paths[0] if refs[0].paths else "-"
    if kind == "dir":
        return f"{where} ({_mode(mode)}) made {n} of {owner} private, e.g. {example}"
    if kind == "own_mode":
        return f"{where}: {n} of {owner} private by their own mode (no read for others), e.g. {example}"
    if kind == "memfd":
        return f"{n} of {owner} private as memfds (no path), e.g. {example}"
    return f"{where}: {n} of {owner} private (the archive does not say which directory), e.g. {example}"


def _other_key(ref: BuildIdRef) -> tuple:
    return (os.path.dirname(ref.paths[0]) if ref.paths and ref.paths[0].startswith("/") else "-",)


def _other_line(key: tuple, refs: list[BuildIdRef]) -> str:
    return f"{key[0]}: {_files(len(refs))}, e.g. {refs[0].paths[0] if refs[0].paths else '-'}"


def _grouped(refs: list[BuildIdRef], key, line) -> list[str]:
    """One line per group of refs (largest first, at most GROUPS_SHOWN_MAX), then how many groups more."""
    groups: dict[tuple, list[BuildIdRef]] = {}
    for ref in refs:
        groups.setdefault(key(ref), []).append(ref)
    ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), str(kv[0])))
    out = [f"    {line(k, v)}" for k, v in ordered[:GROUPS_SHOWN_MAX]]
    rest = ordered[GROUPS_SHOWN_MAX:]
    if rest:
        out.append(f"    ... and {sum(len(v) for _, v in rest)} more in {len(rest)} more places (--list-left-out)")
    return out


def left_out_lines(manifest, *, full: bool = False) -> list[str]:
    """The report of what the archive left out (status ``missing``), for archive, import and pull alike.

    Per reason: ``  left out, REASON (N): HINT`` (manifest.missing_hint), then one line per cause
    (private: the directory that made them private and the owner, :func:`_private_key`; other reasons:
    the directory they were mapped from), at most GROUPS_SHOWN_MAX.  full: also every build-id with its
    first path, under its reason.  [] when nothing was left out.
    """
    from buildidd.offline.manifest import missing_hint

    lines: list[str] = []
    for reason, refs in sorted(manifest.missing_by_reason().items()):
        hint = missing_hint(reason)
        lines.append(f"  left out, {reason} ({len(refs)}){': ' + hint if hint else ''}")
        if reason == "private":
            lines.extend(_grouped(refs, _private_key, _private_line))
            lines.append(f"    {SHARE_HINT}")
        else:
            lines.extend(_grouped(refs, _other_key, _other_line))
        if full:
            lines.extend(f"      {ref.build_id}  {ref.paths[0] if ref.paths else '-'}" for ref in refs)
    if lines and not full:
        lines.append(f"  {LIST_HINT}")
    return lines


def add_list_option(parser) -> None:
    """``--list-left-out`` for archive, import and pull."""
    parser.add_argument("--list-left-out", action="store_true",
                        help="also list each build-id left out of the archive with its path (the default "
                             "summarizes them by directory and owner)")


#: Why a copy is not trusted, by its provenance (store.PROVENANCES), as import says it.
PROVENANCE_REASONS = {
    "untrusted": "on the recording host its copy was not a root-owned file under a system directory "
                 "(/usr, /lib, /opt, ...), so anyone could have made it",
    "conflict": "on the recording host different files claimed this build-id",
    "unknown": "the archive does not say where its copy came from (an older buildidd, or perf's cache)",
}


def untrusted_lines(manifest, build_ids: list[str], policy: str, debug_dir: str) -> list[str]:
    """What import did with each entry that is not ``trusted`` (``--untrusted mark`` or ``skip``): a line saying
    where the word is kept and how to change it, then each build-id with a path it was mapped from and why.
    [] when build_ids is empty."""
    if not build_ids:
        return []
    refs = {ref.build_id: ref for ref in manifest.build_ids}
    if policy == "skip":
        head = (f"  skipped, not trusted ({len(build_ids)}): not installed (--untrusted skip); "
                "--untrusted mark installs them marked")
    else:
        head = (f"  marked untrusted ({len(build_ids)}): installed, with the word in "
                f"{debug_dir}/<path>/<build-id>/provenance; --untrusted skip leaves them out, "
                "--untrusted refuse refuses such an archive")
    lines = [head]
    for bid in build_ids:
        ref = refs.get(bid)
        path = ref.paths[0] if ref is not None and ref.paths else "-"
        word = (ref.provenance if ref is not None else None) or "unknown"
        lines.append(f"    {bid}  {path}: {word}: {PROVENANCE_REASONS.get(word, word)}")
    return lines

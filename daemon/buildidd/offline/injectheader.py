"""inject's HEADER_BUILD_ID: perf's build-id table read from the profile and written to agree with the output.

The feature is a sequence of ``struct perf_record_header_build_id {perf_event_header header; s32 pid;
u8 build_id[20]; u8 size; u8 res; u16 res}`` (36 bytes) + filename (tools/perf/util/header.c
``write_build_id`` / ``perf_header__read_build_ids``); see :mod:`buildidd.offline.perfdata`.
"""

from __future__ import annotations

from buildidd.offline.injectmatch import HEX_BUILD_ID
from buildidd.offline.perfabi import (BUILD_ID_ENTRY, BUILD_ID_SIZE, HOST_KERNEL_ID, PERF_RECORD_MISC_BUILD_ID_SIZE,
                                      PERF_RECORD_MISC_CPUMODE_MASK, PERF_RECORD_MISC_GUEST_KERNEL,
                                      PERF_RECORD_MISC_KERNEL)
from buildidd.offline.perfdata import build_id_entry, user_build_id_entries
from buildidd.offline.perffile import PerfDataError, PerfFile
from buildidd.store import KALLSYMS_DSO

#: Largest HEADER_BUILD_ID section read from the input (bytes).
MAX_BUILD_ID_SECTION = 256 << 20


def parse_build_id_section(pf: PerfFile, raw: bytes) -> list[tuple[int, int, str, str, bytes]]:
    """HEADER_BUILD_ID entries as (misc, pid, build-id hex, filename, entry bytes) (header.c
    ``perf_header__read_build_ids``: a build-id of ``size`` bytes with PERF_RECORD_MISC_BUILD_ID_SIZE, else 20).

    Raises:
        PerfDataError: an entry with a size under 36 bytes or past the section's end.
    """
    out, at = [], 0
    while at < len(raw):
        if len(raw) - at < BUILD_ID_ENTRY.size:
            raise PerfDataError(f"{pf.path}: HEADER_BUILD_ID ends inside an entry")
        e = BUILD_ID_ENTRY.fields_from(raw, at)
        misc, size, pid, bid, bsize = e.misc, e.size, e.pid, e.build_id, e.build_id_size
        if size < BUILD_ID_ENTRY.size or size > len(raw) - at:
            raise PerfDataError(f"{pf.path}: HEADER_BUILD_ID entry of {size} bytes at {at} of {len(raw)}")
        n = bsize if misc & PERF_RECORD_MISC_BUILD_ID_SIZE and bsize <= BUILD_ID_SIZE else BUILD_ID_SIZE
        name = raw[at + BUILD_ID_ENTRY.size:at + size].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        out.append((misc, pid, bid[:n].hex(), name, raw[at:at + size]))
        at += size
    return out


def build_id_section(perf_entries: list, carried: dict, unmatched_paths: set, kernel_bid: str | None,
                     header: dict) -> bytes:
    """The new HEADER_BUILD_ID, counted in header (written, kept_from_perf, dropped_from_perf, kernel_added).

    perf's kernel and module entries; perf's user-space entries for paths whose every mapping carries a
    build-id only when theirs is among those (the others are dropped: perf read the path after the profile,
    and the path held another build by then); then one entry per (build-id, path) the output's MMAP2 records
    carry, under the name those records give it (:mod:`~buildidd.offline.injectnames`: PATH@BIDPREFIX where
    the path holds several).  The host kernel's from the session (kernel_bid) when perf wrote none;
    kernel_bid is ``None`` when the profile names another host or kernel release than the session.

    Args:
        perf_entries: :func:`parse_build_id_section` of the input.
        carried: (build-id hex, path as perf recorded it) → (first pid, name in the output).
        unmatched_paths: paths with a user-space mapping the output leaves without a build-id.
    """
    kernel, user = [], []
    carried_paths = {path for _bid, path in carried}
    for misc, pid, bid, name, raw in perf_entries:
        if misc & PERF_RECORD_MISC_CPUMODE_MASK in (PERF_RECORD_MISC_KERNEL, PERF_RECORD_MISC_GUEST_KERNEL):
            kernel.append(raw)
        elif (bid, name) in carried:
            continue                          # written below, with ours
        elif name in carried_paths and name not in unmatched_paths:
            header["dropped_from_perf"] += 1
        else:
            header["kept_from_perf"] += 1
            user.append((bid, name, pid))
    if isinstance(kernel_bid, str) and not kernel and HEX_BUILD_ID.fullmatch(kernel_bid) and \
            len(kernel_bid) <= 2 * BUILD_ID_SIZE:
        kernel.append(build_id_entry(kernel_bid, KALLSYMS_DSO, True, HOST_KERNEL_ID))
        header["kernel_added"] = True
    user += [(bid, out_name, pid) for (bid, _path), (pid, out_name) in carried.items()]
    entries = kernel + user_build_id_entries(user)
    header["written"] = len(entries)
    return b"".join(entries)

"""A session and a store to archive, built for the offline archive/import tests (gcc binaries, real segments)."""

from __future__ import annotations

import os
from pathlib import Path

from buildidd.resolve.host import kernel_build_id
from buildidd.sessionlog import SessionWriter
from buildidd.store import Store
from conftest import gcc, readelf_build_id, split_debuginfo, store_add

SRC = """
#include <stdio.h>
int counter;
const char tag[] = "%s";
int bidd_archive_fn_%s(int x) { return x * 3 + counter; }
int main(void) { counter++; puts(tag); return bidd_archive_fn_%s(1) == 0; }
"""

SESSION_NAME = "20261122T000000Z-4242"


def build_binary(directory: Path, name: str, *flags: str) -> Path:
    """gcc-built program ``name`` with a function ``bidd_archive_fn_<name>``."""
    directory.mkdir(parents=True, exist_ok=True)
    return gcc(SRC % (name, name, name), directory / name, "-g", *flags)


def make_world(tmp: Path, bins: Path, records: int = 2000) -> dict:
    """A store with ``full`` (symbols), ``split`` (stripped + debuginfo) and the kernel (when root can
    snapshot it); ``gone`` is referenced but never stored.  The session has several compressed
    segments, a lost record and an unresolved mapping.  The binaries are built in ``bins``, a directory
    every user can traverse (``public_tmp_factory``): from a private one the store's copies would be
    private, and neither archived nor served."""
    full = build_binary(bins, "full")
    split = build_binary(bins, "split")
    debug = split_debuginfo(split, tmp / "usr-lib-debug")
    gone = build_binary(bins, "gone")
    store = Store(tmp / "store", debug_root=tmp / "usr-lib-debug")
    bids = {"full": store_add(store, full), "split": store_add(store, split), "gone": readelf_build_id(gone)}
    kbid = kernel_build_id()
    if kbid and os.geteuid() == 0:
        try:
            store.add_kallsyms(kbid)
        except Exception:  # noqa: BLE001 - hidden kallsyms: the world simply has no kernel entry
            pass
    session = tmp / "sessions" / SESSION_NAME
    w = SessionWriter(session, compress=True, max_segment_bytes=4 << 10)
    w.write({"type": "session", "time_ns": 1_000, "host": "prod-1", "boot_id": "b00t", "kernel_release": "6.18",
             "kernel_build_id": kbid, "module_build_ids": {}, "boot_to_wall_offset_ns": 1_700_000_000 * 10**9})
    paths = [(str(full), bids["full"]), (str(split), bids["split"]), (str(gone), bids["gone"])]
    for i in range(records):
        path, bid = paths[i % 3]
        w.write({"type": "mmap", "time_ns": 2_000 + i, "pid": 100 + i % 7, "tid": 100 + i % 7, "comm": "x",
                 "start": 0x400000, "len": 4096, "pgoff": 0, "path": path, "build_id": bid, "error": None})
    w.write({"type": "mmap", "time_ns": 9_000_000, "pid": 1, "tid": 1, "comm": "x", "path": "/memfd:jit",
             "build_id": None, "error": "not_elf"})
    w.write({"type": "lost", "time_ns": 9_000_001, "counts": {"ringbuf_full": 5}})
    w.write({"type": "end", "time_ns": 9_000_002})
    w.close()
    return {"tmp": tmp, "store": store, "session": session, "bids": bids, "kbid": kbid if store.contains(kbid or "00")
            else None, "files": {"full": full, "split": split, "gone": gone}, "debug": debug, "records": records + 4}

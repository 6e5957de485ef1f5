"""A host's store and session for the fleet tests: gcc-built binaries with every kind of trust and debuginfo."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from buildidd.config import Config
from buildidd.sessionlog import SessionWriter
from buildidd.store import Store
from conftest import gcc, store_add

SRC = """
#include <stdio.h>
const char tag[] = "%s";
static char pad[%d] = {1};
int bidd_fleet_fn_%s(int x) { return x * 7 + pad[x & 1]; }
int main(int argc, char **argv) { puts(tag); return bidd_fleet_fn_%s(argc) == 0; }
"""


def build(directory: Path, name: str, *flags: str, pad_bytes: int = 16) -> Path:
    """gcc-built program ``name`` (with a function ``bidd_fleet_fn_<name>`` and pad_bytes of data)."""
    directory.mkdir(parents=True, exist_ok=True)
    return gcc(SRC % (name, pad_bytes, name, name), directory / name, "-g", *flags)


def system_dir() -> Path:
    """A new root-owned 0755 directory under /usr/lib (where the store trusts root's files); removed by the caller."""
    d = Path(tempfile.mkdtemp(prefix="buildidd-fleet-", dir="/usr/lib"))
    os.chmod(d, 0o755)
    return d


def write_session(session_root: Path, name: str, host: str, bids: dict[str, tuple[str, str]], records: int = 600):
    """A closed session (several compressed segments) whose mmap records name every (path, build-id) of bids."""
    w = SessionWriter(session_root / name, compress=True, max_segment_bytes=8 << 10)
    w.write({"type": "session", "time_ns": 1_000, "host": host, "boot_id": "b00t", "kernel_release": "6.18",
             "kernel_build_id": None, "module_build_ids": {}, "boot_to_wall_offset_ns": 1_700_000_000 * 10**9})
    items = list(bids.values())
    for i in range(records):
        path, bid = items[i % len(items)]
        w.write({"type": "mmap", "time_ns": 2_000 + i, "pid": 100 + i % 7, "tid": 100 + i % 7, "comm": "x",
                 "start": 0x400000, "len": 4096, "pgoff": 0, "path": path, "build_id": bid, "error": None})
    w.write({"type": "end", "time_ns": 9_000_002})
    w.close()
    return session_root / name


class Host:
    """One host of the fleet on this machine: its own store, sessions, state and name."""

    def __init__(self, base: Path, name: str, endpoint: str, **cfg):
        self.base, self.name = base, name
        base.mkdir(parents=True, exist_ok=True)
        self.cfg = Config(store_root=str(base / "store"), session_root=str(base / "sessions"),
                          push_bucket="fleet-test", push_endpoint_url=endpoint, push_prefix="debuginfod",
                          push_host=name, push_state_dir=str(base / "state"), push_part_bytes=5 << 20,
                          push_timeout_s=5.0).replace(**cfg)
        self.store = Store(self.cfg.store_root, debug_root=base / "usr-lib-debug")
        self.bids: dict[str, tuple[str, str]] = {}

    def add(self, label: str, path: Path) -> str:
        bid = store_add(self.store, path)
        self.bids[label] = (str(path), bid)
        return bid

    def session(self, name: str = "20261122T000000Z-4242") -> Path:
        return write_session(Path(self.cfg.session_root), name, self.name, self.bids)

    def pusher(self, **cfg):
        from buildidd.fleet.push import Pusher
        return Pusher(self.cfg.replace(**cfg) if cfg else self.cfg)


def remove(*dirs: Path) -> None:
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)

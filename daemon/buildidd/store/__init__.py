"""store: the build-id store, laid out as perf's build-id cache (~/.debug).

``.build-id/xx/rest`` relative links to ``<path>/<build-id>/elf`` (plus
``debug``, ``probes``, kallsyms and modules for the kernel), filled by atomic,
verified copies; a quota; and the snapshotter that copies each binary the
first time its build-id is seen.  One module per concern: layout (perf's
tree, names, listing), install (atomic, verified installs: every file through
one temporary-file path), batch (a burst of new entries made durable by one
syncfs before their links), copydata (the bytes: reflink, else extents with
holes kept), debuginfo,
kernelfiles (the kernel's own files: kallsyms, modules, vmlinux), sdt (perf's
probes file), quota (size, recency, removal), eviction (which entries a copy
may evict: each copy is charged to its payer, origin.Origin.payer), counters (counts and
rate-limited warnings), origin (where a copy came from), store (the
:class:`Store` composing them), chain (several stores read as one: the
host's and the analyst's imports), coverage (which of a session's build-ids the
store holds, and why not), sightings (what the snapshotter remembers of a session's
sightings, bounded in bytes), settledview (whether a sighting needs its file
at all: what the hand-overs ask the store), snapshotter (the copy thread),
copyqueue (its queue, charged per uid) and throttle (its rate limit).

May import: resolve, kernel, and the shared modules; never sessionlog.

The names below are the store's public API (other stages import them from
``buildidd.store``, never from its modules).
"""

from buildidd.store.copyqueue import CopyJob
from buildidd.store.chain import StoreChain
from buildidd.store.copydata import COPY_CHUNK_BYTES
from buildidd.store.install import AddResult
from buildidd.store.layout import (BUILD_ID_DIR, DEBUG_NAME, ELF_NAME, KALLSYMS_DSO, KALLSYMS_NAME, MODULES_NAME,
                                   PROBES_NAME, VDSO_NAME, VMLINUX_NAME, Entry)
from buildidd.store.lookups import CONFLICT, PROVENANCES, TRUSTED, UNKNOWN, UNTRUSTED
from buildidd.store.sdt import sdt_probe_cache
from buildidd.store.snapshotter import SnapshotPolicy, Snapshotter
from buildidd.store.store import Store

__all__ = ["BUILD_ID_DIR", "CONFLICT", "PROVENANCES", "TRUSTED", "UNKNOWN", "UNTRUSTED", "COPY_CHUNK_BYTES",
           "DEBUG_NAME", "ELF_NAME", "KALLSYMS_DSO", "KALLSYMS_NAME", "MODULES_NAME", "PROBES_NAME", "VDSO_NAME",
           "VMLINUX_NAME", "AddResult", "CopyJob", "Entry", "SnapshotPolicy", "Snapshotter", "Store", "StoreChain",
           "sdt_probe_cache"]

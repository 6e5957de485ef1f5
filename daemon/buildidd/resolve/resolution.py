"""The resolution of a request: what a worker is asked (:class:`Request`, one mapping) and what it
answers (:class:`Resolution`, with its JSON tail as the session log writes it).

:func:`make_resolution` builds an answer; :func:`kernel_resolution` turns the
BPF program's own page-cache read (no file opened) into the same answer.  Value
types only: no file is opened here, and nothing here is shared between threads
but frozen values.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import NamedTuple

from buildidd.kernel.events import Identity, MapOrigin, PcStatus, RawEvent
from buildidd.memo import text_bytes
from buildidd.resolve.procfs import Source
from buildidd.resolve.reasons import MissReason

__all__ = ["PAGE", "Request", "Resolution", "Sighting", "job_cost", "kernel_resolution", "make_resolution",
           "request_of"]

#: The page size, bytes: a VMA's end is rounded up to it.
PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True, slots=True)
class Resolution:
    """What is known of one identity.

    Attributes:
        build_id: lower-case hex, or None.
        source: Source value the build-id (or the verdict) came from.
        error: None, or the MissReason there is no build-id (the log's ``error``).
        path: the last path seen for this identity.
        json_tail: the record's identity and build-id fields, JSON-encoded once.
        go_build_id: the Go build ID text (``.note.go.buildid``), for an ELF file without a GNU build-id.
        file_id: 32 hex digits (resolve.fileid.file_id) of a file without a GNU build-id that could be read.
    """

    build_id: str | None
    source: str
    error: MissReason | None
    path: str
    json_tail: str
    go_build_id: str | None = None
    file_id: str | None = None

    @property
    def final(self) -> bool:
        """True when the answer depends only on the file's contents."""
        return self.source != Source.NONE.value


def make_resolution(ident: Identity, build_id: str | None, source: Source, error: MissReason | None,
                    path: str, keys: tuple[str | None, str | None] = (None, None)) -> Resolution:
    """A Resolution with its JSON tail; keys: (go_build_id, file_id)."""
    bid = f'"{build_id}"' if build_id else "null"
    err = f'"{error}"' if error else "null"
    tail = (f'"dev":{ident.dev},"ino":{ident.ino},"ino_generation":{ident.generation},'
            f'"size":{ident.size},"mtime_ns":{ident.mtime_ns},"build_id":{bid},'
            f'"build_id_source":"{source.value}","error":{err}')
    go, fid = keys
    if go:
        tail += f',"go_build_id":{json.dumps(go)}'
    if fid:
        tail += f',"file_id":"{fid}"'
    return Resolution(build_id, source.value, error, path, tail, go, fid)


@dataclass(frozen=True, slots=True)
class Request:
    """One mapping to resolve, as a worker gets it (from a RawEvent).

    Attributes:
        pid: tgid; start, length: the VMA (bytes; 0 for an exec record);
        path: the event's path; nlink: 0 when the file was deleted; identity: the kernel's;
        time_ns: the event's time, ns since boot (0: unknown);
        bulk: the mapping was synthesized at start (a process already running): its hand-over
            and copy wait behind live ones.
        uid: the real uid of the task that mapped or exec'd (event_header.uid; -1: not known): the
            user charged for the hand-over, the copy and what they hold.
    """

    pid: int
    start: int
    length: int
    path: str
    nlink: int
    identity: Identity
    time_ns: int = 0
    bulk: bool = False
    uid: int = -1

    def vma(self) -> tuple[int, int]:
        """(vm_start, vm_end) of the mapping, its end rounded up to a page (bytes; /proc/PID/map_files
        names a mapping by both)."""
        return self.start, self.start + ((self.length + PAGE - 1) & ~(PAGE - 1))


def request_of(ev: RawEvent, path: str) -> Request:
    """The Request of a MAP or EXEC event, at path (the event's, or the one last seen)."""
    return Request(ev.pid, ev.start, ev.length, path, ev.nlink, ev.identity, ev.time_ns,
                   ev.origin == MapOrigin.SYNTHESIZED, ev.uid)


#: Bytes of a queued job (workers.Job, its Request and Resolution) besides the path counted by length.
_JOB_FIXED_BYTES = 1000


def job_cost(path: str) -> int:
    """Bytes a worker job for a mapping of path holds while it waits (WorkerPool.submit's cost)."""
    return text_bytes(path) + _JOB_FIXED_BYTES


class Sighting(NamedTuple):
    """One build-id met at one path in one file: what is handed over, and copied, once.

    Keyed by (dev, inode) too: a user's file claiming a build-id at a path (a bind mount in their
    own namespace) never stands for the root-owned file met there later.
    """

    build_id: str | None        #: lower-case hex (or an htlhash, for the store's copies)
    path: str                   #: the mapping's path
    dev: int                    #: st_dev of the file (0: unknown)
    ino: int                    #: its inode (0: unknown)


#: The reason of a kernel verdict without a build-id (PcStatus in KERNEL_FINAL).
_KERNEL_VERDICTS = {PcStatus.NOT_ELF: MissReason.NOT_ELF, PcStatus.NOTE_TOO_LARGE: MissReason.MALFORMED_ELF,
                    PcStatus.MALFORMED: MissReason.MALFORMED_ELF}


def kernel_resolution(ev: RawEvent) -> Resolution:
    """The Resolution of a mapping whose page-cache read in the BPF program answered (ev.pc_status
    in KERNEL_FINAL): its build-id (OK) or the verdict on its bytes, source ``kernel``; nothing is read here."""
    if ev.pc_status == PcStatus.OK:
        return make_resolution(ev.identity, ev.pc_build_id.hex(), Source.KERNEL, None, ev.path)
    return make_resolution(ev.identity, None, Source.KERNEL, _KERNEL_VERDICTS[PcStatus(ev.pc_status)], ev.path)

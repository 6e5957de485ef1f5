"""Routes to a mapped file and the answers they give: the jobs the enricher's workers run.

A Request (one mapping, from a RawEvent) is resolved by :class:`Routes`:
/proc/PID/map_files first (the mapping's own inode), then the path inside the
process's root and in the daemon's namespace, each accepted only with the
kernel's identity (resolve.procfs.open_identified) and read with the bounded
ELF note reader.  A :class:`Resolution` is the answer, with its JSON tail as
the session log writes it.  :func:`kernel_resolution` turns the BPF program's
own page-cache read (no file opened) into the same answer.
"""

from __future__ import annotations

import enum
import errno
import json
import os
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable

from buildidd import clock
from buildidd.errors import ElfError, FileRefusedError
from buildidd.kernel.events import Identity, PcStatus, RawEvent
from buildidd.memo import LruCache
from buildidd.resolve.buildid import read_build_id_fd
from buildidd.resolve.execpins import ExecPins
from buildidd.resolve.fileid import file_id, read_go_build_id
from buildidd.resolve.procfs import (Source, changed_near, coarse_tick_ns, open_identified, open_route,
                                     open_scanned)
from buildidd.resolve.reasons import MissReason

__all__ = ["PAGE", "HandOver", "OnBuildId", "OnGap", "Request", "Resolution", "Routes", "kernel_resolution",
           "make_resolution"]

PAGE = os.sysconf("SC_PAGE_SIZE")

#: The reasons for which the exact inode was reached: final, like a build-id.
_FINAL_REFUSALS = (MissReason.SLOW_FS, MissReason.NOT_REGULAR)


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


class HandOver(enum.IntEnum):
    """How urgent a file handed to on_build_id is (the store's snapshot priority, same order)."""

    #: Only the descriptor reaches it now (its process is gone, or it has no name left).
    AT_RISK = 0
    #: Its process lives.
    LIVE = 1
    #: Synthesized at start.
    BULK = 2


OnBuildId = Callable[[Identity, "Resolution", "int | None", HandOver, int], None]
"""``on_build_id(identity, resolution, fd, urgency, uid)``: a build-id was just read from fd (still open:
the callee may dup it; None when the store is settled for it), called on a worker thread; uid: the
Request's (the task that mapped or exec'd; -1: unknown, e.g. a /proc/PID/maps scan), the user the
copy is charged to.  A
resolution without a build-id but with a ``file_id`` (a file without a GNU build-id) is handed over
too: the store keeps it under that htlhash."""

#: File identities whose htlhash was queued as a ``file_id`` record, remembered at most (each entry
#: an Identity, no path: KEYED_ENTRY_BYTES each, within KEYED_MAX_BYTES).
FILE_IDS_MAX = 65536
#: FileKeys waiting for the recording thread at most (it drains them every step; no path in one).
FILE_KEYS_QUEUED_MAX = 4096
#: Hand-overs that reached no file remembered at most until the recording thread drains them
#: (each holds a path of at most BUILDIDD_PATH_MAX bytes: this many bounds them to a few MiB).
UNREACHED_MAX = 256
#: What one entry of the ``file_id_keyed`` memory holds (an Identity and its dict entry), bytes ...
KEYED_ENTRY_BYTES = 320
#: ... and the bytes it keeps at most (an identity forgotten only has its file_id record written again).
KEYED_MAX_BYTES = 2 << 20


@dataclass(frozen=True, slots=True)
class FileKey:
    """The htlhash of a file whose build-id the kernel read (or judged), computed by its hand-over:
    the session's ``file_id`` record (sessionlog.records.file_id_line).

    Attributes:
        identity: the file's; build_id: lower-case hex, or None (a kernel verdict without one);
        file_id: 32 hex digits (resolve.fileid.file_id); go_build_id: its Go build ID, or None.
    """

    identity: Identity
    build_id: str | None
    file_id: str
    go_build_id: str | None = None

OnGap = Callable[[str, str, str, int], None]
"""``on_gap(build_id_hex, path, reason, uid)``: a hand-over reached no file (reason as store.coverage's;
uid: the task's that mapped or exec'd it, Request.uid, the user the ledger charges)."""


class Routes:
    """The jobs the workers run: open a route, check it is the mapped file, read it.

    No state is shared with the recording thread but on_build_id (called on
    the worker) and the identity cache, only peeked (one OrderedDict.get:
    atomic under CPython's GIL).

    Args:
        cache: the Enricher's identity cache.
        on_build_id: as Enricher's (fd None when the store is settled, see hand_over).
    Attributes set by the recorder once it has them: ``pins`` (resolve.execpins.ExecPins: the
    files pinned at exec, tried before any path), ``on_gap`` (a hand-over that reached nothing).
    """

    def __init__(self, cache: LruCache, on_build_id: OnBuildId | None):
        self.cache = cache
        self.on_build_id = on_build_id
        self.pins: ExecPins | None = None
        self.on_gap: OnGap | None = None
        #: (build-id, path) of hand-overs that reached no file (appended on workers, drained by the
        #: recording thread, which then hands the next sighting over again; deque appends are atomic).
        self.unreached: deque[tuple[str, str, int, int]] = deque(maxlen=UNREACHED_MAX)
        #: (build-id hex, the sighting's Identity, its path) -> True when the store needs no file for
        #: it (Snapshotter.settled); set once a store exists.  settled_handovers counts the hand-overs
        #: it spared.
        self.settled: Callable[[str, Identity, str], bool] | None = None
        self.settled_handovers = 0
        self.tick_ns = coarse_tick_ns()
        self.wall_offset_ns = clock.boot_to_wall_offset_ns()
        #: FileKeys computed by hand-overs (appended on workers, drained by the recording thread:
        #: Enricher.take_file_keys); file_keys_dropped counts those not queued, the deque being full.
        self.file_keys: deque[FileKey] = deque()
        self.file_keys_dropped = 0
        self.keyed: LruCache[Identity, bool] = LruCache("file_id_keyed", FILE_IDS_MAX,
                                                         max_bytes=KEYED_MAX_BYTES,
                                                         cost=lambda _ident, _v: KEYED_ENTRY_BYTES)
        self._keyed_lock = threading.Lock()     # hand-over workers share _keyed
        #: stored_file_id(build-id hex, identity) -> the htlhash the store recorded for that very file
        #: (its origin's dev, inode, size, mtime), or None; set once a store exists.  A settled
        #: hand-over then opens no file for the key either.
        self.stored_file_id: Callable[[str, Identity], str | None] | None = None

    def _read(self, ident: Identity, fd: int, source: Source, path: str, uid: int = -1) -> Resolution:
        reason = None
        try:
            bid = read_build_id_fd(fd)
        except ElfError as e:
            bid, reason = None, MissReason(e.reason)
        except OSError:
            return make_resolution(ident, None, Source.NONE, MissReason.IO_ERROR, path)
        try:
            fid = file_id(fd)            # the htlhash of every file read: the mapping record carries it
        except OSError:
            fid = None                   # the answer stands, without a content key
        if bid is not None:
            res = make_resolution(ident, bid.hex, source, None, path, (None, fid))
            if self.on_build_id is not None:
                self.on_build_id(ident, res, fd, HandOver.LIVE, uid)
            return res
        try:
            go = read_go_build_id(fd) if reason is None else None
        except OSError:
            go = None
        res = make_resolution(ident, None, source, reason or MissReason.NO_BUILD_ID, path, (go, fid))
        if fid is not None and self.on_build_id is not None:
            self.on_build_id(ident, res, fd, HandOver.LIVE, uid)     # kept under its htlhash
        return res

    def _open_read(self, req: Request, source: Source, vma: tuple[int, int]) -> Resolution:
        """Open one route, check it is the mapped file, read it.

        Raises:
            OSError: the route cannot be opened; FileRefusedError: another file, or refused.
        """
        pfd = open_route(source, req.pid, req.path, vma)
        try:
            fd = open_identified(pfd, req.identity, req.nlink != 0)
        except FileRefusedError as e:
            if e.reason in _FINAL_REFUSALS and (source is Source.MAP_FILES or e.reason == MissReason.SLOW_FS):
                return make_resolution(req.identity, None, source, MissReason(e.reason), req.path)
            raise
        finally:
            os.close(pfd)
        if req.time_ns and changed_near(req.identity, req.time_ns + self.wall_offset_ns, self.tick_ns, req.nlink):
            os.close(fd)
            return make_resolution(req.identity, None, Source.NONE, MissReason.CHANGED_AT_MAP, req.path)
        try:
            return self._read(req.identity, fd, source, req.path, req.uid)
        finally:
            os.close(fd)

    def hand_over(self, arg: tuple[Request, Resolution]) -> bool:
        """Give on_build_id an fd of the file whose build-id the kernel read (a worker job).

        The kernel's read needs no file, but the store copies one.  The file
        pinned at its exec (:attr:`pins`) is taken first: it reaches the exact
        inode however soon its process exited and its path was replaced.
        Otherwise the mapped file is opened by the routes of :meth:`_routes_of`
        (for an exec event, which has no vma, /proc/PID/exe first: the
        executable's own inode however its path was replaced since).  A
        descriptor is accepted only with the event's identity and the
        kernel's build-id, and is closed after on_build_id returns.  False
        when nothing reaches it: on_gap then gets the reason (:meth:`_gap_reason`:
        ``file_cap``, ``uid_pin_cap``, ``replaced_before_pin``, ``process_gone`` or ``unreachable``) and its
        (build-id, path, dev, inode) goes to :attr:`unreached`, so a later mapping of it
        (with a vma) is handed over again.
        """
        req, res = arg
        pins = self.pins
        if res.build_id and self.settled is not None and self.settled(res.build_id, req.identity, req.path) \
                and self._key_known(req, res):
            # A trusted copy is stored already: the sighting only touches it, no file is opened
            # (on a restart, every DSO of every running process would be read again).
            self.settled_handovers += 1
            if pins is not None:
                pins.release(req.identity, held=True)
            self.on_build_id(req.identity, res, None, HandOver.BULK if req.bulk else HandOver.LIVE, req.uid)
            return True
        if pins is not None:
            fd = pins.take(req.identity, req.nlink != 0)
            if fd is not None:
                try:
                    if self._give(req, res, fd):     # the ignore mark waits for the copy (on_held)
                        return True
                finally:
                    os.close(fd)
            pins.mark_exe_of(req.pid, req.identity.dev)
        replaced = False
        for pfd in self._routes_of(req):
            try:
                fd = open_identified(pfd, req.identity, req.nlink != 0)
            except FileRefusedError:
                replaced = True
                continue
            except OSError:
                continue
            finally:
                os.close(pfd)
            try:
                if self._give(req, res, fd):
                    return True
            finally:
                os.close(fd)
        self.unreached.append((res.build_id, req.path, req.identity.dev, req.identity.ino))
        if self.on_gap is not None and res.build_id:
            self.on_gap(res.build_id, req.path, self._gap_reason(req, replaced), req.uid)
        return False

    def _gap_reason(self, req: Request, replaced: bool) -> str:
        """Why a hand-over reached no file (store.coverage.GAP_REASONS): the cap that closed its exec
        pin (``file_cap``, ``uid_pin_cap``: ExecPins.closed_reason, for req's uid), else what its
        routes found."""
        capped = self.pins.closed_reason(req.identity, req.uid) if self.pins is not None else None
        if capped is not None:
            return capped
        if os.path.exists(f"/proc/{req.pid}"):
            return "unreachable"
        return "replaced_before_pin" if replaced else "process_gone"

    def _give(self, req: Request, res: Resolution, fd: int) -> bool:
        """on_build_id(fd) when fd's build-id is the kernel's; its urgency: AT_RISK when req's
        process is gone (only this descriptor reaches the file now), BULK for a synthesized one."""
        try:
            bid = read_build_id_fd(fd)
        except ElfError:
            bid = None
        except OSError:
            return False
        if (bid.hex if bid is not None else None) != res.build_id:
            return False
        res = self._keyed_resolution(req, res, fd)
        if res is None:
            return False
        if not os.path.exists(f"/proc/{req.pid}"):
            urgency = HandOver.AT_RISK
        else:
            urgency = HandOver.BULK if req.bulk else HandOver.LIVE
        self.on_build_id(req.identity, res, fd, urgency, req.uid)
        return True

    def _key_known(self, req: Request, res: Resolution) -> bool:
        """Whether req's file has its htlhash queued already, or the store recorded it for this very
        file (then it is queued here): a settled hand-over need not open the file for it."""
        ident = req.identity
        if ident in self.keyed:
            return True
        fid = self.stored_file_id(res.build_id, ident) if self.stored_file_id is not None else None
        if fid is None:
            return False
        self._queue_key(FileKey(ident, res.build_id, fid))
        return True

    def _queue_key(self, key: FileKey) -> None:
        """Queue key for its file_id record unless its identity has one queued already (any worker)."""
        with self._keyed_lock:
            if key.identity in self.keyed:
                return
            self.keyed.put(key.identity, True)
            if len(self.file_keys) >= FILE_KEYS_QUEUED_MAX:
                self.file_keys_dropped += 1
                return
            self.file_keys.append(key)

    def _keyed_resolution(self, req: Request, res: Resolution, fd: int) -> Resolution | None:
        """res with the htlhash of fd's file, which is queued as a FileKey (once per identity); None when
        the file cannot be read (or, without a build-id, has no htlhash to be kept under)."""
        try:
            fid = file_id(fd)
            go = read_go_build_id(fd) if res.build_id is None else None
        except OSError:
            return res if res.build_id else None
        self._queue_key(FileKey(req.identity, res.build_id, fid, go))
        return make_resolution(req.identity, res.build_id, Source(res.source), res.error, res.path, (go, fid))

    @staticmethod
    def _routes_of(req: Request):
        """O_PATH descriptors of the routes to req's file, opened lazily (the caller closes each).

        A mapping's file is looked for at its path inside the process's root first, then through
        /proc/PID/map_files, then at its path here: the caller accepts a descriptor only with the
        event's identity, so each route reaches the same inode or is refused, and the path inside
        the process's root takes no mmap_lock of the process (only its task_lock, briefly).  A map_files lookup takes the
        process's mmap_lock for reading (fs/proc/base.c, proc_map_files_lookup), which a
        workload that maps and unmaps in a loop then waits for.  An exec event (no vma)
        starts with /proc/PID/exe, the executable's own inode.
        """
        path_ok = req.path and "\0" not in req.path and not req.path.startswith("/memfd:")
        attempts = [lambda: open_route(Source.PROC_ROOT, req.pid, req.path)] if path_ok else []
        if req.start and req.length:
            vma = (req.start, req.start + ((req.length + PAGE - 1) & ~(PAGE - 1)))
            attempts.append(lambda: open_route(Source.MAP_FILES, req.pid, req.path, vma))
        else:
            attempts.insert(0, lambda: os.open(f"/proc/{req.pid}/exe", os.O_PATH | os.O_CLOEXEC))
        if path_ok:
            attempts.append(lambda: open_route(Source.PATH, req.pid, req.path))
        for attempt in attempts:
            try:
                yield attempt()
            except OSError:
                continue

    def retry(self, req: Request) -> Resolution | None:
        """The map_files route only; None when it does not reach the mapped file."""
        end = req.start + ((req.length + PAGE - 1) & ~(PAGE - 1))
        try:
            return self._open_read(req, Source.MAP_FILES, (req.start, end))
        except (OSError, FileRefusedError):
            return None

    def fresh(self, req: Request) -> Resolution:
        """Every route, best first (procfs docstring); the reason when none reaches the mapped file."""
        if req.start and req.length:
            got = self.retry(req)
            if got is not None:
                return got
        path = req.path
        seen_other = denied = not_regular = False
        if path and "\0" not in path and not path.startswith("/memfd:"):
            for source in (Source.PROC_ROOT, Source.PATH):
                try:
                    return self._open_read(req, source, (0, 0))
                except FileRefusedError as e:
                    not_regular |= e.reason == MissReason.NOT_REGULAR
                    seen_other |= e.reason != MissReason.NOT_REGULAR
                except OSError as e:
                    denied |= e.errno in (errno.EACCES, errno.EPERM)
        if req.nlink == 0 or path.startswith("/memfd:"):
            error = MissReason.FILE_DELETED
        elif not_regular:
            error = MissReason.NOT_REGULAR
        elif seen_other:
            error = MissReason.FILE_REPLACED
        elif denied:
            error = MissReason.PERMISSION
        else:
            error = MissReason.FILE_VANISHED
        return make_resolution(req.identity, None, Source.NONE, error, path)

    def scan(self, arg: tuple[int, tuple[int, int], str]) -> tuple[Identity, Resolution, bool] | None:
        """(identity, Resolution, answered from the cache) of a scanned mapping, or None (gone, refused).

        The cache is only peeked here (one OrderedDict.get: atomic under CPython's GIL).
        """
        pid, vma, path = arg
        try:
            fd, ident = open_scanned(pid, *vma)
        except (OSError, FileRefusedError):
            return None
        try:
            res = self.cache.peek(ident)
            if res is not None and res.final:
                return ident, res, True
            return ident, self._read(ident, fd, Source.MAP_FILES, path), False
        finally:
            os.close(fd)


#: The reason of a kernel verdict without a build-id (PcStatus in KERNEL_FINAL).
_KERNEL_VERDICTS = {PcStatus.NOT_ELF: MissReason.NOT_ELF, PcStatus.NOTE_TOO_LARGE: MissReason.MALFORMED_ELF,
                    PcStatus.MALFORMED: MissReason.MALFORMED_ELF}


def kernel_resolution(ev: RawEvent) -> Resolution:
    """The Resolution of a mapping whose page-cache read in the BPF program answered (ev.pc_status
    in KERNEL_FINAL): its build-id (OK) or the verdict on its bytes, source ``kernel``; nothing is read here."""
    if ev.pc_status == PcStatus.OK:
        return make_resolution(ev.identity, ev.pc_build_id.hex(), Source.KERNEL, None, ev.path)
    return make_resolution(ev.identity, None, Source.KERNEL, _KERNEL_VERDICTS[PcStatus(ev.pc_status)], ev.path)

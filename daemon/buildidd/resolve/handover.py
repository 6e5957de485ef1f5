"""The hand-over: a file whose build-id the kernel read, given to the store by a worker.

The kernel's page-cache read needs no file, but the store copies one.  A
hand-over job (:meth:`HandOverJob.run`, on a hand-over worker:
resolve.handoverqueue queues it) first asks the store whether it needs the
file at all (:class:`StoreView`, the store's settled-file view: a call back
into the store, which resolve may not import, so the view is given to the
constructor).  When it does, the job takes the file pinned at its exec
(resolve.execpins), else opens the routes of :func:`handover_routes`, accepts
a descriptor only with the event's identity and the kernel's build-id, and
gives it to ``on_build_id`` (the store's copy queue).  A file it reaches
nowhere is named to ``on_gap`` and remembered as *unreached*
(:meth:`HandOverJob.take_unreached`) so that its next sighting is handed over
again.
"""

from __future__ import annotations

import enum
import os
import threading
from collections import deque
from typing import Callable, Iterator, Protocol

from buildidd.errors import ElfError, FileRefusedError
from buildidd.kernel.events import Identity
from buildidd.resolve.buildid import read_build_id_fd
from buildidd.resolve.execpins import ExecPins
from buildidd.resolve.fileid import file_id, read_go_build_id
from buildidd.resolve.filekeys import FileKey, FileKeys
from buildidd.resolve.procfs import Source, open_identified, open_route
from buildidd.resolve.resolution import Request, Resolution, Sighting, make_resolution

__all__ = ["HandOver", "HandOverJob", "OnBuildId", "OnGap", "StoreView", "handover_routes"]

#: Hand-overs that reached no file remembered at most until the recording thread drains them
#: (each holds a path of at most BUILDIDD_PATH_MAX bytes: this many bounds them to a few MiB).
UNREACHED_MAX = 256


class HandOver(enum.IntEnum):
    """How urgent a file handed to on_build_id is (the store's snapshot priority, same order)."""

    #: Only the descriptor reaches it now (its process is gone, or it has no name left).
    AT_RISK = 0
    #: Its process lives.
    LIVE = 1
    #: Synthesized at start.
    BULK = 2


OnBuildId = Callable[[Identity, Resolution, "int | None", HandOver, int], None]
"""``on_build_id(identity, resolution, fd, urgency, uid)``: a build-id was just read from fd (still open:
the callee may dup it; None when the store is settled for it), called on a worker thread; uid: the
Request's (the task that mapped or exec'd; -1: unknown, e.g. a /proc/PID/maps scan), the user the
copy is charged to.  A resolution without a build-id but with a ``file_id`` (a file without a GNU
build-id) is handed over too: the store keeps it under that htlhash."""

OnGap = Callable[[str, str, str, int], None]
"""``on_gap(build_id_hex, path, reason, uid)``: a hand-over reached no file (reason as store.coverage's;
uid: the task's that mapped or exec'd it, Request.uid, the user the ledger charges)."""


class StoreView(Protocol):
    """What a hand-over asks the store (store.settledview.SettledView): cheap, synchronous, any thread."""

    def settled(self, build_id: str, ident: Identity | None = None, path: str | None = None) -> bool:
        """True when a sighting of build_id (hex) at path from ident's file needs no file copied."""

    def stored_file_id(self, build_id: str, ident: Identity) -> str | None:
        """The htlhash the store recorded for build_id's copy when made from ident's very file, else None."""


def handover_routes(req: Request) -> Iterator[int]:
    """O_PATH descriptors of the routes to req's file, opened lazily (the caller closes each).

    A mapping's file is looked for at its path inside the process's root first, then through
    /proc/PID/map_files, then at its path here: the caller accepts a descriptor only with the
    event's identity, so each route reaches the same inode or is refused, and the path inside
    the process's root takes no mmap_lock of the process (only its task_lock, briefly).  A map_files
    lookup takes the process's mmap_lock for reading (fs/proc/base.c, proc_map_files_lookup), which a
    workload that maps and unmaps in a loop then waits for.  An exec event (no vma)
    starts with /proc/PID/exe, the executable's own inode.
    """
    path_ok = req.path and "\0" not in req.path and not req.path.startswith("/memfd:")
    attempts = [lambda: open_route(Source.PROC_ROOT, req.pid, req.path)] if path_ok else []
    if req.start and req.length:
        attempts.append(lambda: open_route(Source.MAP_FILES, req.pid, req.path, req.vma()))
    else:
        attempts.insert(0, lambda: os.open(f"/proc/{req.pid}/exe", os.O_PATH | os.O_CLOEXEC))
    if path_ok:
        attempts.append(lambda: open_route(Source.PATH, req.pid, req.path))
    for attempt in attempts:
        try:
            yield attempt()
        except OSError:
            continue


class HandOverJob:
    """The job a hand-over worker runs (:meth:`run`), and what it leaves for the recording thread.

    Args:
        on_build_id: where a reached file goes (the store's copy queue: the recorder's hand-over sink).
        file_keys: the queue of htlhashes for ``file_id`` records (the Enricher's).
        view: the store's settled-file view; None: every file is copied.
        pins: the exec pins (taken before any route); None: routes only.
        on_gap: told each hand-over that reached no file; None: not told.
    Thread safety: run() is called on any number of hand-over workers at once.  The fields below
    marked so are guarded by :attr:`_lock`; the collaborators are each safe from any thread.
    """

    def __init__(self, on_build_id: OnBuildId, file_keys: FileKeys, view: StoreView | None,
                 pins: ExecPins | None, on_gap: OnGap | None):
        self.on_build_id = on_build_id
        self.file_keys = file_keys
        self.view = view
        self.pins = pins
        self.on_gap = on_gap
        self._lock = threading.Lock()
        #: Hand-overs spared by a settled store (no file opened).  Guarded by _lock.
        self._settled = 0
        #: Sightings that reached no file, appended by workers (the oldest forgotten beyond
        #: UNREACHED_MAX), taken by the recording thread.  Guarded by _lock.
        self._unreached: deque[Sighting] = deque(maxlen=UNREACHED_MAX)

    @property
    def settled_count(self) -> int:
        """Hand-overs the store's settled view spared (``handovers_settled``); any thread."""
        with self._lock:
            return self._settled

    def take_unreached(self) -> list[Sighting]:
        """The sightings whose hand-over reached no file since the last call (the recording thread)."""
        with self._lock:
            out = list(self._unreached)
            self._unreached.clear()
        return out

    def run(self, arg: tuple[Request, Resolution]) -> bool:
        """Give on_build_id an fd of the file whose build-id the kernel read (a worker job).

        A trusted copy the store holds already (:class:`StoreView`) needs no file: on_build_id
        gets fd None.  Otherwise the file pinned at its exec (:attr:`pins`) is taken first: it
        reaches the exact inode however soon its process exited and its path was replaced; then
        the routes of :func:`handover_routes`.  A descriptor is accepted only with the event's
        identity and the kernel's build-id, and is closed after on_build_id returns.  False when
        nothing reaches it: on_gap then gets the reason (:meth:`_gap_reason`: ``file_cap``,
        ``uid_pin_cap``, ``replaced_before_pin``, ``process_gone`` or ``unreachable``) and its
        Sighting is kept (:meth:`take_unreached`), so a later mapping of it is handed over again.
        """
        req, res = arg
        pins = self.pins
        if res.build_id and self.view is not None and self.view.settled(res.build_id, req.identity, req.path) \
                and self._key_known(req, res):
            # A trusted copy is stored already: the sighting only touches it, no file is opened
            # (on a restart, every DSO of every running process would be read again).
            with self._lock:
                self._settled += 1
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
        given, replaced = self._give_by_route(req, res)
        if given:
            return True
        with self._lock:
            self._unreached.append(Sighting(res.build_id, req.path, req.identity.dev, req.identity.ino))
        if self.on_gap is not None and res.build_id:
            self.on_gap(res.build_id, req.path, self._gap_reason(req, replaced), req.uid)
        return False

    def _give_by_route(self, req: Request, res: Resolution) -> tuple[bool, bool]:
        """(given, replaced): whether a route of :func:`handover_routes` reached req's file and it was
        given (:meth:`_give`), and whether a route met another file at its place."""
        replaced = False
        for pfd in handover_routes(req):
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
                    return True, replaced
            finally:
                os.close(fd)
        return False, replaced

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
        if self.file_keys.known(ident):
            return True
        fid = self.view.stored_file_id(res.build_id, ident)
        if fid is None:
            return False
        self.file_keys.put(FileKey(ident, res.build_id, fid))
        return True

    def _keyed_resolution(self, req: Request, res: Resolution, fd: int) -> Resolution | None:
        """res with the htlhash of fd's file, which is queued as a FileKey (once per identity); None when
        the file cannot be read (or, without a build-id, has no htlhash to be kept under)."""
        try:
            fid = file_id(fd)
            go = read_go_build_id(fd) if res.build_id is None else None
        except OSError:
            return res if res.build_id else None
        self.file_keys.put(FileKey(req.identity, res.build_id, fid, go))
        return make_resolution(req.identity, res.build_id, Source(res.source), res.error, res.path, (go, fid))

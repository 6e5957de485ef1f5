"""Routes to a mapped file and the answers they give: the jobs the enricher's workers run.

A Request (one mapping, from a RawEvent; resolve.resolution) is resolved by
:class:`Routes`: /proc/PID/map_files first (the mapping's own inode), then the
path inside the process's root and in the daemon's namespace, each accepted
only with the kernel's identity (resolve.procfs.open_identified) and read with
the bounded ELF note reader.  A hand-over (resolve.handover), whose file the
kernel read, opens the same routes in its own order.
"""

from __future__ import annotations

import errno
import os

from buildidd import clock
from buildidd.errors import ElfError, FileRefusedError
from buildidd.kernel.events import Identity
from buildidd.memo import LruCache
from buildidd.resolve.buildid import read_build_id_fd
from buildidd.resolve.fileid import file_id, read_go_build_id
from buildidd.resolve.handover import HandOver, OnBuildId
from buildidd.resolve.procfs import (Source, changed_near, coarse_tick_ns, open_identified, open_route,
                                     open_scanned)
from buildidd.resolve.reasons import MissReason
from buildidd.resolve.resolution import Request, Resolution, make_resolution

__all__ = ["Routes"]

#: The reasons for which the exact inode was reached: final, like a build-id.
_FINAL_REFUSALS = (MissReason.SLOW_FS, MissReason.NOT_REGULAR)


class Routes:
    """The jobs the resolve workers run: open a route, check it is the mapped file, read it.

    Shared with the recording thread: on_build_id (called on the worker) and
    the identity cache, which the recording thread changes and a worker only
    peeks (:meth:`scan`) without a lock: LruCache.peek is one ``OrderedDict.get``,
    and CPython runs it whole without letting another thread change the dict
    between (a concurrent change makes the lookup start again, never fail).
    Nothing else is shared; a Routes has no mutable field.

    Args:
        cache: the Enricher's identity cache (peeked only).
        on_build_id: called with an fd a worker read a build-id (or an htlhash) from, HandOver.LIVE
            (resolve.handover.OnBuildId); None: nothing is handed over.
    """

    def __init__(self, cache: LruCache, on_build_id: OnBuildId | None):
        self.cache = cache
        self.on_build_id = on_build_id
        self.tick_ns = coarse_tick_ns()
        self.wall_offset_ns = clock.boot_to_wall_offset_ns()

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

    def retry(self, req: Request) -> Resolution | None:
        """The map_files route only; None when it does not reach the mapped file."""
        try:
            return self._open_read(req, Source.MAP_FILES, req.vma())
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


"""Enrichment: a mapping's file identity → the build-id of that exact file.

Answers are cached by identity (dev, ino, generation, size, mtime), so a library
is opened and parsed once, not once per process.  The cache is a bounded LRU;
answers that depend only on the file's contents (a build-id, no note, not ELF,
malformed) are kept until evicted.  "Could not open the right file" answers are
kept too, but the next event for that identity retries its own
/proc/PID/map_files route, the one route that can still succeed later.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from typing import Callable

from buildidd.memo import LruCache
from buildidd.resolve.buildid import read_build_id_fd
from buildidd.errors import ElfError
from buildidd.kernel.events import Identity, RawEvent
from buildidd.resolve.procfs import Source, identity_of, mismatch, open_in_root, open_map_file, open_path

PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True, slots=True)
class Resolution:
    """What is known of one identity.

    Attributes:
        build_id: lower-case hex, or None.
        source: Source value the build-id (or the verdict) came from.
        error: None, or why there is no build-id: ``no_build_id`` (an ELF without
            the note), ``not_elf``, ``malformed_elf``, ``unsupported_elf``,
            ``file_replaced`` (the reachable file has another identity and the
            mapping is gone), ``file_deleted``, ``file_vanished``,
            ``permission``, ``io_error``.
        path: the last path seen for this identity.
        json_tail: the record's identity and build-id fields, JSON-encoded once.
    """

    build_id: str | None
    source: str
    error: str | None
    path: str
    json_tail: str

    @property
    def final(self) -> bool:
        """True when the answer depends only on the file's contents."""
        return self.source != Source.NONE.value


def _tail(ident: Identity, build_id: str | None, source: str, error: str | None) -> str:
    bid = f'"{build_id}"' if build_id else "null"
    err = f'"{error}"' if error else "null"
    return (f'"dev":{ident.dev},"ino":{ident.ino},"ino_generation":{ident.generation},'
            f'"size":{ident.size},"mtime_ns":{ident.mtime_ns},"build_id":{bid},'
            f'"build_id_source":"{source}","error":{err}')


class Enricher:
    """Resolves identities to build-ids, with a bounded identity cache.

    Args:
        cache_entries: identities kept (LRU).
        on_resolved: called with (identity, Resolution) when an identity gets a
            final answer (the tracer then stops sending its path).
        on_evicted: called with an identity dropped from the cache.
        on_build_id: called with (identity, Resolution, fd) when a build-id was
            just read from fd (still open: the callee may dup it, e.g. to
            snapshot the exact inode).
    """

    def __init__(self, cache_entries: int = 65536,
                 on_resolved: Callable[[Identity, Resolution], None] | None = None,
                 on_evicted: Callable[[Identity], None] | None = None,
                 on_build_id: Callable[[Identity, Resolution, int], None] | None = None):
        self.cache: LruCache[Identity, Resolution] = LruCache("identity", cache_entries,
                                                              on_evict=self._evicted)
        self.on_resolved = on_resolved
        self.on_evicted = on_evicted
        self.on_build_id = on_build_id
        self.resolved = 0
        self.missing: dict[str, int] = {}

    # -- cache -------------------------------------------------------------
    @property
    def hits(self) -> int:
        """Lookups answered from the identity cache (final answers only)."""
        return self.cache.hits

    @property
    def misses(self) -> int:
        """Lookups that had to open and read a file."""
        return self.cache.misses

    def _evicted(self, ident: Identity, _res: Resolution) -> None:
        if self.on_evicted is not None:
            self.on_evicted(ident)

    def _store(self, ident: Identity, res: Resolution) -> Resolution:
        self.cache.put(ident, res)
        if res.final and self.on_resolved:
            self.on_resolved(ident, res)
        return res

    def count(self, res: Resolution) -> None:
        """Count one recorded mapping's outcome (build-id found, or missing by reason)."""
        if res.build_id:
            self.resolved += 1
        else:
            key = res.error or "unknown"
            self.missing[key] = self.missing.get(key, 0) + 1

    # -- resolution --------------------------------------------------------
    def resolve(self, ev: RawEvent) -> Resolution:
        """The Resolution for a MAP or EXEC event's file (cached, else opened and read).

        Never raises for a per-file problem: the Resolution's error says what went wrong.
        """
        ident = ev.identity
        res = self.cache.peek(ident)
        if res is not None and not res.final:
            # Unreachable before: only the mapping itself can still help.
            got = self._try_map_files(ev, ident, ev.path or res.path)
            return self._store(ident, got) if got is not None else res
        res = self.cache.get(ident)         # counts the hit or the miss
        if res is not None:
            return res
        return self._store(ident, self._resolve_uncached(ev, ident))

    def resolve_open(self, ident: Identity, fd: int, source: Source, path: str) -> Resolution:
        """Resolution for a file already open on fd whose identity was checked by the caller."""
        res = self.cache.peek(ident)
        if res is not None and res.final:
            self.cache.count_hits(1)
            return res
        self.cache.count_miss()
        return self._store(ident, self._read(ident, fd, source, path))

    def _read(self, ident: Identity, fd: int, source: Source, path: str) -> Resolution:
        try:
            bid = read_build_id_fd(fd)
        except ElfError as e:
            return Resolution(None, source.value, e.reason, path, _tail(ident, None, source.value, e.reason))
        except OSError:
            return Resolution(None, Source.NONE.value, "io_error", path,
                              _tail(ident, None, Source.NONE.value, "io_error"))
        if bid is None:
            return Resolution(None, source.value, "no_build_id", path,
                              _tail(ident, None, source.value, "no_build_id"))
        res = Resolution(bid.hex, source.value, None, path, _tail(ident, bid.hex, source.value, None))
        if self.on_build_id is not None:
            self.on_build_id(ident, res, fd)
        return res

    def _try_map_files(self, ev: RawEvent, ident: Identity, path: str) -> Resolution | None:
        if ev.start == 0 or ev.length == 0:
            return None
        end = ev.start + ((ev.length + PAGE - 1) & ~(PAGE - 1))
        try:
            fd = open_map_file(ev.pid, ev.start, end)
        except OSError:
            return None
        try:
            if mismatch(ident, identity_of(fd, ident.generation != 0)) is not None:
                return None
            return self._read(ident, fd, Source.MAP_FILES, path)
        except OSError:
            return None
        finally:
            os.close(fd)

    def _resolve_uncached(self, ev: RawEvent, ident: Identity) -> Resolution:
        path = ev.path
        got = self._try_map_files(ev, ident, path)
        if got is not None:
            return got
        seen_other = False
        denied = False
        if path and "\0" not in path and not path.startswith("/memfd:"):
            for source, opener, arg in ((Source.PROC_ROOT, open_in_root, (ev.pid, path)),
                                        (Source.PATH, open_path, (path,))):
                try:
                    fd = opener(*arg)
                except OSError as e:
                    denied |= e.errno in (errno.EACCES, errno.EPERM)
                    continue
                try:
                    if mismatch(ident, identity_of(fd, ident.generation != 0)) is None:
                        return self._read(ident, fd, source, path)
                    seen_other = True
                except OSError:
                    continue
                finally:
                    os.close(fd)
        if ev.nlink == 0 or path.startswith("/memfd:"):
            error = "file_deleted"
        elif seen_other:
            error = "file_replaced"
        elif denied:
            error = "permission"
        else:
            error = "file_vanished"
        return Resolution(None, Source.NONE.value, error, path, _tail(ident, None, Source.NONE.value, error))


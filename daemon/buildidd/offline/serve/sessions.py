"""``/sessions`` and ``/sessions/NAME/archive`` of ``buildidd serve``.

An archive (tar + zstd, :func:`buildidd.offline.archive.write_archive`) is made
on request and sent while it is written; the same bytes go to a spool file,
so that a transfer that broke can be resumed with ``Range`` against exactly
those bytes, and a second request is served from the spool with
``sendfile(2)``.

The archive's identity (its ``ETag``) is a digest of the session's segments
(names, sizes, mtimes in ns) and the store root: a session that grew since is
a new archive.  A resuming client sends ``Range: bytes=N-`` with ``If-Range:
"ETAG"``; when the ETag is no longer current the whole new archive is sent
(200), as RFC 9110 §13.1.5 says.  Once started, a spool file is completed even
if its client went away, so that the resumed request finds it.

Spool files live in ``spool_dir`` (named ``NAME.ETAG.tar.zst``); older ones
are removed, oldest first, when the directory holds more than
:data:`SPOOL_MAX_BYTES` (files being sent stay readable until closed).

Archives are built on the spool's own threads (``guard.ARCHIVE_WORKERS``),
never the loop's default executor that lookups use; a client that takes no
byte of a streamed archive for ``send_timeout_s`` is cut and the spool
completed.  Both routes answer only a caller with rights to the session logs
(:func:`check_access`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from buildidd.errors import BuildiddError
from buildidd.offline.archive import create_archive_file, write_archive
from buildidd.offline.serve.guard import ARCHIVE_WORKERS, GUARD_KEY, Cut
from buildidd.offline.serve.metrics import METRICS_KEY
from buildidd.offline.serve.rights import has_rights
from buildidd.offline.serve.send import refuse_zero_suffix
from buildidd.offline.sessions import list_sessions
from buildidd.sessionlog import list_segments
from buildidd.store import Store

log = logging.getLogger(__name__)

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,254}")
"""A session name as served: a plain directory name (no ``/``, no leading ``.``; ``..`` is refused apart)."""

SPOOL_MAX_BYTES = 8 << 30
"""Spooled archives kept at most, bytes (the newest is always kept)."""

ARCHIVE_CONTENT_TYPE = "application/zstd"
"""The archive's media type (RFC 8878 registers application/zstd; the payload is a tar)."""

_TEE_CHUNK_BYTES = 1 << 20


class SessionNotFound(BuildiddError):
    """No session of that name under the session root."""


def session_dir(session_root: str, name: str) -> Path:
    """The directory of session name: a real (not symlinked) direct child of session_root with segments.

    Raises:
        web.HTTPBadRequest: name is not a plain directory name.
        SessionNotFound: no such session.
    """
    if not NAME_RE.fullmatch(name) or ".." in name:
        raise web.HTTPBadRequest(text="session name must be a plain directory name\n")
    root = Path(os.path.abspath(session_root))
    directory = root / name
    if directory.parent != root or directory.is_symlink() or not directory.is_dir() or not list_segments(directory):
        raise SessionNotFound(f"no session {name!r}")
    return directory


def archive_etag(directory: Path, store_root: str, share_private: bool = False) -> str:
    """The archive's identity: a digest of the segments' names, sizes, mtimes, the store root and
    whether private copies are shared (32 hex)."""
    h = hashlib.sha256(os.fsencode(store_root) + (b"\0private\0" if share_private else b"\0"))
    for seg in list_segments(directory):
        st = os.stat(seg)
        h.update(f"{seg.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()[:32]


class Spool:
    """The spool directory and the archive builds in flight.

    Args:
        directory: where spool files go; None: a private temporary directory, removed by :meth:`close`.
    """

    def __init__(self, directory: str | None):
        self._own = directory is None
        self.dir = Path(tempfile.mkdtemp(prefix="buildidd-serve-spool-") if directory is None else directory)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.building: dict[Path, asyncio.Future] = {}
        self.builders = concurrent.futures.ThreadPoolExecutor(ARCHIVE_WORKERS, thread_name_prefix="archive")

    def path(self, name: str, etag: str) -> Path:
        return self.dir / f"{name}.{etag}.tar.zst"

    def close(self) -> None:
        if self._own:
            shutil.rmtree(self.dir, ignore_errors=True)

    def trim(self, keep: Path) -> None:
        """Remove other spools of keep's session, then the oldest ones past SPOOL_MAX_BYTES."""
        prefix = keep.name.split(".", 1)[0] + "."
        files = []
        for p in self.dir.glob("*.tar.zst"):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            if p != keep and p.name.startswith(prefix) and p not in self.building:
                p.unlink(missing_ok=True)
            else:
                files.append((st.st_mtime_ns, st.st_size, p))
        total = sum(size for _, size, _ in files)
        for _, size, p in sorted(files):
            if total <= SPOOL_MAX_BYTES:
                break
            if p != keep and p not in self.building:
                p.unlink(missing_ok=True)
                total -= size


@dataclass
class _Listener:
    """The client an archive is streamed to while it is built: its answer, and how long one chunk may wait.

    Attributes:
        loop: the server's event loop (the answer is written there).
        resp: the prepared answer; None once the client went away or was cut.
        timeout_s: seconds one write may wait for the client to take bytes.
        on_cut: called in the loop when the client is cut for not reading.
        cut: whether it was cut.
    """

    loop: asyncio.AbstractEventLoop
    resp: web.StreamResponse | None
    timeout_s: float
    on_cut: Callable[[], None]
    cut: bool = False


class _Tee:
    """The file object write_archive writes to (in a builder thread): the spool file, and the HTTP answer
    while its client takes it, each write waiting at most the listener's timeout_s."""

    def __init__(self, f, listener: _Listener):
        self.f = f
        self.listener = listener
        self.sent = 0

    def write(self, data) -> int:
        self.f.write(data)
        li = self.listener
        if li.resp is not None:
            fut = asyncio.run_coroutine_threadsafe(li.resp.write(bytes(data)), li.loop)
            try:
                fut.result(timeout=li.timeout_s)
                self.sent += len(data)
            except concurrent.futures.TimeoutError:
                fut.cancel()
                log.debug("archive client took no bytes for %.0f s after %d bytes; cut (counted in send_timeout), "
                          "completing the spool", li.timeout_s, self.sent)
                li.resp, li.cut = None, True
                li.loop.call_soon_threadsafe(li.on_cut)
            except (ConnectionError, concurrent.futures.CancelledError) as e:
                log.debug("archive client went away after %d bytes (%s); completing the spool", self.sent, e)
                li.resp = None
        return len(data)

    def flush(self) -> None:
        self.f.flush()


def _build(final: Path, directory: Path, cfg: SessionsConfig, listener: _Listener) -> None:
    """write_archive into a temporary file next to final, then rename it into place (in a builder thread)."""
    tmp = final.with_name(f".{final.name}.{secrets.token_hex(4)}.tmp")
    try:
        with create_archive_file(tmp) as f:      # the owner's alone (ARCHIVE_MODE), as every archive
            store = Store(cfg.store_root) if cfg.store_root and os.path.isdir(cfg.store_root) else None
            write_archive(directory, store, _Tee(f, listener), share_private=cfg.share_private)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def check_access(request: web.Request) -> None:
    """The session logs' policy: served to a caller with rights to them, refused (403, counted) to anyone else.

    Rights (:func:`buildidd.offline.serve.rights.has_rights`): the bearer token;
    or, on the unix-socket listener, a peer whose SO_PEERCRED says root or a
    member of the control group.  A TCP peer without a token gets none: on
    loopback TCP every local user looks the same.

    Raises:
        web.HTTPForbidden: no rights.
    """
    if has_rights(request):
        return
    request.app[METRICS_KEY].refuse("sessions_forbidden")
    raise web.HTTPForbidden(text="session logs need the bearer token, or the unix socket as root or a member "
                                 "of the control group\n")


async def handle_sessions(request: web.Request) -> web.Response:
    """``/sessions``: the session root's sessions as a JSON list (``buildidd sessions --json``'s objects, less paths)."""
    check_access(request)
    cfg = request.app[SESSIONS_KEY]
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.run_in_executor(None, list_sessions, cfg.session_root)
    except BuildiddError as e:
        log.warning("503: cannot list sessions: %s", e)
        raise web.HTTPServiceUnavailable(text="sessions cannot be listed right now\n") from e
    items = []
    for info in infos:
        item = info.to_json()
        item.pop("path", None)   # the server's file system is none of the client's business
        items.append(item)
    return web.Response(body=json.dumps(items).encode(), content_type="application/json")


async def handle_archive(request: web.Request) -> web.StreamResponse:
    """``/sessions/NAME/archive``: the archive, streamed while built, or from the spool (Range, If-Range)."""
    check_access(request)
    cfg = request.app[SESSIONS_KEY]
    guard = request.app[GUARD_KEY]
    spool = cfg.spool
    loop = asyncio.get_running_loop()
    name = request.match_info["name"]
    try:
        directory = await loop.run_in_executor(None, session_dir, cfg.session_root, name)
        etag = await loop.run_in_executor(None, archive_etag, directory, cfg.store_root, cfg.share_private)
    except SessionNotFound as e:
        raise web.HTTPNotFound(text=f"{e}\n") from e
    except (OSError, BuildiddError) as e:
        log.warning("503: session %s: %s", name, e)
        raise web.HTTPServiceUnavailable(text="session cannot be read right now\n") from e
    final = spool.path(directory.name, etag)
    headers = {"Content-Type": ARCHIVE_CONTENT_TYPE, "ETag": f'"{etag}"',
               "Content-Disposition": f'attachment; filename="{directory.name}.tar.zst"'}
    pending = spool.building.get(final)
    if not final.exists() and pending is None:
        stream = request.method == "GET" and "Range" not in request.headers
        resp = web.StreamResponse(headers=headers) if stream else None
        if resp is not None:
            resp.enable_chunked_encoding()
            await resp.prepare(request)
        listener = _Listener(loop, resp, guard.limits.send_timeout_s, lambda: guard.cut(request))
        pending = spool.building[final] = loop.run_in_executor(
            spool.builders, _build, final, directory, cfg, listener)
        try:
            await pending
        except (OSError, BuildiddError) as e:
            log.warning("archive of %s failed: %s", name, e)
            if resp is None:
                raise web.HTTPServiceUnavailable(text="the archive could not be made right now\n") from e
            if request.transport is not None:
                request.transport.close()   # the client sees a broken transfer, not a short archive
            return _gone(resp)
        finally:
            del spool.building[final]
        spool.trim(final)
        if resp is not None:
            if listener.cut or listener.resp is None:
                return _gone(resp)
            await resp.write_eof()
            return resp
    elif pending is not None:
        try:
            await asyncio.shield(pending)
        except (OSError, BuildiddError) as e:
            raise web.HTTPServiceUnavailable(text="the archive could not be made right now\n") from e
    resp = _ArchiveFileResponse(final, etag, headers)
    try:
        size = final.stat().st_size
    except OSError as e:
        raise web.HTTPServiceUnavailable(text="the archive could not be read right now\n") from e
    view = _without_stale_range(request, etag)
    refuse_zero_suffix(view, size)
    return await guard.send(view, resp)


def _gone(resp: web.StreamResponse) -> web.StreamResponse:
    """What to return for a streamed archive whose client went away or was cut: nothing more is written."""
    resp.force_close()
    return Cut(resp.status)


class _ArchiveFileResponse(web.FileResponse):
    """A spooled archive: FileResponse (Range, sendfile) whose ETag is the archive's; prepared once."""

    def __init__(self, path: Path, etag: str, headers: dict[str, str]):
        super().__init__(path, headers=headers)
        self.archive_etag = etag

    async def prepare(self, request: web.BaseRequest):
        if self.prepared:   # prepared by the handler with its own view of the request
            return None
        return await super().prepare(request)


def _without_stale_range(request: web.Request, etag: str) -> web.Request:
    """The request FileResponse should see: ``If-Range`` decided here by ETag (RFC 9110 §13.1.5).

    A matching ETag keeps the Range; another validator (an old ETag, a date)
    drops it, so the whole current archive is sent.  If-Range is removed either
    way (aiohttp's FileResponse reads it as a date only).
    """
    if_range = request.headers.get("If-Range")
    if if_range is None:
        return request
    headers = request.headers.copy()
    del headers["If-Range"]
    if if_range.strip() != f'"{etag}"':
        headers.pop("Range", None)
    return request.clone(headers=headers)


@dataclass(frozen=True)
class SessionsOptions:
    """What :func:`add_routes` is told.

    Attributes:
        session_root, store_root: directories.
        spool_dir: where archives are spooled; None: a private temporary directory.
        share_private: archives carry private store copies (``Config.store_share_private``).

    Who has rights to the logs is the application's (:mod:`buildidd.offline.serve.rights`).
    """

    session_root: str
    store_root: str
    spool_dir: str | None = None
    share_private: bool = False


@dataclass(frozen=True)
class SessionsConfig:
    """What the session routes need: session_root and store_root (directories), the spool, whether
    archives carry private store copies (``Config.store_share_private``)."""

    session_root: str
    store_root: str
    spool: Spool
    share_private: bool = False


SESSIONS_KEY: web.AppKey[SessionsConfig] = web.AppKey("buildidd_serve_sessions", SessionsConfig)


async def _archive_etag_header(_request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: an archive answer from the spool carries the archive's ETag, not FileResponse's."""
    if isinstance(response, _ArchiveFileResponse):
        response.etag = response.archive_etag


def add_routes(app: web.Application, opts: SessionsOptions) -> None:
    """Add ``/sessions`` and ``/sessions/NAME/archive`` to app, with a spool (removed at cleanup when private).

    Raises:
        OSError: the spool directory cannot be made.
    """
    spool = Spool(opts.spool_dir)
    app[SESSIONS_KEY] = SessionsConfig(opts.session_root, opts.store_root, spool, opts.share_private)

    async def close_spool(_app) -> None:
        spool.builders.shutdown(wait=False, cancel_futures=True)
        spool.close()

    app.on_cleanup.append(close_spool)
    app.on_response_prepare.append(_archive_etag_header)
    app.router.add_get("/sessions", handle_sessions, allow_head=False)
    app.router.add_get("/sessions/{name}/archive", handle_archive)

"""The ``/buildid/...`` routes of ``buildidd serve`` (the debuginfod protocol) and their handlers.

Lookups run in threads (the store is a file tree; a slow disk holds one
thread, never the loop) through :mod:`buildidd.offline.serve.debuginfod`,
which decides what is held and may be served; each is counted in /metrics.
A private build-id withheld from a caller without rights
(:mod:`buildidd.offline.serve.rights`) is answered with the very 404 of an
absent one (:data:`NOT_HELD`, :data:`NO_SECTION`) and counted as a miss.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiohttp import web

from buildidd.offline.serve import debuginfod as dbg
from buildidd.offline.serve.metrics import METRICS_KEY
from buildidd.offline.serve.rights import has_rights
from buildidd.store import Store

log = logging.getLogger(__name__)

__all__ = ["add_routes"]

STORE_KEY: web.AppKey[Store] = web.AppKey("buildidd_serve_store", Store)
PRIVACY_KEY: web.AppKey[dbg.Privacy] = web.AppKey("buildidd_serve_privacy", dbg.Privacy)

NOT_HELD = "not held\n"
"""The body of the 404 for an executable or debuginfo not held (or withheld from a caller without rights)."""

NO_SECTION = "no such section held\n"
"""The body of the 404 for a section not held (or withheld from a caller without rights)."""

WITHHELD_TEXT = ("held, but private: its source was not readable by every user on the recording host; the "
                 "operator shares such copies with store_share_private = true\n")
"""The body of the 403 a caller with rights gets for a private build-id not shared."""


def add_routes(app: web.Application, store: Store, privacy: dbg.Privacy) -> None:
    """The ``/buildid/...`` routes of app, answering from store with privacy's rules."""
    app[STORE_KEY] = store
    app[PRIVACY_KEY] = privacy
    app.router.add_get("/buildid/{build_id}/section/{name}", handle_section)
    app.router.add_get("/buildid/{build_id}/source/{path:.+}", handle_source)
    app.router.add_get("/buildid/{build_id}/{artifact}", handle_artifact)
    app.router.add_route("*", "/buildid/{tail:.*}", handle_bad_buildid)
    app.router.add_get("/go-buildid/{go_build_id:.+}/executable", handle_go_executable)


def _policy(request: web.Request) -> tuple[Store, dbg.Privacy, bool]:
    """(the store, the privacy policy for this caller, whether the caller has rights)."""
    entitled = has_rights(request)
    return request.app[STORE_KEY], request.app[PRIVACY_KEY].for_caller(entitled), entitled


async def _lookup(request: web.Request, artifact: str, find: Callable[[], object], miss_text: str,
                  entitled: bool):
    """Run a store lookup in a thread; count it; 503 for dbg.Unavailable (logged at a limited rate).
    dbg.Withheld (a private copy): 403 with the reason and X-Buildidd-Withheld: private to an entitled
    caller, else the 404 of a miss (miss_text, counted as one)."""
    loop = asyncio.get_running_loop()
    metrics = request.app[METRICS_KEY]
    try:
        return await loop.run_in_executor(None, find)
    except dbg.Withheld as e:
        if not entitled:
            metrics.lookup(artifact, "miss")
            raise web.HTTPNotFound(text=miss_text) from None
        metrics.lookup(artifact, "withheld")
        raise web.HTTPForbidden(text=WITHHELD_TEXT, headers={"X-Buildidd-Withheld": "private"}) from e
    except dbg.Unavailable as e:
        metrics.lookup(artifact, "unavailable")
        metrics.warn(log, "503: %s", e)
        raise dbg.unavailable(e) from e


async def _send_held(request: web.Request, artifact: str, held: dbg.Held | None) -> web.StreamResponse:
    metrics = request.app[METRICS_KEY]
    if held is None:
        metrics.lookup(artifact, "miss")
        raise web.HTTPNotFound(text=NOT_HELD)
    resp = await _lookup(request, artifact, lambda: dbg.open_held(held), NOT_HELD, True)
    metrics.lookup(artifact, "hit")
    metrics.served(artifact, held.quality)
    return resp


async def handle_artifact(request: web.Request) -> web.StreamResponse:
    """``/buildid/HEX/executable`` and ``/buildid/HEX/debuginfo``."""
    bid = dbg.check_build_id(request.match_info["build_id"])
    artifact = request.match_info["artifact"]
    store, privacy, entitled = _policy(request)
    if artifact == "executable":
        held = await _lookup(request, artifact, lambda: dbg.find_executable(store, bid, privacy), NOT_HELD, entitled)
    elif artifact == "debuginfo":
        held = await _lookup(request, artifact, lambda: dbg.find_debuginfo(store, bid, privacy), NOT_HELD, entitled)
    else:
        raise web.HTTPBadRequest(text=f"unknown artifact type {artifact!r}\n")
    return await _send_held(request, artifact, held)


async def handle_go_executable(request: web.Request) -> web.StreamResponse:
    """``/go-buildid/GOID/executable``: the binary whose Go build ID (``go tool buildid``'s text, its ``/``
    as they are) is GOID, through the store's Go build ID index (Store.go_key), under the same rules as
    ``/buildid/KEY/executable``; 400 for text that is no Go build ID."""
    store, privacy, entitled = _policy(request)
    go_id = request.match_info["go_build_id"]

    def find():
        try:
            key = store.go_key(go_id)
        except ValueError:
            return ValueError
        return dbg.find_executable(store, key, privacy) if key is not None else None

    held = await _lookup(request, "executable", find, NOT_HELD, entitled)
    if held is ValueError:
        raise web.HTTPBadRequest(text="not a Go build ID (base64url parts joined by /)\n")
    return await _send_held(request, "executable", held)


async def handle_section(request: web.Request) -> web.StreamResponse:
    """``/buildid/HEX/section/NAME``: from the debuginfo, else the executable."""
    bid = dbg.check_build_id(request.match_info["build_id"])
    name = dbg.check_section_name(request.match_info["name"])
    store, privacy, entitled = _policy(request)

    def find():
        files = [h for h in (dbg.find_debuginfo(store, bid, privacy), dbg.find_executable(store, bid, privacy))
                 if h is not None]
        section = dbg.find_section(files, name) if files else None
        return dbg.open_section(section, name) if section is not None else None

    resp = await _lookup(request, "section", find, NO_SECTION, entitled)
    if resp is None:
        request.app[METRICS_KEY].lookup("section", "miss")
        raise web.HTTPNotFound(text=NO_SECTION)
    request.app[METRICS_KEY].lookup("section", "hit")
    request.app[METRICS_KEY].served("section", resp.headers.get("X-Buildidd-Quality"))
    return resp


async def handle_source(request: web.Request) -> web.StreamResponse:
    """``/buildid/HEX/source/PATH``: sources are never held; 404 after validation."""
    dbg.check_build_id(request.match_info["build_id"])
    dbg.check_source_path(request.match_info["path"])
    request.app[METRICS_KEY].lookup("source", "miss")
    raise web.HTTPNotFound(text="sources are not held\n")


async def handle_bad_buildid(request: web.Request) -> web.StreamResponse:
    """Any other ``/buildid/...`` shape: 400."""
    raise web.HTTPBadRequest(text="expected /buildid/HEX/{executable,debuginfo,section/NAME,source/PATH}\n")

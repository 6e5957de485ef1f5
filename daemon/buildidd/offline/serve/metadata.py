"""``GET /metadata?key=file|glob&value=V``: which build-ids a path had, from the recorded sessions.

The answer has debuginfod's shape (elfutils 0.190+, debuginfod.cxx handle_metadata; see
:mod:`buildidd.offline.metadata`).  It is drawn from the session logs, so it is served only to
a caller with rights to them (:func:`buildidd.offline.serve.sessions.check_access`): the paths
a host ran are its exec history.  A bad key or value is 400.
"""

from __future__ import annotations

import asyncio
import json
import logging

from aiohttp import web

from buildidd.errors import UsageError
from buildidd.offline.metadata import metadata
from buildidd.offline.serve.buildid import STORE_KEY
from buildidd.offline.serve.sessions import SESSIONS_KEY, check_access

log = logging.getLogger(__name__)

__all__ = ["add_routes"]


def add_routes(app: web.Application) -> None:
    """``/metadata`` on app (after the session routes and the /buildid routes, whose keys it reads)."""
    app.router.add_get("/metadata", handle_metadata)


async def handle_metadata(request: web.Request) -> web.Response:
    """``/metadata``: ``{"results": [...], "complete": bool}``; 400 for a bad key or value, 403 without rights."""
    check_access(request)
    session_root = request.app[SESSIONS_KEY].session_root
    store = request.app[STORE_KEY]
    key, value = request.query.get("key", ""), request.query.get("value", "")
    loop = asyncio.get_running_loop()
    try:
        answer = await loop.run_in_executor(None, metadata, session_root, key, value, store.contains)
    except UsageError as e:
        raise web.HTTPBadRequest(text=f"{e}\n") from e
    return web.Response(body=json.dumps(answer).encode(), content_type="application/json")

"""Who gets what from ``buildidd serve``: a caller's rights, and what a caller without them is told.

A caller has rights when it sent the bearer token (a server started with
``--token-file`` admits no other: the auth middleware of :mod:`.app` checks it
and marks the request, :data:`TOKEN_CHECKED`), or came over the unix-socket
listener and its SO_PEERCRED is root or a member of the control group
(:func:`buildidd.peercred.in_group`).  A TCP peer without the token has none,
loopback included: every local user can connect there (the uid sock_diag
reports for a loopback socket only shares out the caps of :mod:`.guard`).

Rights give:

* the session logs and what is drawn from them (``/sessions*``, ``/metadata``);
  anyone else gets 403, counted ``sessions_forbidden``
  (:func:`buildidd.offline.serve.sessions.check_access`);
* for a build-id whose store copy is private (``Store.is_private``): the copy
  when the operator shares private copies (``store_share_private``), else 403
  with the reason and ``X-Buildidd-Withheld: private``.  A caller without
  rights gets exactly the answer of a build-id the store does not hold (the
  same status, body and headers, counted as a miss), whatever
  ``store_share_private`` says: whether a private binary ran on the host is
  not given away.  The decision is taken from the entry's ``origin.json``
  before the private file is opened (:mod:`.debuginfod`), so nothing of the
  file's size or contents reaches the answer or its time;
* ``/metrics``; anyone else gets 403, counted ``metrics_forbidden``, unless
  the operator opens it to every caller (``serve_metrics_public``: a
  Prometheus scraper without the token).  Its counters never tell a private
  build-id from an absent one either: a lookup withheld from a caller without
  rights is counted as a miss.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from buildidd.offline.serve.guard import GUARD_KEY
from buildidd.offline.serve.metrics import METRICS_KEY
from buildidd.peercred import in_group

__all__ = ["ACCESS_KEY", "Access", "TOKEN_CHECKED", "check_metrics", "has_rights", "is_metrics"]

TOKEN_CHECKED = "buildidd_token_checked"
"""The request item the auth middleware sets (to True) once the request's bearer token matched."""

METRICS_PATH = "/metrics"


@dataclass(frozen=True)
class Access:
    """Who has rights besides token holders, and whether /metrics is open to all.

    Attributes:
        group_gid: the control group's gid: its members (and root) have rights on the unix socket; 0: root only.
        metrics_public: ``/metrics`` answers every caller (``Config.serve_metrics_public``).
    """

    group_gid: int = 0
    metrics_public: bool = False


ACCESS_KEY: web.AppKey[Access] = web.AppKey("buildidd_serve_access", Access)


def has_rights(request: web.Request) -> bool:
    """Whether the caller of request has rights (see the module docstring): it sent the token the server
    requires, or it is a unix-socket peer whose SO_PEERCRED is root or in the control group."""
    if request.get(TOKEN_CHECKED, False):
        return True
    conn = request.app[GUARD_KEY].conn(request)
    return conn is not None and conn.creds is not None and in_group(conn.creds, request.app[ACCESS_KEY].group_gid)


def is_metrics(request: web.Request) -> bool:
    """Whether request was routed to ``/metrics`` (by the router's match, not the raw path)."""
    resource = getattr(request.match_info.route, "resource", None)
    return resource is not None and resource.canonical == METRICS_PATH


def check_metrics(request: web.Request) -> None:
    """``/metrics``' policy: open to all with ``serve_metrics_public``, else to a caller with rights.

    Raises:
        web.HTTPForbidden: no rights (counted ``metrics_forbidden``).
    """
    if request.app[ACCESS_KEY].metrics_public or has_rights(request):
        return
    request.app[METRICS_KEY].refuse("metrics_forbidden")
    raise web.HTTPForbidden(text="/metrics needs the bearer token, or the unix socket as root or a member of the "
                                 "control group (serve_metrics_public = true opens it to every caller)\n")

"""``buildidd pull URL [SESSION...]``: fetch session archives from a ``buildidd serve`` and import them.

Each archive is downloaded into ``work_dir/NAME.tar.zst.part``, with its
``ETag`` beside it (``NAME.tar.zst.etag``).  A transfer that breaks (a reset,
a timeout, a short body) is resumed with ``Range: bytes=N-`` and ``If-Range:
"ETAG"`` (RFC 9110 §14.2, §13.1.5), up to :data:`MAX_ATTEMPTS` times in one
run, and by the next run from the kept partial file.  The server answers 206
with the rest of the same archive, or 200 with a whole new one when the
session changed since (its ETag differs): the partial file is then replaced.

A serve is a peer like any other, hence hostile until proven otherwise:

* an archive is at most ``max_bytes`` (:data:`MAX_BYTES_CEILING` at most):
  a larger ``Content-Length`` is refused before a byte is read, and a body
  that runs past it (an endless chunked one) is stopped there and discarded;
* every socket read waits at most ``timeout_s`` (urllib3's read timeout, a
  timeout on each ``recv``, not on the whole body), and at most what was left
  of the deadline when the attempt began;
* one archive's download, all its attempts and pauses together, ends at
  ``deadline_s``: it is checked between reads, so a body trickling a byte
  every few seconds (never idle for ``timeout_s``) stops at the first read
  past it;
* the bearer token never crosses an origin: it is sent only to the URL's
  scheme, host and port, a redirect elsewhere is followed without it (at most
  :data:`MAX_REDIRECTS`), and an https URL's redirect to plain http, or to a
  scheme that is not http(s), is refused.

The HTTP client is urllib3 (a connection pool with per-read timeouts and no
automatic redirects or retries, so that the rules above are pull's own).

After the download, :func:`buildidd.offline.importer.import_archive` verifies
everything (manifest, sizes, each binary's build-id) before installing.  When
an archive assembled from resumed pieces fails that verification, it is
fetched once more from the start and verified again; the files are removed
once imported.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import ssl
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import urllib3

from buildidd.errors import ArchiveError, ServeError, ServeRefusedError
from buildidd.offline.importer import ImportReport, import_archive
from buildidd.offline.untar import ImportLimits

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 5
"""Requests per archive download in one run (the first and the resumptions)."""

RETRY_PAUSE_S = 1.0
"""Seconds between attempts (doubled each time)."""

CHUNK_BYTES = 1 << 20
MAX_BYTES_CEILING = ImportLimits().max_total_bytes
"""An archive is never downloaded past this many bytes, whatever ``max_bytes`` says (the importer would
refuse more decompressed bytes than this, and the compressed archive is not larger)."""

DEFAULT_DEADLINE_S = 3600.0
"""Seconds one archive's download may take, attempts and pauses included, by default."""

SESSIONS_MAX_BYTES = 16 << 20
"""A ``/sessions`` answer larger than this is refused."""

REFUSAL_TEXT_MAX_BYTES = 1024
"""Bytes of a refusal's body (the serve's explanation) read and shown, at most."""

MAX_REDIRECTS = 10
"""Redirects followed for one request, at most (urllib's HTTPRedirectHandler.max_redirections)."""

_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
#: What a transfer can fail with: the socket's errors, urllib3's (timeouts, protocol), http.client's.
_NET_ERRORS = (OSError, urllib3.exceptions.HTTPError, http.client.HTTPException)
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,254}")
_CONTENT_RANGE_RE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_UNSATISFIED_RE = re.compile(r"bytes \*/(\d+)")


@dataclass(frozen=True)
class PullOptions:
    """What ``buildidd pull`` is told.

    Attributes:
        url: the serve's base URL (``http://host:8002``, ``https://…``).
        sessions: session names to pull (``latest`` for the newest); empty: every session it lists.
        token: the bearer token to send, or None.
        debug_dir: the perf build-id cache to install into; None: ``~/.debug``.
        session_root: where the sessions go.
        work_dir: where partial downloads are kept; None: ``~/.cache/buildidd/pull``.
        timeout_s: seconds without progress (connect, or between reads) before an attempt fails.
        cafile: CA certificates to trust for https, or None (the system's).
        max_bytes: an archive larger than this is refused (at most :data:`MAX_BYTES_CEILING`).
        deadline_s: seconds one archive's download may take, every attempt and pause included.
        untrusted: the importer's policy for entries not ``trusted`` (``mark``, ``skip``, ``refuse``).
    """

    url: str
    sessions: tuple[str, ...]
    session_root: str
    token: str | None = None
    debug_dir: str | None = None
    work_dir: str | None = None
    timeout_s: float = 60.0
    cafile: str | None = None
    max_bytes: int = MAX_BYTES_CEILING
    deadline_s: float = DEFAULT_DEADLINE_S
    untrusted: str = "mark"


@dataclass(frozen=True)
class PullResult:
    """One session pulled: its name, where it was imported, the archive's size, whether a transfer resumed,
    and the import's report (what it installed and what the archive left out)."""

    name: str
    session_dir: Path
    archive_bytes: int
    resumed: bool
    report: "ImportReport | None" = None


class _Broken(Exception):
    """An attempt failed in a way another attempt may fix (reset, timeout, short body, 5xx)."""


def origin(url: str) -> tuple[str, str, int]:
    """(scheme, host in lower case, port: the scheme's default when absent) of an http(s) URL (RFC 6454)."""
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = -1
    default = 443 if parts.scheme == "https" else 80
    return parts.scheme.lower(), (parts.hostname or "").lower(), port if port is not None else default


class _Client:
    """GET requests to one serve through a urllib3 pool: the token only to its origin, TLS settings, redirects
    followed by hand (see the module doc)."""

    def __init__(self, opts: PullOptions):
        parsed = urllib.parse.urlsplit(opts.url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ServeError(f"{opts.url}: expected an http:// or https:// URL")
        self.base = opts.url.rstrip("/")
        self.home = origin(self.base)
        self.token = opts.token
        self.timeout_s = opts.timeout_s
        context = ssl.create_default_context(cafile=opts.cafile) if parsed.scheme == "https" else None
        self.pool = urllib3.PoolManager(ssl_context=context, retries=False)

    def open(self, path: str, headers: dict[str, str] | None = None, timeout_s: float | None = None):
        """The response to GET path, any status, its body unread (a urllib3 HTTPResponse: status, reason,
        headers, read, read1); each connect and each socket read waits at most timeout_s (default: the
        options' timeout_s).

        Raises:
            _Broken: the connection failed or timed out.
            ServeError: a redirect refused (https to http, not http(s)) or more than MAX_REDIRECTS.
        """
        wait = self.timeout_s if timeout_s is None else timeout_s
        timeout = urllib3.Timeout(connect=wait, read=wait)
        url = self.base + path
        for _ in range(MAX_REDIRECTS + 1):
            sent = {**(headers or {}), "Connection": "close"}     # one request per connection, as urllib sent
            if self.token is not None and origin(url) == self.home:
                sent["Authorization"] = f"Bearer {self.token}"
            try:
                resp = self.pool.request("GET", url, headers=sent, preload_content=False, decode_content=False,
                                         redirect=False, retries=False, timeout=timeout)
            except _NET_ERRORS as e:
                raise _Broken(f"{url}: {e}") from e
            location = resp.headers.get("Location")
            if resp.status not in _REDIRECT_STATUSES or not location:
                return resp
            resp.close()            # its body is not read: a redirect's body is the peer's to make endless
            url = self._redirect(url, location)
        raise ServeError(f"{self.base}{path}: more than {MAX_REDIRECTS} redirects")

    def _redirect(self, url: str, location: str) -> str:
        """The URL a redirect from url names (relative ones resolved, RFC 9110 §10.2.2), if it may be followed.

        Raises:
            ServeError: https to another scheme, or a scheme that is not http(s).
        """
        target = urllib.parse.urljoin(url, location)
        there = origin(target)
        if there[0] not in ("http", "https") or (self.home[0] == "https" and there[0] != "https"):
            raise ServeError(f"{url}: redirect from {self.home[0]} to {there[0] or '?'} refused")
        if self.token is not None and there != self.home:
            log.warning("redirected to %s://%s:%d: following it without the token", *there)
        return target


def refusal(client: _Client, where: str, resp) -> ServeError:
    """The error for a 4xx answer: the status, the serve's own explanation (the body's first
    REFUSAL_TEXT_MAX_BYTES, as one printable line), and for 401 or 403 what to do about the token.

    Returns:
        ServeRefusedError (exit status 4) for 401 and 403, else ServeError.
    """
    try:
        body = resp.read(REFUSAL_TEXT_MAX_BYTES)
    except _NET_ERRORS:
        body = b""
    text = "".join(c if c.isprintable() else "?" for c in " ".join(body.decode("utf-8", "replace").split()))
    message = f"{where}: HTTP {resp.status} {resp.reason}" + (f": {text.rstrip('.')}" if text else "")
    if resp.status not in (401, 403):
        return ServeError(message)
    if client.token is None:
        message += ("; give pull --token-file FILE holding the token the serve was started with "
                    "(buildidd serve --token-file FILE)")
    else:
        message += "; the serve did not accept the token in --token-file: is it the one serve was started with?"
    return ServeRefusedError(message)


def remote_sessions(client: _Client) -> list[str]:
    """The names ``/sessions`` lists, in its order (oldest first).

    Raises:
        ServeRefusedError: refused (401, 403: the token).
        ServeError: refused otherwise, unreachable, or a malformed answer.
    """
    try:
        resp = client.open("/sessions")
    except _Broken as e:
        raise ServeError(f"cannot list sessions: {e}") from e
    with resp:
        if resp.status != 200:
            raise refusal(client, f"{client.base}/sessions", resp)
        try:
            data = resp.read(SESSIONS_MAX_BYTES + 1)
        except _NET_ERRORS as e:
            raise ServeError(f"{client.base}/sessions: the answer broke off: {e}") from e
    if len(data) > SESSIONS_MAX_BYTES:
        raise ServeError(f"{client.base}/sessions: answer over {SESSIONS_MAX_BYTES} bytes")
    try:
        items = json.loads(data)
        names = [item["name"] for item in items]
    except (ValueError, TypeError, KeyError) as e:
        raise ServeError(f"{client.base}/sessions: malformed answer") from e
    bad = [n for n in names if not isinstance(n, str) or not _NAME_RE.fullmatch(n) or ".." in n]
    if bad:
        raise ServeError(f"{client.base}/sessions: refusing session names {bad[:3]!r}")
    return names


def _chosen(wanted: tuple[str, ...], listed: list[str]) -> list[str]:
    if not wanted:
        return listed
    out = []
    for name in wanted:
        if name == "latest":
            if not listed:
                raise ServeError("no session to pull: the serve lists none")
            name = listed[-1]
        if name not in listed:
            raise ServeError(f"the serve has no session {name!r}")
        out.append(name)
    return out


class _Download:
    """One archive's download into work_dir, resumable, within a size cap and a deadline."""

    def __init__(self, client: _Client, name: str, work_dir: Path, opts: PullOptions):
        self.client = client
        self.name = name
        self.part = work_dir / f"{name}.tar.zst.part"
        self.etag_file = work_dir / f"{name}.tar.zst.etag"
        self.resumed = False
        self.max_bytes = min(opts.max_bytes, MAX_BYTES_CEILING)
        self.deadline_s = opts.deadline_s
        self.deadline = time.monotonic() + opts.deadline_s

    def _left_s(self) -> float:
        """Seconds left before the deadline.

        Raises:
            ServeError: none left (the partial file is kept for the next pull).
        """
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise ServeError(f"{self.name}: not downloaded within {self.deadline_s:.0f} s (--deadline); "
                             f"{self._have()} bytes kept in {self.part} for the next pull")
        return left

    def discard(self) -> None:
        self.part.unlink(missing_ok=True)
        self.etag_file.unlink(missing_ok=True)

    def run(self) -> Path:
        """Download until complete; the part file's path.

        Raises:
            ServeError: refused (4xx), or still broken after MAX_ATTEMPTS.
        """
        pause = RETRY_PAUSE_S
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                self._attempt()
                return self.part
            except _Broken as e:
                if attempt == MAX_ATTEMPTS:
                    raise ServeError(f"{self.name}: transfer failed {attempt} times, last: {e}; "
                                     f"{self._have()} bytes kept in {self.part} for the next pull") from e
                log.warning("%s: %s; resuming from byte %d in %.0f s", self.name, e, self._have(), pause)
                time.sleep(min(pause, self._left_s()))
                pause *= 2
        raise AssertionError("unreachable")

    def _have(self) -> int:
        try:
            return self.part.stat().st_size
        except FileNotFoundError:
            return 0

    def _attempt(self) -> None:
        have = self._have()
        etag = self.etag_file.read_text().strip() if have and self.etag_file.exists() else None
        headers = {"Range": f"bytes={have}-", "If-Range": etag} if etag else {}
        if not etag:
            have = 0
        resp = self.client.open(f"/sessions/{urllib.parse.quote(self.name)}/archive", headers,
                                timeout_s=min(self.client.timeout_s, self._left_s()))
        with resp:
            if resp.status == 416:
                m = _UNSATISFIED_RE.fullmatch(resp.headers.get("Content-Range", ""))
                if m and int(m.group(1)) == have:
                    return  # already complete
                self.discard()
                raise _Broken("the kept partial file does not fit the archive; starting over")
            if resp.status >= 500:
                raise _Broken(f"HTTP {resp.status} {resp.reason}")
            if resp.status == 206:
                m = _CONTENT_RANGE_RE.fullmatch(resp.headers.get("Content-Range", ""))
                if not m or int(m.group(1)) != have:
                    self.discard()
                    raise _Broken(f"unexpected Content-Range {resp.headers.get('Content-Range')!r}; starting over")
                self.resumed = True
                log.info("%s: resuming at byte %d", self.name, have)
                mode = "ab"
            elif resp.status == 200:
                mode = "wb"
                new_etag = resp.headers.get("ETag")
                if new_etag:
                    self.etag_file.write_text(new_etag)
                else:
                    self.etag_file.unlink(missing_ok=True)
            else:
                raise refusal(self.client, f"{self.client.base}: session {self.name}", resp)
            self._copy(resp, mode)

    def _copy(self, resp, mode: str) -> None:
        """Write resp's body to the part file: within max_bytes and the deadline (checked before each read;
        each read waits at most the attempt's read timeout, see :meth:`_Client.open`).

        Raises:
            ServeError: the archive is over max_bytes (the part file is removed), or the deadline passed.
            _Broken: the transfer broke or ended short.
        """
        expected = resp.headers.get("Content-Length")
        base = self._have() if mode == "ab" else 0
        if expected is not None and expected.isdigit() and base + int(expected) > self.max_bytes:
            self.discard()
            raise ServeError(f"{self.name}: the archive is {base + int(expected)} bytes, over the cap of "
                             f"{self.max_bytes} (--max-bytes)")
        got = 0
        with open(self.part, mode) as f:
            try:
                while True:
                    self._left_s()
                    chunk = resp.read1(CHUNK_BYTES)
                    if not chunk:
                        break
                    f.write(chunk)
                    got += len(chunk)
                    if base + got > self.max_bytes:
                        f.close()
                        self.discard()
                        raise ServeError(f"{self.name}: the archive runs past the cap of {self.max_bytes} bytes "
                                         f"(--max-bytes); stopped and discarded")
            except _NET_ERRORS as e:
                raise _Broken(f"transfer broke after {got} bytes: {e}") from e
            finally:
                if not f.closed:
                    f.flush()
                    os.fsync(f.fileno())
        if expected is not None and got != int(expected):
            raise _Broken(f"transfer ended after {got} of {expected} bytes")


def _pull_one(client: _Client, name: str, opts: PullOptions, work_dir: Path) -> PullResult:
    dl = _Download(client, name, work_dir, opts)
    for fresh in (False, True):
        if fresh:
            dl.discard()
            dl.resumed = False
        path = dl.run()
        size = path.stat().st_size
        try:
            report = import_archive(path, debug_dir=opts.debug_dir or os.path.expanduser("~/.debug"),
                                    session_root=opts.session_root, untrusted=opts.untrusted)
        except ArchiveError as e:
            if dl.resumed and not fresh:
                log.warning("%s: the resumed archive failed verification (%s); fetching it whole", name, e)
                continue
            dl.discard()
            raise
        dl.discard()
        return PullResult(name, report.session_dir, size, dl.resumed, report)
    raise AssertionError("unreachable")


def pull(opts: PullOptions, progress: bool = False) -> Iterator[PullResult]:
    """Fetch and import each chosen session, in order; yields each one's result once imported.

    Args:
        opts: see :class:`PullOptions`.
        progress: log each archive's start (the archive's own progress is the server's).

    Raises:
        ServeError: the serve refuses, lacks a session, or a transfer keeps failing.
        ArchiveError: an archive fetched whole fails verification (nothing of it is installed).
        OSError: the work directory or a target cannot be written.
    """
    client = _Client(opts)
    work_dir = Path(opts.work_dir or os.path.expanduser("~/.cache/buildidd/pull"))
    work_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    for name in _chosen(opts.sessions, remote_sessions(client)):
        if progress:
            log.info("pulling %s from %s", name, client.base)
        yield _pull_one(client, name, opts, work_dir)

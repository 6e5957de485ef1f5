"""Sending a held file's bytes: an fd closed exactly once, byte ranges, a section streamed from its file.

Used by :mod:`buildidd.offline.serve.debuginfod` and the archive answers of
:mod:`buildidd.offline.serve.sessions`.  aiohttp's ``FileResponse`` sends
whole files (and their ranges) with ``sendfile(2)``; a section is a slice of a
file, sent here one chunk at a time as the client takes it.
"""

from __future__ import annotations

import asyncio
import os
import re
import weakref

from aiohttp import web

__all__ = ["OpenFd", "SectionResponse", "byte_range", "refuse_zero_suffix"]


class OpenFd:
    """An fd closed exactly once: after the answer is sent, or when the response is dropped unsent."""

    def __init__(self, fd: int):
        self.fd: int | None = fd

    def close(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)


_ZERO_SUFFIX_RE = re.compile(r"\s*bytes\s*=\s*-0+\s*")


def refuse_zero_suffix(request: web.BaseRequest, size_bytes: int) -> None:
    """416 for ``Range: bytes=-0``: the last 0 bytes are no range at all (RFC 9110 §14.1.3: a suffix-length
    of 0 is unsatisfiable); aiohttp's ``http_range`` reads it as the whole representation.

    Raises:
        web.HTTPRequestRangeNotSatisfiable: the Range header is a zero suffix.
    """
    if _ZERO_SUFFIX_RE.fullmatch(request.headers.get("Range", "x")):
        raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{size_bytes}"})


def byte_range(request: web.BaseRequest, size_bytes: int) -> tuple[int, int] | None:
    """The (start, stop) of a single ``Range: bytes=…`` over size_bytes, or None for the whole.

    Raises:
        web.HTTPRequestRangeNotSatisfiable: a malformed, zero-suffix or empty range.
    """
    refuse_zero_suffix(request, size_bytes)
    unsatisfiable = web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{size_bytes}"})
    try:
        rng = request.http_range
    except ValueError:
        raise unsatisfiable from None
    if rng.start is None and rng.stop is None:
        return None
    start, stop, _ = rng.indices(size_bytes)
    if start >= stop:
        raise unsatisfiable
    return start, stop


class SectionResponse(web.StreamResponse):
    """A section's bytes, read from the open file :data:`CHUNK_BYTES` at a time (in a thread) as the client
    takes them: memory per answer is one chunk, whatever the section's size.  ``Range`` as a file answer."""

    CHUNK_BYTES = 256 << 10

    def __init__(self, fd: int, offset: int, size_bytes: int, headers: dict[str, str]):
        super().__init__(headers=dict(headers, **{"Accept-Ranges": "bytes"}))
        self._fd = OpenFd(fd)
        self._offset = offset
        self.size_bytes = size_bytes
        weakref.finalize(self, self._fd.close)

    async def prepare(self, request: web.BaseRequest):
        if self.prepared:
            return None
        try:
            size = self.size_bytes
            rng = byte_range(request, size)
            start, stop = rng if rng is not None else (0, size)
            if rng is not None:
                self.set_status(206)
                self.headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
            self.content_length = stop - start
            writer = await super().prepare(request)
            if request.method != "HEAD":
                await self._stream(start, stop)
            return writer
        finally:
            self._fd.close()

    async def _stream(self, start: int, stop: int) -> None:
        loop = asyncio.get_running_loop()
        fd = self._fd.fd
        pos = start
        while pos < stop:
            chunk = await loop.run_in_executor(None, os.pread, fd, min(self.CHUNK_BYTES, stop - pos),
                                               self._offset + pos)
            if not chunk:
                raise ConnectionResetError("the file shrank while its section was sent")
            await self.write(chunk)
            pos += len(chunk)

"""C++ symbol names demangled as perf, gdb and binutils show them, by binutils' ``c++filt`` in a child process.

``c++filt`` is libiberty's ``cplus_demangle``, the demangler gdb, objdump and perf (when built with
libiberty) use, so a name reads the same in ``resolve --symbolize`` as in those tools; binutils is already
among what scripts/setup installs.  It runs as a child, not in this process: symbol names come from binaries
a user controls, and a demangler meeting a hostile name may recurse deeply or crash (libiberty has had such
bugs, and keeps a recursion limit for them); a child that dies or answers late costs the names it was asked,
which then stay mangled, never the command.

One child serves every name of a run: a name is written as one line and its answer read as one line (c++filt
flushes after each line it reads from stdin).  Only a name that is an Itanium C++ ABI mangled name
(``_Z...``) of printable, blank-free characters and at most :data:`NAME_MAX_CHARS` is sent; anything else is
returned as it is.
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import subprocess
import time
from collections import OrderedDict

__all__ = ["Demangler", "NAME_MAX_CHARS"]

log = logging.getLogger(__name__)

NAME_MAX_CHARS = 4096
"""A longer name is not sent to c++filt (returned mangled)."""

ANSWER_TIMEOUT_S = 2.0
"""Seconds c++filt may take to answer one name; after that it is stopped and names stay mangled."""

ANSWER_MAX_BYTES = 64 << 10
"""An answer line longer than this stops the child (names stay mangled)."""

CACHE_NAMES = 4096
"""Demangled names remembered (LRU)."""


def _sendable(name: str) -> bool:
    return (name.startswith("_Z") and len(name) <= NAME_MAX_CHARS and name.isascii() and name.isprintable()
            and not any(c.isspace() for c in name))


class Demangler:
    """Demangles names through one ``c++filt`` child, started at the first mangled name.

    Attributes:
        available: False once c++filt is missing, failed or timed out (names are then returned as given).
        error: why it is not available ("" while it is).
    """

    def __init__(self, program: str = "c++filt"):
        self.program = program
        self.available = True
        self.error = ""
        self._proc: subprocess.Popen | None = None
        self._buffer = b""
        self._cache: OrderedDict[str, str] = OrderedDict()

    def __enter__(self) -> Demangler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def demangle(self, name: str) -> str:
        """name demangled (``_ZN3foo3barEi`` -> ``foo::bar(int)``), or name itself when it is not a mangled C++
        name, c++filt cannot demangle it, or c++filt is not available."""
        if not self.available or not _sendable(name):
            return name
        hit = self._cache.get(name)
        if hit is not None:
            self._cache.move_to_end(name)
            return hit
        answer = self._ask(name)
        if answer is None:
            return name
        self._cache[name] = answer
        if len(self._cache) > CACHE_NAMES:
            self._cache.popitem(last=False)
        return answer

    def _start(self) -> bool:
        path = shutil.which(self.program)
        if path is None:
            return self._fail(f"{self.program} not found (binutils): C++ names are shown mangled")
        try:
            self._proc = subprocess.Popen([path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, bufsize=0)
        except OSError as e:
            return self._fail(f"{self.program}: {e.strerror}: C++ names are shown mangled")
        return True

    def _ask(self, name: str) -> str | None:
        if self._proc is None and not self._start():
            return None
        try:
            self._proc.stdin.write(name.encode() + b"\n")
            line = self._read_line(time.monotonic() + ANSWER_TIMEOUT_S)
        except OSError as e:
            line = None
            self.error = f"{self.program}: {e}"
        if line is None:
            self._fail(self.error or f"{self.program} did not answer: C++ names are shown mangled")
            return None
        text = line.decode("utf-8", "replace")
        return text if text and text.isprintable() else name

    def _read_line(self, deadline: float) -> bytes | None:
        """One line of the child's stdout (without its newline), or None at the deadline, EOF or an over-long line."""
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or len(self._buffer) > ANSWER_MAX_BYTES or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def _fail(self, why: str) -> bool:
        self.available, self.error = False, why
        log.warning("%s", why)
        self.close()
        return False

    def close(self) -> None:
        """Stop the child (if any)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

"""The control socket client, used by the CLI and the tests alike."""

from __future__ import annotations

import select
import socket
import time
from typing import Any

from buildidd.control import protocol
from buildidd.control.protocol import ControlError


class ControlClient:
    """Sends requests to a :class:`~.server.ControlServer` over one connection.

    The connection is opened by the first request and reused; if the server
    closed it meanwhile (its idle timeout), the next request reconnects.

    Args:
        path: the server's socket path.
        timeout_s: seconds allowed for connecting and for each whole request
            (send and complete response).

    Usage::

        with ControlClient("/run/buildidd/control.sock") as c:
            print(c.request("status"))
    """

    def __init__(self, path: str, timeout_s: float = 5.0):
        self.path = path
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._buf = bytearray()  # received bytes past the last response line

    def __enter__(self) -> "ControlClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection (a later request opens a new one)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._buf.clear()

    def request(self, cmd: str, **args: Any) -> Any:
        """Run cmd with keyword args on the server; its result (any JSON value).

        Raises:
            ControlError (a ProtocolError): the server answered ``ok: false``
                (``.code``, ``.message`` are the server's), or its answer was
                malformed (``bad_response``, ``bad_json``, ``too_large``), or the
                request cannot be encoded (``bad_request``, ``too_large``).
            OSError: cannot connect, the connection broke before a response
                arrived, or no response within timeout_s (TimeoutError).
        """
        line = protocol.encode_request(cmd, args or None)
        deadline = time.monotonic() + self.timeout_s
        sock = self._connection()
        try:
            try:
                sock.settimeout(self.timeout_s)
                sock.sendall(line)
            except (BrokenPipeError, ConnectionResetError):
                # Refused at accept (busy, permission_denied): the reason may be waiting to be read.
                resp = self._read_line(sock, deadline)
                if resp is None:
                    raise
            else:
                resp = self._read_line(sock, deadline)
                if resp is None:
                    raise ConnectionResetError("control server closed the connection without a response")
        except BaseException:
            self.close()
            raise
        try:
            return protocol.decode_response(resp)
        except ControlError:
            if self._sock is not None and self._pending():
                self.close()  # the server said goodbye; do not reuse
            raise

    def _connection(self) -> socket.socket:
        if self._sock is not None and (self._buf or self._pending()):
            self.close()  # unsolicited data or EOF: the server timed us out
        if self._sock is None:
            self._sock = self._connect()
        return self._sock

    def _connect(self) -> socket.socket:
        """Connect, retrying while the server's listen backlog is full (EAGAIN: unix(7)
        connect() on a full backlog, e.g. while other clients flood it) until timeout_s."""
        deadline = time.monotonic() + self.timeout_s
        pause_s = 0.005
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(self.timeout_s)
                sock.connect(self.path)
                return sock
            except BlockingIOError:
                sock.close()
                if time.monotonic() + pause_s >= deadline:
                    raise TimeoutError(f"{self.path}: the server's backlog stayed full for {self.timeout_s:g} s")
                time.sleep(pause_s)
                pause_s = min(pause_s * 2, 0.1)
            except BaseException:
                sock.close()
                raise

    def _pending(self) -> bool:
        """Whether the socket has data or EOF to read right now."""
        readable, _, _ = select.select([self._sock], [], [], 0)
        return bool(readable)

    def _read_line(self, sock: socket.socket, deadline: float) -> bytes | None:
        """One response line (without "\\n"); None on EOF or reset before any line.

        Raises TimeoutError past deadline (time.monotonic() seconds), ControlError
        TOO_LARGE for a line over MAX_RESPONSE_BYTES.
        """
        while True:
            i = self._buf.find(b"\n")
            if i >= 0:
                line = bytes(self._buf[:i])
                del self._buf[:i + 1]
                return line
            if len(self._buf) >= protocol.MAX_RESPONSE_BYTES:
                raise ControlError(protocol.TOO_LARGE,
                                   f"response exceeds {protocol.MAX_RESPONSE_BYTES} bytes")
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                raise TimeoutError(f"no response from {self.path} within {self.timeout_s:g} s")
            sock.settimeout(remaining_s)
            try:
                data = sock.recv(min(65536, protocol.MAX_RESPONSE_BYTES - len(self._buf)))
            except ConnectionResetError:
                data = b""  # unix(7): the server closed with our bytes unread; nothing more will come
            if not data:
                return None
            self._buf += data

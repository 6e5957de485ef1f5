"""A loopback TCP proxy in front of weed's S3 port, for faults a real server does not make on demand.

Modes (set ``proxy.mode`` at any time; a connection takes the mode current at each chunk or request):

``pass``  bytes forwarded both ways as they come.
``slow``  the server's answers are held ``delay_s`` per chunk and sent at ``rate_bytes_per_s`` (a link
          that crawls: the client's read timeout fires).
``full``  every request but HEAD is answered by the proxy itself with S3's ``507 InsufficientStorage``
          error (what an S3 server out of space answers: AWS's error code list), then the connection is
          closed; HEAD is forwarded (a full server still answers it).  The requests are read one by one
          (HTTP/1.1 heads and Content-Length bodies: what boto3 sends).
"""

from __future__ import annotations

import socket
import threading
import time

FULL_BODY = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InsufficientStorage</Code>'
             b"<Message>Insufficient storage to perform the operation.</Message></Error>")


class Proxy:
    """127.0.0.1:port → upstream (host, port); ``close()`` stops it."""

    def __init__(self, upstream: tuple[str, int]):
        self.upstream = upstream
        self.mode = "pass"
        self.delay_s, self.rate_bytes_per_s = 2.0, 64 << 10
        self.answered_full = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(self.upstream)
        except OSError:
            client.close()
            return
        threading.Thread(target=self._down, args=(server, client), daemon=True).start()
        try:
            self._up(client, server)
        except OSError:
            pass
        finally:
            for s in (client, server):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def _up(self, client: socket.socket, server: socket.socket) -> None:
        """Client → server, request by request (so that ``full`` can answer one itself)."""
        buf = b""
        while True:
            while b"\r\n\r\n" not in buf:
                data = client.recv(65536)
                if not data:
                    return
                buf += data
            head, _, buf = buf.partition(b"\r\n\r\n")
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                           if line.lower().startswith(b"content-length:")), 0)
            if self.mode == "full" and not head.startswith(b"HEAD "):
                self.answered_full += 1
                client.sendall(b"HTTP/1.1 507 Insufficient Storage\r\nContent-Type: application/xml\r\n"
                               b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(FULL_BODY), FULL_BODY))
                return
            server.sendall(head + b"\r\n\r\n")
            while length > 0:
                if not buf:
                    buf = client.recv(min(65536, length))
                    if not buf:
                        return
                part, buf = buf[:length], buf[length:]
                server.sendall(part)
                length -= len(part)

    def _down(self, server: socket.socket, client: socket.socket) -> None:
        """Server → client, slowed in ``slow`` mode."""
        try:
            while data := server.recv(65536):
                if self.mode == "slow":
                    time.sleep(self.delay_s)
                    for i in range(0, len(data), 4096):
                        client.sendall(data[i:i + 4096])
                        time.sleep(4096 / self.rate_bytes_per_s)
                else:
                    client.sendall(data)
        except OSError:
            pass
        finally:
            try:
                client.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

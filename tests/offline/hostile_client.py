"""A hostile HTTP client, run as the unprivileged test user with the system's python3 (stdlib only).

Modes (argv[1]); each prints one JSON object on stdout:

``hold HOST PORT N PATH TOKEN HOLD_S``
    N connections with a 4096-byte receive buffer, each sends ``GET PATH``
    (with the bearer TOKEN unless it is ``-``) and reads nothing for HOLD_S
    seconds; then each is drained (2 s without data ends it).  Prints
    ``{"opened", "status": [...], "bytes": [...], "reset": [...]}``.
``slowheaders HOST PORT N HOLD_S``
    N connections that send half a request's headers and nothing more for
    HOLD_S seconds.  Prints ``{"opened", "refused_connect", "closed_by_server"}``.
``garbage HOST PORT N``
    N connections each sending a malformed request (a bad Content-Length, or
    TLS bytes to the plain port).  Prints ``{"sent"}``.
``get-unix SOCKET PATH`` / ``get HOST PORT PATH``
    One GET; prints ``{"status", "bytes"}``.
``fetch TARGET METHOD PATH...``
    The requests in turn on one keep-alive connection to TARGET (``HOST:PORT``,
    or a unix socket's path, starting with ``/``), with no token.  Prints
    ``{"answers": [{"status", "headers": [[name, value], ...], "body" (latin-1),
    "elapsed_s"}, ...]}``.
"""

import http.client
import json
import resource
import socket
import sys
import time


def _raise_fd_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def hold(host, port, n, path, token, hold_s):
    socks = []
    auth = f"Authorization: Bearer {token}\r\n" if token != "-" else ""
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect((host, port))
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode())
        socks.append(s)
    print(json.dumps({"ready": n}), file=sys.stderr, flush=True)
    time.sleep(hold_s)
    status, got, reset = [], [], []
    for s in socks:
        s.settimeout(2.0)
        head, total, was_reset = b"", 0, False
        try:
            while chunk := s.recv(1 << 20):
                if len(head) < 256:
                    head += chunk[:256]
                total += len(chunk)
        except socket.timeout:
            pass
        except ConnectionError:
            was_reset = True
        first = head.split(b"\r\n", 1)[0].split(b" ")
        status.append(int(first[1]) if len(first) > 1 and first[1].isdigit() else 0)
        got.append(total)
        reset.append(was_reset)
        s.close()
    return {"opened": n, "status": status, "bytes": got, "reset": reset}


def slowheaders(host, port, n, hold_s):
    _raise_fd_limit()
    socks, refused = [], 0
    for _ in range(n):
        s = socket.socket()
        try:
            s.connect((host, port))
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        except OSError:
            refused += 1
            s.close()
            continue
        socks.append(s)
    print(json.dumps({"ready": len(socks)}), file=sys.stderr, flush=True)
    time.sleep(hold_s)
    closed = 0
    for s in socks:
        s.setblocking(False)
        try:
            if not s.recv(1):
                closed += 1
        except BlockingIOError:
            pass
        except ConnectionError:
            closed += 1
        s.close()
    return {"opened": len(socks), "refused_connect": refused, "closed_by_server": closed}


def garbage(host, port, n):
    for i in range(n):
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n" if i % 2
                      else b"\x16\x03\x01\x02\x00garbage\r\n\r\n")
            try:
                s.recv(1024)
            except OSError:
                pass
    return {"sent": n}


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("localhost", timeout=30)
        self.unix_path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(self.unix_path)


def get(conn, path):
    conn.request("GET", path)
    r = conn.getresponse()
    return {"status": r.status, "bytes": len(r.read())}


def fetch(target, method, paths):
    if target.startswith("/"):
        conn = _UnixConnection(target)
    else:
        host, port = target.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
    answers = []
    for path in paths:
        t0 = time.monotonic()
        conn.request(method, path)
        r = conn.getresponse()
        body = r.read()
        answers.append({"status": r.status, "headers": [list(h) for h in r.getheaders()],
                        "body": body.decode("latin-1"), "elapsed_s": time.monotonic() - t0})
    conn.close()
    return {"answers": answers}


def main(argv):
    mode = argv[1]
    if mode == "hold":
        out = hold(argv[2], int(argv[3]), int(argv[4]), argv[5], argv[6], float(argv[7]))
    elif mode == "slowheaders":
        out = slowheaders(argv[2], int(argv[3]), int(argv[4]), float(argv[5]))
    elif mode == "garbage":
        out = garbage(argv[2], int(argv[3]), int(argv[4]))
    elif mode == "get-unix":
        out = get(_UnixConnection(argv[2]), argv[3])
    elif mode == "fetch":
        out = fetch(argv[2], argv[3], argv[4:])
    elif mode == "get":
        out = get(http.client.HTTPConnection(argv[2], int(argv[3]), timeout=30), argv[4])
    else:
        raise SystemExit(f"unknown mode {mode}")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv)

#!/usr/bin/env python3
"""Throughput of ``buildidd serve``: MB/s for one large file, requests/s with N parallel clients.

Builds a store in a temporary directory (a gcc binary, and the same with a
``.blob`` section of --large-mib MiB added by objcopy, so a large ELF file with
a build-id), starts ``buildidd serve`` on a free loopback port and measures:

* large: GET of the large file by one client, read in 1 MiB chunks and
  discarded; MB/s (10^6 bytes) per repetition, median reported;
* small: --clients processes, each with one keep-alive connection, GET the
  small binary's ``/buildid/HEX/executable`` in a loop for --seconds;
  requests/s over all clients.

Client and server share the machine's CPUs: the figures are what one host
does to itself over loopback.

    .venv/bin/python scripts/bench_serve.py [--large-mib 256] [--clients 16] [--seconds 5]
"""

from __future__ import annotations

import argparse
import http.client
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def build_id(path: Path) -> str:
    out = subprocess.run(["readelf", "-n", str(path)], capture_output=True, text=True, check=True).stdout
    return re.search(r"Build ID:\s*([0-9a-f]+)", out).group(1)


def make_store(tmp: Path, large_mib: int) -> tuple[Path, dict[str, tuple[str, int]]]:
    from buildidd.store import Store

    src = tmp / "prog.c"
    src.write_text('#include <stdio.h>\nint main(void) { puts("bench"); return 0; }\n')
    small = tmp / "small"
    subprocess.run(["gcc", "-O1", "-g", "-o", str(small), str(src)], check=True)
    blob = tmp / "blob"
    with open(blob, "wb") as f:
        for _ in range(large_mib):
            f.write(os.urandom(1 << 20))
    large_src = tmp / "prog2.c"
    large_src.write_text('#include <stdio.h>\nint main(void) { puts("large"); return 0; }\n')
    large = tmp / "large"
    subprocess.run(["gcc", "-O1", "-o", str(large), str(large_src)], check=True)
    subprocess.run(["objcopy", "--add-section", f".blob={blob}", str(large)], check=True)
    blob.unlink()
    store = Store(tmp / "store")
    out = {}
    for name, path in (("small", small), ("large", large)):
        bid = build_id(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            store.add_from_fd(fd, str(path), bid)
        finally:
            os.close(fd)
        out[name] = (bid, path.stat().st_size)
    return tmp / "store", out


def start_serve(store: Path, log: Path) -> tuple[subprocess.Popen, int]:
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "buildidd.cli", "serve", "--listen", "127.0.0.1:0",
                                 "--store-root", str(store), "--session-root", str(store.parent / "sessions"),
                                 "--socket", ""], stdout=subprocess.PIPE, stderr=f, text=True)
    line = proc.stdout.readline()
    m = re.search(r":(\d+)$", line.strip())
    if not m:
        proc.kill()
        raise SystemExit(f"serve did not start: {line!r} {log.read_text()}")
    return proc, int(m.group(1))


def get_large(port: int, path: str) -> tuple[int, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    t0 = time.perf_counter()
    conn.request("GET", path)
    r = conn.getresponse()
    n = 0
    while chunk := r.read(1 << 20):
        n += len(chunk)
    dt = time.perf_counter() - t0
    conn.close()
    assert r.status == 200
    return n, dt


def small_client(args) -> int:
    port, path, seconds, start_at = args
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    while time.time() < start_at:
        time.sleep(0.001)
    end = start_at + seconds
    n = 0
    while time.time() < end:
        conn.request("GET", path)
        r = conn.getresponse()
        r.read()
        assert r.status == 200
        n += 1
    conn.close()
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--large-mib", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=5.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as d:
        os.chmod(d, 0o755)   # else the store marks its copies private and serve answers 404
        tmp = Path(d)
        store, files = make_store(tmp, args.large_mib)
        proc, port = start_serve(store, tmp / "serve.log")
        try:
            bid, size = files["large"]
            get_large(port, f"/buildid/{bid}/executable")  # warm the page cache
            rates = []
            for _ in range(args.repeat):
                n, dt = get_large(port, f"/buildid/{bid}/executable")
                assert n == size
                rates.append(n / dt / 1e6)
            print(f"large file: {size / 2**20:.0f} MiB, {args.repeat} GETs, one client: "
                  f"median {statistics.median(rates):.0f} MB/s (min {min(rates):.0f}, max {max(rates):.0f})")
            bid, size = files["small"]
            path = f"/buildid/{bid}/executable"
            start_at = time.time() + 1.0
            with multiprocessing.Pool(args.clients) as pool:
                counts = pool.map(small_client, [(port, path, args.seconds, start_at)] * args.clients)
            total = sum(counts)
            print(f"small file: {size} bytes, {args.clients} parallel keep-alive clients, {args.seconds:.0f} s: "
                  f"{total / args.seconds:.0f} requests/s ({min(counts)}..{max(counts)} per client)")
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())

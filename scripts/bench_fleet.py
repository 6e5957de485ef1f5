"""bench fleet: issue 44's goals, against a real S3 server (SeaweedFS ``weed mini``) on loopback.

Three hosts on this machine: three ``buildidd run`` daemons, each with its own store, session
root and host name, each with its push service (``buildidd push --service``).  They all see the
same programs (BPF sees every exec of the machine).  The hosts start from one image: a store of
the machine's running binaries snapshotted and pushed once (host ``seed``), each host's store a
copy of it, so the run measures what the hosts add (--cold-stores: empty stores, each host pushes
the machine's binaries at the same moment: the claims' race).  The hosts' untrusted entries are
not pushed (push_untrusted = "skip": a per-host tree is each host's own by design).  Printed:

- latency: from a program's first exec to its object in the bucket (p50, p99, max; a ~100 MB one
  included), polling the bucket's listing every 0.25 s;
- outage: the bucket stopped for --outage-s (600 by default) while new programs run and segments
  close; then restarted: how long the backlog takes to drain, and what is missing (lost);
- gone: host-3 stops, its store, sessions and push state are deleted; every build-id its pushed
  session names is fetched with debuginfod-find from the bucket's HTTP front (private and untrusted
  ones excepted), gdb reads one program's debuginfo through DEBUGINFOD_URLS, ``buildidd fleet pull``
  brings the session back and ``inject`` and ``resolve`` work on it;
- dedup: bytes on the wire (a counting proxy between the hosts and the bucket; the services' own
  totals beside) / unique bytes the hosts added to the bucket (listing, objects with the same ETag
  and size once), over the run and over the programs' phase;
- recording: an exec storm with one daemon, paired per repetition against the same daemon without
  push, with push on and the bucket reachable, slow (a TCP proxy adding delay and a rate limit), and
  down (weed stopped): median workload-time ratio, daemon CPU per event ratio, losses.

Run as root after scripts/setup:  scripts/bench --scenarios fleet   (or scripts/bench_fleet.py)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
for p in (HERE, HERE.parent / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from benchlib import PY, SETTLE_S, Buildidd, build as workloads, lost_count, mapping_records, remove_tree  # noqa: E402
from perfcompare import perf_record_lock  # noqa: E402
from fleet.conftest import ACCESS_KEY, SECRET_KEY, Weed  # noqa: E402
from fleet.world import system_dir  # noqa: E402

BUCKET, PREFIX = "fleet-bench", "debuginfod"
BUILDIDD = [PY, "-m", "buildidd.cli"]
PROG = """#include <stdio.h>
#include <unistd.h>
static char pad[%d] = {1};
__attribute__((noinline)) int bidd_goal_%s(int x) { return x * 7 + pad[x & 1]; }
int main(int argc, char **argv) { printf("%%d %%p\\n", getpid(), (void *)bidd_goal_%s); fflush(stdout);
                                  return bidd_goal_%s(argc) == 0; }
"""


def aws_env() -> dict:
    """The pusher's credentials through the standard AWS chain (environment), nothing else of the host's."""
    return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"}


def s3(endpoint: str):
    import boto3
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")


def listing(endpoint: str, prefix: str = PREFIX) -> dict[str, dict]:
    """Every object under prefix: key → the listing's entry (Size, ETag)."""
    out = {}
    for page in s3(endpoint).get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
        out.update({o["Key"]: o for o in page.get("Contents", [])})
    return out


def program(directory: Path, name: str, pad_bytes: int = 16) -> tuple[Path, str]:
    """gcc-built program ``name`` with pad_bytes of initialized data: (path, build-id)."""
    src = directory / f"{name}.c"
    src.write_text(PROG % (pad_bytes, name, name, name))
    out = directory / name
    subprocess.run(["gcc", "-O1", "-g", "-o", str(out), str(src)], check=True)
    note = subprocess.run(["readelf", "-n", str(out)], check=True, capture_output=True, text=True).stdout
    return out, note.split("Build ID:")[1].split()[0]


class Poller:
    """Lists the bucket every interval_s in a thread: the first time (monotonic s) each key was seen."""

    def __init__(self, endpoint: str, interval_s: float = 0.25):
        self.endpoint, self.seen, self._stop = endpoint, {}, threading.Event()
        self._t = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._t.start()

    def _run(self, interval_s: float) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                for key in listing(self.endpoint):
                    self.seen.setdefault(key, now)
            except Exception:                    # the bucket is down: try again
                pass
            self._stop.wait(interval_s)

    def stop(self) -> None:
        self._stop.set()
        self._t.join()


class SlowProxy:
    """A TCP proxy on loopback to 127.0.0.1:port that delays each chunk by delay_s and limits each
    direction of each connection to rate bytes/s: a slow bucket.  With delay_s 0 and rate inf: a
    counter of the bytes clients sent (``sent``: what went over the wire, requests that lost a
    conditional PUT included)."""

    def __init__(self, port: int, delay_s: float = 0.2, rate: float = 1 << 20):
        self.upstream, self.delay_s, self.rate = port, delay_s, rate
        self.sent = 0                             # bytes from clients to the server (requests: uploads)
        self._lock = threading.Lock()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return                            # closed
            try:
                up = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:
                client.close()                    # the server is down: so is the proxy's connection
                continue
            for a, b, up_dir in ((client, up, True), (up, client, False)):
                threading.Thread(target=self._pump, args=(a, b, up_dir), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, up_dir: bool) -> None:
        try:
            while data := src.recv(64 << 10):
                if self.delay_s or self.rate != float("inf"):
                    time.sleep(self.delay_s + len(data) / self.rate)
                dst.sendall(data)
                if up_dir:
                    with self._lock:
                        self.sent += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.server.close()


class Host:
    """One host: ``buildidd run`` (its own store and session root) and ``buildidd push --service`` as host name."""

    def __init__(self, base: Path, name: str, endpoint: str, prefix: str = PREFIX, retry_max_s: float = 300.0,
                 segment_age: str = "5s", seed: Path | None = None):
        base.mkdir(parents=True, exist_ok=True)
        self.base, self.name, self.prefix = base, name, prefix
        self.store, self.state = base / "store", base / "state"
        if seed is not None:                      # a host made from the fleet's image: its store to start with
            # hard links: store files never change once published (a new copy is a new file renamed in)
            subprocess.run(["cp", "-al", str(seed), str(self.store)], check=True)
        self.daemon = Buildidd(base, store=self.store, compress=True,
                               extra=["--segment-max-bytes", "1M", "--segment-max-age", segment_age])
        self.conf = base / "push.toml"
        keys = {"store_root": self.store, "session_root": self.daemon.root, "push_bucket": BUCKET,
                "push_endpoint_url": endpoint, "push_prefix": prefix, "push_host": name, "push_state_dir": self.state,
                "push_retry_max_s": f"{retry_max_s}s", "push_timeout_s": "10s", "push_untrusted": "skip"}
        self.conf.write_text("".join(f'{k} = "{v}"\n' for k, v in keys.items()))
        self.push = None
        self.start_push()

    def start_push(self) -> None:
        with open(self.base / "push.log", "a") as log:
            self.push = subprocess.Popen([*BUILDIDD, "push", "--service", "--config", str(self.conf)],
                                         env={**os.environ, **aws_env()}, stdout=log, stderr=log)

    def status(self) -> dict:
        try:
            return json.loads((self.state / "status.json").read_text())
        except (OSError, ValueError):
            return {}

    def drained(self, since_ns: int = 0) -> bool:
        """The last pass (one started after since_ns, ns since the epoch) left nothing (binaries, segments,
        sessions) and did not fail."""
        st = self.status()
        last, backlog = st.get("last_pass") or {}, st.get("backlog") or {}
        return (bool(backlog) and not last.get("error") and not any(backlog.values())
                and last.get("started_wall_ns", 0) > since_ns)

    def stop(self) -> None:
        """The daemon (its session closes), then the push service once a pass begun after that pushed
        the closed session."""
        if self.daemon.proc.poll() is None:
            self.daemon.stop(read=False)
        stopped_ns = time.time_ns()
        wait_for(lambda: self.drained(stopped_ns), 120)
        self.stop_push()

    def stop_push(self) -> None:
        if self.push is not None and self.push.poll() is None:
            self.push.send_signal(signal.SIGTERM)
            self.push.wait(timeout=90)

    def kill(self) -> None:
        self.daemon.kill_if_running()
        if self.push is not None and self.push.poll() is None:
            self.push.kill()
            self.push.wait()


def wait_for(pred, timeout_s: float, interval_s: float = 0.25) -> float | None:
    """Seconds until pred() held, or None after timeout_s."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if pred():
            return time.monotonic() - t0
        time.sleep(interval_s)
    return None


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (nearest rank) of values; None for none."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, -(-len(s) * q // 100) - 1))]


def run_programs(progs: list[tuple[Path, str]]) -> dict[str, float]:
    """Run each program once: build-id → monotonic time (s) of its first exec."""
    out = {}
    for path, bid in progs:
        out[bid] = time.monotonic()
        subprocess.run([str(path)], check=True, stdout=subprocess.DEVNULL)
    return out


def latency(poller: Poller, t_exec: dict[str, float], timeout_s: float = 120.0) -> dict:
    """Seconds from each program's first exec to its canonical executable in the bucket (p50, p99, max)."""
    keys = {bid: f"{PREFIX}/buildid/{bid}/executable" for bid in t_exec}
    wait_for(lambda: all(k in poller.seen for k in keys.values()), timeout_s)
    lat = [poller.seen[k] - t_exec[b] for b, k in keys.items() if k in poller.seen]
    return {"programs": len(keys), "in_bucket": len(lat), "p50_s": percentile(lat, 50), "p99_s": percentile(lat, 99),
            "max_s": max(lat, default=None)}


def closed_segments(host: Host, before_ns: int) -> dict[str, int]:
    """Bucket key → size of each compressed (closed) segment of host modified before before_ns."""
    out = {}
    for seg in Path(host.daemon.root).glob("*/segment-*.zst"):
        st = seg.stat()
        if st.st_mtime_ns < before_ns:
            out[f"{host.prefix}/sessions/{host.name}/{seg.parent.name}/{seg.name}"] = st.st_size
    return out


def outage(weed: Weed, hosts: list[Host], sysdir: Path, seconds: float, every_s: float = 2.0,
           drain_timeout_s: float = 900.0) -> dict:
    """The bucket stopped for seconds while new programs run (one every every_s) and segments close;
    then restarted: seconds until every host's backlog drained, and what is missing from the bucket."""
    wait_for(lambda: all(h.drained() for h in hosts), 120)
    weed.stop()
    t0, progs = time.monotonic(), []
    while time.monotonic() - t0 < seconds:
        progs.append(program(sysdir, f"outage{len(progs)}"))
        run_programs(progs[-1:])
        time.sleep(max(0.0, every_s - (time.monotonic() - t0) % every_s))
    backlog = {h.name: (h.status().get("backlog") or {}) for h in hosts}
    oldest = max((h.status().get("oldest_unpushed_age_s") or 0) for h in hosts)
    weed.start()
    drain_s = wait_for(lambda: all(h.drained() for h in hosts), drain_timeout_s)
    # what to find in the bucket: the segments closed (compressed, renamed in) well before a pass that
    # began after the drain and drained too (a .zst's mtime is its last write, just before its rename)
    checked_ns = time.time_ns()
    wait_for(lambda: all(h.drained(checked_ns) for h in hosts), 60)
    held = listing(weed.endpoint)
    missing = [bid for _p, bid in progs if f"{PREFIX}/buildid/{bid}/executable" not in held]
    segs = {}
    for h in hosts:
        segs.update(closed_segments(h, checked_ns - 2_000_000_000))
    lost = [k for k, size in segs.items() if k not in held or held[k]["Size"] != size]
    return {"outage_s": round(time.monotonic() - t0 - (drain_s or 0), 1), "programs": len(progs),
            "backlog_at_end": backlog, "oldest_unpushed_age_s": oldest, "drain_s": drain_s,
            "programs_missing": missing, "segments": len(segs), "segments_lost": lost}


def fetch_all(endpoint: str, bids: list[str], cache: Path) -> dict[str, bool]:
    """debuginfod-find executable for each build-id with DEBUGINFOD_URLS at the bucket's HTTP front."""
    env = {**os.environ, "DEBUGINFOD_URLS": f"{endpoint}/{BUCKET}/{PREFIX}", "DEBUGINFOD_CACHE_PATH": str(cache),
           "DEBUGINFOD_TIMEOUT": "30"}

    def one(bid: str) -> bool:
        return subprocess.run(["debuginfod-find", "executable", bid], env=env, capture_output=True,
                              timeout=120).returncode == 0
    with ThreadPoolExecutor(4) as pool:
        return dict(zip(bids, pool.map(one, bids)))


def gdb_reads_bucket(endpoint: str, probe: Path, name: str, tmp: Path) -> bool:
    """gdb on a stripped copy of probe (same build-id) finds its line table through DEBUGINFOD_URLS."""
    stripped = tmp / "stripped-probe"
    subprocess.run(["strip", "-s", "-o", str(stripped), str(probe)], check=True)
    env = {**os.environ, "DEBUGINFOD_URLS": f"{endpoint}/{BUCKET}/{PREFIX}", "DEBUGINFOD_CACHE_PATH": str(tmp / "gdb-cache")}
    r = subprocess.run(["gdb", "-batch", "-nx", "-iex", "set debuginfod enabled on", "-ex", f"info line bidd_goal_{name}",
                        str(stripped)], env=env, capture_output=True, text=True, timeout=120)
    return f'of "{probe}.c"' in r.stdout or f"{name}.c" in r.stdout


def analyst(endpoint: str, host: str, session: str, tmp: Path, perf_data: Path, pid: str, addr: str, name: str) -> dict:
    """fleet pull host/session into tmp's analyst roots, then inject perf_data and resolve pid addr on it."""
    empty = tmp / "empty.toml"
    empty.write_text("")
    roots = ["--session-root", str(tmp / "a-sessions"), "--store-root", "", "--debug-dir", str(tmp / "a-debug"),
             "--config", str(empty)]
    env = {**os.environ, **aws_env()}
    pull = subprocess.run([*BUILDIDD, "fleet", "pull", f"{host}/{session}", "--bucket", BUCKET, "--endpoint-url",
                           endpoint, "--prefix", PREFIX, "--json", *roots], env=env, capture_output=True, text=True)
    out = {"pull_rc": pull.returncode, "pull_error": pull.stderr[-500:] if pull.returncode else ""}
    if pull.returncode == 0:
        got = json.loads(pull.stdout)
        out.update(installed=len(got["installed"]), missing=len(got["missing"]))
    inj = subprocess.run([*BUILDIDD, "inject", str(perf_data), session, "-o", str(tmp / "injected.data"), "--json",
                          *roots], capture_output=True, text=True)
    out["inject_matched"] = json.loads(inj.stdout).get("matched", 0) if inj.returncode == 0 else inj.stderr[-300:]
    res = subprocess.run([*BUILDIDD, "resolve", session, pid, addr, "--symbolize", *roots],
                         capture_output=True, text=True)
    out["resolve_ok"] = res.returncode == 0 and f"bidd_goal_{name}+0x0" in res.stdout
    out["resolve_out"] = (res.stdout + res.stderr)[-300:]
    return out


def gone(weed: Weed, host: Host, tmp: Path, probe: dict) -> dict:
    """host stops, then disappears; what of its pushed session can be had from the bucket alone."""
    from buildidd.sessionlog import read_session
    host.stop()
    host.final_status = host.status()
    (sdir,) = [d for d in Path(host.daemon.root).iterdir() if d.is_dir()]
    named = {r["build_id"] for r in read_session(sdir) if r.get("build_id")}
    for d in (host.store, Path(host.daemon.root), host.state):
        shutil.rmtree(d, ignore_errors=True)
    body = s3(weed.endpoint).get_object(Bucket=BUCKET, Key=f"{PREFIX}/sessions/{host.name}/{sdir.name}/manifest.json")
    listed = {r["build_id"]: r for r in json.loads(body["Body"].read())["build_ids"]}
    excluded = {b for b, r in listed.items() if r.get("reason") == "private" or r.get("provenance") == "untrusted"}
    # named by the session, but its store never held them (the manifest says so: not_in_store): nothing was
    # there to push; counted apart, and asked for all the same (they must not be in the bucket by accident)
    never = {b for b, r in listed.items() if r.get("reason") == "not_in_store"} & named
    want = sorted(named - excluded - never)
    fetched = fetch_all(weed.endpoint, want + sorted(never), tmp / "client-cache")
    failed = [b for b in want if not fetched[b]]
    return {"named": len(named), "excluded_private_untrusted": len(named & excluded), "wanted": len(want),
            "fetched": len(want) - len(failed), "fetched_pct": 100.0 * (len(want) - len(failed)) / max(1, len(want)),
            "never_held": len(never), "never_held_in_bucket": sum(fetched[b] for b in never),
            "not_fetched": {b: listed.get(b, {}).get("reason", "not in manifest") for b in failed},
            "gdb_ok": gdb_reads_bucket(weed.endpoint, probe["path"], probe["name"], tmp),
            **analyst(weed.endpoint, host.name, sdir.name, tmp, probe["perf_data"], probe["pid"], probe["addr"],
                      probe["name"])}


def unique_bytes(objs: dict[str, dict], before: set[str]) -> int:
    """Bytes of the objects of a listing not in before, those with the same ETag and size once."""
    return sum(size for _etag, size in {(o["ETag"], o["Size"]) for k, o in objs.items() if k not in before})


def dedup(endpoint: str, statuses: list[dict], before: set[str]) -> dict:
    """Bytes the push services sent / unique bytes they added to the bucket (objects with one ETag and
    size once; those of the keys in before, the seed's, left out)."""
    sent = sum((st.get("totals") or {}).get("sent_bytes", 0) for st in statuses)
    objs = listing(endpoint)
    unique = unique_bytes(objs, before)
    return {"sent_bytes": sent, "unique_bytes": unique, "objects": len(objs), "ratio": sent / unique if unique else None,
            "objects_added": len(set(objs) - before), "per_host_sent": [(st.get("totals") or {}).get("sent_bytes", 0) for st in statuses]}


def probe_run(sysdir: Path, tmp: Path) -> dict:
    """A program run under perf record (the profile the analyst later injects): its pid and function address."""
    path, bid = program(sysdir, "probe")
    data = tmp / "probe.perf.data"
    with perf_record_lock():
        r = subprocess.run(["perf", "record", "-q", "-e", "cpu-clock", "-o", str(data), "--", str(path)],
                           capture_output=True, text=True)
    r.check_returncode()
    pid, addr = r.stdout.split()[:2]
    return {"path": path, "bid": bid, "name": "probe", "perf_data": data, "pid": pid, "addr": addr}


def seed_store(weed: Weed, work: Path) -> tuple[Path, dict]:
    """The fleet's image: the machine's running binaries snapshotted once (benchlib.warm_store) and pushed
    once by a one-shot ``buildidd push`` as host ``seed``; each host starts with a copy of this store, so
    what the run measures is what the hosts add.  (store, the seed push's status)."""
    from benchlib import warm_store
    store = warm_store(work)
    state = work / "seed-state"
    conf = work / "seed-push.toml"
    conf.write_text(f'store_root = "{store}"\npush_bucket = "{BUCKET}"\npush_endpoint_url = "{weed.endpoint}"\n'
                    f'push_prefix = "{PREFIX}"\npush_host = "seed"\npush_state_dir = "{state}"\nsession_root = ""\n')
    t = time.monotonic()
    subprocess.run([*BUILDIDD, "push", "--config", str(conf)], env={**os.environ, **aws_env()}, check=True,
                   stdout=subprocess.DEVNULL)
    status = json.loads((state / "status.json").read_text())
    print(f"  seed pushed: {(status.get('totals') or {}).get('sent_bytes', 0) / 2**20:.1f} MiB in "
          f"{time.monotonic() - t:.1f} s", flush=True)
    return store, status


def fleet(weed: Weed, work: Path, n_hosts: int, n_progs: int, big_mb: int, outage_s: float,
          retry_max_s: float = 300.0, seeded: bool = True) -> dict:
    """Hosts (from one seeded image, or with cold stores), programs (small ones, one of big_mb MiB, an
    untrusted one, a private one), latency, outage, the last host gone, dedup."""
    sysdir = system_dir()
    hosts: list[Host] = []
    made: list[Path] = []
    work.mkdir(parents=True, exist_ok=True)
    clock = [time.monotonic()]
    phases: dict[str, float] = {}

    def phase(name: str) -> None:            # seconds since the previous phase ended
        now = time.monotonic()
        phases[name] = round(now - clock[0], 2)
        clock[0] = now

    seed = seed_store(weed, work)[0] if seeded else None
    seed_keys = set(listing(weed.endpoint))
    phase("seed")
    poller = Poller(weed.endpoint)
    wire = SlowProxy(int(weed.endpoint.rsplit(":", 1)[1]), delay_s=0.0, rate=float("inf"))
    try:
        hosts = [Host(work / f"host-{i + 1}", f"host-{i + 1}", f"http://127.0.0.1:{wire.port}",
                      retry_max_s=retry_max_s, seed=seed) for i in range(n_hosts)]
        start_s = wait_for(lambda: all(h.drained() for h in hosts), 300)   # what ran before: each store's start
        phase("hosts_up")
        progs = [program(sysdir, f"p{i}") for i in range(n_progs)] + [program(sysdir, "big", big_mb << 20)]
        public = Path(tempfile.mkdtemp(prefix="buildidd-fleet-pub-", dir="/tmp"))
        os.chmod(public, 0o755)
        private = Path(tempfile.mkdtemp(prefix="buildidd-fleet-priv-", dir="/tmp"))
        made += [public, private]
        others = [program(public, "untrusted"), program(private, "private")]
        w0, before = wire.sent, listing(weed.endpoint)
        t_exec = run_programs(progs)
        run_programs(others)
        probe = probe_run(sysdir, work)
        phase("programs")
        lat = latency(poller, t_exec)
        phase("latency")
        passes = {h.name: (h.status().get("last_pass") or {}).get("duration_s") for h in hosts}
        wait_for(lambda: all(h.drained() for h in hosts), 300)
        steady = {"wire_bytes": wire.sent - w0, "program_bytes": sum(p.stat().st_size for p, _b in progs),
                  "unique_bytes": unique_bytes(listing(weed.endpoint), set(before))}
        phase("steady_drained")
        out = outage(weed, hosts, sysdir, outage_s) if outage_s > 0 else None
        phase("outage")
        for h in hosts[:-1]:
            h.stop()
        statuses = [h.status() for h in hosts[:-1]]
        phase("hosts_stopped")
        last = hosts[-1]
        g = gone(weed, last, work, probe)
        statuses.append(last.final_status)
        phase("gone")
        return {"latency": lat, "passes": passes, "outage": out, "gone": g, "seeded": seeded, "start_s": start_s,
                "phases_s": phases,
                "dedup": {**dedup(weed.endpoint, statuses, seed_keys), "wire_bytes": wire.sent, "steady": steady}}
    finally:
        wire.close()
        poller.stop()
        for h in hosts:
            h.kill()
        for d in (sysdir, *made):
            shutil.rmtree(d, ignore_errors=True)
        if seed is not None:
            remove_tree(seed)


def attached(mode: str, weed: Weed, proxy: SlowProxy, workdir: Path, store: Path, workload: list[str], tag: str) -> dict:
    """One exec storm with a daemon on store and, unless mode is "off", a push service of store to a new
    prefix (so it has the whole store to push meanwhile) with the bucket reachable, slow or down."""
    d = Buildidd(workdir, store=store, compress=True)
    push = None
    try:
        if mode != "off":
            state = Path(tempfile.mkdtemp(prefix="push-state-", dir=workdir))
            endpoint = f"http://127.0.0.1:{proxy.port}" if mode == "slow" else weed.endpoint
            conf = state / "push.toml"
            conf.write_text(f'store_root = "{store}"\nsession_root = "{d.root}"\npush_bucket = "{BUCKET}"\n'
                            f'push_endpoint_url = "{endpoint}"\npush_prefix = "rec-{tag}"\npush_host = "rec"\n'
                            f'push_state_dir = "{state}"\npush_interval_s = "1s"\n')
            push = subprocess.Popen([*BUILDIDD, "push", "--service", "--config", str(conf)],
                                    env={**os.environ, **aws_env()}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)                       # the first pass under way
        time.sleep(SETTLE_S)
        c0, t = d.cpu_s(), time.monotonic()
        subprocess.run(workload, check=True, stdout=subprocess.DEVNULL)
        wall = time.monotonic() - t
        time.sleep(0.2)
        cpu = d.cpu_s() - c0
        records = d.stop()
        n = len(mapping_records(records))
        return {"wall_s": wall, "cpu_us_per_event": cpu * 1e6 / n if n else None, "events": n,
                "losses": lost_count(records)}
    finally:
        if push is not None:
            push.kill()
            push.wait()
        d.kill_if_running()
        d.cleanup()


def recording(weed: Weed, workdir: Path, reps: int, exec_n: int) -> dict:
    """Paired per repetition against "off": median ratios of workload time and daemon CPU per event."""
    from benchlib import warm_store
    w = workloads.build(workdir / "bin", n_libs=1)
    workload = [str(w["storm"]), str(exec_n), str(w["child"])]
    store = warm_store(workdir)
    proxy = SlowProxy(int(weed.endpoint.rsplit(":", 1)[1]))
    modes = ["off", "reachable", "slow", "down"]
    runs: list[dict] = []
    try:
        for i in range(reps):
            row = {}
            for mode in modes[i % 4:] + modes[:i % 4]:
                if mode == "down":
                    weed.stop()
                try:
                    row[mode] = attached(mode, weed, proxy, workdir, store, workload, f"{i}-{mode}")
                finally:
                    if mode == "down":
                        weed.start()
            runs.append(row)
            print(f"  recording rep {i + 1}/{reps}: " + " ".join(f"{m} {row[m]['wall_s']:.3f}s" for m in modes),
                  flush=True)
    finally:
        proxy.close()
    out = {}
    for m in modes[1:]:
        wall = [r[m]["wall_s"] / r["off"]["wall_s"] for r in runs]
        cpu = [r[m]["cpu_us_per_event"] / r["off"]["cpu_us_per_event"] for r in runs
               if r[m]["cpu_us_per_event"] and r["off"]["cpu_us_per_event"]]
        out[m] = {"wall_ratio": statistics.median(wall), "wall_ratios": wall,
                  "cpu_ratio": statistics.median(cpu) if cpu else None,
                  "losses": sum(r[m]["losses"] for r in runs)}
    out["off"] = {"wall_s": statistics.median(r["off"]["wall_s"] for r in runs),
                  "losses": sum(r["off"]["losses"] for r in runs)}
    return out


def fmt(res: dict) -> list[str]:
    """The goal lines."""
    lines = []
    lat, g, d, o, rec = res.get("latency"), res.get("gone"), res.get("dedup"), res.get("outage"), res.get("recording")
    if lat:
        lines.append(f"  exec → bucket: {lat['in_bucket']}/{lat['programs']} programs, p50 {lat['p50_s']:.2f} s, "
                     f"p99 {lat['p99_s']:.2f} s, max {lat['max_s']:.2f} s (goal p99 ≤ 10 s)")
    if g:
        lines.append(f"  host gone: {g['fetched']}/{g['wanted']} build-ids fetched ({g['fetched_pct']:.1f}%, goal 100%; "
                     f"{g['excluded_private_untrusted']} private/untrusted excepted; {g['never_held']} named that its "
                     f"store never held, manifest reason not_in_store, {g['never_held_in_bucket']} of them in the "
                     f"bucket from other hosts); gdb {'ok' if g['gdb_ok'] else 'FAILED'}; "
                     f"pull rc {g['pull_rc']} ({g.get('installed')} installed); inject matched {g['inject_matched']}; "
                     f"resolve {'ok' if g['resolve_ok'] else 'FAILED'}")
        if g["not_fetched"]:
            lines.append(f"    not fetched, by the manifest's reason: {sorted(g['not_fetched'].values())}")
    if d:
        lines.append(f"  uploaded / unique: {d['wire_bytes'] / 2**20:.1f} / {d['unique_bytes'] / 2**20:.1f} MiB = "
                     f"{d['wire_bytes'] / d['unique_bytes']:.3f} on the wire (goal ≤ 1.05); the push services' own "
                     f"count {d['ratio']:.3f} (per host {[round(x / 2**20, 1) for x in d['per_host_sent']]} MiB)")
        st = d["steady"]
        lines.append(f"    while the programs ran (all hosts up): {st['wire_bytes'] / 2**20:.1f} MiB on the wire / "
                     f"{st['unique_bytes'] / 2**20:.1f} MiB added = {st['wire_bytes'] / st['unique_bytes']:.3f} "
                     f"({st['program_bytes'] / 2**20:.1f} MiB of programs; the machine's other new binaries and "
                     "the sessions' segments in it too)")
    if o:
        lines.append(f"  outage {o['outage_s']:.0f} s: {o['programs']} programs, {o['segments']} segments; drained in "
                     f"{o['drain_s'] if o['drain_s'] is None else round(o['drain_s'], 1)} s; lost "
                     f"{len(o['programs_missing'])} programs, {len(o['segments_lost'])} segments")
    if rec:
        lines.append(f"  recording (exec storm, off {rec['off']['wall_s']:.3f} s): "
                     + "; ".join(f"{m} ×{rec[m]['wall_ratio']:.3f} time, ×{rec[m]['cpu_ratio'] or 0:.3f} CPU/ev, "
                                 f"lost {rec[m]['losses']}" for m in ("reachable", "slow", "down")))
    if res.get("phases_s"):
        lines.append("  the run's phases, s: " + ", ".join(f"{k} {v:g}" for k, v in res["phases_s"].items()))
    return lines


def run(args) -> dict:
    """The whole scenario with args' sizes (hosts, programs, big_mb, outage_s, reps, exec_n); prints and returns."""
    work = Path(tempfile.mkdtemp(prefix="buildidd-bench-fleet-"))
    os.environ.update(aws_env())
    weed = Weed(work / "weed-data", work / "weed.log")
    weed.data_dir.mkdir()
    weed.start()
    try:
        s3(weed.endpoint).create_bucket(Bucket=BUCKET)
        res = fleet(weed, work / "fleet", args.hosts, args.programs, args.big_mb, args.outage_s,
                    retry_max_s=args.retry_max_s, seeded=not args.cold_stores)
        if args.reps:
            res["recording"] = recording(weed, work, args.reps, args.exec_n)
        print("\nfleet goals (issue 44):\n" + "\n".join(fmt(res)), flush=True)
        return res
    finally:
        weed.stop()
        remove_tree(work)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument("--programs", type=int, default=40, help="small programs run once (and one of --big-mb)")
    ap.add_argument("--big-mb", type=int, default=100)
    ap.add_argument("--outage-s", type=float, default=600.0, help="bucket outage (0: none)")
    ap.add_argument("--reps", type=int, default=5, help="recording: repetitions (0: skip)")
    ap.add_argument("--exec-n", type=int, default=2000)
    ap.add_argument("--retry-max-s", type=float, default=300.0, help="the push services' push_retry_max_s")
    ap.add_argument("--cold-stores", action="store_true",
                    help="hosts start with empty stores (not the seeded image): each pushes the machine's running "
                         "binaries at the same moment (the claims' race)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: 3 hosts, 2 programs, 5 MiB, 3 s outage")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.smoke:
        args.programs, args.big_mb, args.outage_s, args.reps, args.retry_max_s = 2, 5, 3.0, 0, 4.0
    res = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

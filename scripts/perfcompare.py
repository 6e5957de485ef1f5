"""The yardstick: run ``perf record -e dummy -a --buildid-mmap`` and compare sessions with it.

With ``--buildid-mmap`` the kernel puts the build-id it read at mmap time into
each PERF_RECORD_MMAP2 (kernel/events/core.c perf_event_mmap_event, lib/buildid.c).
It reads without faulting, so when the ELF header page is not in the page cache
the record carries dev/ino/generation instead; those are counted apart, never
as a failure of either side.  Used by the tests and by scripts/bench.

perf record now and then writes a record twice: perf_mmap__push (tools/perf/util/mmap.c)
reads the ring's data_head, then perf_mmap__read_init reads it again for the end of
what it copies, yet it sets prev (the next start) to the first value, so records the
kernel wrote between the two reads are copied again at the start of that CPU's next
chunk.  compare() drops such copies (same record, same ns timestamp).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

# comm pid [cpu] time: PERF_RECORD_MMAP2 pid/tid: [0xSTART(0xLEN) @ PGOFF <BUILDID>]: perms path
# or ... @ PGOFF MAJ:MIN INO GEN]: perms path
_MMAP2 = re.compile(
    r"^\s*(?P<comm>.*?)\s+(?P<spid>-?\d+)\s+\[\d+\]\s+(?P<time>[\d.]+):\s+PERF_RECORD_MMAP2\s+"
    r"(?P<pid>-?\d+)/(?P<tid>-?\d+):\s+\[0x(?P<start>[0-9a-f]+)\(0x(?P<len>[0-9a-f]+)\)\s+@\s+"
    r"(?P<pgoff>0x[0-9a-f]+|0)\s+(?:<(?P<bid>[0-9a-f]*)>|(?P<maj>[0-9a-f]+):(?P<min>[0-9a-f]+)\s+"
    r"(?P<ino>\d+)\s+(?P<gen>\d+))\]:\s+(?P<perms>\S+)\s+(?P<path>.*)$")


#: The host's lock for perf record sessions (flock(2)), taken around every perf record the bench and
#: the tests start (see perf_record_lock): root's in /run, where no other user can make the file first.
PERF_RECORD_LOCK = Path("/run/buildidd-perf-record.lock") if os.geteuid() == 0 else \
    Path(f"/tmp/buildidd-perf-record-{os.geteuid()}.lock")
#: Threads (idents) holding the lock in this process.
_holders: set[int] = set()


@contextlib.contextmanager
def perf_record_lock(timeout_s: float = 900.0, path: Path = PERF_RECORD_LOCK) -> Iterator[None]:
    """Hold the host's perf record lock for the body: one perf record session at a time among the bench
    and the tests on this host.

    Why: while one session records with --buildid-mmap, the kernel gives other sessions' MMAP2 records
    the build-id flag over their maj/min/ino (kernel/events/core.c perf_event_mmap_output sets
    PERF_RECORD_MISC_MMAP_BUILD_ID in the mmap event every perf event shares and does not restore it;
    see buildidd.offline.inject.flag_without_build_id), and perf 6.1 then aborts reading them
    (util/build-id.c build_id__init: a "build-id" of 254 bytes, the disk's major, copied into 20).

    Raises:
        RuntimeError: this thread holds it already (a second flock of the file would wait for itself).
        TimeoutError: another holder kept it for timeout_s seconds.
    """
    me = threading.get_ident()
    if me in _holders:
        raise RuntimeError("perf_record_lock is held by this thread already: do not nest it")
    fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{path}: held by another perf record for {timeout_s:.0f} s") from None
                time.sleep(0.1)
        _holders.add(me)
        try:
            yield
        finally:
            _holders.discard(me)
    finally:
        os.close(fd)     # releases the lock


def other_tracers(ignore_descendants_of: int | None = None) -> list[str]:
    """Tracers already running on this host: ``perf record`` and ``buildidd run``/``record`` processes,
    this process left out, and with ignore_descendants_of the processes that pid started.

    Every mapping of every process reaches each of them, so a benchmark run
    beside a forgotten one measures the sum (a stray ``perf record -a
    --buildid-mmap`` left by a crashed run made buildidd/perf ratios of 1.2
    out of 1.0 here).  Returns one "pid: command line" per process found.
    """
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:   # gone meanwhile
            continue
        words = [a.decode(errors="replace") for a in argv if a]
        prog = os.path.basename(words[0]) if words else ""
        perf = prog == "perf" and "record" in words[1:3]
        ours = any(w.endswith("buildidd.cli") or os.path.basename(w) == "buildidd" for w in words[:3]) \
            and any(w in ("run", "record") for w in words[1:5])
        if (perf or ours) and not (ignore_descendants_of is not None
                                   and _descends_from(int(d.name), ignore_descendants_of)):
            found.append(f"{d.name}: {' '.join(words)[:200]}")
    return found


def _descends_from(pid: int, ancestor: int) -> bool:
    """Whether ancestor started pid (its parent, or its parent's, ...; /proc/PID/stat's ppid)."""
    for _ in range(64):
        try:
            stat = Path(f"/proc/{pid}/stat").read_bytes()
            pid = int(stat[stat.rindex(b")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
    return False


class TracerWatch:
    """The other tracers (other_tracers) seen on this host while the block runs, this process's own
    children left out: looked for every interval_s seconds by a thread.  ``seen``: "pid: command" lines."""

    def __init__(self, interval_s: float = 0.5):
        self.interval_s = interval_s
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tracer-watch", daemon=True)

    def start(self) -> TracerWatch:
        """Start watching; returns self."""
        self._thread.start()
        return self

    def stop(self) -> set[str]:
        """Stop watching (once; again: nothing more) and return what was seen."""
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join()
            self.seen.update(other_tracers(os.getpid()))
        return self.seen

    def __enter__(self) -> TracerWatch:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _watch(self) -> None:
        while True:
            self.seen.update(other_tracers(os.getpid()))
            if self._stop.wait(self.interval_s):
                return


def require_quiet_host(what: str) -> None:
    """Exit (status 2) with a message when :func:`other_tracers` finds any: their cost would be measured too."""
    others = other_tracers()
    if others:
        raise SystemExit(f"{what}: other tracers are running; stop them first, their cost would be measured "
                         "too:\n  " + "\n  ".join(others))


@dataclass(frozen=True)
class PerfMmap:
    """One PERF_RECORD_MMAP2 as `perf script --show-mmap-events` prints it.

    Attributes:
        comm, pid, tid; time_s: perf's timestamp (s, 0.0 for synthesized records);
        start, length, pgoff: bytes; build_id: hex or None (then dev/ino were sent);
        perms: e.g. "r-xp"; path: the file; synthesized: made by perf from /proc at start.
    """

    comm: str
    pid: int
    tid: int
    time_s: float
    start: int
    length: int
    pgoff: int
    build_id: str | None
    perms: str
    path: str

    @property
    def synthesized(self) -> bool:
        """True for records perf made from /proc at start (timestamp 0)."""
        return self.time_s == 0.0


def parse_perf_script(text: str) -> list[PerfMmap]:
    """Every executable file MMAP2 in `perf script --show-mmap-events` output."""
    out = []
    for line in text.splitlines():
        if "PERF_RECORD_MMAP2" not in line:
            continue
        m = _MMAP2.match(line)
        if not m or "x" not in m["perms"] or not m["path"].startswith("/"):
            continue
        out.append(PerfMmap(m["comm"], int(m["pid"]), int(m["tid"]), float(m["time"]),
                            int(m["start"], 16), int(m["len"], 16), int(m["pgoff"], 16),
                            m["bid"] or None, m["perms"], m["path"]))
    return out


#: PerfRecorders started and not finished (see finish_all); strong references: one dropped unfinished
#: would leave perf running and the lock held.
_RUNNING: set = set()


def finish_all() -> int:
    """Finish every PerfRecorder of this process still running (a test that failed before its stop):
    perf stopped and the host's perf record lock released.  Returns how many there were."""
    left = list(_RUNNING)
    for perf in left:
        perf.finish()
    return len(left)


class PerfRecorder:
    """A running ``perf record -e dummy -a --buildid-mmap``, started like a daemon.

    Args:
        output: the perf.data path to write.
        extra: more perf record options.
        base: the event and mode options (default the yardstick's: dummy, -a, --buildid-mmap).
        perf: the perf command and its global options (e.g. ``("perf", "--buildid-dir", DIR)``).
    Holds perf_record_lock from start to finish() (waiting for it before perf starts).
    Raises:
        RuntimeError: perf is missing or did not start.
        TimeoutError: the host's perf record lock stayed taken (perf_record_lock).
    """

    def __init__(self, output: str | os.PathLike, *, extra: Iterable[str] = (),
                 base: Iterable[str] = ("-e", "dummy", "-a", "--buildid-mmap"), perf: Iterable[str] = ("perf",)):
        self.output = Path(output)
        self.output.unlink(missing_ok=True)
        self._lock = contextlib.ExitStack()
        self._lock.enter_context(perf_record_lock())
        try:
            self._start(perf, base, extra)
            _RUNNING.add(self)
        except BaseException:
            if getattr(self, "proc", None) is not None and self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._lock.close()
            raise

    def _start(self, perf: Iterable[str], base: Iterable[str], extra: Iterable[str]) -> None:
        t0 = time.monotonic()
        self.proc = subprocess.Popen([*perf, "record", *base, "-q", "-o", str(self.output), *extra],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        # READY when perf waits for data: builtin-record.c __cmd_record opens the events,
        # synthesizes running processes, enables the events, then loops on poll(2);
        # its main thread blocked in poll/ppoll (/proc/PID/syscall: 7, 271 on x86_64)
        # is recording (a marker exec right after was in its output 8 times of 8).
        deadline = t0 + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"perf record exited: {self.proc.stderr.read().decode()[-500:]}")
            try:
                with open(f"/proc/{self.proc.pid}/syscall") as f:
                    nr = f.read(64).split(" ", 1)[0]
            except OSError:
                nr = ""
            if nr in ("7", "271"):
                #: seconds from starting perf to its waiting state.
                self.ready_s = time.monotonic() - t0
                return
            time.sleep(0.002)
        raise RuntimeError("perf record did not start within 20 s")

    def pid(self) -> int:
        """perf record's pid."""
        return self.proc.pid

    def finish(self) -> None:
        """SIGINT perf, wait until it has written the file (killed after 60 s), and release the lock.
        Once perf has exited (reaped by the caller, its returncode set), only releases the lock."""
        try:
            if self.proc.returncode is None:
                self.proc.send_signal(signal.SIGINT)
                try:
                    self.proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        finally:
            _RUNNING.discard(self)
            self._lock.close()

    def stop(self) -> list[PerfMmap]:
        """SIGINT perf, wait for it, and return its executable MMAP2 records."""
        self.finish()
        # --ns: a timestamp per record to the nanosecond, which compare() needs to tell
        # perf's duplicated records from distinct mappings made within one microsecond.
        r = subprocess.run(["perf", "script", "-i", str(self.output), "--show-mmap-events", "--ns"],
                           capture_output=True, text=True, errors="replace")
        return parse_perf_script(r.stdout)


@dataclass
class Comparison:
    """How a session's mmap records cover perf's, place by place.

    A perf MMAP2 and a session record are at the same place when pid and start
    agree; they match when len, pgoff, path and build-id agree too.

    Attributes:
        perf_with_build_id: perf MMAP2 records considered that carry a build-id.
        matched: ... for which the session has a record with the same len,
            pgoff, path and build-id (and none with another build-id there).
        wrong: ... where a session record at that place has another build-id
            (even beside a matching one; must be 0).
        path_differs: ... where the build-id agrees but the path does not
            (" (deleted)" set apart on both sides).
        extent_differs: ... where the build-id and path agree but len or pgoff do not.
        missing: ... with no session record at that pid and address.
        no_build_id: ... with a session record that has no build-id (reason in examples).
        perf_without_build_id: perf's own misses: records that carried dev/ino
            instead of a build-id (the page was not cached).
        perf_duplicates: perf records left out as copies of an earlier one (every
            field and the timestamp equal): perf record wrote them twice (see the module doc).
        resolved_where_perf_had_none: ... of which the session has a build-id:
            build-ids we have that perf does not.
        examples: a few mismatches, for the failure message.
    """

    perf_with_build_id: int = 0
    matched: int = 0
    wrong: int = 0
    path_differs: int = 0
    extent_differs: int = 0
    missing: int = 0
    no_build_id: int = 0
    perf_without_build_id: int = 0
    perf_duplicates: int = 0
    resolved_where_perf_had_none: int = 0
    examples: list = field(default_factory=list)

    @property
    def match_rate(self) -> float:
        """matched / perf_with_build_id (1.0 when perf saw none)."""
        return self.matched / self.perf_with_build_id if self.perf_with_build_id else 1.0

    def as_dict(self) -> dict:
        """The counters and match_rate, JSON-ready."""
        d = {k: v for k, v in self.__dict__.items() if k != "examples"}
        d["match_rate"] = round(self.match_rate, 6)
        return d

    def _example(self, *what) -> None:
        if len(self.examples) < 10:
            self.examples.append(what)


DELETED = " (deleted)"


def same_path(perf_path: str, ours: str) -> bool:
    """True when perf's path (d_path: " (deleted)" appended to an unlinked file) names ours."""
    return perf_path.removesuffix(DELETED) == ours.removesuffix(DELETED)


def compare(perf: list[PerfMmap], records: Iterable[dict], comms: set[str] | None = None,
            pids: set[int] | None = None) -> Comparison:
    """Compare perf's non-synthesized exec MMAP2 records with a session's mmap records.

    A place (pid, start) can be mapped again and again (dlopen, dlclose,
    dlopen of another library at the same address): at each place perf's
    records and the session's (synthesized ones left out) are paired in time
    order.  A perf record takes the session's next record at its place with
    its build-id; session records passed over on the way that carry another
    build-id make it wrong.  A perf record equal to an earlier one, timestamp
    included, is perf's own duplicate (module doc) and left out, counted in
    perf_duplicates; give perf script --ns so that timestamps are distinct.

    Args:
        perf: from PerfRecorder.stop() or parse_perf_script().
        records: the session's records (any types; mmap ones are used).
        comms, pids: consider only perf records of these comms / pids.
    """
    ours: dict[tuple[int, int], list[dict]] = {}
    for r in records:
        if r.get("type") == "mmap" and r.get("origin") != "synthesized":
            ours.setdefault((r["pid"], r["start"]), []).append(r)
    for rs in ours.values():
        rs.sort(key=lambda r: r["time_ns"])
    theirs: dict[tuple[int, int], list[PerfMmap]] = {}
    seen: set[PerfMmap] = set()
    c = Comparison()
    for p in perf:
        if p.synthesized or (comms is not None and p.comm not in comms) or (pids is not None and p.pid not in pids):
            continue
        if p in seen:
            c.perf_duplicates += 1
            continue
        seen.add(p)
        theirs.setdefault((p.pid, p.start), []).append(p)
    for place, ps in theirs.items():
        cands = ours.get(place, [])
        i = 0
        for p in sorted(ps, key=lambda p: p.time_s):
            i = _pair(c, p, cands, i)
    return c


def _pair(c: Comparison, p: PerfMmap, cands: list[dict], i: int) -> int:
    """Count perf record p against cands[i:] (the session's records at its place, in time order);
    returns the index of the first record left for the next perf record there."""
    if p.build_id is None:
        c.perf_without_build_id += 1
        if i < len(cands) and cands[i]["build_id"]:
            c.resolved_where_perf_had_none += 1
        return i + 1
    c.perf_with_build_id += 1
    j = next((k for k in range(i, len(cands)) if cands[k]["build_id"] == p.build_id), None)
    if j is None:
        if i >= len(cands):
            c.missing += 1
            c._example("missing", p)
        elif any(r["build_id"] for r in cands[i:]):
            c.wrong += 1
            c._example("wrong", p, next(r for r in cands[i:] if r["build_id"]))
        else:
            c.no_build_id += 1
            c._example("no_build_id", p, cands[i].get("error"))
        return i + 1
    other = [r for r in cands[i:j] if r["build_id"]]
    r = cands[j]
    if other:
        c.wrong += 1
        c._example("wrong", p, other[0])
    elif not same_path(p.path, r["path"]):
        c.path_differs += 1
        c._example("path_differs", p, r["path"])
    elif r["len"] != p.length or r["pgoff"] != p.pgoff:
        c.extent_differs += 1
        c._example("extent_differs", p, r)
    else:
        c.matched += 1
    return j + 1

"""One user's flood of fresh files costs that user's own hand-overs and copies, never root's or another's.

A real unprivileged user (the ``attacker`` fixture) maps thousands of fresh
ELF files, each with its own build-id, PROT_EXEC, and unlinks each (the flood
of issue 42); a second real user (``buildidd-test-bystander``) and root map
one file each.  Their mapping events go through the real Enricher (hand-over
pool, Routes.hand_over through /proc/PID/map_files) into a real Snapshotter
and Store, as the recorder wires them; only the BPF side is left out (the
events are built from /proc/PID/maps, with the build-id the kernel would read).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from buildidd.cli.ctl import _handover_refusals, _store_lines
from buildidd.kernel.events import EventType, MapOrigin, PcStatus, RawEvent
from buildidd.resolve.enrich import Enricher, Offload
from buildidd.resolve.procfs import identity_of
from buildidd.capture.wiring import submit_copy
from buildidd.resolve.filekeys import FileKeys
from buildidd.resolve.handover import HandOver, HandOverJob
from buildidd.resolve.handoverqueue import HandOverQueue
from buildidd.resolve.workers import PoolPolicy
from buildidd.store import CopyJob, SnapshotPolicy, Snapshotter, Store

from conftest import as_user_popen, gcc, readelf_build_id

#: Fresh files the attacker maps (each its own build-id).
FLOOD_FILES = 3000
#: The build-id the template is linked with; each copy gets its own in its place.
TEMPLATE_BID = "5a" * 20

#: Maps each path named in the file argv[1] (PROT_READ|PROT_EXEC, one page), unlinks it when
#: argv[2] == "unlink", prints "ready" and keeps the mappings until stdin closes.
MAPPER = r"""
import mmap, os, sys
maps = []
for path in open(sys.argv[1]).read().split():
    fd = os.open(path, os.O_RDONLY)
    maps.append(mmap.mmap(fd, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_EXEC, flags=mmap.MAP_PRIVATE))
    os.close(fd)
    if sys.argv[2] == "unlink":
        os.unlink(path)
print("ready", flush=True)
sys.stdin.read()
"""


@dataclasses.dataclass
class Mapper:
    """A process (of user uid) holding mappings of files: path -> (build-id hex, Identity, vma)."""
    proc: subprocess.Popen
    uid: int
    files: dict

    def events(self, nlink: int) -> list[RawEvent]:
        """The MAP events the kernel side would send, with the build-id its page-cache read found."""
        return [RawEvent(EventType.MAP, self.proc.pid, self.proc.pid, 0, "mapper", start, end - start, 0, 5, 2,
                         MapOrigin.MMAP, ident, nlink, 0, path, pc_status=PcStatus.OK,
                         pc_build_id=bytes.fromhex(bid), uid=self.uid)
                for path, (bid, ident, (start, end)) in self.files.items()]


def _fresh_elves(template: bytes, d: Path, n: int, first: int) -> dict[str, str]:
    """n copies of template in d, each with its own build-id: path -> build-id hex."""
    at = template.index(bytes.fromhex(TEMPLATE_BID))
    out = {}
    for i in range(first, first + n):
        bid = (i.to_bytes(4, "big") + bytes.fromhex(TEMPLATE_BID)[4:]).hex()
        p = d / f"f{i}.so"
        p.write_bytes(template[:at] + bytes.fromhex(bid) + template[at + 20:])
        out[str(p)] = bid
    return out


def _map_as(user, paths: dict[str, str], d: Path, unlink: bool) -> Mapper:
    """Start a mapper as user ((uid, gid, name); None: root) over paths (owned by it), once they are mapped."""
    uid = 0 if user is None else user[0]
    files = {}
    for p, bid in paths.items():
        if user is not None:
            os.chown(p, user[0], user[1])
        fd = os.open(p, os.O_RDONLY)
        try:
            # ctime 0: not compared, as for an event whose nlink was 0 (the unlink changes it).
            files[p] = [bid, dataclasses.replace(identity_of(fd), ctime_ns=0 if unlink else identity_of(fd).ctime_ns)]
        finally:
            os.close(fd)
    listing = d / f"list-{uid}"
    listing.write_text("\n".join(paths))
    os.chmod(listing, 0o644)
    argv = [sys.executable, "-c", MAPPER, str(listing), "unlink" if unlink else "keep"]
    kw = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    proc = as_user_popen(user, argv, **kw) if user is not None else subprocess.Popen(argv, **kw)
    assert proc.stdout.readline() == b"ready\n"
    with open(f"/proc/{proc.pid}/maps") as f:
        for line in f:
            name = line.split(maxsplit=5)[-1].strip().removesuffix(" (deleted)")
            if name in files and len(files[name]) == 2:
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                files[name].append((start, end))
    assert all(len(v) == 3 for v in files.values())
    return Mapper(proc, uid, {p: tuple(v) for p, v in files.items()})


@pytest.fixture
def world(attacker, bystander):
    """The attacker's flood of FLOOD_FILES fresh, unlinked, mapped files; the bystander's one (unlinked);
    root's one (kept): {"flood", "bystander", "root": Mapper, "dir": Path}."""
    work = Path(tempfile.mkdtemp(prefix="buildidd-fair-", dir="/tmp"))     # root's tmp_path is 0700
    mappers = []
    try:
        os.chmod(work, 0o755)
        tpl = gcc("int f(void) { return 3; }\n", work / "tpl.so", "-shared", "-fPIC", "-nostdlib", "-s",
                  f"-Wl,--build-id=0x{TEMPLATE_BID}")
        assert readelf_build_id(tpl) == TEMPLATE_BID
        template = tpl.read_bytes()
        dirs = {}
        for name, user in (("flood", attacker), ("bystander", bystander), ("root", None)):
            dirs[name] = work / name
            dirs[name].mkdir()
            os.chmod(dirs[name], 0o755)
            if user is not None:
                os.chown(dirs[name], user[0], user[1])
        got = {"dir": work, "template": template}
        for name, user, n, first, unlink in (("flood", attacker, FLOOD_FILES, 0, True),
                                            ("bystander", bystander, 1, 1 << 20, True),
                                            ("root", None, 1, 1 << 21, False)):
            got[name] = _map_as(user, _fresh_elves(template, dirs[name], n, first), work, unlink)
            mappers.append(got[name])
        yield got
    finally:
        for m in mappers:
            m.proc.stdin.close()
            m.proc.wait()
        shutil.rmtree(work, ignore_errors=True)


def _wire(snap: Snapshotter, offload: Offload) -> tuple[Enricher, HandOverQueue]:
    """An Enricher whose hand-overs go to snap through a hand-over queue, as capture.wiring wires them
    (the copy sink, on_gap, the settled view)."""
    def on_build_id(ident, res, fd, urgency: HandOver, uid: int) -> None:
        submit_copy(snap, ident, res, fd, urgency, uid)
    job = HandOverJob(on_build_id, FileKeys(), snap.view, None,
                      lambda bid, path, reason, uid: snap.coverage.outcome(bid, reason, path, uid))
    q = HandOverQueue(job, offload.pool, offload.handover_uid_share)
    return Enricher(on_build_id=on_build_id, offload=offload, hand_over=q.offer), q


def _only_bid(m: Mapper) -> str:
    (bid, _, _), = m.files.values()
    return bid


def test_a_users_flood_of_fresh_files_never_drops_roots_or_a_bystanders_copy(world, public_tmp_factory):
    """The flood's events come first, root's and the bystander's after: the hand-over pool and the copy
    queue refuse only the attacker's jobs beyond its share (uid_budget, counted for its uid); root's and
    the bystander's are queued with their descriptors, and the copy worker reaches each of them within
    one job per uid while the flood's backlog stands."""
    flood, by, root = world["flood"], world["bystander"], world["root"]
    store = Store(public_tmp_factory() / "store")
    # ~3 copies a second (each file is a few KiB): the backlog stands while root's job is served.
    policy = SnapshotPolicy(rate_bytes_per_s=3 * len(Path(world["dir"], "tpl.so").read_bytes()), max_queue=256,
                            max_fds=64, uid_share=0.25, at_risk_reserve=0.25, housekeeping_interval_s=3600)
    snap = Snapshotter(store, policy)
    e, q = _wire(snap, Offload(pool=PoolPolicy(queue_max=512), handover_uid_share=0.25))
    try:
        for ev in flood.events(nlink=0) + by.events(nlink=0) + root.events(nlink=1):
            e.resolve(ev)
        assert q.live.drain(60.0)
        handed = q.live.status()
        print(f"\nhand-over pool: {handed['submitted']} taken, {handed['queue_dropped']} refused, "
              f"by uid {handed['refused_by_uid']}")
        assert handed["refused_by_uid"] == {str(flood.uid): handed["queue_dropped"]} and handed["queue_dropped"] > 0
        queue = snap.status()["queue"]
        print(f"copy queue: {queue}")
        assert set(queue["refused_by_uid"]) == {str(flood.uid)}
        assert queue["jobs_by_uid"][str(flood.uid)] == 64        # its share: 48 general + 16 reserve slots
        assert queue["fds_by_uid"][str(flood.uid)] == 16         # 12 general + 4 reserve descriptors
        assert queue["jobs_by_uid"]["0"] == 1 and queue["fds_by_uid"]["0"] == 1
        assert queue["jobs_by_uid"][str(by.uid)] == 1 and queue["fds_by_uid"][str(by.uid)] == 1
        text = "\n".join(_store_lines(snap.status(), {})) + _handover_refusals({**e.status(), **q.status()})
        assert f"uid {flood.uid} 64 jobs/16 fds" in text and f"refused (queue_uid_share, snapshot_queue_max): " \
            f"uid {flood.uid} {queue['refused_by_uid'][str(flood.uid)]}" in text, text
        assert f"(uid {flood.uid} {handed['queue_dropped']})" in text, text
        gaps = snap.coverage.report(store.contains, final=False)["gaps"]
        assert gaps.get("uid_budget", 0) == len(flood.files) - 64 and "queue_full" not in gaps
        assert "handover_dropped" not in gaps
        snap.start()
        deadline = time.monotonic() + 30
        served = {}
        while time.monotonic() < deadline and len(served) < 2:
            for name, m in (("root", root), ("bystander", by)):
                if name not in served and snap.coverage.state(_only_bid(m)) == "held":
                    served[name] = (snap.stats["stored"], snap.queued())
            time.sleep(0.01)
        print(f"(copies made, jobs still queued) when held: {served}")
        assert set(served) == {"root", "bystander"}
        # Three uids take turns: each of root's and the bystander's copies came within three copies
        # (one of the attacker's at most before each), with the flood's backlog still queued.
        assert all(made <= 3 and left >= 50 for made, left in served.values()), served
    finally:
        q.close()
        e.close()
        snap.stop(budget_s=20)
    assert store.contains(_only_bid(root)) and store.contains(_only_bid(by))


def test_at_risk_copies_find_a_slot_and_a_descriptor_when_the_queue_is_otherwise_full(world, attacker, bystander,
                                                                                      public_tmp_factory):
    """The attacker and the bystander fill every general slot and descriptor of the copy queue with
    live jobs of their own files (a share of one half each); the attacker's at-risk flood then takes
    its half of the reserve and no more (uid_budget).  The bystander's at-risk file and root's still
    get a slot and a descriptor (the reserve), while a live job of root's finds the general part full
    (queue_full)."""
    flood, by, root = world["flood"], world["bystander"], world["root"]
    # Slots: general 48 (24 per uid), reserve 16 (8 per uid); descriptors: general 12 (6 per uid), reserve 4 (2).
    snap = Snapshotter(Store(public_tmp_factory() / "store"),
                       SnapshotPolicy(max_queue=64, max_fds=16, uid_share=0.5, at_risk_reserve=0.25,
                                      housekeeping_interval_s=3600))
    fds = []

    def submit(bid: str, path: str, ident, priority: HandOver, uid: int, fd: int) -> str | None:
        fds.append(fd)
        snap.coverage.named(bid, path)                  # the session wrote it (the recorder names each)
        snap.submit(CopyJob(bid, path, ident, priority, uid), fd)
        return snap.coverage.state(bid)

    def mapped(m: Mapper, path: str) -> int:
        start, end = m.files[path][2]
        return os.open(f"/proc/{m.proc.pid}/map_files/{start:x}-{end:x}", os.O_RDONLY)

    try:
        for user, first in ((attacker, 1 << 22), (bystander, 1 << 23)):
            d = world["dir"] / f"live-{user[0]}"
            d.mkdir()
            for path, bid in _fresh_elves(world["template"], d, 24, first).items():
                os.chown(path, user[0], user[1])
                fd = os.open(path, os.O_RDONLY)
                assert submit(bid, path, identity_of(fd), HandOver.LIVE, user[0], fd) == "in_progress"
        q = snap.status()["queue"]
        assert q["slots_cap"] == [48, 16] and q["jobs"] == 48 and q["fds"] == 12      # general parts full
        states = [submit(bid, path, ident, HandOver.LIVE, flood.uid, mapped(flood, path))   # AT_RISK: nlink 0
                  for path, (bid, ident, _) in list(flood.files.items())[:32]]
        assert states.count("in_progress") == 8 and states.count("uid_budget") == 24
        assert snap.status()["queue"]["fds_by_uid"][str(flood.uid)] == 6 + 2
        (bpath, (bbid, bident, _)), = by.files.items()
        assert submit(bbid, bpath, bident, HandOver.LIVE, by.uid, mapped(by, bpath)) == "in_progress"
        (rpath, (rbid, rident, _)), = root.files.items()      # its process gone: the caller says AT_RISK
        assert submit(rbid, rpath, rident, HandOver.AT_RISK, 0, mapped(root, rpath)) == "in_progress"
        q = snap.status()["queue"]
        print(f"\ncopy queue: {q}")
        assert q["fds_by_uid"]["0"] == 1 and q["fds_by_uid"][str(by.uid)] == 6 + 1 and q["fds"] == 16
        assert q["jobs_by_uid"]["0"] == 1 and q["jobs_by_uid"][str(by.uid)] == 25
        # Queued without a descriptor: 18 live jobs of each user beyond its 6, 6 of the flood beyond its 2.
        assert snap.stats["urgent"] == 10 and snap.stats["no_fd"] == 2 * 18 + 6
        assert q["no_fd_by_uid"] == {str(flood.uid): 18 + 6, str(by.uid): 18}
        (lpath, lbid), = _fresh_elves(world["template"], world["dir"] / "root", 1, 1 << 24).items()
        fd = os.open(lpath, os.O_RDONLY)
        assert submit(lbid, lpath, identity_of(fd), HandOver.LIVE, 0, fd) == "queue_full"
    finally:
        snap.stop(budget_s=0)
        for fd in fds:
            os.close(fd)

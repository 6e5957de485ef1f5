"""The enricher's per-file memories stay within their byte budgets under a flood of fresh files with
deep paths (a user's ~3,700-character directory), measured with tracemalloc."""

from __future__ import annotations

from buildidd.kernel.events import EventType, Identity, MapOrigin, PcStatus, RawEvent
from buildidd.resolve import enrich, filekeys, handover, handoverqueue
from buildidd.resolve.enrich import Enricher
from buildidd.resolve.filekeys import FileKey, FileKeys
from buildidd.resolve.handover import HandOverJob
from buildidd.resolve.handoverqueue import HandOverQueue
from buildidd.resolve.procfs import Source
from buildidd.resolve.resolution import make_resolution
from buildidd.resolve.workers import PoolPolicy, WorkerPool
from tests.memflood import FLOOD_N, deep_path, retained_bytes

#: A pid above pid_max: every route to its files fails at once, as for a process that exited.
GONE_PID = 999_999_999


def _ident(i: int) -> Identity:
    return Identity(2049, 1_000_000 + i, 1, 5 * 1024, 1_700_000_000_000_000_000 + i, 1_700_000_000_000_000_000 + i)


def _kernel_map(i: int) -> RawEvent:
    """A mapping of the i-th fresh file whose build-id the kernel read (KERNEL_FINAL)."""
    return RawEvent(EventType.MAP, GONE_PID, GONE_PID, 1, "flood", 0x1000, 0x2000, 0, 5, 2, MapOrigin.MMAP,
                    _ident(i), 0, 0, deep_path(i), pc_status=PcStatus.OK, pc_build_id=i.to_bytes(20, "little"),
                    uid=1000)


def test_the_identity_cache_stays_within_its_budget():
    e = Enricher()
    try:
        def flood():
            for i in range(FLOOD_N):
                ident = _ident(i)
                e._store(ident, make_resolution(ident, None, Source.NONE, enrich.MissReason.FILE_DELETED,
                                                deep_path(i)))
        held = retained_bytes(flood)
        assert e.cache.bytes <= enrich.IDENTITY_CACHE_MAX_BYTES
        assert held <= enrich.IDENTITY_CACHE_MAX_BYTES, held
        assert e.cache.evictions > FLOOD_N // 2 and len(e.cache) > 100
    finally:
        e.close()


def test_kernel_answers_handed_over_stay_within_the_hand_overs_budgets():
    """Each fresh build-id the kernel read goes to a hand-over (its file unreachable here: the
    process is gone): the hand-overs' memory, the queues and the unreached list stay bounded."""
    gaps = []
    job = HandOverJob(lambda *a: None, FileKeys(), None, None,
                      lambda bid, path, reason, uid: gaps.append(reason) if len(gaps) < 10 else None)
    q = HandOverQueue(job, enrich.Offload().pool, 0.25)
    e = Enricher(on_build_id=lambda *a: None, hand_over=q.offer)
    # Each hand-over of a deep path is about 4 KiB: a fifth of a flood fills the handed record
    # (HANDED_MAX_BYTES) and the unreached list many times over, and each hand-over runs a job.
    n = FLOOD_N // 5
    assert n * len(deep_path(0)) > 10 * handoverqueue.HANDED_MAX_BYTES
    try:
        def flood():
            for i in range(n):
                res = e.resolve(_kernel_map(i))
                assert res.build_id == i.to_bytes(20, "little").hex()
                if i % 1000 == 999:
                    for pool in (q.live, q.bulk):
                        assert pool.status()["queued_bytes"] <= pool.policy.queue_max_bytes
            for pool in (q.live, q.bulk):
                assert pool.drain(30.0)
        held = retained_bytes(flood)
        bound = handoverqueue.HANDED_MAX_BYTES + handover.UNREACHED_MAX * (len(deep_path(0)) + 400)
        assert q.handed.bytes <= handoverqueue.HANDED_MAX_BYTES
        assert held <= bound, (held, bound)
        assert gaps and set(gaps) <= {"process_gone", "handover_dropped", "uid_budget"}
    finally:
        q.close()
        e.close()


def test_file_keys_and_their_memory_stay_bounded():
    keys = FileKeys()

    def flood():
        for i in range(FLOOD_N):
            keys.put(FileKey(_ident(i), "ab" * 20, "cd" * 16))
    held = retained_bytes(flood)
    assert len(keys) == filekeys.FILE_KEYS_QUEUED_MAX and keys.dropped == FLOOD_N - len(keys)
    assert keys.keyed.bytes <= filekeys.KEYED_MAX_BYTES
    assert held <= filekeys.KEYED_MAX_BYTES + filekeys.FILE_KEYS_QUEUED_MAX * 600, held


def test_a_pool_refuses_jobs_beyond_its_queued_bytes():
    pool = WorkerPool(PoolPolicy(workers=1, max_threads=1, queue_max=1 << 20, queue_max_bytes=10_000))
    import threading
    gate = threading.Event()
    try:
        assert pool.submit(lambda _: gate.wait(10), None, 0) is not None      # holds the one thread
        got = [pool.submit(lambda _: None, i, 3000) for i in range(10)]
        assert sum(j is not None for j in got) == 3 and pool.stats["queue_dropped"] == 7
        assert pool.status()["queued_bytes"] in (9000, 12000 - 3000)
    finally:
        gate.set()
        assert pool.drain(10.0)
        assert pool.status()["queued_bytes"] == 0
        pool.close()


def test_a_fair_pool_holds_one_users_bytes_to_their_share_and_roots_job_still_waits():
    import threading
    pool = WorkerPool(PoolPolicy(workers=1, max_threads=1, queue_max=1 << 20, queue_max_bytes=10_000,
                                 uid_share=0.25))
    gate = threading.Event()
    try:
        assert not isinstance(pool.submit_charged(lambda _: gate.wait(10), None, 0, 0), str)
        got = [pool.submit_charged(lambda _: None, i, 1000, 1000) for i in range(10)]
        assert got[2:] == ["uid_budget"] * 8 and not any(isinstance(j, str) for j in got[:2])
        assert not isinstance(pool.submit_charged(lambda _: None, None, 0, 5000), str)     # root: no share
        assert pool.submit_charged(lambda _: None, None, 0, 5000) == "queue_full"          # the whole is full
        assert pool.status()["queued_bytes"] == 7000
    finally:
        gate.set()
        assert pool.drain(10.0)
        assert pool.status()["queued_bytes"] == 0 and pool._bytes_by_uid == {}
        pool.close()

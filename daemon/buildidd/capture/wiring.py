"""The wiring of a recording session's store side: who is given what, in which order.

With a store (Config.store_root), :meth:`Recorder.start` calls
:func:`open_store_side` once the BPF side is loaded (the store's kallsyms copy
needs the running kernel's build-id).  It builds, each part given its
collaborators in its constructor:

1. the Store, and its settled-file view (store.settledview.SettledView);
2. the exec pins (resolve.execpins.ExecPins), started (None without fanotify);
3. the Snapshotter (store.snapshotter: the copy queue and its thread), told to
   give each held file to the pins' ignore mark;
4. the hand-over job (resolve.handover.HandOverJob), given the view, the
   pins, the coverage ledger for its gaps, the copy sink and the Enricher's
   file-key queue;
5. the hand-over queue (resolve.handoverqueue.HandOverQueue) running it.

The Enricher and the slow path are made earlier (the recorder's parts share
them), so they reach the store side through the recorder's sinks, given to
their constructors (Recorder._hand_over, _on_build_id, _named), which do
nothing until the store side exists.
"""

from __future__ import annotations

import collections
import functools
import resource
from dataclasses import dataclass
from pathlib import Path

from buildidd import clock
from buildidd.config import Config
from buildidd.errors import StoreError
from buildidd.kernel.events import Identity
from buildidd.resolve.enrich import Enricher
from buildidd.resolve.execpins import ExecPins, PinPolicy
from buildidd.resolve.handover import HandOver, HandOverJob
from buildidd.resolve.handoverqueue import HandOverQueue
from buildidd.resolve.resolution import Resolution
from buildidd.store import CopyJob, SnapshotPolicy, Snapshotter, Store
from buildidd.store.coverage import Coverage
from buildidd.store.origin import KEY_HTLHASH
from buildidd.store.settledview import SettledView

__all__ = ["NOFILE_SPARE", "StoreSide", "open_store_side", "raise_nofile", "start_pins", "submit_copy"]

#: Descriptors the daemon needs besides pins and queued copies (rings, maps, workers, sockets, segments).
NOFILE_SPARE = 1024


@dataclass(frozen=True)
class StoreSide:
    """A session's store side, started: the copy thread, the exec pins (None: not available here)
    and the hand-over queue."""

    snapshotter: Snapshotter
    pins: ExecPins | None
    handovers: HandOverQueue


def submit_copy(snapshotter: Snapshotter, ident: Identity, res: Resolution, fd: int | None, urgency: HandOver,
                uid: int) -> None:
    """A hand-over's file to the copy queue (resolve.handover.OnBuildId; a worker thread): under its GNU
    build-id, else its htlhash; the copy is charged to uid (the task that mapped or exec'd it)."""
    if res.build_id:
        snapshotter.submit(CopyJob(res.build_id, res.path, ident, urgency, uid), fd)
    elif res.file_id:
        snapshotter.submit(CopyJob(res.file_id, res.path, ident, urgency, uid, KEY_HTLHASH), fd)


def open_store_side(cfg: Config, session_dir: Path, kernel_build_id: str | None,
                    last_errors: collections.deque, enricher: Enricher) -> StoreSide:
    """The store side of a session, started, in the order of the module docstring.

    A kallsyms snapshot that fails, and exec pins that cannot be had, are noted in last_errors.
    Raises StoreError (the store cannot be opened).
    """
    from buildidd.capture.housekeeping import Housekeeping, RetentionPolicy

    store = Store.from_config(cfg)
    if kernel_build_id:
        try:
            store.add_kallsyms(kernel_build_id)
        except (StoreError, OSError) as e:
            last_errors.append({"time_ns": clock.boot_ns(), "error": f"kallsyms snapshot: {e}"})
    raise_nofile(cfg.pin_max_files + cfg.snapshot_fds_max + NOFILE_SPARE)
    pins = start_pins(cfg, last_errors)
    view = SettledView(store)
    retention = RetentionPolicy(session_root=session_dir.parent, current_session=session_dir,
                                max_age_s=cfg.session_max_age_s or None,
                                max_total_bytes=cfg.session_max_total_bytes or None)
    policy = SnapshotPolicy(rate_bytes_per_s=cfg.snapshot_rate_bytes_per_s, max_queue=cfg.snapshot_queue_max,
                            max_fds=cfg.snapshot_fds_max, uid_share=cfg.queue_uid_share,
                            at_risk_reserve=cfg.snapshot_at_risk_reserve)
    snapshotter = Snapshotter(store, policy, housekeeping=Housekeeping(store, retention),
                              coverage=Coverage(cfg.coverage_max_bytes, cfg.coverage_uid_share),
                              on_held=pins.ignore if pins is not None else None, view=view)
    snapshotter.start()
    cov = snapshotter.coverage
    job = HandOverJob(functools.partial(submit_copy, snapshotter), enricher.file_keys, view, pins,
                      lambda bid, path, reason, uid: cov.outcome(bid, reason, path, uid))
    handovers = HandOverQueue(job, enricher.offload.pool, enricher.offload.handover_uid_share,
                              cfg.identity_cache_entries)
    return StoreSide(snapshotter, pins, handovers)


def raise_nofile(need: int) -> int:
    """Raise RLIMIT_NOFILE's soft limit to need (within the hard limit) when it is lower: pins and
    queued copies hold descriptors (Config.pin_max_files, SnapshotPolicy.max_fds).  Returns the soft
    limit in force; a refused raise leaves it (the caps then count what does not fit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            return want
        except (ValueError, OSError):
            return soft
    return soft


def start_pins(cfg: Config, last_errors: collections.deque) -> ExecPins | None:
    """Exec pins (resolve.execpins) for the hand-overs, started; None when Config.pin_max_files is 0
    or fanotify cannot be had here (noted in last_errors: the hand-overs then reach files by their
    routes only)."""
    if cfg.pin_max_files <= 0:
        return None
    pins = ExecPins(PinPolicy(max_files=cfg.pin_max_files, ttl_s=cfg.pin_ttl_s, uid_share=cfg.pin_uid_share,
                              confirm_s=cfg.pin_confirm_s))
    try:
        pins.start()
    except OSError as e:
        last_errors.append({"time_ns": clock.boot_ns(), "error": f"exec pins: {e}"})
        pins.close()
        return None
    return pins

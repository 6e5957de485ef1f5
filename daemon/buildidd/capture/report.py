"""What a Recorder reports: ``status`` (the control socket), ``STATUS=`` (systemd), the session's totals.

Read by other threads (the control socket's) while the recording thread
runs: every value is a counter or a copy taken under the GIL.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from buildidd import clock, memo
from buildidd.errors import SessionLogError
from buildidd.sessionlog import sessions_usage, write_gaps
from buildidd.sessionlog.records import dict_line

#: Configuration keys reported in status["limits"]: what bounds a loss, a skipped copy or the sessions.
LIMIT_KEYS = ("ring_bytes", "recording_nice", "pending_lines_max_bytes", "store_quota_bytes",
              "store_file_max_bytes", "store_uid_share", "session_max_total_bytes", "session_max_age_s",
              "segment_max_bytes")

#: Bytes of the end record's line at most (docs/record-format.md): the coverage's inline gap list is
#: bounded to fit (store.gapreport); end_line trims what is left over.
END_RECORD_MAX_BYTES = 64 << 10

if TYPE_CHECKING:
    from buildidd.capture.recorder import Recorder


def status(rec: Recorder) -> dict:
    """What the daemon is doing (JSON-ready; read by the control socket's thread).

    Besides summary(): "caches" gives every bounded cache's {entries, capacity, hits,
    misses, evictions, bytes, max_bytes} by name (memo.py; bytes: the entries' estimated
    bytes), and the other per-file memories' {entries, bytes, max_bytes, ...}:
    ``live_mappings`` (Tables.memory), ``snapshot_seen``, ``snapshot_settled`` and
    ``snapshot_queue`` (Snapshotter.memory, with a store), ``coverage_ledger`` (its bytes,
    store.coverage); see caches();
    "kernel_build_id_memo" Tracer.memo_stats();
    "quiet" Rings.quiet_status() (an idle recorder sleeps: last_step_s_ago grows meanwhile);
    "last_reload" the last SIGHUP's outcome ({"time_ns", "ok", "error"}, or None);
    "limits" the configuration keys the text status names beside what they bound;
    "sessions" the sessions under session_root and their bytes (sessionlog.sessions_usage).
    """
    cfg = rec.config
    n_sessions, sessions_bytes = sessions_usage(cfg.session_root) if cfg.session_root else (0, 0)
    now = time.monotonic()
    out = {"session": rec.session_dir.name, "session_dir": str(rec.session_dir),
           "uptime_s": round(now - rec.started_mono, 1), "ready_s": rec.ready_s,
           "events_per_s": _rates(list(rec.rate_window)), "last_errors": list(rec.last_errors),
           "log": rec.log.stats_or_none(),
           "snapshots": rec.snapshotter.status() if rec.snapshotter is not None else None,
           "exec_pins": rec.pins.status() if rec.pins is not None else None,
           "resolve": {**rec.enricher.status(), **(rec.handovers.status() if rec.handovers is not None else {})},
           "loop_errors": dict(rec.guard.loop_errors),
           "last_step_s_ago": round(max(0.0, time.monotonic() - rec.guard.last_progress), 3),
           "ring_wakeups": rec.rings.wakeups if rec.rings is not None else 0,
           "quiet": rec.rings.quiet_status() if rec.rings is not None else None,
           "kernel_build_id_path": rec.kernel_path.as_dict() if rec.kernel_path else None,
           "kernel_build_id_memo": rec.tracer.memo_stats() if rec.tracer is not None else None,
           "caches": caches(rec),
           "last_reload": rec.last_reload,
           "limits": {k: getattr(cfg, k) for k in LIMIT_KEYS},
           "sessions": {"root": cfg.session_root, "count": n_sessions, "bytes": sessions_bytes}}
    out.update(summary(rec))
    return out


def caches(rec: Recorder) -> dict:
    """Every per-file or per-path memory of the recorder by name, with the bytes it holds (JSON-ready;
    see status())."""
    e = rec.enricher
    out = {**memo.shared_stats()}
    handed = [rec.handovers.handed] if rec.handovers is not None else []
    for cache in (e.cache, *handed, rec.slow.kernel_fast):
        out[cache.name] = cache.stats()
    out["file_id_keyed"] = e.file_keys.keyed_stats()
    out["live_mappings"] = rec.tables.memory()["live"]
    if rec.snapshotter is not None:
        for name, got in rec.snapshotter.memory().items():
            out[f"snapshot_{name}"] = got
        cov = rec.snapshotter.coverage
        out["coverage_ledger"] = {"bytes": cov.bytes, "max_bytes": cov.max_bytes}
    return out


def status_line(rec: Recorder) -> str:
    """One line for systemd's STATUS=."""
    ev = rec.stats.events
    e = rec.enricher
    return (f"{sum(ev.values())} events ({ev.get('mmap', 0)} mmap, {ev.get('exec', 0)} exec), "
            f"{e.resolved} build-ids, {sum(e.missing.values())} missing, "
            f"{sum(rec.stats.lost.values())} lost")


def summary(rec: Recorder) -> dict:
    """Totals of the session so far (JSON-ready)."""
    e = rec.enricher
    lookups = e.hits + e.misses
    return {"events": dict(rec.stats.events), "lost": dict(rec.stats.lost),
            "decode_errors": rec.stats.decode_errors, "recovered": rec.stats.recovered,
            "synthesized": rec.stats.synthesized, "synth_skipped": rec.stats.synth_skipped,
            "build_ids_resolved": e.resolved, "build_ids_missing": dict(e.missing),
            "identity_cache": {"entries": len(e.cache), "hits": e.hits, "misses": e.misses,
                               "hit_rate": round(e.hits / lookups, 4) if lookups else None},
            "log_write_errors": rec.stats.log_write_errors,
            "log_lines_dropped": rec.stats.log_lines_dropped,
            "priority_boosts": rec.stats.priority_boosts,
            "event_errors": dict(rec.stats.event_errors), "resolve_timeouts": e.timeouts,
            "live_pids_dropped": rec.stats.live_pids_dropped,
            "throttled": rec.tracer.budgets.totals() if rec.tracer is not None else None}


def store_totals(rec: Recorder) -> dict:
    """The end record's store part: ``store`` (Snapshotter.status), ``exec_pins`` (ExecPins.status)
    and ``store_coverage`` (Coverage.report, final: the build-ids the session named that the store
    lacks, counted by reason and uid, the first listed), whose ``gaps_file`` names the gap file
    written now beside the segments with every one (sessionlog.gapfile; None: no gap); {} without
    a store."""
    snap = rec.snapshotter
    if snap is None:
        return {}
    gaps: list[dict] = []
    cov = snap.coverage.report(snap.store.contains, final=True, all_gaps=gaps)
    cov["gaps_file"] = _gap_file(rec, gaps)
    return {"store": snap.status(), "exec_pins": rec.pins.status() if rec.pins is not None else None,
            "store_coverage": cov}


def _gap_file(rec: Recorder, gaps: list[dict]) -> dict | None:
    """Write the session's gap file (write_gaps); what the end record says of it, None without gaps,
    {"error": why} when it could not be written (noted in last_errors)."""
    if not gaps:
        return None
    try:
        return write_gaps(rec.session_dir, gaps, compress=rec.config.compress,
                          max_bytes=rec.config.coverage_max_bytes)
    except SessionLogError as e:
        rec.last_errors.append({"time_ns": clock.boot_ns(), "error": str(e)})
        return {"error": str(e)}


def end_line(record: dict) -> bytes:
    """The end record as its line, at most END_RECORD_MAX_BYTES (and so within the reader's
    MAX_LINE_BYTES): were it longer, store_coverage's ``missing`` and then ``by_uid`` are cut
    (``"trimmed": true``), then store_coverage keeps only its counts, then the record keeps only
    type, time_ns and reason.  The gap file keeps every gap whatever is cut here."""
    line = dict_line(record)
    cov = record.get("store_coverage")
    while len(line) > END_RECORD_MAX_BYTES and isinstance(cov, dict):
        if cov.get("missing"):
            del cov["missing"][len(cov["missing"]) // 2:]
            cov["missing_listed"] = len(cov["missing"])
        elif len(cov.get("by_uid") or ()) > 1:
            cov["by_uid"] = dict(list(cov["by_uid"].items())[:len(cov["by_uid"]) // 2])
        else:
            break
        cov["trimmed"] = True
        line = dict_line(record)
    if len(line) > END_RECORD_MAX_BYTES and isinstance(cov, dict):
        record["store_coverage"] = {k: cov[k] for k in ("named", "held", "gaps", "untracked", "gaps_file")
                                    if k in cov} | {"trimmed": True}
        line = dict_line(record)
    if len(line) > END_RECORD_MAX_BYTES:
        line = dict_line({k: record.get(k) for k in ("type", "time_ns", "reason")} | {"trimmed": True})
    return line


def _rates(window: list[tuple[float, dict]]) -> dict[str, float]:
    """Events per second by type over window: (time.monotonic(), counts so far) samples, oldest first."""
    if len(window) < 2:
        return {}
    (t0, c0), (t1, c1) = window[0], window[-1]
    return {k: round((v - c0.get(k, 0)) / (t1 - t0), 1) for k, v in c1.items()}

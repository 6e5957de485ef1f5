"""One push pass: every store entry and closed segment the ledger does not hold yet goes to the bucket.

The local store and sessions are the queue: a pass lists them, leaves out what
the ledger says is pushed (at the same stamp), and pushes the rest, binaries
first (``push_concurrency`` at once), then sessions (whose manifests name
those binaries).  A failure that would fail the next request too (the bucket
unreachable, credentials refused, full: bucket.FATAL_CAUSES) ends the pass;
what was not pushed stays in the queue for the next one.  Nothing is marked
pushed before the bucket said so.

The status (``STATE_DIR/status.json``, ``buildidd push --status``) gives the
backlog (entries and segments not pushed, their bytes), the age of the oldest
unpushed one, bytes and objects pushed, errors by cause, and the cumulative
counters kept in the ledger.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from buildidd.config import Config
from buildidd.errors import PushError, SessionLogError, StoreError
from buildidd.fleet.binaries import EntryPlan, entry_stamp, plan_entry, push_entry
from buildidd.fleet.bucket import FATAL_CAUSES, Bucket, BucketOptions
from buildidd.fleet.claims import ClaimPolicy
from buildidd.fleet.keys import Keys
from buildidd.fleet.ledger import Ledger, ledger_path
from buildidd.fleet.sessions import Destination, SessionWork, push_session, session_work
from buildidd.fleet.status import STATUS_NAME, write_status
from buildidd.offline.serve.debuginfod import Privacy
from buildidd.store import BUILD_ID_DIR, Store

__all__ = ["Pusher", "PassReport", "host_name"]

log = logging.getLogger(__name__)



def host_name(cfg: Config) -> str:
    """``Config.push_host``, else the kernel's host name up to its first dot."""
    return cfg.push_host or socket.gethostname().split(".")[0] or "localhost"


@dataclass
class PassReport:
    """What one pass did.

    Attributes:
        started_wall_ns: ns since the epoch.
        duration_s: seconds.
        counts: ``uploaded``, ``present``, ``conflicts_kept_aside``, ``objects``, ``copies``, ``sent_bytes``,
            ``segments``, ``sessions``, ``skipped_<reason>`` (binaries.SKIP_REASONS), ``errors_<cause>``.
        error: the failure that ended the pass early, or None.
        backlog: ``entries``, ``entry_bytes``, ``segments``, ``segment_bytes`` not pushed at its end.
        oldest_unpushed_ns: ns since the epoch of the oldest item not pushed (None: nothing left).
        abandoned: uploads still in progress when the stop budget ran out.
    """

    started_wall_ns: int
    duration_s: float = 0.0
    counts: Counter = field(default_factory=Counter)
    error: str | None = None
    backlog: dict = field(default_factory=dict)
    oldest_unpushed_ns: int | None = None
    abandoned: int = 0

    @property
    def failed(self) -> bool:
        """The pass ended early on a failure that concerns every request (bucket.FATAL_CAUSES)."""
        return self.error is not None


class Pusher:
    """Pushes one host's store and sessions to the configured bucket, pass after pass.

    Args:
        cfg: push_* keys, store_root, session_root, store_share_private.
        bucket: the bucket (tests give one); default from cfg.

    Raises:
        PushError: ``config`` (no bucket, a malformed host name or prefix, the ledger).
        StoreError: the store cannot be opened.
    """

    def __init__(self, cfg: Config, bucket: Bucket | None = None):
        self.cfg = cfg
        opts = BucketOptions.from_config(cfg)
        try:
            self.keys = Keys(cfg.push_prefix, host_name(cfg))
        except ValueError as e:
            raise PushError("config", str(e)) from e
        self.bucket = bucket or Bucket(opts)
        destination = f"{cfg.push_endpoint_url}|{cfg.push_bucket}|{cfg.push_prefix}|{self.keys.host}"
        self.ledger = Ledger(ledger_path(cfg.push_state_dir, destination), destination)
        self.bucket.journal = self.ledger
        self.store = Store.from_config(cfg, quota_bytes=None) if cfg.store_root else None
        self.privacy = Privacy(cfg.store_share_private)
        self.policy = f"share_private={cfg.store_share_private}|untrusted={cfg.push_untrusted}"
        self.last: PassReport | None = None
        #: What the caller added to the status (the service's part): kept in every later write.
        self._extra: dict = {}
        self.claims = ClaimPolicy.from_config(cfg)
        self._heads: dict[str, int] = {}          # .build-id/XX -> its mtime (ns) at the last look
        self._retry: set[str] = set()             # keys a quick pass looks at again (claimed elsewhere, failed)
        self._manifest_at: dict[str, float] = {}  # session name -> monotonic s its manifest was last written
        self._finished: set[str] = set()          # closed sessions wholly pushed: quick passes skip them

    # -- the queue -----------------------------------------------------------------------

    def _entry_work(self, report: PassReport, keys: Iterable[str]) -> list[tuple[EntryPlan, str]]:
        """Of keys, the store entries whose stamp the ledger does not hold: their plans (skipped ones
        marked at once)."""
        if self.store is None:
            return []
        done = self.ledger.stamps("entry:")
        work = []
        for hex_key in keys:
            stamp = entry_stamp(self.store, hex_key, self.policy)
            if done.get(f"entry:{hex_key}") == stamp:
                self._retry.discard(hex_key)
                continue
            plan = plan_entry(self.store, hex_key, self.privacy, self.cfg.push_untrusted)
            if isinstance(plan, str):
                report.counts[f"skipped_{plan}"] += 1
                if plan != "unavailable":
                    self.ledger.mark(f"entry:{hex_key}", stamp)
                    self._retry.discard(hex_key)
                continue
            work.append((plan, stamp))
        return work

    def _changed_heads(self) -> list[str]:
        """The store's ``.build-id/XX`` directories made or changed since the last look (one stat each:
        a new entry's link changes its directory's mtime).  One changed within the last second is
        looked at again next time too: two links made within one tick of the file system's clock
        leave the same mtime."""
        top = Path(self.cfg.store_root) / BUILD_ID_DIR
        try:
            names = [n for n in os.listdir(top) if len(n) == 2]
        except OSError:
            return []
        seen, changed, recent = {}, [], time.time_ns() - 1_000_000_000
        for n in names:
            try:
                seen[n] = os.stat(top / n).st_mtime_ns
            except OSError:
                continue
            if self._heads.get(n) != seen[n] or seen[n] > recent:
                changed.append(n)
        self._heads = seen
        return changed

    def _quick_keys(self) -> list[str]:
        """The keys of the entries under changed ``.build-id/XX`` directories, and those to look at again."""
        top = Path(self.cfg.store_root) / BUILD_ID_DIR
        keys = set(self._retry)
        for head in self._changed_heads():
            try:
                keys.update(head + tail for tail in os.listdir(top / head))
            except OSError:
                continue
        return sorted(k for k in keys if len(k) >= 4 and all(c in "0123456789abcdef" for c in k))

    def _all_keys(self) -> list[str]:
        self._changed_heads()                     # what a quick pass compares with from now on
        return [] if self.store is None else [e.build_id_hex for e in self.store.entries()]

    # -- a pass --------------------------------------------------------------------------------

    def run_pass(self, stop: Callable[[], bool] = lambda: False, stop_budget_s: float | None = None,
                 full: bool = True) -> PassReport:
        """Push what the ledger does not hold; never raises for a request that failed (it is counted).

        Args:
            full: go over every store entry; False (a quick pass): only the entries under the store's
                ``.build-id/XX`` directories that changed since the last pass, and those a pass left
                (claimed elsewhere, failed); its backlog is then of those only.  Sessions: every one but
                the closed ones a pass found wholly pushed.
            stop: polled between items; once True no item is started.
            stop_budget_s: after stop() turns True, how long uploads in progress may go on
                (default push_stop_budget_s); those still running then are abandoned (counted).

        Raises:
            StoreError, SessionLogError: the store or the sessions cannot be listed.
        """
        report = PassReport(time.time_ns())
        t0 = time.monotonic()
        failure = threading.Event()
        self._abort_stale(report, failure)
        keys = [] if failure.is_set() or self.store is None else self._all_keys() if full else self._quick_keys()
        entries = self._entry_work(report, keys)
        left = self._parallel(entries, lambda item: self._one_entry(item, report, failure),
                              lambda: stop() or failure.is_set(), report,
                              self.cfg.push_stop_budget_s if stop_budget_s is None else stop_budget_s)
        if full:
            self._finished.clear()                # a full pass looks at every session again
        sessions = [] if self.cfg.session_root == "" else session_work(self.cfg.session_root, self.ledger,
                                                                       set(self._finished), self._finished)
        unpushed = list(sessions)
        if not (stop() or failure.is_set()):
            unpushed = self._sessions(sessions, report, failure, stop)
        report.backlog, report.oldest_unpushed_ns = _backlog(left, unpushed)
        report.duration_s = time.monotonic() - t0
        self.ledger.add(dict(report.counts))
        self.last = report
        self.write_status()
        return report

    def _abort_stale(self, report: PassReport, failure: threading.Event) -> None:
        """Abort the multipart uploads an earlier failure or crash left unfinished (the ledger's journal)."""
        for key, upload in self.ledger.uploads():
            try:
                self.bucket.abort(key, upload)
                report.counts["aborted_uploads"] += 1
            except PushError as e:
                self._failed(e, report, failure, f"abort of {key}")
                return

    def _one_entry(self, item: tuple[EntryPlan, str], report: PassReport, failure: threading.Event) -> bool:
        plan, stamp = item
        try:
            r = push_entry(self.bucket, self.keys, plan, self.claims)
        except PushError as e:
            self._failed(e, report, failure, plan.hex_key)
            self._retry.add(plan.hex_key)
            return False
        report.counts.update({r.outcome if r.outcome != "conflict" else "conflicts_kept_aside": 1,
                              "objects": r.objects, "copies": r.copies, "sent_bytes": r.sent_bytes})
        if r.outcome == "claimed_elsewhere":
            self._retry.add(plan.hex_key)         # looked at again (a HEAD) by the next pass
            return False
        self._retry.discard(plan.hex_key)
        self.ledger.mark(f"entry:{plan.hex_key}", stamp)
        return True

    def _failed(self, e: PushError, report: PassReport, failure: threading.Event, what: str) -> None:
        report.counts[f"errors_{e.cause}"] += 1
        if e.cause in FATAL_CAUSES:
            if not failure.is_set():
                report.error = str(e)
                log.warning("push: %s: %s; the pass ends, the rest stays queued", what, e)
            failure.set()
        else:
            log.warning("push: %s: %s (tried again next pass)", what, e)

    def _sessions(self, sessions: list[SessionWork], report: PassReport, failure: threading.Event,
                  stop: Callable[[], bool]) -> list[SessionWork]:
        """Push each session in turn; returns those not (wholly) pushed."""
        left = []
        for work in sessions:
            if stop() or failure.is_set():
                left.append(work)
                continue
            last = self._manifest_at.get(work.name)
            manifest = work.closed or last is None or time.monotonic() - last >= self.cfg.push_manifest_interval_s
            if not work.segments and not manifest:
                report.counts["manifests_deferred"] += 1
                continue
            try:
                r = push_session(Destination(self.bucket, self.keys, self.ledger), work, self.store,
                                 share_private=self.cfg.store_share_private, stop=stop, manifest=manifest)
                report.counts.update({"sent_bytes": r.sent_bytes, "objects": r.objects, "sessions": 1,
                                      "segments": len(work.segments)})
                if manifest:
                    self._manifest_at[work.name] = time.monotonic()
            except PushError as e:
                self._failed(e, report, failure, f"session {work.name}")
                left.append(work)
            except (SessionLogError, StoreError) as e:
                report.counts["errors_source"] += 1
                log.warning("push: session %s: %s (tried again next pass)", work.name, e)
                left.append(work)
        return left

    def _parallel(self, items: list, fn: Callable[[object], bool], stop: Callable[[], bool], report: PassReport,
                  budget_s: float) -> list:
        """Run fn over items on push_concurrency daemon threads; returns the items not done.

        After stop() turns True no item starts; those running get budget_s to finish, then are abandoned
        (their threads are daemons: the process may exit under them; a half-sent object is never
        visible in S3).
        """
        pending, done, lock = iter(items), set(), threading.Lock()

        def worker() -> None:
            while not stop():
                with lock:
                    item = next(pending, None)
                if item is None:
                    return
                if fn(item):
                    with lock:
                        done.add(id(item))

        threads = [threading.Thread(target=worker, name=f"push-{i}", daemon=True)
                   for i in range(min(self.cfg.push_concurrency, max(1, len(items))))]
        for t in threads:
            t.start()
        deadline = None
        while alive := [t for t in threads if t.is_alive()]:
            alive[0].join(0.05)
            if deadline is None and stop():
                deadline = time.monotonic() + budget_s
            if deadline is not None and time.monotonic() > deadline:
                report.abandoned = sum(t.is_alive() for t in threads)
                break
        with lock:
            return [item for item in items if id(item) not in done]

    # -- status ----------------------------------------------------------------------------------

    def status(self) -> dict:
        """The status as JSON-ready data (see the module docstring)."""
        r = self.last
        return {"host": self.keys.host, "bucket": self.cfg.push_bucket, "endpoint": self.cfg.push_endpoint_url,
                "prefix": self.cfg.push_prefix, "conditional_put": self.bucket.conditional,
                "time_wall_ns": time.time_ns(),
                "last_pass": None if r is None else {
                    "started_wall_ns": r.started_wall_ns, "duration_s": round(r.duration_s, 3),
                    "error": r.error, "counts": dict(r.counts), "abandoned": r.abandoned},
                "backlog": r.backlog if r is not None else None,
                "oldest_unpushed_age_s": None if r is None or r.oldest_unpushed_ns is None
                else round(max(0, time.time_ns() - r.oldest_unpushed_ns) / 1e9, 3),
                "totals": self.ledger.counters()}

    def write_status(self, extra: dict | None = None) -> None:
        """Write :meth:`status` (and extra, merged into what earlier calls gave: a pass's own write keeps
        the service's part) to ``STATE_DIR/status.json`` (temporary file, then rename)."""
        self._extra.update(extra or {})
        try:
            write_status(self.cfg.push_state_dir, {**self.status(), **self._extra})
        except OSError as e:
            log.warning("push: cannot write %s/%s: %s", self.cfg.push_state_dir, STATUS_NAME, e)

    def close(self) -> None:
        self.ledger.close()


def _backlog(entries: Iterable[tuple[EntryPlan, str]], sessions: Iterable[SessionWork]) -> tuple[dict, int | None]:
    """The backlog counts and the oldest unpushed item's time (ns since the epoch) of what is left."""
    out = {"entries": 0, "entry_bytes": 0, "segments": 0, "segment_bytes": 0, "sessions": 0}
    oldest = None
    for plan, _stamp in entries:
        out["entries"] += 1
        out["entry_bytes"] += plan.size_bytes
        oldest = plan.first_seen_ns if oldest is None else min(oldest, plan.first_seen_ns)
    for work in sessions:
        out["sessions"] += 1
        for _p, size, mtime_ns in work.segments:
            out["segments"] += 1
            out["segment_bytes"] += size
            oldest = mtime_ns if oldest is None else min(oldest, mtime_ns)
    return out, oldest

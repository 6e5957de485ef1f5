"""The recording daemon's lifecycle (``buildidd run``): what runs beside the Recorder, in order.

start: the heap's settings, the Recorder (BPF loaded, running processes
synthesized), the control socket, READY=1.  run: the recording loop, with a
tick after each step (STATUS=, WATCHDOG=1 while steps complete, heap trim, a
SIGHUP's reload and rotation) and quiet waits bounded by the next watchdog
ping and --duration.  stop: STOPPING=1, the control socket closed, the
Recorder closed (rings drained, queued copies finished within
snapshot_stop_budget_s, the end record written).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from buildidd import clock, heap
from buildidd.capture.loop import QUIET_MAX_S
from buildidd.capture.recorder import Recorder
from buildidd.cli.service import Signals, Ticker, notify, watchdog_interval_s
from buildidd.config import Config
from buildidd.errors import BuildiddError

log = logging.getLogger("buildidd")

__all__ = ["Daemon"]


class Daemon:
    """``buildidd run``: a Recorder, its control socket and its service-manager protocol.

    Args:
        config: the configuration at start.
        reload_config: re-reads the configuration (on SIGHUP); raises BuildiddError when it is bad.
        session_dir: an exact session directory, or None for a new one under session_root.
        duration_s: stop after this many seconds (None: at SIGTERM or SIGINT).
    """

    def __init__(self, config: Config, reload_config: Callable[[], Config], session_dir: str | None = None,
                 duration_s: float | None = None):
        self.config = config
        self.reload_config = reload_config
        self.duration_s = duration_s
        self.signals = Signals()
        self.rec = Recorder(config, session_dir=session_dir)
        self.server = None
        self.wd_s = watchdog_interval_s()
        self._tickers: list[Ticker] = []
        self._watchdog: Ticker | None = None

    # -- lifecycle ---------------------------------------------------------
    def start(self) -> None:
        """Load BPF and synthesize (Recorder.start), listen on the control socket, send READY=1.

        Raises:
            ProbeError, SessionLogError, StoreError: the Recorder could not start.
            BuildiddError: the control socket is taken (the Recorder is closed first).
        """
        log.info("loading BPF programs and synthesizing running processes ...")
        self.rec.start()
        self.rec.wake_on_signals()
        if self.config.control_socket:
            self._listen()
        notify(f"READY=1\nSTATUS=recording into {self.rec.session_dir}")
        log.info("recording into %s (ready in %.2f s, %d mappings synthesized)",
                 self.rec.session_dir, self.rec.ready_s, self.rec.stats.synthesized)
        rec, wd_s = self.rec, self.wd_s
        # WATCHDOG=1 only while the recording loop completes steps: a thread stuck
        # in one stops the pings, and systemd restarts the unit (WatchdogSec=).
        self._watchdog = Ticker(wd_s, lambda: rec.guard.progressing(wd_s) and notify("WATCHDOG=1"))
        self._tickers = [Ticker(2.0, lambda: notify(f"STATUS={rec.status_line()}")), self._watchdog,
                         Ticker(heap.TRIM_INTERVAL_S, heap.trim)]   # first trim: what start-up left free

    def _listen(self) -> None:
        from buildidd.control.handlers import make_handlers
        from buildidd.control.server import ControlServer, ServerOptions
        cfg = self.config
        self.server = ControlServer(cfg.control_socket, make_handlers(self.rec), ServerOptions(group=cfg.control_group))
        try:
            self.server.start()
        except FileExistsError as e:  # a second daemon started meanwhile, or not a socket
            self.rec.close()
            raise BuildiddError(f"control socket {cfg.control_socket}: {e.strerror}; stop the other buildidd "
                                "(systemctl stop buildidd) or give --control-socket PATH") from e

    def run(self) -> None:
        """The recording loop until SIGTERM/SIGINT or the duration; then stop().

        Raises:
            BuildiddError: too many failed steps in a row (the end record says so).
        """
        try:
            self.rec.run(self._should_stop, self._tick, self._quiet_s)
        finally:
            self.stop()

    def stop(self) -> None:
        """STOPPING=1, close the control socket, close the Recorder (its end record)."""
        notify("STOPPING=1")
        if self.server is not None:
            self.server.stop()
            self.server = None
        self.rec.close()

    # -- the loop's callbacks --------------------------------------------------
    def _tick(self) -> None:
        now = time.monotonic()
        for ticker in self._tickers:
            ticker.poke(now)
        if self.signals.reload:
            self.signals.reload = False
            self._reload()

    def _reload(self) -> None:
        """SIGHUP: apply the re-read configuration (a bad one keeps the old), then rotate."""
        try:
            self.rec.reconfigure(self.reload_config())
            self.rec.last_reload = {"time_ns": clock.boot_ns(), "ok": True, "error": None}
            log.info("configuration reloaded")
        except BuildiddError as e:
            self.rec.last_reload = {"time_ns": clock.boot_ns(), "ok": False, "error": str(e)}
            self.rec.last_errors.append({"time_ns": self.rec.last_reload["time_ns"], "error": f"config reload: {e}"})
            log.error("reload failed, keeping the old configuration: %s", e)
        self.rec.rotate()

    def _should_stop(self) -> bool:
        return self.signals.stop or (self.duration_s is not None
                                     and time.monotonic() - self.rec.started_mono >= self.duration_s)

    def _quiet_s(self) -> float:
        """How long an idle loop may wait without a step: not past the next WATCHDOG=1 (sent by
        the tick after a step) nor the duration."""
        now = time.monotonic()
        bound = QUIET_MAX_S
        if self.wd_s is not None:
            bound = min(bound, self._watchdog.next - now)
        if self.duration_s is not None:
            bound = min(bound, self.duration_s - (now - self.rec.started_mono))
        return bound

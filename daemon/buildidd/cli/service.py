"""Running as a service: sd_notify, the journal, signals, periodic status.

Under systemd (Type=notify) the daemon says READY=1 once the BPF programs are
attached and running processes are synthesized, keeps a one-line STATUS=,
pings WATCHDOG=1 at half of WatchdogSec, and says STOPPING=1 on shutdown.
Outside systemd (no NOTIFY_SOCKET) every notification is a no-op.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time

log = logging.getLogger(__name__)

try:  # Debian's python3-systemd (seen through the venv's system site-packages)
    from systemd import daemon as _sd_daemon
    from systemd import journal as _sd_journal
except ImportError:  # pragma: no cover - the set-up installs it
    _sd_daemon = None
    _sd_journal = None


def notify(state: str) -> bool:
    """Send an sd_notify(3) state string ("READY=1", "STATUS=...") to $NOTIFY_SOCKET.

    Returns False when there is no NOTIFY_SOCKET or the send failed (never raises).
    """
    if not os.environ.get("NOTIFY_SOCKET"):
        return False
    if _sd_daemon is not None:
        try:
            return bool(_sd_daemon.notify(state))
        except OSError:
            return False
    addr = os.environ["NOTIFY_SOCKET"]
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(state.encode(), addr)
        return True
    except OSError:
        return False


def watchdog_interval_s() -> float | None:
    """Half of $WATCHDOG_USEC in seconds when the watchdog is meant for this process, else None."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6
    except ValueError:
        return None


def setup_logging(verbose: bool) -> None:
    """Log to the journal under systemd (JOURNAL_STREAM set), else to stderr."""
    level = logging.DEBUG if verbose else logging.INFO
    root = logging.getLogger()
    root.setLevel(level)
    if os.environ.get("JOURNAL_STREAM") and _sd_journal is not None:
        handler: logging.Handler = _sd_journal.JournalHandler(SYSLOG_IDENTIFIER="buildidd")
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("buildidd: %(message)s"))
    root.handlers[:] = [handler]


class Signals:
    """SIGTERM/SIGINT set stop; SIGHUP sets reload. Flags are polled by the main loop."""

    def __init__(self):
        self.stop = False
        self.reload = False
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_hup)

    def _on_stop(self, signum, _frame):
        self.stop = True

    def _on_hup(self, signum, _frame):
        self.reload = True


class Ticker:
    """Calls fn at most every interval_s seconds when poked."""

    def __init__(self, interval_s: float | None, fn):
        self.interval_s = interval_s
        self.fn = fn
        self.next = 0.0

    def poke(self, now: float | None = None) -> None:
        """Call fn if interval_s has passed since the last call (now: time.monotonic())."""
        if self.interval_s is None:
            return
        now = time.monotonic() if now is None else now
        if now >= self.next:
            self.next = now + self.interval_s
            self.fn()

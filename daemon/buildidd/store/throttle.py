"""The copy throttle: a token bucket limiting the snapshot copies to a rate in bytes/s."""

from __future__ import annotations

import threading
import time

__all__ = ["TokenBucket"]


class TokenBucket:
    """Limits a byte stream to rate_bytes_per_s (burst: one second's worth); 0 = unlimited.

    Called (``bucket(nbytes)``) by the store after each chunk it copies (Store.throttle), on the
    snapshot thread; :meth:`lift` is called from another (Snapshotter.stop).  Every field is
    guarded by :attr:`_lock`; the sleep is taken without it.
    """

    def __init__(self, rate_bytes_per_s: int):
        self._lock = threading.Lock()
        #: bytes/s (0: unlimited).  Guarded by _lock.
        self.rate = rate_bytes_per_s
        #: bytes that may be copied now without a wait (negative: owed).  Guarded by _lock.
        self._tokens = float(rate_bytes_per_s)
        #: time.monotonic() of the last refill.  Guarded by _lock.
        self._t = time.monotonic()

    def lift(self) -> None:
        """No limit from now on (any thread): the copies left run at full speed."""
        with self._lock:
            self.rate = 0

    def __call__(self, nbytes: int) -> None:
        """Account nbytes just copied; sleep while more was copied than the rate allows."""
        with self._lock:
            rate = self.rate
            if rate <= 0:
                return
            now = time.monotonic()
            self._tokens = min(rate, self._tokens + (now - self._t) * rate)
            self._t = now
            self._tokens -= nbytes
            wait_s = -self._tokens / rate if self._tokens < 0 else 0.0
        if wait_s:
            time.sleep(wait_s)

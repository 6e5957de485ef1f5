"""Exec pins: a descriptor of every executed file, opened by the kernel at exec time.

A short-lived program that is renamed over (a package upgrade, a rebuild)
the moment it exits leaves no route to its bytes by the time a hand-over
worker gets to it: /proc/PID is gone and its path names another inode.  So
the file is pinned at exec: a fanotify group (fanotify(7), Linux 5.0+ for
``FAN_OPEN_EXEC``) marks every local file system (``FAN_MARK_FILESYSTEM``,
the super block, so every mount of it in every mount namespace), and for
each exec, the ELF interpreter's open included, the kernel queues an event
holding a reference to the exact file that was opened (fs/notify/fanotify:
the event keeps the ``struct path``; the descriptor is made when the event
is read).  The inode and its bytes then outlive a rename or unlink for as
long as the pin is held.

Hand-overs (resolve.routes.Routes.hand_over) take a pin by identity before
any path route: :meth:`ExecPins.take`.  A pin nobody asks for (a file whose
build-id was handed over before at that path) is closed after ``ttl_s``, or
at once when the hand-over says so (:meth:`ExecPins.release`); a file handed
to the store (or found settled there) gets an evictable ignore mark
(``FAN_MARK_IGNORED_MASK | FAN_MARK_EVICTABLE``, Linux 5.19), so its later
execs make no event until it is modified (an ignore mask is cleared by a
modification unless ``FAN_MARK_IGNORED_SURV_MODIFY``) or its inode leaves
the cache (an evictable mark never pins an inode).

Bounds: at most ``max_files`` pins (beyond it the oldest pin of the user,
other than root, whose files hold the most is closed, counted ``file_cap``:
one user's flood of execs closes that user's pins first); the group's queue
is the kernel's default (16,384 events), an overflow is counted
(``overflow``).  Only file systems whose contents the kernel serves itself
are marked (:mod:`buildidd.resolve.fanotify`): reading a FUSE event would
make the kernel call the FUSE server to open the file, on this thread.  The thread makes no other call on a user's file: ``fstat`` and
``close`` on the descriptor the kernel opened, and ``fanotify_mark`` on it.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import stat
import threading
import time
from dataclasses import dataclass

from buildidd.kernel.events import Identity
from buildidd.resolve.fanotify import FAN_Q_OVERFLOW, FanotifyGroup
from buildidd.resolve.procfs import identity_of, mismatch

log = logging.getLogger(__name__)

__all__ = ["ExecPins", "PinPolicy"]

@dataclass(frozen=True)
class PinPolicy:
    """How many exec pins are held, and for how long.

    Attributes:
        max_files: pins held at most (each one open descriptor); the oldest is closed beyond it.
        ttl_s: seconds a pin nobody took is held (the recording thread and a hand-over worker
            must reach its exec within it, a storm's backlog included).
    """

    max_files: int = 1024
    ttl_s: float = 30.0


@dataclass
class _Pin:
    fd: int
    st: os.stat_result
    pid: int
    since: float            # time.monotonic() of the event


class ExecPins:
    """The exec pins: a :class:`FanotifyGroup`, its reader thread and the descriptors it holds
    (see the module docstring).

    Args:
        policy: bounds (:class:`PinPolicy`).
        mountinfo: the mount table read to find the file systems to mark.
    """

    def __init__(self, policy: PinPolicy = PinPolicy(), mountinfo: str = "/proc/self/mountinfo"):
        self.policy = policy
        self.mountinfo = mountinfo
        self.group: FanotifyGroup | None = None
        self._lock = threading.Lock()
        self._reading = threading.Lock()         # one reader of the group's queue at a time
        self._pins: collections.OrderedDict[tuple[int, int], _Pin] = collections.OrderedDict()
        self._released: collections.deque[Identity] = collections.deque(maxlen=65536)
        self._stop = threading.Event()
        self._wake_r, self._wake_w = -1, -1
        self._thread: threading.Thread | None = None
        self.stats = {"events": 0, "pinned": 0, "repeats": 0, "taken": 0, "released": 0, "expired": 0,
                      "file_cap": 0, "overflow": 0, "not_regular": 0, "read_errors": 0}
        self.last_error: str | None = None

    # -- lifecycle ---------------------------------------------------------
    def start(self) -> None:
        """Make the group, mark every pinnable file system, start the reader thread.

        Raises:
            OSError: fanotify_init failed; nothing is left open.
        """
        self.group = FanotifyGroup(self.mountinfo)
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self.group.mark_mounts()
        self._thread = threading.Thread(target=self._run, name="buildidd-execpins", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread, close every pin and the group.  The group's descriptor is closed only
        with no read of it in progress (a hand-over may be reading it: take), and the thread's
        own descriptors only once it has ended (a descriptor number closed under a reader could
        be reused by another file meanwhile)."""
        self._stop.set()
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            for pin in self._pins.values():
                os.close(pin.fd)
            self._pins.clear()
        if self._thread is not None and self._thread.is_alive():
            return                       # left to the process's exit
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1
        if self.group is not None and self._reading.acquire(timeout=2.0):
            try:
                self.group.close()
            finally:
                self._reading.release()
        # else: a hand-over is stuck reading the group (a file system that does not answer): the
        # descriptor is left to the process's exit rather than closed under it.

    @property
    def enabled(self) -> bool:
        """True while the group exists."""
        return self.group is not None and self.group.fd >= 0

    def marked(self) -> int:
        """Super blocks marked."""
        return len(self.group.marked) if self.group is not None else 0

    # -- the hand-over workers' side ------------------------------------------
    def take(self, ident: Identity, named_at_event: bool = True) -> int | None:
        """The pinned descriptor of ident's file (the caller closes it), or None.

        The pin is matched by (dev, inode) and accepted only when the descriptor's
        identity agrees with ident (resolve.procfs.mismatch; named_at_event as
        procfs.stat_identity's).  A pin that disagrees stays (another exec may
        be of it).  When none is held and ident's file system is marked, the
        group's queue is read first (the exec's event may still wait in it: the
        reader thread and the recording thread run apart).  Any thread.
        """
        key = (ident.dev, ident.ino)
        if key not in self._pins and self.group is not None and ident.dev in self.group.marked:
            self._read_events()
        with self._lock:
            pin = self._pins.get(key)
            if pin is None and os.major(ident.dev) == 0:
                # btrfs gives stat(2) a subvolume's anonymous dev and the kernel side the super
                # block's (resolve.procfs.mismatch): the same inode under another major-0 dev.
                key = next((k for k in self._pins if k[1] == ident.ino and os.major(k[0]) == 0), key)
                pin = self._pins.get(key)
            if pin is None:
                return None
            try:
                got = identity_of(pin.fd, ident.generation != 0, named_at_event)
            except OSError:
                return None
            if mismatch(ident, got) is not None:
                return None
            del self._pins[key]
            self.stats["taken"] += 1
        return pin.fd

    def covers(self, dev: int) -> bool:
        """True when execs of files on dev (st_dev) are pinned: its file system is marked.  A set
        lookup, no system call (the recording thread asks)."""
        return self.group is not None and dev in self.group.marked

    def release(self, ident: Identity) -> None:
        """ident's file needs no pin (settled in the store, or handed over before at its path):
        the reader thread closes its pin and sets its ignore mark.  Any thread; no system call."""
        self._released.append(ident)

    def ignore(self, fd: int) -> None:
        """FanotifyGroup.ignore: fd's file (handed to the store) makes no exec event until modified."""
        if self.group is not None:
            self.group.ignore(fd)

    def mark_exe_of(self, pid: int, dev: int) -> bool:
        """FanotifyGroup.mark_exe_of (hand-over workers: a file system met in another mount namespace)."""
        return self.group.mark_exe_of(pid, dev) if self.enabled else False

    def status(self) -> dict:
        """Counters (JSON-ready): events read, pins made, taken, released, expired, closed at the
        cap (``file_cap``), queue overflows; ``held`` now, ``marked`` super blocks, the group's
        mark counters."""
        g = self.group
        return {**self.stats, **(g.stats if g is not None else {}), "held": len(self._pins),
                "marked": self.marked(), "max_files": self.policy.max_files, "ttl_s": self.policy.ttl_s,
                "enabled": self.enabled, "last_error": self.last_error or (g.last_error if g else None)}

    # -- the reader thread -------------------------------------------------
    def _run(self) -> None:
        ep = select.epoll()
        mi = -1
        try:
            ep.register(self.group.fd, select.EPOLLIN)
            ep.register(self._wake_r, select.EPOLLIN)
            try:
                mi = os.open(self.mountinfo, os.O_RDONLY | os.O_CLOEXEC)
                ep.register(mi, select.EPOLLPRI | select.EPOLLERR)
            except OSError:
                mi = -1
            while not self._stop.is_set():
                for fd, _ev in ep.poll(1.0):
                    if fd == self.group.fd:
                        self._read_events()
                    elif fd == mi:
                        os.lseek(mi, 0, os.SEEK_SET)
                        os.read(mi, 1 << 16)        # re-arm: POLLPRI stays up until the table is read
                        self.group.mark_mounts()
                    elif fd == self._wake_r:
                        os.read(self._wake_r, 64)
                self._expire()
        except Exception as e:     # the thread must not die silently; pins stop, recording goes on
            self.last_error = f"reader: {e}"
            log.exception("exec pins: reader thread failed")
        finally:
            if mi >= 0:
                os.close(mi)
            ep.close()

    def _read_events(self) -> None:
        """Read what the group's queue holds (the reader thread, or a hand-over that found no pin:
        one at a time)."""
        with self._reading:
            self._read_events_locked()

    def _read_events_locked(self) -> None:
        try:
            for mask, fd, pid in self.group.events():
                self.stats["events"] += 1
                if mask & FAN_Q_OVERFLOW:
                    self.stats["overflow"] += 1
                if fd >= 0:
                    self._pin(fd, pid)
        except (OSError, ValueError) as e:
            self.stats["read_errors"] += 1
            self.last_error = f"read: {e}"

    def _pin(self, fd: int, pid: int) -> None:
        try:
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            return
        if not stat.S_ISREG(st.st_mode):
            self.stats["not_regular"] += 1
            os.close(fd)
            return
        key = (st.st_dev, st.st_ino)
        now = time.monotonic()
        with self._lock:
            old = self._pins.get(key)
            if old is not None and _same_contents(old.st, st):
                old.since = now                 # the same file again: keep one pin, held longer
                self._pins.move_to_end(key)
                self.stats["repeats"] += 1
                os.close(fd)
                return
            if old is not None:
                os.close(old.fd)
            self._pins[key] = _Pin(fd, st, pid, now)
            self._pins.move_to_end(key)
            self.stats["pinned"] += 1
            while len(self._pins) > self.policy.max_files:
                gone = self._pins.pop(self._victim())
                os.close(gone.fd)
                self.stats["file_cap"] += 1

    def _victim(self) -> tuple[int, int]:
        """The pin closed at the cap (lock held): the oldest of the user (st_uid other than root)
        holding the most pins, so that one user exec'ing many files of their own closes their
        own pins first, never root's or another user's; the oldest of all when only root's are
        held."""
        owners = collections.Counter(pin.st.st_uid for pin in self._pins.values() if pin.st.st_uid != 0)
        if not owners:
            return next(iter(self._pins))
        uid = owners.most_common(1)[0][0]
        return next(k for k, pin in self._pins.items() if pin.st.st_uid == uid)

    def _expire(self) -> None:
        now = time.monotonic()
        released: dict[tuple[int, int], Identity] = {}
        while self._released:
            ident = self._released.popleft()
            released[(ident.dev, ident.ino)] = ident
        with self._lock:
            # Only the pin of the very contents released: a newer pin of the inode (modified since) stays.
            drop = [(k, self._pins.pop(k)) for k, ident in released.items()
                    if k in self._pins and self._pins[k].st.st_size == ident.size
                    and self._pins[k].st.st_mtime_ns == ident.mtime_ns]
            self.stats["released"] += len(drop)
            while self._pins:
                k, pin = next(iter(self._pins.items()))
                if now - pin.since < self.policy.ttl_s:
                    break
                del self._pins[k]
                self.stats["expired"] += 1
                drop.append((k, pin))
        for k, pin in drop:
            if k in released:
                self.ignore(pin.fd)
            os.close(pin.fd)


def _same_contents(a: os.stat_result, b: os.stat_result) -> bool:
    return a.st_size == b.st_size and a.st_mtime_ns == b.st_mtime_ns and a.st_ctime_ns == b.st_ctime_ns

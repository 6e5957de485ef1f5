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

Hand-overs (resolve.handover.HandOverJob.run) take a pin by identity before
any path route: :meth:`ExecPins.take`.  A pin nobody asks for (a file whose
build-id was handed over before at that path) is closed after ``ttl_s``, or
at once when the hand-over says so (:meth:`ExecPins.release`); a file the
store holds (copied, or found settled there) gets an evictable ignore mark
(``FAN_MARK_IGNORED_MASK | FAN_MARK_EVICTABLE``, Linux 5.19: the store's
snapshotter calls :meth:`ExecPins.ignore` once the copy is held, never when
it is only queued), so its later execs make no event until it is modified
(an ignore mask is cleared by a modification unless
``FAN_MARK_IGNORED_SURV_MODIFY``) or its inode leaves the cache (an
evictable mark never pins an inode).  A held file with no pin then is remembered
(:data:`HELD_MAX`; inode, size, mtime, ctime): its next event sets the mark through
its own descriptor and makes no pin, and its exec confirmations are dropped.

Charges (:mod:`buildidd.resolve.pinledger`): a pin is charged to the real uid
of the task that exec'd, never to the file's owner.  The event gives a pid
only: its uid is read from /proc/PID/status when the event is read (a user's
cached per pid for :data:`~buildidd.resolve.execuids.UID_CACHE_S`, root's never: a root process may drop
to a user and exec at once), and an exec record of the recording
thread (:meth:`ExecPins.recorded`: "pid P exec'd file F as uid U", from the
ring's EXEC records and EXEC_MAIN/EXEC_INTERP mappings) confirms the pin and
moves it to U.  A process gone before its event was read (a short-lived
program, or a user forking a child per exec) is charged to its exec
record's uid when that came first (the confirmations the recording thread
has published are applied before such an event is charged), else to no known uid
(:data:`~buildidd.resolve.pinledger.UNKNOWN_UID`, a share of its own) until
its record comes: never to the file's owner, which would let a user's execs
of root's files spend root's share.

Failed execs: the kernel opens the file (and queues the event) before an
exec can fail (a bad argv: EFAULT), so a pin is *provisional* until
confirmed.  Once the recording thread has read past the pin's event by
``confirm_s`` (:meth:`ExecPins.recorded` publishes the boot time before its
last drain; :meth:`ExecPins.waiting` says it sleeps with the rings empty, its
progress is then the present) with no exec record for it, the exec failed
and the pin is closed (``exec_failed``).  A repeat event of a provisional pin
does not extend its life.  Without a recording thread (no progress
published) a provisional pin lives until ``ttl_s``.

A hand-over queued for a pinned file (:meth:`ExecPins.claim`, made when its
exec's mapping is handed to the bulk pool) keeps its pin from expiring until
that hand-over has run (:meth:`ExecPins.unclaim`), at most :data:`CLAIM_MAX_S`.

Bounds: at most ``max_files`` pins and ``uid_share`` of them per uid
(pinledger: at a uid's cap its own oldest provisional pin goes first, then
its own oldest, ``uid_cap``; at max_files the uid holding the most pays,
``file_cap``); confirmations waiting for their pin at most
:data:`~buildidd.resolve.pinledger.PENDING_MAX`; the group's queue is the kernel's default (16,384
events; the kernel merges an event with an identical one still queued), an
overflow is counted (``overflow``).  Only file systems whose contents the
kernel serves itself are marked (:mod:`buildidd.resolve.fanotify`): reading
a FUSE event would make the kernel call the FUSE server to open the file, on
this thread.  The thread makes no other call on a user's file: ``fstat`` and
``close`` on the descriptor the kernel opened, and ``fanotify_mark`` on it;
it reads /proc/PID/status of the exec's process.
"""

from __future__ import annotations

import logging
import os
import select
import stat
import threading
import time
from dataclasses import dataclass

from buildidd import clock
from buildidd.kernel.events import Identity
from buildidd.memo import LruCache
from buildidd.resolve.execuids import ExecUids
from buildidd.resolve.fanotify import FAN_Q_OVERFLOW, FanotifyGroup
from buildidd.resolve.pininbox import QUIET, PinInbox, apply_notes, drop_released, is_held, note_held
from buildidd.resolve.pinledger import UNKNOWN_UID, Pin, PinLedger
from buildidd.resolve.procfs import identity_of, mismatch

log = logging.getLogger(__name__)

__all__ = ["CLAIM_MAX_S", "ExecPins", "PinPolicy"]

#: Seconds a claimed pin (a hand-over of it queued) is held at most without an event.
CLAIM_MAX_S = 600.0
#: Files the store holds (release(held=True), ignore) remembered for their ignore mark, at most:
#: ExecPins._held, (st_dev, ino) -> (size, mtime_ns, ctime_ns or 0: unknown), guarded by its _lock.
HELD_MAX = 65536


@dataclass(frozen=True)
class PinPolicy:
    """How many exec pins are held, and for how long.

    Attributes:
        max_files: pins held at most (each one open descriptor).
        ttl_s: seconds a pin nobody took is held (the recording thread and a hand-over worker
            must reach its exec within it, a storm's backlog included).
        uid_share: the share of max_files the pins charged to one uid may take, in (0, 1].
        confirm_s: seconds after a pin's event was read by which the recording thread must have
            read its exec record (the exec's run from its open to sched_process_exec, and the
            rings' ordering, included); past it, an unconfirmed pin is an exec that failed.
    """

    max_files: int = 1024
    ttl_s: float = 30.0
    uid_share: float = 0.25
    confirm_s: float = 2.0


class ExecPins:
    """The exec pins: a :class:`FanotifyGroup`, its reader thread and the descriptors it holds
    (see the module docstring).

    Args:
        policy: bounds (:class:`PinPolicy`).
        mountinfo: the mount table read to find the file systems to mark.
    Locks: :attr:`_lock` guards the ledger, ``stats`` and ``last_error``; :attr:`_reading` lets one
    thread at a time read the group's queue (it is taken before _lock, never inside it); the
    notes other threads leave for the reader thread guard themselves (resolve.pininbox.PinInbox).
    """

    def __init__(self, policy: PinPolicy = PinPolicy(), mountinfo: str = "/proc/self/mountinfo"):
        self.policy = policy
        self.mountinfo = mountinfo
        self.group: FanotifyGroup | None = None
        self._lock = threading.Lock()
        self._reading = threading.Lock()
        #: Guarded by _lock.
        self.ledger = PinLedger(policy.max_files, policy.uid_share)
        self.inbox = PinInbox()
        #: The uid of an event's pid (the reader thread's, or a hand-over's under _reading).
        self._uids = ExecUids()
        self._held: LruCache[tuple[int, int], tuple[int, int, int]] = LruCache("exec_pins_held", HELD_MAX)
        self._stop = threading.Event()
        self._wake_r, self._wake_w = -1, -1
        self._thread: threading.Thread | None = None
        #: Counters.  Guarded by _lock.
        self.stats = {"events": 0, "pinned": 0, "repeats": 0, "taken": 0, "released": 0,
                      "confirms": 0, "uid_unknown": 0, "overflow": 0, "held_ignored": 0, "not_regular": 0, "read_errors": 0}
        #: Guarded by _lock.
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
            for key in list(self.ledger.pins):
                os.close(self.ledger.remove(key).fd)
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

        The pins of ident's (dev, inode) are tried, confirmed ones first, whoever they are charged
        to (the file is the same), and one is accepted only when the descriptor's identity agrees
        with ident (resolve.procfs.mismatch; named_at_event as procfs.stat_identity's).  A pin that
        disagrees stays (another exec may be of it).  When none is held and ident's file system is
        marked, the group's queue is read first (the exec's event may still wait in it: the reader
        thread and the recording thread run apart).  Any thread.
        """
        if not self.ledger.of_inode(ident.dev, ident.ino) and self.group is not None \
                and ident.dev in self.group.marked:
            self._read_events()
        with self._lock:
            keys = self.ledger.of_inode(ident.dev, ident.ino)
            if not keys and os.major(ident.dev) == 0:
                # btrfs gives stat(2) a subvolume's anonymous dev and the kernel side the super
                # block's (resolve.procfs.mismatch): the same inode under another major-0 dev.
                dev = next((d for d, i in self.ledger.inodes() if i == ident.ino and os.major(d) == 0), None)
                keys = self.ledger.of_inode(dev, ident.ino) if dev is not None else []
            for key in keys:
                pin = self.ledger.pins[key]
                try:
                    got = identity_of(pin.fd, ident.generation != 0, named_at_event)
                except OSError:
                    continue
                if mismatch(ident, got) is None:
                    self.ledger.remove(key)
                    self.ledger.count(key[2], "taken")
                    self.stats["taken"] += 1
                    return pin.fd
        return None

    def closed_reason(self, ident: Identity, uid: int) -> str | None:
        """``file_cap`` or ``uid_pin_cap`` when a cap closed the pin of ident's file charged to uid
        (or to no known uid) lately: the reason a hand-over that found no pin gives its gap; None
        otherwise (pinledger.PinLedger.closed_reason).  Any thread."""
        with self._lock:
            return self.ledger.closed_reason(ident.dev, ident.ino, uid)

    def covers(self, dev: int) -> bool:
        """True when execs of files on dev (st_dev) are pinned: its file system is marked.  A set
        lookup, no system call (the recording thread asks)."""
        return self.group is not None and dev in self.group.marked

    def release(self, ident: Identity, held: bool = False) -> None:
        """ident's file needs no pin (handed over before at its path; held: the store holds it, so
        its inode also gets the ignore mark): the reader thread closes its pins but a claimed one.
        Any thread; no system call."""
        self.inbox.release(ident, held)

    def ignore(self, fd: int, remember: bool = True) -> None:
        """FanotifyGroup.ignore: fd's file (the store holds it, remember: noted as held) makes no exec
        event until modified.  Called once the copy is held (the snapshotter's on_held), or when settled."""
        if self.group is not None:
            self.group.ignore(fd)
            if remember and (ident := _fd_identity(fd)) is not None:
                self.inbox.release(ident, True)

    def mark_exe_of(self, pid: int, dev: int) -> bool:
        """FanotifyGroup.mark_exe_of (hand-over workers: a file system met in another mount namespace)."""
        return self.group.mark_exe_of(pid, dev) if self.enabled else False

    # -- the recording thread's side (no system call: PinInbox notes) --------------------------
    def recorded(self, execs: list[tuple[int, int, int, int, int]], until_ns: int) -> None:
        """The recording thread took every ring record of time before until_ns (ns since boot: the
        time before its drain); execs: (pid, uid, kernel dev_t, ino, time_ns) of each exec record
        and exec mapping it took (capture.tables.Tables.execs), which confirm their pins."""
        self.inbox.recorded(execs, until_ns)

    def waiting(self) -> None:
        """The recording thread sleeps with the rings empty (a quiet wait): its progress is the
        present until its next recorded()."""
        self.inbox.waiting()

    def claim(self, ident: Identity, pid: int, uid: int) -> None:
        """A hand-over of ident's file, exec'd by pid as uid, is queued: its pin is confirmed and
        held until unclaim (at most CLAIM_MAX_S)."""
        self.inbox.claim(ident, pid, uid)

    def unclaim(self, ident: Identity) -> None:
        """The hand-over claim() announced has run (or was dropped): ident's pins expire again."""
        self.inbox.unclaim(ident)

    def status(self) -> dict:
        """Counters (JSON-ready): events read, pins made, taken, released, expired, closed at the
        caps (``file_cap``: max_files; ``uid_cap``: a uid's share), closed as failed execs
        (``exec_failed``), exec confirmations read (``confirms``) and dropped unread, pins charged to
        no known uid (``uid_unknown``), queue overflows; ``held`` now, ``unconfirmed`` of them,
        ``by_uid`` (the uids that pinned the most: pinledger.UID_COUNTERS and ``held``), ``marked``
        super blocks, the group's mark counters."""
        g = self.group
        led = self.ledger
        with self._lock:
            mine = {**self.stats, "confirms_dropped": self.inbox.dropped(), **led.totals, "held": len(led),
                    "unconfirmed": len(led.unconfirmed), "pending_confirms": len(led.pending),
                    "by_uid": led.top_uids(), "uid_max": led.uid_max}
            last_error = self.last_error
        return {**mine, **(g.stats if g is not None else {}), "marked": self.marked(),
                "max_files": self.policy.max_files, "ttl_s": self.policy.ttl_s, "confirm_s": self.policy.confirm_s,
                "enabled": self.enabled, "last_error": last_error or (g.last_error if g else None)}

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
            last = 0.0
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
                if time.monotonic() - last >= 0.1:   # a flood of events does not run this per read
                    last = time.monotonic()
                    self._expire()
        except Exception as e:     # the thread must not die silently; pins stop, recording goes on
            with self._lock:
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
        """Pin each event's file (caller holds _reading, not _lock)."""
        try:
            for mask, fd, pid in self.group.events():
                with self._lock:
                    self.stats["events"] += 1
                    self.stats["overflow"] += bool(mask & FAN_Q_OVERFLOW)
                if fd >= 0:
                    self._pin(fd, pid)
        except (OSError, ValueError) as e:
            with self._lock:
                self.stats["read_errors"] += 1
                self.last_error = f"read: {e}"

    def _pin(self, fd: int, pid: int) -> None:
        try:
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            return
        if not stat.S_ISREG(st.st_mode):
            with self._lock:
                self.stats["not_regular"] += 1
            os.close(fd)
            return
        with self._lock:
            pending = self.ledger.pending.pop((st.st_dev, st.st_ino, pid), None)
            self.stats["held_ignored"] += (held := pending is None and is_held(self._held, self.ledger, st))
        if held:
            return _ignore_and_close(self, fd)
        pending, uid, closed = _charged_to(self, st, pid, pending)
        key = (st.st_dev, st.st_ino, uid)
        now = time.monotonic()
        with self._lock:
            old = self.ledger.pins.get(key)
            if old is not None and _same_contents(old.st, st):
                self.ledger.refresh(key, now)     # the same file again, by the same user: one pin
                self.stats["repeats"] += 1
                closed.append(fd)
                if pending is not None:
                    closed += [p.fd for p in self.ledger.confirm(key, uid, pending[1])[1]]
            else:
                closed += [self.ledger.remove(key).fd] if old is not None else []
                pin = Pin(fd, st, pid, uid, now, clock.boot_ns(), pending is not None,
                          int(pending is not None and pending[1]))
                closed += [p.fd for p in self.ledger.add(key, pin)]
                self.stats["pinned"] += 1
                self.stats["uid_unknown"] += uid == UNKNOWN_UID
        for c in closed:
            os.close(c)

    def _expire(self) -> None:
        """The reader thread's round: confirmations and claims read, released pins closed, failed
        execs' pins closed, pins past their ttl closed."""
        notes = self.inbox.take()               # the progress covers every confirmation taken with it
        progress = notes.progress_ns
        with self._lock:
            self.stats["confirms"] += len(notes.confirms)
            closed = [(p, False) for p in apply_notes(self.ledger, notes, time.monotonic(), self.policy.ttl_s,
                                                      self._held.entries)]
            note_held(self._held, notes.released)
            released = drop_released(self.ledger, notes.released)
            self.stats["released"] += len(released)
            closed += released
            if progress is not None:
                due = (clock.boot_ns() if progress == QUIET else progress) - int(self.policy.confirm_s * 1e9)
                closed += [(p, False) for p in self.ledger.failed(due)]
            closed += [(p, False) for p in self.ledger.expired(time.monotonic(), self.policy.ttl_s, CLAIM_MAX_S)]
        for pin, ignore in closed:
            if ignore:
                self.ignore(pin.fd, remember=False)     # remembered from its release
            os.close(pin.fd)


def _charged_to(pins: ExecPins, st: os.stat_result, pid: int, pending: tuple | None) -> tuple:
    """The uid an event of pid's exec of st's file is charged to: its exec record's (pending, a
    confirmation that came first), else pid's real uid (ExecUids).  For a gone process (no known uid)
    the confirmations published so far (PinInbox.take_confirms) are applied first: one of them may
    give its uid (a short-lived program whose record the recording thread read while the reader was
    behind); without this, under a flood that fills the no-known-uid share, such a pin could be closed
    at that cap before its confirmation came round.  Returns (the confirmation or None, the uid, the
    descriptors of pins the confirmations' moves closed at their caps: the caller closes them)."""
    if pending is not None:
        return pending, pending[0], []
    uid = pins._uids.of(pid)
    notes = pins.inbox.take_confirms() if uid == UNKNOWN_UID else None
    if not notes or not notes.confirms:
        return None, uid, []
    with pins._lock:
        pins.stats["confirms"] += len(notes.confirms)
        closed = [p.fd for p in apply_notes(pins.ledger, notes, time.monotonic(), pins.policy.ttl_s,
                                            pins._held.entries)]
        pending = pins.ledger.pending.pop((st.st_dev, st.st_ino, pid), None)
    return pending, pending[0] if pending is not None else uid, closed


def _ignore_and_close(pins: ExecPins, fd: int) -> None:
    """An event of a held file: the ignore mark set through its descriptor (the exact inode the kernel
    opened), which is then closed; no pin."""
    pins.ignore(fd, remember=False)
    os.close(fd)


def _fd_identity(fd: int) -> Identity | None:
    """fd's file's Identity from fstat (generation 0: not compared here), None when fstat fails."""
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return Identity(st.st_dev, st.st_ino, 0, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _same_contents(a: os.stat_result, b: os.stat_result) -> bool:
    return a.st_size == b.st_size and a.st_mtime_ns == b.st_mtime_ns and a.st_ctime_ns == b.st_ctime_ns

"""The exec pins' ledger: which pins are held, the user each is charged to, and which goes first at a cap.

Pure bookkeeping, no system call: :mod:`buildidd.resolve.execpins` holds the
descriptors, reads the events and calls this under its lock; the descriptors
this hands back (closed pins) are closed by the caller.

A pin is keyed by (st_dev, st_ino, uid): each user who exec'd a file holds
their own pin of it, so that one user's execs of a file never stand in for,
extend or close another user's pin of the same file.  The uid is the real
uid of the task that exec'd (read from /proc/PID/status by the reader, or
given by an exec record: :meth:`PinLedger.confirm`), never the file's owner;
:data:`UNKNOWN_UID` when neither was had (the process was gone before its
event was read and no exec record named it yet).

A pin is *provisional* until an exec record of the recording thread confirms
it (the exec succeeded: :meth:`PinLedger.confirm`); one still unconfirmed
once the recording thread has read past its event plus ``confirm_s`` is an
exec that failed and is closed (:meth:`PinLedger.unconfirmed_due`).

Bounds: each uid holds at most ``uid_max`` pins (a share of ``max_files``);
beyond it that uid's own oldest provisional pin goes, else its own oldest
unclaimed one, else its own oldest (``uid_cap``).  Beyond ``max_files`` in
all, the uid holding the most pins pays the same way (``file_cap``).  So one
user's flood closes only that user's pins, never root's or another user's.
Which (file, uid) a cap closed is remembered (a bounded set per uid) so that
a hand-over that then finds no pin names the cause (:meth:`PinLedger.closed_reason`).
"""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass, field

__all__ = ["CLOSED_PER_UID", "PENDING_MAX", "Pin", "PinLedger", "UNKNOWN_UID", "UIDS_TRACKED"]

#: The uid a pin is charged to when the task's could not be established.
UNKNOWN_UID = -1
#: (file, uid) closures at a cap remembered per uid, and uids remembered (the oldest forgotten first).
CLOSED_PER_UID = 1024
CLOSED_UIDS = 64
#: uids whose counters are kept (status); beyond, the least active without pins are forgotten.
UIDS_TRACKED = 256
#: Exec confirmations that came before their pin's event was read, kept at most (the oldest dropped).
PENDING_MAX = 16384

Key = tuple[int, int, int]          # (st_dev, st_ino, uid)

#: Counters kept per uid (status ``by_uid``).
UID_COUNTERS = ("pinned", "confirmed", "taken", "exec_failed", "uid_cap", "file_cap", "expired", "released")


@dataclass(eq=False)
class Pin:
    """One exec pin.

    Attributes:
        fd: the descriptor the kernel opened at the exec (the event's); st: its fstat.
        pid: tgid of the exec (fanotify_event_metadata.pid) of the latest event.
        uid: the uid charged (the task's real uid; UNKNOWN_UID when not established).
        since: time.monotonic() of the latest event (pin_ttl_s counts from it).
        read_ns: ns since boot (CLOCK_BOOTTIME) when its first event was read: the exec happened
            before it, so its exec record, if any, carries an earlier or a slightly later time.
        confirmed: an exec record named it (the exec succeeded).
        claimed: hand-overs of it queued (each claim counts one until its hand-over has run): it
            does not expire while one is.
    """

    fd: int
    st: os.stat_result
    pid: int
    uid: int
    since: float
    read_ns: int
    confirmed: bool = False
    claimed: int = 0


@dataclass
class _Holder:
    """One uid's pins, oldest first: provisional ones, and confirmed ones."""

    provisional: collections.OrderedDict = field(default_factory=collections.OrderedDict)
    confirmed: collections.OrderedDict = field(default_factory=collections.OrderedDict)

    def __len__(self) -> int:
        return len(self.provisional) + len(self.confirmed)

    def victim(self, pins: dict) -> Key:
        """The key to close first: the oldest provisional, else the oldest unclaimed, else the oldest."""
        if self.provisional:
            return next(iter(self.provisional))
        return next((k for k in self.confirmed if not pins[k].claimed), None) or next(iter(self.confirmed))


class PinLedger:
    """The pins and their charges (see the module docstring); not thread-safe (the caller locks).

    Args:
        max_files: pins held at most in all.
        uid_share: the share of max_files one uid may hold, in (0, 1].
    """

    def __init__(self, max_files: int, uid_share: float):
        self.max_files = max_files
        self.uid_max = max(1, int(max_files * uid_share))
        self.pins: collections.OrderedDict[Key, Pin] = collections.OrderedDict()   # by latest event
        self.unconfirmed: collections.OrderedDict[Key, int] = collections.OrderedDict()  # by read_ns
        self._inode: dict[tuple[int, int], dict[Key, None]] = {}
        self._holders: dict[int, _Holder] = {}
        self._closed: collections.OrderedDict[int, collections.OrderedDict] = collections.OrderedDict()
        self.by_uid: dict[int, dict[str, int]] = {}
        #: pins closed at a uid's share (``uid_cap``) and at max_files (``file_cap``), all uids
        self.totals = {"uid_cap": 0, "file_cap": 0, "exec_failed": 0, "expired": 0}
        #: (st_dev, ino, pid) -> (uid, claimed, time.monotonic()): exec confirmations whose pin's
        #: event is not read yet (the reader lags the recording thread), oldest first
        self.pending: collections.OrderedDict[tuple[int, int, int], tuple] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self.pins)

    # -- counting ------------------------------------------------------------
    def count(self, uid: int, name: str, n: int = 1) -> None:
        """by_uid[uid][name] += n; the least active uid without pins is forgotten beyond UIDS_TRACKED."""
        row = self.by_uid.get(uid)
        if row is None:
            if len(self.by_uid) >= UIDS_TRACKED:
                idle = [u for u in self.by_uid if u not in self._holders]
                if idle:
                    del self.by_uid[min(idle, key=lambda u: self.by_uid[u]["pinned"])]
            row = self.by_uid[uid] = dict.fromkeys(UID_COUNTERS, 0)
        row[name] += n

    def top_uids(self, n: int = 8) -> dict[str, dict[str, int]]:
        """The n uids that pinned the most, with their counters, pins ``held`` now and how many of
        those are ``unconfirmed`` (JSON-ready)."""
        top = sorted(self.by_uid.items(), key=lambda kv: -kv[1]["pinned"])[:n]
        empty = _Holder()
        return {str(uid): {**row, "held": len(self._holders.get(uid, empty)),
                           "unconfirmed": len(self._holders.get(uid, empty).provisional)} for uid, row in top}

    # -- lookups ---------------------------------------------------------------
    def of_inode(self, dev: int, ino: int) -> list[Key]:
        """Keys of the pins of (dev, ino), confirmed ones first."""
        keys = list(self._inode.get((dev, ino), ()))
        keys.sort(key=lambda k: not self.pins[k].confirmed)
        return keys

    def inodes(self):
        """The (dev, ino) pairs with a pin."""
        return self._inode.keys()

    def closed_reason(self, dev: int, ino: int, uid: int) -> str | None:
        """``file_cap`` or ``uid_pin_cap`` when a cap closed (dev, ino)'s pin charged to uid, or to no
        known uid, recently (the bounded memory of closures); else None."""
        for u in (uid, UNKNOWN_UID):
            got = self._closed.get(u, {}).get((dev, ino))
            if got is not None:
                return got
        return None

    # -- changes ---------------------------------------------------------------
    def add(self, key: Key, pin: Pin) -> list[Pin]:
        """Hold pin under key (none held there); returns the pins the caps closed (the caller closes
        their descriptors): at most one for the uid's share, and at most one for max_files."""
        self.pins[key] = pin
        self._inode.setdefault(key[:2], {})[key] = None
        holder = self._holders.setdefault(key[2], _Holder())
        (holder.confirmed if pin.confirmed else holder.provisional)[key] = None
        if not pin.confirmed:
            self.unconfirmed[key] = pin.read_ns
        self.count(key[2], "pinned")
        if pin.confirmed:
            self.count(key[2], "confirmed")
        closed = []
        if len(self.pins) > self.max_files:
            uid = max(self._holders, key=lambda u: len(self._holders[u]))
            closed.append(self._close_at_cap(self._holders[uid].victim(self.pins), "file_cap", "file_cap"))
        if len(holder) > self.uid_max:
            closed.append(self._close_at_cap(holder.victim(self.pins), "uid_cap", "uid_pin_cap"))
        return closed

    def _close_at_cap(self, key: Key, counter: str, reason: str) -> Pin:
        pin = self.remove(key)
        self.count(key[2], counter)
        self.totals[counter] += 1
        closed = self._closed.pop(key[2], None) or collections.OrderedDict()
        self._closed[key[2]] = closed
        closed.pop(key[:2], None)
        closed[key[:2]] = reason
        while len(closed) > CLOSED_PER_UID:
            closed.popitem(last=False)
        while len(self._closed) > CLOSED_UIDS:
            self._closed.popitem(last=False)
        return pin

    def remove(self, key: Key) -> Pin:
        """Forget the pin under key (KeyError when none); returns it (its descriptor still open)."""
        pin = self.pins.pop(key)
        self.unconfirmed.pop(key, None)
        keys = self._inode[key[:2]]
        del keys[key]
        if not keys:
            del self._inode[key[:2]]
        holder = self._holders[key[2]]
        holder.provisional.pop(key, None)
        holder.confirmed.pop(key, None)
        if not len(holder):
            del self._holders[key[2]]
        return pin

    def refresh(self, key: Key, now: float) -> None:
        """A repeat event of the pin's file by the same uid: a confirmed pin is held longer (ttl from
        now); a provisional one is not (its confirmation is due from its first event, and it still
        expires ttl_s after that: a user's repeats never keep an unconfirmed pin)."""
        pin = self.pins[key]
        if pin.confirmed:
            pin.since = now
            self.pins.move_to_end(key)

    def confirm(self, key: Key, uid: int, claim: bool) -> tuple[Key, list[Pin]]:
        """Mark the pin under key confirmed (an exec record named it), charged to uid (the record's:
        the pin moves to that uid when charged to another, as after a /proc read that came after a
        setuid, or to no known uid; when uid holds a pin of the file already, that one is confirmed and
        this one closed); claim: a hand-over of it is queued.  Returns its key now and the pins closed
        (the caller closes their descriptors): a duplicate, or those a move closed at uid's caps."""
        pin = self.pins[key]
        closed = []
        if key[2] != uid:
            other = (key[0], key[1], uid)
            if other in self.pins:            # that uid has its own pin of the file: it is the one,
                closed.append(self.remove(key))   # this one a second descriptor of the same file
                key, pin = other, self.pins[other]
            else:
                self.remove(key)
                pin.uid = uid
                pin.confirmed = True
                pin.claimed += claim
                return other, self.add(other, pin)
        if not pin.confirmed:
            pin.confirmed = True
            self.unconfirmed.pop(key, None)
            holder = self._holders[key[2]]
            holder.provisional.pop(key, None)
            holder.confirmed[key] = None
            self.count(key[2], "confirmed")
        pin.claimed += claim
        return key, closed

    def confirm_exec(self, file_pid: tuple[int, int, int], uid: int, claim: bool, now: float) -> list[Pin]:
        """An exec record (or a queued hand-over, claim) says pid exec'd (dev, ino) as uid: confirm the
        unconfirmed pin of the file that pid's event made (charged to another uid, or to none known,
        it moves to uid), else uid's pin of the file.  With none, the confirmation waits in :attr:`pending` for its pin's
        event (now: time.monotonic()).  Returns the pins a move closed at uid's caps."""
        dev, ino, pid = file_pid
        keys = self.of_inode(dev, ino)
        key = next((k for k in keys if not self.pins[k].confirmed and self.pins[k].pid == pid), None) or next(
            (k for k in keys if k[2] == uid), None)
        if key is None:
            self.pending[file_pid] = (uid, claim, now)
            self.pending.move_to_end(file_pid)
            return []
        return self.confirm(key, uid, claim)[1]

    def trim_pending(self, before: float) -> None:
        """Forget the waiting confirmations made before `before` (time.monotonic()), and beyond PENDING_MAX."""
        pending = self.pending
        while pending and (len(pending) > PENDING_MAX or next(iter(pending.values()))[2] < before):
            pending.popitem(last=False)

    def failed(self, due_ns: int) -> list[Pin]:
        """Forget the provisional pins whose first event was read at or before due_ns (ns since boot):
        the recording thread has read past them with no exec record, their execs failed
        (``exec_failed``).  Returns them (the caller closes their descriptors)."""
        out = []
        unconfirmed = self.unconfirmed
        while unconfirmed:
            key, read_ns = next(iter(unconfirmed.items()))
            if read_ns > due_ns:
                break
            out.append(self.remove(key))
            self.count(key[2], "exec_failed")
            self.totals["exec_failed"] += 1
        return out

    def expired(self, now: float, ttl_s: float, claimed_ttl_s: float) -> list[Pin]:
        """Forget the pins whose latest event is ttl_s old (a claimed one: claimed_ttl_s) at now
        (time.monotonic()): ``expired``.  Returns them (the caller closes their descriptors)."""
        out = []
        pins = self.pins
        for _ in range(len(pins)):
            key, pin = next(iter(pins.items()))
            age = now - pin.since
            if age < ttl_s:
                break
            if pin.claimed and age < claimed_ttl_s:
                pins.move_to_end(key)          # looked at again when it comes round
                continue
            out.append(self.remove(key))
            self.count(key[2], "expired")
            self.totals["expired"] += 1
        return out

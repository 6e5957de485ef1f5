"""What other threads tell the exec pins' reader thread (resolve.execpins), and how it applies it.

Three kinds of notes reach the reader thread, from threads that must make no
system call for them: a file needs no pin any more (a hand-over found it
handed over before, or the store holds it: :meth:`PinInbox.release`), the
recording thread read exec records and got this far
(:meth:`PinInbox.recorded`, :meth:`PinInbox.waiting`), a hand-over of a
pinned file was queued or has run (:meth:`PinInbox.claim`,
:meth:`PinInbox.unclaim`).  The reader takes them all at once each round
(:meth:`PinInbox.take`) and applies them to its ledger (:func:`apply_notes`,
:func:`drop_released`) under the pins' lock.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from typing import NamedTuple

from buildidd.kernel.events import Identity, kdev_to_st_dev
from buildidd.memo import LruCache
from buildidd.resolve.pinledger import Pin, PinLedger

__all__ = ["CONFIRMS_MAX", "QUIET", "Claim", "Notes", "PinInbox", "apply_notes", "drop_released"]

#: Exec confirmations handed over by the recording thread and not yet read, at most (the oldest dropped).
CONFIRMS_MAX = 65536
#: Releases and claims waiting for the reader, at most each (the oldest dropped).
NOTES_MAX = 65536
#: The recording thread's progress while it waits with the rings empty (PinInbox.waiting).
QUIET = -1


class Claim(NamedTuple):
    """A hand-over of a pinned file queued (claim True, with the exec's pid and uid) or run (False)."""
    claim: bool
    pid: int
    uid: int
    ident: Identity


class Notes(NamedTuple):
    """What PinInbox.take returns: the notes since the last take, oldest first, and the progress."""
    released: list[tuple[Identity, bool]]       #: (identity, held by the store)
    confirms: list[tuple[int, int, int, int, int]]  #: (pid, uid, kernel dev_t, ino, time_ns) of exec records
    claims: list[Claim]
    progress_ns: int | None     #: ns since boot the recording thread read up to; QUIET; None: no recording thread


class PinInbox:
    """The notes for the pins' reader thread (see the module docstring).

    Every field is guarded by :attr:`_lock`; each method takes it (a short append, no system call).
    Attributes:
        confirms_dropped: confirmations dropped unread, beyond CONFIRMS_MAX.
    """

    def __init__(self):
        self._lock = threading.Lock()
        #: Guarded by _lock.
        self._released: deque[tuple[Identity, bool]] = deque(maxlen=NOTES_MAX)
        #: Guarded by _lock.
        self._confirms: deque[tuple[int, int, int, int, int]] = deque(maxlen=CONFIRMS_MAX)
        #: Guarded by _lock.
        self._claims: deque[Claim] = deque(maxlen=NOTES_MAX)
        #: Guarded by _lock.
        self._progress_ns: int | None = None
        #: Guarded by _lock.
        self.confirms_dropped = 0

    def release(self, ident: Identity, held: bool) -> None:
        """ident's file needs no pin (held: the store holds it, so its inode also gets the ignore mark)."""
        with self._lock:
            self._released.append((ident, held))

    def recorded(self, execs: list[tuple[int, int, int, int, int]], until_ns: int) -> None:
        """The recording thread read every ring record before until_ns; execs confirm their pins."""
        with self._lock:
            over = len(self._confirms) + len(execs) - CONFIRMS_MAX
            if over > 0:
                self.confirms_dropped += over
            self._confirms.extend(execs)
            self._progress_ns = until_ns

    def waiting(self) -> None:
        """The recording thread sleeps with the rings empty: its progress is the present."""
        with self._lock:
            self._progress_ns = QUIET

    def claim(self, ident: Identity, pid: int, uid: int) -> None:
        """A hand-over of ident's file, exec'd by pid as uid, is queued."""
        with self._lock:
            self._claims.append(Claim(True, pid, uid, ident))

    def unclaim(self, ident: Identity) -> None:
        """The hand-over claim() announced has run (or was dropped)."""
        with self._lock:
            self._claims.append(Claim(False, 0, 0, ident))

    def take(self) -> Notes:
        """Every note since the last take (the reader thread): read together, so the progress
        covers every confirmation taken with it."""
        with self._lock:
            notes = Notes(list(self._released), list(self._confirms), list(self._claims), self._progress_ns)
            self._released.clear()
            self._confirms.clear()
            self._claims.clear()
        return notes

    def take_confirms(self) -> Notes:
        """The exec records' confirmations only (the reader thread, for an event whose process is gone:
        one of them may name it), without the progress: those taken later still cover what it says."""
        with self._lock:
            notes = Notes([], list(self._confirms), [], None)
            self._confirms.clear()
        return notes

    def dropped(self) -> int:
        """confirms_dropped (any thread)."""
        with self._lock:
            return self.confirms_dropped


def apply_notes(ledger: PinLedger, notes: Notes, now: float, ttl_s: float, held=frozenset()) -> list[Pin]:
    """Confirm the pins the exec records and the hand-overs' claims name (the pins' lock held); a
    confirmation whose pin is not read yet waits in the ledger's pending (trimmed past ttl_s), but
    one of a file in held ((st_dev, ino) keys: the store holds it, its event makes no pin) with no
    pin is dropped.  Returns the pins a move to another uid closed at its caps."""
    closed: list[Pin] = []
    pinned = ledger.inodes()
    for pid, uid, kdev, ino, _t in notes.confirms:
        dev = kdev_to_st_dev(kdev)
        if (dev, ino) in held and (dev, ino) not in pinned:
            continue
        closed += ledger.confirm_exec((dev, ino, pid), uid, False, now)
    for c in notes.claims:
        if c.claim:
            closed += ledger.confirm_exec((c.ident.dev, c.ident.ino, c.pid), c.uid, True, now)
            continue
        for key in ledger.of_inode(c.ident.dev, c.ident.ino):
            pin = ledger.pins[key]
            pin.claimed = max(0, pin.claimed - 1)
    ledger.trim_pending(now - ttl_s)
    return closed


def drop_released(ledger: PinLedger, released: list[tuple[Identity, bool]]) -> list[tuple[Pin, bool]]:
    """Remove the pins of the files released (the pins' lock held): only those of the very contents
    released (a newer pin of the inode, modified since, stays), and none a queued hand-over claimed.
    Returns (pin, give it the ignore mark) for each, one mark per inode, to close."""
    out = []
    for ident, held in released:
        marked = not held
        for key in ledger.of_inode(ident.dev, ident.ino):
            pin = ledger.pins[key]
            if pin.claimed or pin.st.st_size != ident.size or pin.st.st_mtime_ns != ident.mtime_ns:
                continue
            ledger.remove(key)
            _dev, _ino, uid = key
            ledger.count(uid, "released")
            out.append((pin, not marked))
            marked = True                 # one ignore mark per inode
    return out


def note_held(held: LruCache, released: list[tuple[Identity, bool]]) -> None:
    """Remember the files released as held by the store (held: (st_dev, ino) -> (size, mtime_ns,
    ctime_ns, 0 when unknown)), whether or not a pin of them is open (ExecPins' ignore at next event)."""
    for ident, is_store_held in released:
        if is_store_held:
            held.put((ident.dev, ident.ino), (ident.size, ident.mtime_ns, ident.ctime_ns))


def is_held(held: LruCache, ledger: PinLedger, st: os.stat_result) -> bool:
    """True when st's file has no pin and its contents (size, mtime, ctime when known) are the ones
    remembered in held (note_held): its exec event then only sets the ignore mark."""
    got = held.peek((st.st_dev, st.st_ino))
    return got is not None and got[:2] == (st.st_size, st.st_mtime_ns) and got[2] in (0, st.st_ctime_ns) \
        and (st.st_dev, st.st_ino) not in ledger.inodes()

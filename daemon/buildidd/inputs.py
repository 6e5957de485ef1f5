"""Addresses and times as people type and paste them, and times as people read them.

The one parser of each, shared by every verb that takes an address or a time
(``lookup``, ``resolve``, ``show``, and any later one); a usage error is
:class:`~buildidd.errors.UsageError` (exit status 2) naming the forms accepted.

Addresses (:func:`parse_address`, :func:`parse_address_range`):

* hex as ``/proc/PID/maps`` and perf print it (``7f3c75c44000``), or with
  ``0x``; a ``/proc/PID/maps`` range ``55be404ab000-55be404ac000`` (its
  start, for a verb that takes one address);
* decimal only when the caller asks (``--decimal``; ``0x...`` stays hex).
  Digits alone are hex, as maps prints them, except when read as hex they lie
  beyond user space (:data:`USER_SPACE_END`) while read as decimal they do
  not: such a number can only be decimal, and is refused with the hint.

Times (:class:`SessionClock`), always returned as ns since boot (CLOCK_BOOTTIME,
the clock of every record's ``time_ns``):

* ``3923009122689``: ns since boot;
* ``1905.521357``: seconds since boot with a fraction (perf script's
  ``sec.usec``, ``--ns``'s ``sec.nsec``; a trailing ``:`` as perf prints it is
  ignored).  perf's default clock does not count suspend, CLOCK_BOOTTIME does:
  they agree on a host never suspended; ``perf record -k boottime`` makes them agree always;
* ISO 8601 wall-clock (``2026-11-23T14:05:00.123456789+01:00``,
  ``2026-11-23 14:05``; no zone: local time);
* ``HH:MM[:SS[.frac]]``: that wall-clock time today (local);
* ``now``, ``today``, ``yesterday``, ``tomorrow`` (midnight, local);
* relative to now, as journalctl: ``-40s``, ``-2min``, ``-1h30min``, ``+5min``.

Wall-clock forms go through the session record's ``boot_to_wall_offset_ns``
(clock.wall_ns's inverse).  Human output shows times as local (or UTC)
wall-clock ISO 8601 with the zone (:meth:`SessionClock.format`).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from functools import lru_cache

from buildidd import clock
from buildidd.config import parse_duration
from buildidd.errors import ConfigError, UsageError

#: The end of user space on x86-64 (47-bit) and arm64 (48-bit) address spaces: a
#: number of decimal digits whose hex reading is at or above it, and whose decimal
#: reading is below it, can only be meant as decimal.
USER_SPACE_END = 1 << 48

_HEX_RE = re.compile(r"(0[xX])?([0-9a-fA-F]{1,16})")
_DEC_RE = re.compile(r"[0-9]{1,20}")
_MAX_TEXT = 80

ADDRESS_FORMS = ("give hex as /proc/PID/maps and perf print it (7f3c75c44000 or 0x7f3c75c44000, "
                 "or a maps range 7f3c75c44000-7f3c75c46000), or decimal with --decimal")


def _one(text: str, decimal: bool, whole: str) -> int:
    m = _HEX_RE.fullmatch(text)
    if decimal and not (m and m.group(1)):
        if _DEC_RE.fullmatch(text) and int(text) < 1 << 64:
            return int(text)
    elif m:
        value = int(m.group(2), 16)
        if not m.group(1) and text.isdigit() and value >= USER_SPACE_END and int(text) < USER_SPACE_END:
            raise UsageError(f"address {whole[:40]!r} has only decimal digits and, read as hex as "
                             f"/proc/PID/maps prints it ({value:#x}), lies beyond user space: if it is "
                             f"decimal ({int(text):#x}), pass --decimal; if it is hex, write 0x{text}")
        return value
    elif not decimal and _DEC_RE.fullmatch(text) and int(text) < 1 << 64:
        raise UsageError(f"address {whole[:40]!r} has only decimal digits and is too long for hex: "
                         f"if it is decimal ({int(text):#x}), pass --decimal")
    raise UsageError(f"address {whole[:40]!r}: {ADDRESS_FORMS}")


def parse_address_range(text: str, *, decimal: bool = False) -> tuple[int, int]:
    """``[start, end)`` in bytes from an address (``end = start + 1``) or a maps range ``START-END``.

    Raises:
        UsageError: a malformed address (see the module doc), or a range whose
            end is not above its start (empty or inverted).
    """
    whole = text.strip()
    if len(whole) > _MAX_TEXT:
        raise UsageError(f"address {whole[:40]!r}...: too long; {ADDRESS_FORMS}")
    if "-" in whole.lstrip("-"):
        lo, _, hi = whole.partition("-")
        start, end = _one(lo.strip(), decimal, whole), _one(hi.strip(), decimal, whole)
        if end <= start:
            raise UsageError(f"address range {whole!r} is {'empty' if end == start else 'inverted'}: "
                             "the end must be above the start, as in /proc/PID/maps")
        return start, end
    start = _one(whole, decimal, whole)
    return start, start + 1


def parse_address(text: str, *, decimal: bool = False) -> int:
    """An address (bytes) from hex (with or without ``0x``), a maps range (its start), or decimal
    when decimal is set.

    Raises:
        UsageError: none of those forms, above 2**64 - 1, an empty or inverted
            range, or only decimal digits that cannot be hex (the hint names --decimal).
    """
    return parse_address_range(text, decimal=decimal)[0]


# -- times ---------------------------------------------------------------------------------------

TIME_FORMS = ("give ns since boot (3923009122689), perf's sec.usec (1905.521357), ISO 8601 "
              "(2026-11-23T14:05:00, zone optional), HH:MM[:SS] today, now/today/yesterday, "
              "or relative like -40s, -2min, -1h")

_BOOT_SECONDS_RE = re.compile(r"(\d{1,12})\.(\d{1,9})")
_CLOCK_RE = re.compile(r"(\d{1,2}):(\d{2})(?::(\d{2})(?:[.,](\d{1,9}))?)?")
_ISO_FRACTION_RE = re.compile(r"(\d\d:\d\d:\d\d)[.,](\d{1,9})")
_RELATIVE_RE = re.compile(r"([+-])\s*(\d.*)")


@lru_cache(maxsize=1024)
def _second_text(second: int, utc: bool) -> tuple[str, str]:
    tz = timezone.utc if utc else None
    dt = datetime.fromtimestamp(second, tz).astimezone(tz)
    return dt.strftime("%Y-%m-%dT%H:%M:%S."), dt.strftime("%z")


@dataclass(frozen=True)
class SessionClock:
    """The times of one session, as typed and as shown.

    Attributes:
        offset_ns: the session record's ``boot_to_wall_offset_ns`` (wall ns since
            the epoch minus boot ns), or ``None`` when unknown (then only boot
            forms parse, and :meth:`format` shows ns since boot).
        now_wall_ns: "now" for relative and named times (ns since the epoch).
        utc: :meth:`format` in UTC instead of the local zone.
    """

    offset_ns: int | None
    now_wall_ns: int = field(default_factory=time.time_ns)
    utc: bool = False

    def parse(self, text: str) -> int:
        """A time (any form in the module doc) → ns since boot.

        Raises:
            UsageError: none of the forms, or a wall-clock form and no offset.
        """
        s = text.strip().rstrip(":")
        if len(s) > _MAX_TEXT:
            raise UsageError(f"time {s[:40]!r}...: too long; {TIME_FORMS}")
        if s.isdigit():
            return int(s)
        if m := _BOOT_SECONDS_RE.fullmatch(s):
            return int(m.group(1)) * 10**9 + int(m.group(2).ljust(9, "0"))
        return self._wall(s, text) - self._offset(text)

    def _offset(self, text: str) -> int:
        if self.offset_ns is None:
            raise UsageError(f"time {text.strip()[:40]!r} is wall-clock, and the session has no session record "
                             "with boot_to_wall_offset_ns: give ns since boot or perf's sec.usec")
        return self.offset_ns

    def _wall(self, s: str, text: str) -> int:
        """A wall-clock form → ns since the epoch."""
        now = datetime.fromtimestamp(self.now_wall_ns / 1e9).astimezone()
        midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
        named = {"today": midnight, "yesterday": midnight - timedelta(days=1), "tomorrow": midnight + timedelta(days=1)}
        if s == "now":
            return self.now_wall_ns
        if s in named:
            return int(named[s].timestamp()) * 10**9
        if m := _RELATIVE_RE.fullmatch(s):
            try:
                seconds = parse_duration(m.group(2))
            except ConfigError:
                raise UsageError(f"time {text.strip()[:40]!r}: a relative time takes units like -40s, -2min, "
                                 "-1h30min, -2d") from None
            return self.now_wall_ns + round(seconds * 1e9) * (-1 if m.group(1) == "-" else 1)
        if m := _CLOCK_RE.fullmatch(s):
            h, mi, sec = int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)
            if h > 23 or mi > 59 or sec > 59:
                raise UsageError(f"time {text.strip()[:40]!r}: not a time of day (HH:MM[:SS])")
            when = midnight.replace(hour=h, minute=mi, second=sec)
            return int(when.timestamp()) * 10**9 + int((m.group(4) or "0").ljust(9, "0"))
        frac_ns = 0
        if m := _ISO_FRACTION_RE.search(s):
            frac_ns = int(m.group(2).ljust(9, "0"))
            s = s[:m.start()] + m.group(1) + s[m.end():]
        try:
            when = datetime.fromisoformat(s[:-1] + "+00:00" if s.endswith(("Z", "z")) else s)
        except ValueError:
            raise UsageError(f"time {text.strip()[:40]!r}: {TIME_FORMS}") from None
        if when.tzinfo is None:
            when = when.astimezone()          # local time, as `date` prints it
        return int(when.timestamp()) * 10**9 + frac_ns

    def parse_range(self, since: str | None, until: str | None, *, names: tuple[str, str] = ("--since", "--until")
                    ) -> tuple[int | None, int | None]:
        """``(since_ns, until_ns)`` in ns since boot from two optional times (``None``: open).

        Raises:
            UsageError: a malformed time, or since not before until (an empty or
                inverted range), naming both as wall-clock.
        """
        lo = self.parse(since) if since is not None else None
        hi = self.parse(until) if until is not None else None
        if lo is not None and hi is not None and lo >= hi:
            raise UsageError(f"{names[0]} {since.strip()!r} ({self.format(lo)}) is not before {names[1]} "
                             f"{until.strip()!r} ({self.format(hi)}): the range is "
                             f"{'empty' if lo == hi else 'inverted'}")
        return lo, hi

    def format(self, time_ns) -> str:
        """time_ns (ns since boot) as ISO 8601 wall-clock with µs and the zone
        (``2026-11-23T14:05:00.123456+0100``); ns since boot when the offset is unknown; ``-`` for no time."""
        if not isinstance(time_ns, int) or isinstance(time_ns, bool):
            return "-"
        if self.offset_ns is None:
            return f"{time_ns} ns since boot"
        wall = clock.wall_ns(time_ns, self.offset_ns)
        head, zone = _second_text(wall // 10**9, self.utc)
        return f"{head}{wall % 10**9 // 1000:06d}{zone}"

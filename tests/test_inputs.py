"""The one parser of addresses and times (buildidd.inputs): every form, every refusal (no BPF needed)."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

import pytest

from buildidd.errors import UsageError
from buildidd.inputs import USER_SPACE_END, SessionClock, parse_address, parse_address_range

OFFSET_NS = 1_700_000_000_000_000_000


@pytest.mark.parametrize("text,decimal,value", [
    ("7f3c75c44000", False, 0x7f3c75c44000), ("0x7f3c75c44000", False, 0x7f3c75c44000),
    ("0X10", True, 16), ("1234", False, 0x1234), ("1234", True, 1234), ("00400000", False, 0x400000),
    (" ffffffffffffffff ", False, 2**64 - 1), ("55be404ab000-55be404ac000", False, 0x55be404ab000),
    ("139897406210576", True, 139897406210576)])
def test_address_forms(text, decimal, value):
    assert parse_address(text, decimal=decimal) == value


def test_maps_range_is_start_and_end():
    assert parse_address_range("55be404ab000-55be404ac000") == (0x55be404ab000, 0x55be404ac000)
    assert parse_address_range("0x10") == (0x10, 0x11)


@pytest.mark.parametrize("text,decimal", [("zz", False), ("", False), ("0x", False), ("ff", True), ("-1", True),
                                          ("18446744073709551616", True), ("1-", False), ("x" * 200, False)])
def test_address_refusals_name_the_forms(text, decimal):
    with pytest.raises(UsageError, match="give hex as /proc/PID/maps and perf print it"):
        parse_address(text, decimal=decimal)


@pytest.mark.parametrize("text,word", [("55be404ac000-55be404ab000", "inverted"),
                                       ("55be404ab000-55be404ab000", "empty")])
def test_empty_or_inverted_address_range(text, word):
    with pytest.raises(UsageError) as e:
        parse_address_range(text)
    assert str(e.value) == (f"address range {text!r} is {word}: the end must be above the start, "
                            "as in /proc/PID/maps")


def test_a_number_that_can_only_be_decimal_gets_the_hint():
    # An address written in decimal: as hex it would lie far beyond user space.
    with pytest.raises(UsageError) as e:
        parse_address("139897406210576")  # 0x7f3c6733c210
    assert str(e.value) == ("address '139897406210576' has only decimal digits and, read as hex as /proc/PID/maps "
                            "prints it (0x139897406210576), lies beyond user space: if it is decimal "
                            "(0x7f3c6733c210), pass --decimal; if it is hex, write 0x139897406210576")
    with pytest.raises(UsageError, match=r"too long for hex: if it is decimal \(0x[0-9a-f]+\), pass --decimal"):
        parse_address("18446744073709551615")
    # Digits whose hex reading is in user space stay hex (maps prints 00400000), and 0x is always hex.
    assert parse_address("400000") == 0x400000
    assert parse_address("0x139897406210576") == 0x139897406210576
    assert USER_SPACE_END == 1 << 48


def test_boot_times_need_no_offset():
    c = SessionClock(None)
    assert c.parse("3923009122689") == 3923009122689
    assert c.parse("1905.521357") == 1905_521_357_000            # perf script's sec.usec
    assert c.parse("1905.521357123:") == 1905_521_357_123        # perf script --ns, with its colon
    with pytest.raises(UsageError, match="has no session record with boot_to_wall_offset_ns"):
        c.parse("2026-11-22T10:00:00Z")
    assert c.format(12345) == "12345 ns since boot"


def test_wall_clock_times():
    c = SessionClock(OFFSET_NS)
    wall = datetime(2026, 11, 22, 10, 0, 0, tzinfo=timezone.utc)
    ns = int(wall.timestamp()) * 10**9 + 123456789
    assert c.parse("2026-11-22T10:00:00.123456789Z") == ns - OFFSET_NS
    assert c.parse("2026-11-22T11:00:00.123456789+01:00") == ns - OFFSET_NS
    local = datetime(2026, 11, 22, 10, 0).astimezone()
    assert c.parse("2026-11-22 10:00") == int(local.timestamp()) * 10**9 - OFFSET_NS


def test_time_of_day_is_today_local():
    now = time.time_ns()
    c = SessionClock(OFFSET_NS, now)
    midnight = datetime.fromtimestamp(now / 1e9).astimezone().replace(hour=0, minute=0, second=0, microsecond=0)
    assert c.parse("12:01") == int((midnight + timedelta(hours=12, minutes=1)).timestamp()) * 10**9 - OFFSET_NS
    assert c.parse("07:05:09.5") == (int((midnight + timedelta(hours=7, minutes=5, seconds=9)).timestamp())
                                     * 10**9 + 500_000_000 - OFFSET_NS)
    with pytest.raises(UsageError, match="not a time of day"):
        c.parse("25:00")


@pytest.mark.parametrize("text,delta_s", [("-40s", -40), ("-2min", -120), ("-1h", -3600), ("+30s", 30),
                                          ("-1h30min", -5400), ("-2d", -172800), ("now", 0)])
def test_relative_times_from_now(text, delta_s):
    now = time.time_ns()
    assert SessionClock(OFFSET_NS, now).parse(text) == now + delta_s * 10**9 - OFFSET_NS


@pytest.mark.parametrize("bad", ["yesterday-ish", "-1 parsec", "2026-13-01", "", "12:01:02:03", "1e9"])
def test_time_refusals_name_the_forms(bad):
    with pytest.raises(UsageError, match="ns since boot|relative time"):
        SessionClock(OFFSET_NS).parse(bad)


def test_empty_or_inverted_time_range():
    now = time.time_ns()
    c = SessionClock(OFFSET_NS, now, utc=True)
    assert c.parse_range("-1h", "now") == (now - 3600 * 10**9 - OFFSET_NS, now - OFFSET_NS)
    assert c.parse_range(None, "-1h") == (None, now - 3600 * 10**9 - OFFSET_NS)
    with pytest.raises(UsageError) as e:
        c.parse_range("now", "-1h")
    assert str(e.value) == (f"--since 'now' ({c.format(now - OFFSET_NS)}) is not before --until '-1h' "
                            f"({c.format(now - 3600 * 10**9 - OFFSET_NS)}): the range is inverted")
    with pytest.raises(UsageError, match="the range is empty"):
        c.parse_range("100", "100")


def test_format_is_wall_clock_with_zone():
    c = SessionClock(OFFSET_NS, utc=True)
    assert c.format(1_500_000) == "2023-11-14T22:13:20.001500+0000"
    assert c.format(None) == "-"
    local = SessionClock(OFFSET_NS).format(0)
    assert local[:19] == datetime.fromtimestamp(OFFSET_NS // 10**9).strftime("%Y-%m-%dT%H:%M:%S")
    assert local[-5] in "+-" and local[-4:].isdigit()

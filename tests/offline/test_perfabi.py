"""perfabi agrees with the kernel's uapi header: every constant, offset and flag bit it takes from
include/uapi/linux/perf_event.h, checked by gcc against the installed header."""

import struct
import subprocess

import pytest

from buildidd.offline import perfabi
from buildidd.offline.perfabi import ATTR_HEAD, EVENT_HEADER, FILE_HEADER, PERF_EVENT_ATTR, Layout

from conftest import gcc

#: perfabi name → C expression (a macro or enumerator of perf_event.h, time.h or sys/mman.h).
CONSTANTS = [
    "PERF_RECORD_MMAP", "PERF_RECORD_COMM", "PERF_RECORD_EXIT", "PERF_RECORD_FORK", "PERF_RECORD_SAMPLE",
    "PERF_RECORD_MMAP2", "PERF_RECORD_MISC_CPUMODE_MASK", "PERF_RECORD_MISC_KERNEL", "PERF_RECORD_MISC_USER",
    "PERF_RECORD_MISC_GUEST_KERNEL", "PERF_RECORD_MISC_MMAP_DATA", "PERF_RECORD_MISC_COMM_EXEC",
    "PERF_RECORD_MISC_MMAP_BUILD_ID", "PERF_SAMPLE_IP", "PERF_SAMPLE_TID", "PERF_SAMPLE_TIME", "PERF_SAMPLE_ID",
    "PERF_SAMPLE_CPU", "PERF_SAMPLE_STREAM_ID", "PERF_SAMPLE_IDENTIFIER", "PERF_TYPE_SOFTWARE",
    "PERF_COUNT_SW_DUMMY", "PERF_ATTR_SIZE_VER0", "PERF_ATTR_SIZE_VER7", "CLOCK_BOOTTIME", "PROT_READ",
    "PROT_EXEC", "MAP_PRIVATE",
]
#: perfabi ATTR_FLAG_* → the perf_event_attr bit-field it stands for.
FLAG_FIELDS = {"ATTR_FLAG_MMAP": "mmap", "ATTR_FLAG_COMM": "comm", "ATTR_FLAG_TASK": "task",
               "ATTR_FLAG_SAMPLE_ID_ALL": "sample_id_all", "ATTR_FLAG_MMAP2": "mmap2",
               "ATTR_FLAG_COMM_EXEC": "comm_exec", "ATTR_FLAG_USE_CLOCKID": "use_clockid",
               "ATTR_FLAG_BUILD_ID": "build_id"}
#: perfabi field names that C spells otherwise (the bit-field word has no C name: checked through FLAG_FIELDS).
C_NAMES = {"reserved_2": "__reserved_2", "reserved_3": "__reserved_3"}


def _c_program() -> tuple[str, dict[str, int]]:
    lines = ["#include <stdio.h>", "#include <stddef.h>", "#include <string.h>", "#include <time.h>",
             "#include <sys/mman.h>", "#include <linux/perf_event.h>", "int main(void) {",
             "struct perf_event_attr a;"]
    expected = {}
    for name in CONSTANTS:
        lines.append(f'printf("{name} %llu\\n", (unsigned long long)({name}));')
        expected[name] = getattr(perfabi, name)
    for layout, cname in ((EVENT_HEADER, "perf_event_header"), (PERF_EVENT_ATTR, "perf_event_attr")):
        lines.append(f'printf("sizeof {cname} %zu\\n", sizeof(struct {cname}));')
        expected[f"sizeof {cname}"] = layout.size
        for field in layout.names:
            if field == "flags":
                continue
            c = C_NAMES.get(field, field)
            lines.append(f'printf("{cname}.{field} %zu\\n", offsetof(struct {cname}, {c}));')
            expected[f"{cname}.{field}"] = layout.offset_of(field)
    flags_at = ATTR_HEAD.offset_of("flags")
    for name, bitfield in FLAG_FIELDS.items():
        lines += ["memset(&a, 0, sizeof a);", f"a.{bitfield} = 1;",
                  f'{{ unsigned long long w; memcpy(&w, (char *)&a + {flags_at}, 8); printf("{name} %llu\\n", w); }}']
        expected[name] = getattr(perfabi, name)
    lines += ["return 0; }"]
    return "\n".join(lines), expected


def test_the_uapi_constants_and_layouts_match_the_installed_header(tmp_path):
    src, expected = _c_program()
    exe = gcc(src, tmp_path / "perfabi")
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    got = {}
    for line in out.splitlines():
        key, value = line.rsplit(" ", 1)
        got[key] = int(value)
    # sizeof perf_event_attr grows with the kernel (VER8 adds config3); perfabi describes VER7, its prefix.
    assert got.pop("sizeof perf_event_attr") >= PERF_EVENT_ATTR.size == perfabi.PERF_ATTR_SIZE_VER7
    expected.pop("sizeof perf_event_attr")
    assert got == expected
    assert ATTR_HEAD.names == PERF_EVENT_ATTR.names[:len(ATTR_HEAD.names)]


def test_perf_tool_layouts_have_the_documented_sizes():
    """perf_file_header (104 bytes), perf_record_header_build_id (36): tools/perf/util/header.h and
    tools/lib/perf/include/perf/event.h, which no package installs; perf itself reads what export and
    inject write (test_perfdata.py, test_inject*.py)."""
    assert FILE_HEADER.size == 104 and FILE_HEADER.offset_of("data_size") == 48
    assert FILE_HEADER.offset_of("adds_features") == 72
    assert perfabi.BUILD_ID_ENTRY.size == 36 and perfabi.SECTION.size == 16
    assert (perfabi.MMAP_NAME_AT, perfabi.MMAP2_NAME_AT, perfabi.MMAP2_UNION_AT) == (40, 72, 40)


def test_a_layout_round_trips_named_fields_and_repeated_ones():
    raw = FILE_HEADER.pack(b"PERFILE2", 104, 136, 112, 136, 256, 1000, 0, 0, 1, 0, 0, 1 << 63)
    h = FILE_HEADER.fields_from(raw)
    assert (h.magic, h.data_size, h.adds_features) == (b"PERFILE2", 1000, (1, 0, 0, 1 << 63))
    assert FILE_HEADER.pack_fields(h) == raw
    changed = h._replace(adds_features=perfabi.set_feature(h.adds_features, perfabi.HEADER_BUILD_ID))
    assert perfabi.feature_bits(changed.adds_features) == [0, 2, 255]
    assert FILE_HEADER.fields_from(b"\0" * 8 + FILE_HEADER.pack_fields(changed), 8) == changed
    with pytest.raises(struct.error):
        FILE_HEADER.fields_from(raw[:-1])
    with pytest.raises(struct.error):
        FILE_HEADER.pack_fields(h._replace(adds_features=(1, 2)))
    with pytest.raises(ValueError):
        Layout("bad", (("x", "QQ"),))

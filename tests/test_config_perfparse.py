"""Configuration files, and the parser of perf's MMAP2 output."""

from __future__ import annotations

import pytest

from buildidd.config import Config, load
from buildidd.errors import ConfigError
from perfcompare import compare, parse_perf_script


def test_config_file(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('session_root = "/tmp/x"\nsegment_max_age_s = 60\ncompress = false\n')
    cfg = load(str(f), required=True)
    assert cfg.session_root == "/tmp/x" and cfg.segment_max_age_s == 60.0 and cfg.compress is False
    assert load(str(tmp_path / "absent.toml")) == Config()
    with pytest.raises(ConfigError):
        load(str(tmp_path / "absent.toml"), required=True)
    for bad in ('nonsense = 1\n', 'compress = "yes"\n', 'segment_max_bytes = 10\n', '[[[\n',
                'session_root = "/a"\nstore_root = "/a/store"\n'):
        f.write_text(bad)
        with pytest.raises(ConfigError):
            load(str(f))


PERF_OUT = """\
            true 10759 [001]  1284.416036: PERF_RECORD_MMAP2 10759/10759: [0x5589ce7bc000(0x4000) @ 0x2000 <c89156ebdabf859f4ee70cb0c303004dccf1ae51>]: r-xp /usr/bin/true
            true 10759 [001]  1284.416082: PERF_RECORD_MMAP2 10759/10759: [0x7ff6d1769000(0x2000) @ 0 00:00 0 0]: r-xp [vdso]
            true 10759 [001]  1284.416417: PERF_RECORD_MMAP2 10759/10759: [0x7ff6d159c000(0x156000) @ 0x26000 fe:00 339380 0]: r-xp /usr/lib/libc.so.6
            bash     0 [000]     0.000000: PERF_RECORD_MMAP2 1072/1072: [0x7f970acbd000(0x156000) @ 0x26000 <93ac61ec5a8eb1396f9fbd350e3169a558528a40>]: r-xp /usr/lib/libc.so.6
"""


def test_perf_script_parsing_and_comparison():
    maps = parse_perf_script(PERF_OUT)
    assert len(maps) == 3                       # [vdso] is not a file
    assert maps[0].build_id == "c89156ebdabf859f4ee70cb0c303004dccf1ae51" and maps[0].pgoff == 0x2000
    assert maps[1].build_id is None             # perf sent dev/ino: page not cached
    assert maps[2].synthesized
    ours = [{"type": "mmap", "pid": 10759, "start": 0x5589ce7bc000, "build_id": "c89156ebdabf859f4ee70cb0c303004dccf1ae51"},
            {"type": "mmap", "pid": 10759, "start": 0x7ff6d159c000, "build_id": "93ac61ec5a8eb1396f9fbd350e3169a558528a40"}]
    c = compare(maps, ours)
    assert (c.perf_with_build_id, c.matched, c.wrong, c.missing) == (1, 1, 0, 0)
    assert (c.perf_without_build_id, c.resolved_where_perf_had_none) == (1, 1)
    ours[0]["build_id"] = "00" * 20
    c = compare(maps, ours)
    assert c.wrong == 1 and c.match_rate == 0.0

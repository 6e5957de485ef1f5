"""Configuration files, and the parser of perf's MMAP2 output."""

from __future__ import annotations

import pytest

import dataclasses
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from buildidd.config import Config, load, parse_duration, parse_size, render_markdown, render_toml
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


def test_unknown_key_is_named(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('segment_max_byte = "64M"\n')
    with pytest.raises(ConfigError, match=r"unknown key 'segment_max_byte'"):
        load(str(f))


def test_sizes_and_durations_with_units_in_the_config_file(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('segment_max_bytes = "64M"\nstore_quota_bytes = "1.5G"\nring_bytes = 8388608\n'
                 'session_max_age_s = "7d"\nsegment_max_age_s = "1h30min"\nsnapshot_rate_bytes_per_s = "10M"\n')
    cfg = load(str(f))
    assert cfg.segment_max_bytes == 64 << 20 and cfg.store_quota_bytes == 3 << 29 and cfg.ring_bytes == 8 << 20
    assert cfg.session_max_age_s == 7 * 86400.0 and cfg.segment_max_age_s == 5400.0
    assert cfg.snapshot_rate_bytes_per_s == 10 << 20
    for bad in ('segment_max_bytes = "64X"\n', 'segment_max_bytes = "-1M"\n', 'segment_max_age_s = "soon"\n',
                'store_quota_bytes = -5\n', 'segment_max_bytes = "0.3K"\n'):
        f.write_text(bad)
        with pytest.raises(ConfigError, match=bad.split(" ")[0]):
            load(str(f))


@pytest.mark.parametrize("text,size", [("4096", 4096), ("64M", 64 << 20), ("64m", 64 << 20), ("1G", 1 << 30),
                                       ("512KiB", 512 << 10), ("2MB", 2 << 20), (" 8K ", 8192), ("1.5K", 1536),
                                       (100, 100)])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "M", "64Q", "-1", "1.1", "0x10", "1" * 100, True, None])
def test_parse_size_refuses(text):
    with pytest.raises(ConfigError):
        parse_size(text)


@pytest.mark.parametrize("text,seconds", [("90", 90.0), ("1.5s", 1.5), ("5min", 300.0), ("2m", 120.0),
                                          ("1h30min", 5400.0), ("30d", 2592000.0), ("250ms", 0.25), (3, 3.0)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "h", "5 parsecs", "-1h", "1h-", None])
def test_parse_duration_refuses(text):
    with pytest.raises(ConfigError):
        parse_duration(text)


def test_shipped_config_documents_every_key_with_the_codes_default(tmp_path):
    shipped = (Path(__file__).resolve().parents[1] / "systemd" / "buildidd.toml").read_text()
    assert shipped == render_toml(), "systemd/buildidd.toml is stale: run scripts/gen-config"
    reference = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    assert reference == render_markdown(), "docs/configuration.md is stale: run scripts/gen-config"
    for f in dataclasses.fields(Config):
        assert f"| `{f.name}` |" in reference
    # Every key appears, documented with its unit, and uncommented gives exactly the defaults.
    for f in dataclasses.fields(Config):
        assert re.search(rf"^# {f.name} \({re.escape(f.metadata['unit'])}\): ", shipped, re.M), f.name
    uncommented = re.sub(r"^#(\w+ = )", r"\1", shipped, flags=re.M)
    assert set(tomllib.loads(uncommented)) == {f.name for f in dataclasses.fields(Config)}
    (tmp_path / "all.toml").write_text(uncommented)
    assert load(str(tmp_path / "all.toml"), required=True) == Config()


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
    ours = [{"type": "mmap", "time_ns": 1, "pid": 10759, "start": 0x5589ce7bc000, "len": 0x4000, "pgoff": 0x2000,
             "path": "/usr/bin/true", "build_id": "c89156ebdabf859f4ee70cb0c303004dccf1ae51"},
            {"type": "mmap", "time_ns": 2, "pid": 10759, "start": 0x7ff6d159c000, "len": 0x156000, "pgoff": 0x26000,
             "path": "/usr/lib/libc.so.6", "build_id": "93ac61ec5a8eb1396f9fbd350e3169a558528a40"}]
    c = compare(maps, ours)
    assert (c.perf_with_build_id, c.matched, c.wrong, c.missing) == (1, 1, 0, 0)
    assert (c.perf_without_build_id, c.resolved_where_perf_had_none) == (1, 1)
    ours[0]["build_id"] = "00" * 20
    c = compare(maps, ours)
    assert c.wrong == 1 and c.match_rate == 0.0


def test_perf_duplicate_records_are_dropped():
    # perf record copied this record twice (perf_mmap__push reads data_head twice): same ns timestamp.
    line = ("       bidd_mmap 21163 [000]  1147.464976300: PERF_RECORD_MMAP2 21163/21163: [0x7f5db5db1000(0x1000) @ 0 "
            "<a714d0a8e7b2a018a14e2045a822bf10e860798c>]: r-xp /tmp/libbidd0.so\n")
    other = line.replace("1147.464976300", "1147.464978368")
    maps = parse_perf_script(line + line + other)
    assert len(maps) == 3
    ours = [{"type": "mmap", "time_ns": t, "pid": 21163, "start": 0x7f5db5db1000, "len": 0x1000, "pgoff": 0,
             "path": "/tmp/libbidd0.so", "build_id": "a714d0a8e7b2a018a14e2045a822bf10e860798c"} for t in (1, 2)]
    c = compare(maps, ours)
    assert (c.perf_with_build_id, c.matched, c.missing, c.perf_duplicates) == (2, 2, 0, 1)


def test_benchmarks_refuse_a_host_where_another_tracer_runs(tmp_path):
    """A forgotten `perf record` beside a benchmark would be measured with it: require_quiet_host says so."""
    import subprocess

    from perfcompare import other_tracers, require_quiet_host

    src = tmp_path / "sleeper.c"
    # The stand-in says "up" once it runs: by then its exec is done and /proc/PID/cmdline is its own.
    src.write_text("#include <stdio.h>\n#include <unistd.h>\n"
                   "int main(void) { puts(\"up\"); fflush(stdout); pause(); return 0; }\n")
    exe = tmp_path / "perf"           # a stand-in named perf, run as `perf record -a`
    subprocess.run(["gcc", "-o", str(exe), str(src)], check=True)
    p = subprocess.Popen([str(exe), "record", "-a"], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "up\n"
        assert any(line.startswith(f"{p.pid}: ") and "record -a" in line for line in other_tracers())
        with pytest.raises(SystemExit, match="other tracers are running"):
            require_quiet_host("bench")
    finally:
        p.kill()
        p.wait()
        p.stdout.close()
    assert not any(line.startswith(f"{p.pid}: ") for line in other_tracers())


def test_unknown_key_gets_did_you_mean(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('segment_max_byte = "64M"\n')
    with pytest.raises(ConfigError) as e:
        load(str(f))
    assert str(e.value) == f"{f}: unknown key 'segment_max_byte'; did you mean 'segment_max_bytes'?"
    f.write_text('zzzz = 1\n')
    with pytest.raises(ConfigError, match=r"unknown key 'zzzz' \(known: session_root, segment_max_bytes, "):
        load(str(f))


@pytest.mark.parametrize("text,hint", [("16 Mb", "write 16M, 16MB or 16MiB"), ("16mb", "write 16M, 16MB or 16MiB"),
                                       ("1Kib", "write 1K, 1KB or 1KiB"), ("4096b", "write 4096 or 4096B")])
def test_sizes_in_bits_are_refused_with_the_bytes_spelling(text, hint):
    with pytest.raises(ConfigError) as e:
        parse_size(text)
    assert str(e.value) == f"size {text!r}: a lower-case b means bits; sizes are bytes: {hint}"


@pytest.mark.parametrize("text", ["16M", "16MB", "16MiB", "16m", "16 MB"])
def test_bytes_spellings_stay_bytes(text):
    assert parse_size(text) == 16 << 20


def _check(*args):
    return subprocess.run([sys.executable, "-m", "buildidd.cli", "check-config", *args], capture_output=True,
                          text=True, timeout=60)


def test_check_config_verb(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('segment_max_bytes = "16MiB"\nstore_share_private = true\n')
    r = _check(str(f))
    assert r.returncode == 0 and r.stdout == (f"{f}: valid; 2 key(s) differ from the defaults:\n"
                                              "  segment_max_bytes = 16M  (default 64M)\n"
                                              "  store_share_private = True  (default False)\n")
    f.write_text('segment_max_byte = "16M"\n')
    r = _check(str(f))
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr == f"buildidd: {f}: unknown key 'segment_max_byte'; did you mean 'segment_max_bytes'?\n"
    f.write_text('store_quota_bytes = "16 Mb"\n')
    r = _check(str(f))
    assert r.returncode == 1 and r.stderr == (f"buildidd: {f}: store_quota_bytes: size '16 Mb': a lower-case b "
                                              "means bits; sizes are bytes: write 16M, 16MB or 16MiB\n")
    r = _check(str(tmp_path / "absent.toml"))
    assert r.returncode == 1 and r.stderr == f"buildidd: {tmp_path / 'absent.toml'}: no such file\n"
    r = subprocess.run([sys.executable, "-m", "buildidd.cli", "record", "--segment-max-bytes", "16Mb", "--", "true"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "a lower-case b means bits" in r.stderr

"""Issue 43 item 5: each message an analyst met says what happened and what to do, with the right exit status.

Real parts: buildidd as a subprocess for every verb, a real ``buildidd serve`` for pull, gcc and g++ binaries,
binutils' c++filt, perf (the oracle for where ``--buildid-dir`` goes), man.
"""

from __future__ import annotations

import gzip
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import zstandard

from buildidd.offline.demangle import Demangler
from buildidd.offline.symbols import Symbolizer
from buildidd.sessionlog import SessionWriter
from buildidd.store import Store
from conftest import ROOT, ServeProcess, gcc, store_add
from offline.test_replay import mmap, write_session

CLI = [sys.executable, "-m", "buildidd.cli"]
SESSION = "20261124T010000Z-5"


def _run(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, **kw)


def _one_line(r) -> str:
    assert "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.splitlines()) == 1, r.stderr
    return r.stderr.strip()


@pytest.fixture(scope="module")
def world(tmp_path_factory, public_tmp_factory):
    """A store with one program built in a public directory (so: public, but untrusted: not under /usr), a
    session naming it, and an archive of both."""
    tmp = tmp_path_factory.mktemp("msgs")
    exe = gcc("int bidd_msg_fn(int x) { return x + 1; }\nint main(void) { return bidd_msg_fn(0) - 1; }\n",
              public_tmp_factory("buildidd-msgs-") / "tool")
    store = Store(tmp / "store", debug_root=tmp / "no-debug")
    bid = store_add(store, exe)
    w = SessionWriter(tmp / "sessions" / SESSION, compress=True)
    w.write({"type": "session", "time_ns": 1, "host": "h", "boot_id": "b", "kernel_release": "6",
             "kernel_build_id": None, "module_build_ids": {}, "boot_to_wall_offset_ns": 0})
    w.write({"type": "mmap", "time_ns": 10, "pid": 5, "tid": 5, "comm": "tool", "start": 0x400000, "len": 4096,
             "pgoff": 0, "path": str(exe), "build_id": bid, "error": None})
    w.write({"type": "end", "time_ns": 100})
    w.close()
    archive = tmp / "a.tar.zst"
    r = _run("archive", str(tmp / "sessions" / SESSION), "-o", str(archive), "--store-root", str(tmp / "store"))
    assert r.returncode == 0, r.stderr
    return {"tmp": tmp, "exe": exe, "bid": bid, "archive": archive}


# -- pull without (or with a wrong) token --------------------------------------------------------------


def test_pull_refused_prints_the_serves_reason_and_the_token_option_with_exit_4(world, tmp_path):
    token = tmp_path / "token"
    token.write_text("right\n")
    wrong = tmp_path / "wrong"
    wrong.write_text("wrong\n")
    dest = ["--debug-dir", str(tmp_path / "d"), "--session-root", str(tmp_path / "s"), "--work-dir",
            str(tmp_path / "w")]
    with_token = ServeProcess(world["tmp"] / "store", tmp_path / "t.log", "--token-file", str(token),
                              session_root=world["tmp"] / "sessions")
    open_serve = ServeProcess(world["tmp"] / "store", tmp_path / "o.log", session_root=world["tmp"] / "sessions")
    try:
        r = _run("pull", with_token.url, *dest)
        assert r.returncode == 4
        assert _one_line(r) == (f"buildidd: {with_token.url}/sessions: HTTP 401 Unauthorized: bearer token required; "
                                "give pull --token-file FILE holding the token the serve was started with "
                                "(buildidd serve --token-file FILE)")
        r = _run("pull", with_token.url, *dest, "--token-file", str(wrong))
        assert r.returncode == 4 and "did not accept the token in --token-file" in _one_line(r)
        r = _run("pull", open_serve.url, *dest)            # a serve without a token gives logs to no TCP peer
        assert r.returncode == 4
        line = _one_line(r)
        assert line.startswith(f"buildidd: {open_serve.url}/sessions: HTTP 403 Forbidden: session logs need the "
                               "bearer token, or the unix socket as root or a member of the control group; "), line
        assert "--token-file" in line
    finally:
        with_token.stop()
        open_serve.stop()


# -- import of what is not an archive ------------------------------------------------------------------


def _tar_of(name: str, data: bytes) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        ti = tarfile.TarInfo(name)
        ti.size = len(data)
        tar.addfile(ti, io.BytesIO(data))
    return out.getvalue()


def test_import_of_a_file_that_is_not_an_archive_names_it_and_what_it_is(tmp_path):
    plain_tar = _tar_of("notes.txt", b"hello\n")
    cases = {
        "notes.txt": (b"just text\n", "it does not start with a zstd frame"),
        "empty.tar.zst": (b"", "it is empty"),
        "perf.tar.gz": (gzip.compress(plain_tar), "it is gzip, not zstd"),
        "plain.tar": (plain_tar, "it is an uncompressed tar"),
    }
    for name, (data, what) in cases.items():
        f = tmp_path / name
        f.write_bytes(data)
        r = _run("import", str(f), "--debug-dir", str(tmp_path / "d"), "--session-root", str(tmp_path / "s"))
        assert r.returncode == 1
        assert _one_line(r) == (f"buildidd: {f}: not a buildidd archive ({what}); an archive is the tar + zstd "
                                "file buildidd archive SESSION -o FILE writes [not_an_archive]"), name
    other = tmp_path / "other.tar.zst"
    other.write_bytes(zstandard.ZstdCompressor().compress(plain_tar))
    r = _run("import", str(other), "--debug-dir", str(tmp_path / "d"), "--session-root", str(tmp_path / "s"))
    assert r.returncode == 1 and _one_line(r) == (f"buildidd: {other}: not a buildidd archive: its first member is "
                                                  "'notes.txt', not a manifest.json file [bad_manifest]")
    r = _run("import", str(tmp_path / "absent.tar.zst"), "--debug-dir", str(tmp_path / "d"))
    assert r.returncode == 1 and _one_line(r) == (f"buildidd: {tmp_path / 'absent.tar.zst'}: cannot open the archive: "
                                                  "No such file or directory [unreadable]")
    assert not (tmp_path / "d").exists() and not (tmp_path / "s").exists()


# -- archive -o into a missing directory ------------------------------------------------------------------


def test_archive_into_a_missing_directory_names_it_not_a_temporary_file(world, tmp_path):
    out = tmp_path / "no" / "such" / "a.tar.zst"
    r = _run("archive", str(world["tmp"] / "sessions" / SESSION), "-o", str(out), "--store-root",
             str(world["tmp"] / "store"))
    assert r.returncode == 2
    assert _one_line(r) == (f"buildidd: -o {out}: no directory {out.parent}; create it first (mkdir -p {out.parent}) "
                            "or name a file in an existing one")
    assert ".part-" not in r.stderr and not (tmp_path / "no").exists()


# -- import marking a build-id untrusted --------------------------------------------------------------


def test_import_says_which_entry_it_marked_untrusted_its_path_and_why(world, tmp_path):
    r = _run("import", str(world["archive"]), "--debug-dir", str(tmp_path / "d"), "--session-root",
             str(tmp_path / "s"))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert (f"  marked untrusted (1): installed, with the word in {tmp_path / 'd'}/<path>/<build-id>/provenance; "
            "--untrusted skip leaves them out, --untrusted refuse refuses such an archive") in lines, r.stdout
    assert (f"    {world['bid']}  {world['exe']}: untrusted: on the recording host its copy was not a root-owned "
            "file under a system directory (/usr, /lib, /opt, ...), so anyone could have made it") in lines, r.stdout
    r = _run("import", str(world["archive"]), "--debug-dir", str(tmp_path / "d2"), "--session-root",
             str(tmp_path / "s2"), "--untrusted", "skip")
    assert r.returncode == 0 and "  skipped, not trusted (1): not installed (--untrusted skip)" in r.stdout, r.stdout


# -- sessions on a missing root ---------------------------------------------------------------------------


def test_sessions_on_a_missing_root_says_so_and_exits_1(tmp_path):
    r = _run("sessions", "--session-root", str(tmp_path / "none"))
    assert r.returncode == 1 and r.stdout == ""
    assert _one_line(r) == (f"buildidd: sessions: no session root at {tmp_path / 'none'}: nothing was recorded or "
                            "imported there; give --session-root DIR (the daemon's session_root, or where buildidd "
                            "import put them)")
    (tmp_path / "empty").mkdir()
    r = _run("sessions", "--session-root", str(tmp_path / "empty"))
    assert r.returncode == 0 and r.stdout.startswith("NAME") and r.stderr == ""     # there, and empty: not an error


# -- resolve --symbolize demangles C++ ------------------------------------------------------------------

CXX_SRC = """
namespace ns43 { struct Widget { int n; __attribute__((noinline)) int poke(int x); }; }
int ns43::Widget::poke(int x) { return n * x + 1; }
int main(int argc, char **) { ns43::Widget w{argc}; return w.poke(argc) == 3; }
"""


def test_resolve_symbolize_demangles_cpp_names_as_cxxfilt_does(tmp_path):
    if shutil.which("g++") is None or shutil.which("c++filt") is None:
        pytest.skip("g++ and c++filt (binutils) are needed")
    src = tmp_path / "w.cc"
    src.write_text(CXX_SRC)
    exe = tmp_path / "widget"
    subprocess.run(["g++", "-O1", "-o", str(exe), str(src)], check=True)
    nm = subprocess.run(["nm", str(exe)], capture_output=True, text=True, check=True).stdout
    mangled, vaddr = next((f[2], int(f[0], 16)) for f in map(str.split, nm.splitlines())
                          if len(f) == 3 and "Widget4poke" in f[2])
    store = Store(tmp_path / "store")
    bid = store_add(store, exe)
    table = Symbolizer(store).table(bid)
    offset = next(o + (vaddr - v) for o, n, v in table.loads if v <= vaddr < v + n)
    write_session(tmp_path / "s", [mmap(10, 100, 0x555500000000, 0x10000, str(exe), bid)])
    addr = f"{0x555500000000 + offset + 4:x}"
    base = ["resolve", str(tmp_path / "s"), "100", addr, "--store-root", str(tmp_path / "store"), "--symbolize"]
    r = _run(*base)
    assert r.returncode == 0, r.stderr
    assert " ns43::Widget::poke(int)+0x4 " in r.stdout, r.stdout
    oracle = subprocess.run(["c++filt", mangled], capture_output=True, text=True).stdout.strip()
    assert oracle == "ns43::Widget::poke(int)"
    r = _run(*base, "--no-demangle")
    assert f" {mangled}+0x4 " in r.stdout, r.stdout
    r = _run(*base, "--json")
    assert '"name":"%s","demangled":"ns43::Widget::poke(int)"' % mangled in r.stdout, r.stdout


def test_the_demangler_never_lets_a_name_or_a_stuck_child_stop_it(tmp_path):
    with Demangler() as d:
        assert d.demangle("_ZN3foo3barEi") == "foo::bar(int)"
        assert d.demangle("main") == "main"                                # not C++: as given
        assert d.demangle("_ZN3foo\n_ZN3bar") == "_ZN3foo\n_ZN3bar"        # a newline is never sent
        assert d.demangle("_Z" + "N1a" * 5000 + "E") == "_Z" + "N1a" * 5000 + "E"   # over the length cap
        assert d.demangle("_Zgarbage") == "_Zgarbage"                    # c++filt gives it back as it is
        assert d.demangle("_ZN3foo3barEi") == "foo::bar(int)" and d.available
    stuck = tmp_path / "stuck-filt"
    stuck.write_text("#!/bin/sh\nexec sleep 60\n")
    stuck.chmod(0o755)
    with Demangler(str(stuck)) as d:
        assert d.demangle("_ZN3foo3barEi") == "_ZN3foo3barEi"
        assert not d.available and "did not answer" in d.error
        assert d.demangle("_ZN3foo3barEv") == "_ZN3foo3barEv"              # no second wait
    with Demangler(str(tmp_path / "absent")) as d:
        assert d.demangle("_ZN3foo3barEi") == "_ZN3foo3barEi" and "not found" in d.error


# -- the manual page ----------------------------------------------------------------------------------


def test_the_manual_page_describes_buildidd_and_gives_examples():
    r = _run("help-man")
    assert r.returncode == 0, r.stderr
    sections = re.split(r"^\.SH ", r.stdout, flags=re.M)
    description = next(s for s in sections if s.startswith("DESCRIPTION"))
    examples = next(s for s in sections if s.startswith("EXAMPLES"))
    assert len(description.splitlines()) > 10 and "build\\-id" in description and "store_share_private" in description
    for command in ("buildidd archive latest", "buildidd import host1.tar.zst", "perf \\-\\-buildid\\-dir ~/.debug report",
                    "buildidd which \\-\\-glob", "buildidd resolve latest"):
        assert command in examples, command
    if shutil.which("man"):
        shown = subprocess.run(["man", "-l", "-"], input=r.stdout, capture_output=True, text=True,
                               env={**os.environ, "MANWIDTH": "120", "MAN_KEEP_FORMATTING": "0"}, timeout=60)
        assert shown.returncode == 0 and "perf --buildid-dir ~/.debug report -i perf.exact.data" in shown.stdout


# -- perf's --buildid-dir where perf takes it --------------------------------------------------------------


def test_every_documented_perf_command_puts_buildid_dir_before_the_subcommand():
    """perf 6.1 refuses ``perf report --buildid-dir DIR``: the option is perf's own."""
    texts = {p: p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
    texts["inject --help"] = _run("inject", "--help", env={**os.environ, "COLUMNS": "300"}).stdout
    texts["help-man"] = _run("help-man").stdout.replace("\\-", "-")
    wrong = [(where, m.group(0)) for where, text in texts.items()
             for m in re.finditer(r"perf (?:report|script|annotate|inject|buildid-list)\b[^\n`]*--buildid-dir", text)]
    assert not wrong, wrong
    if shutil.which("perf"):
        r = subprocess.run(["perf", "report", "--buildid-dir", "/tmp", "-i", "/nonexistent"], capture_output=True,
                           text=True, timeout=60)
        assert "unknown option `buildid-dir'" in r.stderr + r.stdout
        r = subprocess.run(["perf", "--buildid-dir", "/tmp", "report", "-i", "/nonexistent"], capture_output=True,
                           text=True, timeout=60)
        assert "unknown option" not in r.stderr + r.stdout and "/nonexistent" in r.stderr + r.stdout


def test_the_readme_says_two_daemons_need_their_own_pin_roots():
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"\*\*Two daemons on one host\*\*[^*]*own `bpf_pin_root`", readme)

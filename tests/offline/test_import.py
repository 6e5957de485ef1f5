"""``buildidd import``: the installed layout (perf, gdb), and every hostile archive refused with nothing written."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import pytest
import zstandard

from buildidd.errors import ArchiveError
from buildidd.offline.archive import write_archive
from buildidd.offline.importer import import_archive
from buildidd.offline.sessions import session_info
from buildidd.offline.untar import ImportLimits
from conftest import readelf_build_id, remove_tree, store_add
from offline.archive_world import SESSION_NAME, build_binary, make_world


@pytest.fixture(scope="module")
def world(tmp_path_factory, public_tmp_factory):
    w = make_world(tmp_path_factory.mktemp("import"), public_tmp_factory("buildidd-import-bins-"), records=300)
    out = io.BytesIO()
    w["manifest"] = write_archive(w["session"], w["store"], out)
    w["archive"] = out.getvalue()
    w["other"] = build_binary(w["tmp"] / "other", "other")      # a binary with another build-id
    return w


def good_members(world) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(world["archive"]), read_across_frames=True).read()
    with tarfile.open(fileobj=io.BytesIO(raw)) as tf:
        return [(ti, tf.extractfile(ti).read() if ti.isreg() else None) for ti in tf]


def write_tar(path, members, *, raw_tail: bytes = b"") -> None:
    """members: (TarInfo, bytes or None) as tarfile writes them, compressed with zstd."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for ti, body in members:
            tf.addfile(ti, io.BytesIO(body) if body is not None else None)
    path.write_bytes(zstandard.ZstdCompressor().compress(buf.getvalue() + raw_tail))


def member(name, body=b"", kind=tarfile.REGTYPE, linkname=""):
    ti = tarfile.TarInfo(name)
    ti.type, ti.linkname, ti.size, ti.mode = kind, linkname, len(body or b""), 0o644
    return ti, (body if kind == tarfile.REGTYPE else None)


def with_manifest(world, edit) -> tuple[tarfile.TarInfo, bytes]:
    m = json.loads(good_members(world)[0][1])
    edit(m)
    return member("manifest.json", json.dumps(m).encode())


def snapshot(root) -> dict[str, tuple]:
    """Every path under root (lstat: type, size, target), to show what an import wrote."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            out[p] = (st.st_mode, st.st_size, os.readlink(p) if os.path.islink(p) else None)
    return out


def do_import(tmp_path, archive, limits=ImportLimits()):
    return import_archive(archive, debug_dir=tmp_path / "t" / "debug", session_root=tmp_path / "t" / "sessions",
                          limits=limits)


def test_import_installs_perf_cache_gdb_links_and_session(world, tmp_path):
    archive = tmp_path / "a.tar.zst"
    archive.write_bytes(world["archive"])
    r = do_import(tmp_path, archive)
    debug = tmp_path / "t" / "debug"
    bids, files = world["bids"], world["files"]
    assert set(r.installed) >= {bids["full"], bids["split"]} and r.missing == [bids["gone"]] and r.session_new
    for name in ("full", "split"):
        bid = bids[name]
        link = debug / ".build-id" / bid[:2] / bid[2:]
        assert os.readlink(link) == f"../../{str(files[name]).lstrip('/')}/{bid}"          # perf's relative link
        assert (link / "elf").read_bytes() == files[name].read_bytes()
    full_dbg = debug / ".build-id" / bids["full"][:2] / (bids["full"][2:] + ".debug")
    split_dbg = debug / ".build-id" / bids["split"][:2] / (bids["split"][2:] + ".debug")
    assert os.readlink(full_dbg).endswith("/elf")                 # no separate debuginfo: the binary itself
    assert os.readlink(split_dbg).endswith("/debug") and split_dbg.read_bytes() == world["debug"].read_bytes()
    for seg in (world["session"]).iterdir():
        assert (tmp_path / "t" / "sessions" / SESSION_NAME / seg.name).read_bytes() == seg.read_bytes()
    if world["kbid"]:
        k = world["kbid"]
        assert (debug / "[kernel.kallsyms]" / k / "kallsyms").read_bytes() == \
            (world["store"].root / "[kernel.kallsyms]" / k / "kallsyms").read_bytes()
    if shutil.which("perf"):
        out = subprocess.run(["perf", "--buildid-dir", str(debug), "buildid-cache", "-l"], capture_output=True,
                             text=True).stdout
        assert bids["full"] in out and bids["split"] in out
    if shutil.which("gdb"):
        # gdb finds the stripped binary's debuginfo by build-id in the imported tree, and not without it.
        def gdb(*pre):
            return subprocess.run(["gdb", "-nx", "-batch", *pre, "-ex", f"file {files['split']}",
                                   "-ex", "info address bidd_archive_fn_split"], capture_output=True, text=True).stdout
        assert "is a function at address" in gdb("-ex", f"set debug-file-directory {debug}")
        assert "is a function at address" not in gdb("-ex", f"set debug-file-directory {tmp_path / 'none'}")
    assert not [p for p in snapshot(tmp_path / "t") if ".buildidd-import-" in p]       # staging removed
    assert json.loads((tmp_path / "t" / "sessions" / SESSION_NAME / ".closed").read_bytes())["clean"] is True
    assert session_info(tmp_path / "t" / "sessions" / SESSION_NAME).closed


def test_import_lays_out_gdbs_tree_and_keeps_the_hosts_file_times(world, tmp_path):
    """gdb's tree (.gdb/.build-id/xx/rest -> the binary, rest.debug -> its debuginfo) beside perf's, and every
    installed file with the archive member's mtime: the store copy's, which is the host file's."""
    archive = tmp_path / "a.tar.zst"
    archive.write_bytes(world["archive"])
    do_import(tmp_path, archive)
    debug = tmp_path / "t" / "debug"
    bids, files = world["bids"], world["files"]
    for name in ("full", "split"):
        bid = bids[name]
        exe = debug / ".gdb" / ".build-id" / bid[:2] / bid[2:]
        assert os.readlink(exe) == f"../../../{str(files[name]).lstrip('/')}/{bid}/elf"
        assert exe.read_bytes() == files[name].read_bytes()
        host_ns = os.stat(files[name]).st_mtime_ns
        assert os.stat(world["store"].path_of(bid)).st_mtime_ns == host_ns          # the store kept it
        assert os.stat(exe).st_mtime == host_ns // 10**9                            # the archive's seconds
    split_dbg = debug / ".gdb" / ".build-id" / bids["split"][:2] / (bids["split"][2:] + ".debug")
    assert split_dbg.read_bytes() == world["debug"].read_bytes()
    full_dbg = debug / ".gdb" / ".build-id" / bids["full"][:2] / (bids["full"][2:] + ".debug")
    assert os.readlink(full_dbg).endswith("/elf")
    if world["kbid"]:                                    # no executable for gdb in the kernel's entry
        assert not os.path.lexists(debug / ".gdb" / ".build-id" / world["kbid"][:2] / world["kbid"][2:])
    seg = next(world["session"].glob("segment-*"))
    assert os.stat(tmp_path / "t" / "sessions" / SESSION_NAME / seg.name).st_mtime == int(seg.stat().st_mtime)


def test_an_mtime_out_of_range_is_not_applied(world, tmp_path):
    """A member mtime past 2**34 s (or not a number) leaves the file with the import's time; the archive is taken."""
    members = []
    for ti, body in good_members(world):
        if ti.isreg() and ti.name.endswith(f"/{world['bids']['full']}/elf"):
            ti.mtime = 1 << 40
        members.append((ti, body))
    archive = tmp_path / "far.tar.zst"
    write_tar(archive, members)
    before = time.time()
    r = do_import(tmp_path, archive)
    bid = world["bids"]["full"]
    assert bid in r.installed
    assert before - 1 <= os.stat(tmp_path / "t" / "debug" / ".build-id" / bid[:2] / bid[2:] / "elf").st_mtime \
        <= time.time() + 1


def test_an_archive_without_closed_marker_gets_one_recreated(world, tmp_path):
    """An archive made before sessions had ``.closed`` (no marker member, none in the manifest): the imported
    session that ended still gets a marker, saying so."""
    members = []
    for ti, body in good_members(world):
        if ti.name.endswith("/.closed"):
            continue
        if ti.name == "manifest.json":
            m = json.loads(body)
            assert m.pop("closed_marker")["member"] == f"session/{SESSION_NAME}/.closed"
            m["session"].pop("clean", None)
            ti, body = member("manifest.json", json.dumps(m).encode())
        members.append((ti, body))
    archive = tmp_path / "old.tar.zst"
    write_tar(archive, members)
    do_import(tmp_path, archive)
    marker = json.loads((tmp_path / "t" / "sessions" / SESSION_NAME / ".closed").read_bytes())
    assert marker == {"clean": True, "recreated_by": "buildidd import"}


def test_import_twice_is_idempotent_and_a_different_session_of_that_name_is_refused(world, tmp_path):
    archive = tmp_path / "a.tar.zst"
    archive.write_bytes(world["archive"])
    do_import(tmp_path, archive)
    before = snapshot(tmp_path / "t")
    r = do_import(tmp_path, archive)
    assert not r.installed and not r.session_new and snapshot(tmp_path / "t") == before
    seg = next((tmp_path / "t" / "sessions" / SESSION_NAME).iterdir())
    with open(seg, "ab") as f:
        f.write(b"x")
    with pytest.raises(ArchiveError) as e:
        do_import(tmp_path, archive)
    assert e.value.reason == "session_exists"


def _replace_elf(world, name, new_body):
    """The good archive with the elf of world binary `name` replaced by new_body (manifest size adjusted)."""
    bid = world["bids"][name]

    def edit(m):
        for ref in m["build_ids"]:
            if ref["build_id"] == bid:
                next(f for f in ref["files"] if f["name"] == "elf")["size_bytes"] = len(new_body)
    out = [with_manifest(world, edit)]
    for ti, body in good_members(world)[1:]:
        if ti.name.endswith(f"/{bid}/elf"):
            ti.size, body = len(new_body), new_body
        out.append((ti, body))
    return out


def _bomb(world):
    size = 48 << 20

    def edit(m):
        m["segments"].append({"member": f"session/{SESSION_NAME}/segment-000099.jsonl", "size_bytes": size})
    ti = tarfile.TarInfo(f"session/{SESSION_NAME}/segment-000099.jsonl")
    ti.size = size
    return [with_manifest(world, edit), (ti, b"\0" * size)]


HOSTILE = {
    "absolute_path": lambda w: [good_members(w)[0], member("/tmp/buildidd-evil", b"x")],
    "dotdot": lambda w: [good_members(w)[0], member("cache/../../../buildidd-evil", b"x")],
    "symlink_escape": lambda w: [good_members(w)[0],
                                 member("cache/.build-id/ab/cdef", kind=tarfile.SYMTYPE, linkname="../../../../etc")],
    "symlink_escape_absolute": lambda w: [good_members(w)[0],
                                          member("cache/x", kind=tarfile.SYMTYPE, linkname="/etc/passwd")],
    "hard_link": lambda w: [good_members(w)[0], member("cache/x", kind=tarfile.LNKTYPE, linkname="/etc/passwd")],
    "device": lambda w: [good_members(w)[0], member("cache/null", kind=tarfile.CHRTYPE)],
    "fifo": lambda w: [good_members(w)[0], member("cache/fifo", kind=tarfile.FIFOTYPE)],
    "build_id_mismatch": lambda w: _replace_elf(w, "full", w["other"].read_bytes()),
    "unlisted_member": lambda w: [*good_members(w), member("cache/extra", b"x")],
    "size_mismatch": lambda w: [good_members(w)[0], *[(ti, b) for ti, b in good_members(w)[1:2]],
                                member(good_members(w)[2][0].name, b"short")],
    "missing_member": lambda w: good_members(w)[:2],
    "bad_manifest": lambda w: [member("cache/first", b"x"), *good_members(w)],
    "bad_link": lambda w: [(ti, b) if not ti.issym() else
                           member(ti.name, kind=tarfile.SYMTYPE, linkname="../../usr") for ti, b in good_members(w)],
    "zstd_bomb": _bomb,
    "bad_marker": lambda w: [(ti, b) if not ti.name.endswith("/.closed") else member(ti.name, b'{"clean":"yes"}'.ljust(len(b)))
                             for ti, b in good_members(w)],
}
LIMITS = {"zstd_bomb": ImportLimits(ratio_floor_bytes=4 << 20)}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_archive_refused_with_its_own_error_and_nothing_written(world, tmp_path, case):
    archive = tmp_path / "hostile.tar.zst"
    write_tar(archive, HOSTILE[case](world))
    before = snapshot(tmp_path)
    # Where an absolute or ../ member would land outside the targets (the targets lie under tmp_path).
    escapes = [Path("/tmp/buildidd-evil")] + [d / "buildidd-evil" for d in tmp_path.parents]
    assert not any(p.exists() for p in escapes)
    with pytest.raises(ArchiveError) as e:
        do_import(tmp_path, archive, LIMITS.get(case, ImportLimits()))
    assert e.value.reason == case.removesuffix("_absolute"), str(e.value)
    assert snapshot(tmp_path) == before                    # not even the targets: the import made them
    assert not any(p.exists() for p in escapes)


def test_size_and_count_limits(world, tmp_path):
    archive = tmp_path / "a.tar.zst"
    archive.write_bytes(world["archive"])
    before = snapshot(tmp_path)
    for limits, reason in ((ImportLimits(max_members=3), "too_many_members"),
                           (ImportLimits(max_member_bytes=1000), "too_large"),
                           (ImportLimits(max_total_bytes=20000), "too_large"),
                           (ImportLimits(max_manifest_bytes=100), "too_large")):
        with pytest.raises(ArchiveError) as e:
            do_import(tmp_path, archive, limits)
        assert e.value.reason == reason, (limits, e.value)
        assert snapshot(tmp_path) == before


def test_corrupt_and_truncated_streams(world, tmp_path):
    archive = tmp_path / "a.tar.zst"
    archive.write_bytes(world["archive"][: len(world["archive"]) // 2])
    with pytest.raises(ArchiveError) as e:
        do_import(tmp_path, archive)
    assert e.value.reason in ("corrupt", "missing_member")
    archive.write_bytes(b"not zstd at all" * 100)
    with pytest.raises(ArchiveError) as e:
        do_import(tmp_path, archive)
    assert e.value.reason == "not_an_archive" and str(archive) in str(e.value)    # refused before decoding
    archive.write_bytes(world["archive"][:4] + b"not zstd at all" * 100)          # the magic, then garbage
    with pytest.raises(ArchiveError) as e:
        do_import(tmp_path, archive)
    assert e.value.reason == "corrupt" and str(archive) in str(e.value)


def test_target_reached_through_a_symlink_is_refused(world, tmp_path):
    """A directory of the cache that is a symlink (to elsewhere) is never written through."""
    archive = tmp_path / "a.tar.zst"
    archive.write_bytes(world["archive"])
    outside = tmp_path / "outside"
    outside.mkdir()
    debug = tmp_path / "t" / "debug"
    debug.mkdir(parents=True)
    first = str(world["files"]["full"]).lstrip("/").split("/")[0]
    (debug / first).symlink_to(outside)
    with pytest.raises(ArchiveError) as e:
        do_import(tmp_path, archive)
    assert e.value.reason == "target_symlink"
    assert list(outside.iterdir()) == []


def test_a_binary_mapped_1200_directories_deep_is_archived_and_imported(tmp_path, public_tmp_factory):
    """A user can map a file at a path deeper than Python recurses; the store, the archive and the imported
    cache mirror that path (perf's layout).  Import installs it, and removes its staging whole."""
    from buildidd.sessionlog import SessionWriter
    from buildidd.store import Store

    top = public_tmp_factory("buildidd-import-deep-")
    deep = top.joinpath(*["d"] * 1200)
    subprocess.run(["mkdir", "-p", str(deep)], check=True)          # os.makedirs recurses once per level
    exe = build_binary(deep, "deep")
    bid = readelf_build_id(exe)
    store = Store(tmp_path / "store", debug_root=tmp_path / "no-debug")
    debug, sessions = tmp_path / "debug", tmp_path / "imported"
    try:
        store_add(store, exe)
        session = tmp_path / "sessions" / SESSION_NAME
        w = SessionWriter(session, compress=True)
        w.write({"type": "session", "time_ns": 1_000, "host": "prod-1", "boot_id": "b00t", "kernel_release": "6.18",
                 "kernel_build_id": None, "module_build_ids": {}, "boot_to_wall_offset_ns": 1_700_000_000 * 10**9})
        w.write({"type": "mmap", "time_ns": 2_000, "pid": 100, "tid": 100, "comm": "x", "start": 0x400000,
                 "len": 4096, "pgoff": 0, "path": str(exe), "build_id": bid, "error": None})
        w.write({"type": "end", "time_ns": 3_000})
        w.close()
        archive = tmp_path / "deep.tar.zst"
        with open(archive, "wb") as out:
            write_archive(session, store, out)
        report = import_archive(archive, debug_dir=debug, session_root=sessions)
        assert report.installed == [bid], [(r.status, r.reason) for r in report.manifest.build_ids]
        got = subprocess.run(["readelf", "-n", str(debug / ".build-id" / bid[:2] / bid[2:] / "elf")], capture_output=True,
                             text=True, timeout=60)
        assert bid in got.stdout, got.stderr
        assert [p.name for p in debug.iterdir() if p.name.startswith(".buildidd")] == []     # no staging left
        assert [p.name for p in sessions.iterdir() if p.name.startswith(".")] == []
    finally:
        for d in (tmp_path / "store", debug):
            remove_tree(d)

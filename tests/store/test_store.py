"""Tests of buildidd.store on real files: gcc-built binaries, perf as the layout oracle.

``perf --buildid-dir DIR buildid-cache -a FILE`` (perf 6.1 does not read
PERF_BUILDID_DIR; it only sets it for the commands it runs) writes the tree the
store must write; ``perf buildid-cache -l`` reads ours.  perf record/report
checks live in tests/integration/test_store_perf.py.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
import struct
import subprocess
import time
from pathlib import Path

import pytest

from buildidd.store import copydata as copy_mod
from buildidd.resolve.buildid import read_build_id
from buildidd.errors import StoreError
from buildidd.resolve.host import kernel_build_id
from buildidd.resolve.procfs import identity_of
from buildidd.sessionlog import SessionWriter, enforce_retention, session_build_ids
from buildidd.store import COPY_CHUNK_BYTES, KALLSYMS_DSO, Store, sdt_probe_cache
from buildidd.store.debuginfo import lacks_section
from buildidd.store.sdt import probes_text

from conftest import gcc, need, readelf_build_id, remove_tree

HAVE_PERF = shutil.which("perf") is not None

# -- inputs -----------------------------------------------------------------------

MAIN_SRC = """
#include <stdio.h>
int bidd_store_marker_%(n)d(int x) { return x * %(n)d; }
int main(int argc, char **argv) { printf("%%d\\n", bidd_store_marker_%(n)d(argc)); return 0; }
"""

#: A binary with hand-made SDT notes (no sys/sdt.h needed): a semaphore in .probes,
#: a .stapsdt.base, arguments perf renames, skips (constants, scaled, %rip-relative),
#: a note without arguments, one with ":x", and repeated provider:name pairs.
SDT_SRC = r"""
unsigned short bidd_sem __attribute__((section(".probes"), used));
__asm__(".pushsection .stapsdt.base,\"aG\",\"progbits\",.stapsdt.base,comdat\n"
        ".weak _.stapsdt.base\n.hidden _.stapsdt.base\n_.stapsdt.base: .space 1\n"
        ".size _.stapsdt.base, 1\n.popsection\n");
#define NOTE(lbl, sem, prov, name, args) \
  ".pushsection .note.stapsdt,\"\",\"note\"\n.balign 4\n.4byte 992f-991f, 994f-993f, 3\n" \
  "991: .asciz \"stapsdt\"\n992: .balign 4\n993: .8byte " lbl "\n.8byte _.stapsdt.base\n" \
  ".8byte " sem "\n.asciz \"" prov "\"\n.asciz \"" name "\"\n.asciz \"" args "\"\n994: .balign 4\n.popsection\n"
int f(int x) {
  __asm__ volatile("980: nop\n"
    NOTE("980b", "bidd_sem", "bidd", "regs", ARGS)
    NOTE("980b", "0", "bidd", "noargs", "")
    NOTE("980b", "0", "bidd", "colon", ":x")
    "981: nop\n"
    NOTE("981b", "0", "bidd", "regs", "8@%rsi")
    NOTE("981b", "0", "bidd", "regs", "8@%rsi")
    NOTE("980b", "0", "bidd", "regs", "1@%al 1@%dil 8@%rsp 4@%esp")
    NOTE("981b", "0", "other_provider", "dup", ""));
  return x + 1;
}
int main(int c, char **v) { return f(c); }
"""
SDT_ARGS = ("8@%rdi -4@$5 8@(%rax,%rbx,8) 4@-16(%rbp) 2@%r8w 1@(%rsp) %rax 8@check(%rip) "
            "8@24(%rdi) -8@%r15 -2@+8(%r12d) 8@%xmm0")


def build(tmp: Path, name: str, n: int = 1, *flags: str) -> Path:
    """A gcc-built executable (mode 0o755 whatever the umask) with a SHA-1 build-id that differs for each n."""
    exe = gcc(MAIN_SRC % {"n": n}, tmp / name, "-g", "-Wl,--build-id=sha1", *flags)
    os.chmod(exe, 0o755)
    return exe


def build_big(tmp: Path, pad_bytes: int, name: str = "big") -> Path:
    """An executable of about pad_bytes bytes (an initialized array in .data)."""
    src = f"char pad[{pad_bytes}] __attribute__((used)) = {{1}}; int main(void) {{ return pad[7]; }}"
    exe = gcc(src, tmp / name, "-Wl,--build-id=sha1")
    assert exe.stat().st_size > pad_bytes
    return exe


def build_sdt(tmp: Path, args: str = SDT_ARGS) -> Path:
    exe = gcc(SDT_SRC, tmp / "sdt", "-g", "-Wl,--build-id=sha1", f'-DARGS="{args}"')
    os.chmod(exe, 0o755)
    return exe


def bid_of(path: Path) -> str:
    bid = readelf_build_id(path)
    assert bid, f"{path} has no build-id"
    return bid


def add(st: Store, path: Path, bid: str | None = None, name: str | None = None, **kw):
    fd = os.open(path, os.O_RDONLY)
    try:
        return st.add_from_fd(fd, str(path) if name is None else name, bid or bid_of(path), **kw)
    finally:
        os.close(fd)


def tree(root: Path) -> dict[str, tuple]:
    """Every entry under root as perf sees it: relative path → (kind, link target or sha256).

    Modes are left out (the store's are 0o750/0o640 root:group on purpose, perf's 0o755:
    see test_modes_whatever_the_umask_and_source), and so is buildidd's origin.json.
    """
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st = os.lstat(p)
            rel = str(p.relative_to(root))
            if name == "origin.json":
                continue
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir",)
            else:
                out[rel] = ("file", hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def files_under(root: Path) -> list[str]:
    return sorted(str(Path(d, f).relative_to(root)) for d, _, fs in os.walk(root) for f in fs)


def perf(*args: str, buildid_dir: Path) -> subprocess.CompletedProcess:
    need(HAVE_PERF, "perf (linux-perf) not installed")
    env = {k: v for k, v in os.environ.items() if k != "DEBUGINFOD_URLS"}
    return subprocess.run(["perf", "--buildid-dir", str(buildid_dir), *args], capture_output=True,
                          text=True, env=env, check=True)


@pytest.fixture
def st(tmp_path) -> Store:
    return Store(tmp_path / "store", debug_root=tmp_path / "no-debug")


# -- layout: perf as the oracle -------------------------------------------------------


def test_layout_is_perfs(tmp_path):
    exe = build(tmp_path, "prog")
    bid = bid_of(exe)
    perf("buildid-cache", "-a", str(exe), buildid_dir=tmp_path / "A")
    st = Store(tmp_path / "B", debug_root=tmp_path / "no-debug")
    res = add(st, exe)

    theirs, ours = tree(tmp_path / "A"), tree(tmp_path / "B")
    assert ours == theirs  # paths, kinds, link targets, contents
    rel_dir = f"{str(exe).lstrip('/')}/{bid}"
    assert ours[f".build-id/{bid[:2]}/{bid[2:]}"] == ("link", f"../../{rel_dir}")
    assert set(ours) >= {f"{rel_dir}/elf", f"{rel_dir}/probes"}
    assert res.added and res.path == tmp_path / "B" / rel_dir / "elf" and not res.debuginfo
    assert res.bytes == exe.stat().st_size + (res.path.parent / "origin.json").stat().st_size
    assert st.contains(bid) and st.path_of(bid) == res.path

    # perf reads our store: --list validates each entry against the original file.
    listed = perf("buildid-cache", "-l", buildid_dir=tmp_path / "B").stdout.split()
    assert listed == [bid, str(exe)]


def test_byte_identical_copy_and_fd_offset_untouched(st, tmp_path):
    exe = build(tmp_path, "prog")
    os.chmod(exe, 0o4775)  # setuid, group-writable: neither is copied
    fd = os.open(exe, os.O_RDONLY)
    try:
        os.lseek(fd, 123, os.SEEK_SET)
        res = st.add_from_fd(fd, str(exe), bid_of(exe))
        assert os.lseek(fd, 0, os.SEEK_CUR) == 123
    finally:
        os.close(fd)
    assert res.path.read_bytes() == exe.read_bytes()
    assert stat.S_IMODE(res.path.stat().st_mode) == 0o640  # not setuid, not executable, not world-readable
    assert read_build_id(res.path).hex == bid_of(exe)


def test_add_is_idempotent_and_dedups_by_build_id(st, tmp_path):
    exe = build(tmp_path, "prog")
    first = add(st, exe)
    again = add(st, exe)
    twin = tmp_path / "twin"
    shutil.copy2(exe, twin)
    elsewhere = add(st, twin)  # the same build-id under another path: one entry
    assert first.added and not again.added and not elsewhere.added
    assert again.path == elsewhere.path == first.path and again.bytes == 0
    assert st.counters["added"] == 1 and st.counters["already_present"] == 2
    assert [e.path for e in st.entries()] == [str(exe)]


def test_sdt_probes_are_perfs(tmp_path):
    exe = build_sdt(tmp_path)
    perf("buildid-cache", "-a", str(exe), buildid_dir=tmp_path / "A")
    st = Store(tmp_path / "B", debug_root=tmp_path / "no-debug")
    add(st, exe)
    assert tree(tmp_path / "B") == tree(tmp_path / "A")
    probes = (st.path_of(bid_of(exe)).parent / "probes").read_text()
    assert probes.startswith("%sdt_bidd:regs=regs\n")
    assert " arg1=%di:u64 arg4=-16(%bp):u32 arg5=%r8:u16 arg6=+0(%sp):u8 arg7=%ax " in probes
    assert f"{exe}:0x" in probes and "%sdt_other_provider:dup=dup" in probes


def test_sdt_argument_size_out_of_range_leaves_probes_empty_like_perf(tmp_path):
    exe = build_sdt(tmp_path, args="16@%rdi")
    perf("buildid-cache", "-a", str(exe), buildid_dir=tmp_path / "A")
    st = Store(tmp_path / "B", debug_root=tmp_path / "no-debug")
    add(st, exe)
    assert tree(tmp_path / "B") == tree(tmp_path / "A")
    assert (st.path_of(bid_of(exe)).parent / "probes").read_bytes() == b""


def _system_files_with_sdt_or_debug() -> list[str]:
    out = []
    for p in ("/usr/lib/x86_64-linux-gnu/libstdc++.so.6", "/usr/lib/x86_64-linux-gnu/libc.so.6",
              "/usr/bin/python3"):
        if os.path.exists(p):
            out.append(os.path.realpath(p))
    return out


@pytest.mark.parametrize("path", _system_files_with_sdt_or_debug())
def test_system_files_layout_is_perfs(tmp_path, path):
    """Real libraries: SDT probes (libstdc++, python) and host debuginfo (libc with libc6-dbg)."""
    perf("buildid-cache", "-a", path, buildid_dir=tmp_path / "A")
    st = Store(tmp_path / "B")  # the host's /usr/lib/debug, as perf uses
    res = add(st, Path(path))
    assert tree(tmp_path / "B") == tree(tmp_path / "A")
    bid = bid_of(Path(path))
    assert res.debuginfo == os.path.exists(f"/usr/lib/debug/.build-id/{bid[:2]}/{bid[2:]}.debug")


def test_sdt_probe_cache_without_notes_is_empty(tmp_path):
    exe = build(tmp_path, "prog")
    with open(exe, "rb") as f:
        assert sdt_probe_cache(f, str(exe)) == b""
    junk = tmp_path / "junk"
    junk.write_bytes(b"\x7fELF" + b"\xff" * 100)
    with open(junk, "rb") as f:
        assert sdt_probe_cache(f, str(junk)) == b""


def test_probes_text_skips_pyelftools_only_where_it_would_find_nothing(tmp_path):
    """probes_text answers b"" without pyelftools when the section table has no .note.stapsdt; on real
    files with and without probes, and on files whose table cannot be read whole, it answers as
    sdt_probe_cache does."""
    plain, sdt = build(tmp_path, "plain"), build_sdt(tmp_path)
    files = [plain, sdt, *map(Path, _system_files_with_sdt_or_debug())]
    data = bytearray(plain.read_bytes())
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    str_size, = struct.unpack_from("<Q", data, shoff + shstrndx * shentsize + 0x20)
    struct.pack_into("<I", data, shoff + (shnum - 1) * shentsize, str_size + 5)  # a name out of the table
    unreadable = tmp_path / "unreadable-name"
    unreadable.write_bytes(bytes(data))
    files.append(unreadable)
    for path in files:
        with open(path, "rb") as f:
            assert probes_text(path, str(path)) == sdt_probe_cache(f, str(path)), path
            if path == sdt:
                assert not lacks_section(f.fileno(), b".note.stapsdt")
            if path == plain:
                assert lacks_section(f.fileno(), b".note.stapsdt")
            if path == unreadable:
                assert not lacks_section(f.fileno(), b".note.stapsdt")   # in doubt: pyelftools decides
    assert probes_text(sdt, str(sdt)).startswith(b"%sdt_bidd:regs=regs\n")


# -- debuginfo ---------------------------------------------------------------------


def _debug_tree(tmp_path: Path, exe: Path, bid: str) -> Path:
    """A fake /usr/lib/debug holding exe's debuginfo as .build-id/xx/rest.debug."""
    root = tmp_path / "debugroot"
    dst = root / ".build-id" / bid[:2] / f"{bid[2:]}.debug"
    dst.parent.mkdir(parents=True)
    subprocess.run(["objcopy", "--only-keep-debug", str(exe), str(dst)], check=True)
    return root


def test_debuginfo_lands_where_perf_looks(tmp_path):
    exe = build(tmp_path, "prog")
    bid = bid_of(exe)
    stripped = tmp_path / "prog.stripped"
    subprocess.run(["strip", "--strip-all", "-o", str(stripped), str(exe)], check=True)
    assert bid_of(stripped) == bid
    debug_root = _debug_tree(tmp_path, exe, bid)
    st = Store(tmp_path / "store", debug_root=debug_root)
    res = add(st, stripped)
    assert res.debuginfo and st.counters["debuginfo_added"] == 1
    debug_src = debug_root / ".build-id" / bid[:2] / f"{bid[2:]}.debug"
    # perf: DSO_BINARY_TYPE__BUILD_ID_CACHE_DEBUGINFO = <linkname>/debug
    via_link = tmp_path / "store" / ".build-id" / bid[:2] / bid[2:] / "debug"
    assert via_link.read_bytes() == debug_src.read_bytes()
    assert res.bytes == (stripped.stat().st_size + debug_src.stat().st_size
                         + (res.path.parent / "origin.json").stat().st_size)
    assert [e.size_bytes for e in st.entries()] == [res.bytes]


def test_debuginfo_with_another_build_id_is_not_stored(tmp_path):
    exe, other = build(tmp_path, "prog", 1), build(tmp_path, "other", 2)
    bid = bid_of(exe)
    root = tmp_path / "debugroot"
    dst = root / ".build-id" / bid[:2] / f"{bid[2:]}.debug"
    dst.parent.mkdir(parents=True)
    subprocess.run(["objcopy", "--only-keep-debug", str(other), str(dst)], check=True)
    st = Store(tmp_path / "store", debug_root=root)
    res = add(st, exe)
    assert res.added and not res.debuginfo
    assert not (res.path.parent / "debug").exists()
    assert st.counters["debuginfo_mismatch"] == 1


def test_debuginfo_installed_later_is_added_on_the_next_add(tmp_path):
    exe = build(tmp_path, "prog")
    bid = bid_of(exe)
    root = tmp_path / "debugroot"
    st = Store(tmp_path / "store", debug_root=root)
    assert not add(st, exe).debuginfo
    _debug_tree(tmp_path, exe, bid)
    res = add(st, exe)
    assert not res.added and res.debuginfo and (res.path.parent / "debug").is_file()


def test_kernel_module_names_get_no_debuginfo_like_perf(tmp_path):
    exe = build(tmp_path, "prog")
    root = _debug_tree(tmp_path, exe, bid_of(exe))
    st = Store(tmp_path / "store", debug_root=root)
    res = add(st, exe, name="/lib/modules/x/foo.ko")
    assert res.added and not res.debuginfo


# -- failures leave nothing -----------------------------------------------------------


def test_verify_failure_leaves_nothing(st, tmp_path):
    exe, other = build(tmp_path, "prog", 1), build(tmp_path, "other", 2)
    with pytest.raises(StoreError, match="build-id"):
        add(st, exe, bid=bid_of(other))
    assert st.counters["verify_failed"] == 1 and st.counters["added"] == 0
    assert not st.contains(bid_of(other))
    assert files_under(st.root) == [] and os.listdir(st.root) == []
    assert add(st, exe).added  # still usable


def test_identity_mismatch_before_copying(st, tmp_path):
    exe = build(tmp_path, "prog")
    fd = os.open(exe, os.O_RDONLY)
    try:
        ident = identity_of(fd)
        os.utime(exe, ns=(1, 1))  # mtime differs from the identity's
        with pytest.raises(StoreError, match="before copying"):
            st.add_from_fd(fd, str(exe), bid_of(exe), identity=ident)
    finally:
        os.close(fd)
    assert st.counters["identity_mismatch"] == 1 and os.listdir(st.root) == []


def test_source_modified_while_copying_is_discarded(st, tmp_path):
    big = build_big(tmp_path, 3 << 20)
    fd = os.open(big, os.O_RDONLY)
    ident = identity_of(fd)
    calls = []

    def throttle(n: int) -> None:
        calls.append(n)
        if len(calls) == 1:
            with open(big, "r+b") as f:  # rewrite a byte in place: mtime changes
                f.seek(100)
                f.write(f.read(1))

    st.throttle = throttle
    try:
        with pytest.raises(StoreError, match="changed while being copied|after copying"):
            st.add_from_fd(fd, str(big), bid_of(big), identity=ident)
    finally:
        os.close(fd)
    if not calls:
        pytest.skip("the copy was a reflink: no chunk to interfere with")
    assert st.counters["identity_mismatch"] == 1
    assert files_under(st.root) == []


def test_not_a_regular_file(st):
    fd = os.open("/dev/null", os.O_RDONLY)
    try:
        with pytest.raises(StoreError, match="regular"):
            st.add_from_fd(fd, "/dev/null", "ab" * 20)
    finally:
        os.close(fd)


@pytest.mark.parametrize("path", ["relative/x", "/a/../b", "/.build-id/ab/cd", "", "/"])
def test_bad_paths(st, tmp_path, path):
    exe = build(tmp_path, "prog")
    with pytest.raises(ValueError):
        add(st, exe, name=path)


@pytest.mark.parametrize("bid", ["xyz", "abc", "ab", "", "a" * 130])
def test_bad_build_ids(st, bid):
    with pytest.raises(ValueError):
        st.contains(bid)


# -- copying: chunks, throttle, fallbacks -----------------------------------------------


def test_throttle_called_per_chunk(st, tmp_path):
    big = build_big(tmp_path, 5 << 19)
    size = big.stat().st_size
    calls = []
    st.throttle = calls.append
    res = add(st, big)
    if res.reflinked:
        assert calls == [] and st.counters["reflinks"] == 1
    else:
        assert calls == [COPY_CHUNK_BYTES] * (size // COPY_CHUNK_BYTES) + [size % COPY_CHUNK_BYTES]
        assert st.counters["bytes_copied"] == size
    assert res.path.read_bytes() == big.read_bytes()


def _fail(err: int):
    def f(*args, **kwargs):
        raise OSError(err, os.strerror(err))
    return f


@pytest.mark.parametrize("broken", [[], ["ioctl"], ["ioctl", "cfr"], ["ioctl", "cfr", "sendfile"]])
def test_copy_falls_back(st, tmp_path, monkeypatch, broken):
    big = build_big(tmp_path, 5 << 19)
    if "ioctl" in broken:
        monkeypatch.setattr(copy_mod.fcntl, "ioctl", _fail(errno.EOPNOTSUPP))
    if "cfr" in broken:
        monkeypatch.setattr(copy_mod, "_copy_file_range", _fail(errno.EXDEV))
    if "sendfile" in broken:
        monkeypatch.setattr(copy_mod, "_sendfile", _fail(errno.EINVAL))
    res = add(st, big)
    assert res.path.read_bytes() == big.read_bytes()


def test_io_error_is_a_store_error(st, tmp_path, monkeypatch):
    exe = build(tmp_path, "prog")
    monkeypatch.setattr(copy_mod.fcntl, "ioctl", _fail(errno.EOPNOTSUPP))
    monkeypatch.setattr(copy_mod, "_copy_file_range", _fail(errno.EIO))
    with pytest.raises(StoreError, match="Input/output"):
        add(st, exe)
    assert st.counters["copy_errors"] == 1 and files_under(st.root) == []


# -- full disk (tmpfs, root) -----------------------------------------------------------

@pytest.fixture
def small_tmpfs(tmpfs_mount):
    """A 1 MiB tmpfs (a disk that fills up)."""
    return tmpfs_mount("1m")


def test_full_disk(small_tmpfs, tmp_path):
    big = build_big(tmp_path, 2 << 20)
    small = build(tmp_path, "small")
    st = Store(small_tmpfs / "store", debug_root=tmp_path / "no-debug")
    with pytest.raises(StoreError, match="No space left"):
        add(st, big)
    assert st.counters["copy_errors"] == 1
    assert files_under(small_tmpfs) == []  # no temporary file, no half-written elf
    assert not st.contains(bid_of(big))
    res = add(st, small)  # the space came back: the store is usable
    assert res.added and res.path.read_bytes() == small.read_bytes()
    assert tree(small_tmpfs / "store").keys() == tree_of_one(small, bid_of(small)).keys()


def tree_of_one(exe: Path, bid: str) -> dict[str, tuple]:
    parts = str(exe).strip("/").split("/")
    out = {".build-id": (), f".build-id/{bid[:2]}": (), f".build-id/{bid[:2]}/{bid[2:]}": ()}
    for i in range(1, len(parts) + 1):
        out["/".join(parts[:i])] = ()
    d = "/".join(parts) + "/" + bid
    out.update({d: (), f"{d}/elf": (), f"{d}/probes": ()})
    return out


# -- recency, quota ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def four_binaries(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bins")
    return [build(tmp, f"prog{n}", n) for n in range(4)]


def test_quota_removes_least_recent_unprotected(tmp_path, four_binaries):
    st = Store(tmp_path / "store", debug_root=tmp_path / "no-debug")
    a, b, c, d = (bid_of(p) for p in four_binaries)
    for p in four_binaries:
        add(st, p)
    for bid in (a, b, c, d, a):  # LRU order now: b, c, d, a
        st.touch(bid)
    assert st.size_bytes() == sum(e.size_bytes for e in st.entries())
    sizes = {e.build_id_hex: e.disk_bytes for e in st.entries()}  # the quota counts disk bytes
    assert st.disk_bytes() == sum(sizes.values())

    st.quota_bytes = sizes[a] + sizes[b] + 1  # room for two
    assert st.enforce_quota({b}) == [c, d]
    assert {e.build_id_hex for e in st.entries()} == {a, b} and not st.over_quota
    assert not st.contains(c) and st.path_of(d) is None
    # Empty directories of removed entries are gone too.
    assert not (st.root / str(four_binaries[2]).lstrip("/")).exists()

    st.quota_bytes = 0
    assert st.enforce_quota({b.upper()}) == [a]
    assert [e.build_id_hex for e in st.entries()] == [b] and st.over_quota
    assert st.counters["removed"] == 3

    with pytest.raises(TypeError):
        st.enforce_quota({bytes.fromhex(b)})


def test_no_quota_removes_nothing(st, four_binaries):
    add(st, four_binaries[0])
    assert st.enforce_quota(set()) == [] and not st.over_quota


def test_touch_and_entries(st, four_binaries):
    add(st, four_binaries[0])
    bid = bid_of(four_binaries[0])
    (entry,) = st.entries()
    before = entry.last_ref_ns
    time.sleep(0.01)
    st.touch(bid)
    (entry,) = st.entries()
    assert entry.last_ref_ns > before and entry.last_ref_ns <= time.time_ns()
    assert entry.path == str(four_binaries[0]) and entry.directory == st.path_of(bid).parent
    with pytest.raises(StoreError):
        st.touch(bid_of(four_binaries[1]))


def test_remove(st, four_binaries):
    res = add(st, four_binaries[0])
    bid = bid_of(four_binaries[0])
    assert st.remove(bid) == res.bytes
    assert st.remove(bid) == 0
    assert not st.contains(bid) and files_under(st.root) == []


def test_sweep_temps(st, four_binaries):
    res = add(st, four_binaries[0])
    stale = res.path.with_name(".elf.buildidd-tmp-0123456789ab")
    stale.write_bytes(b"x")
    link = st.linkname(bid_of(four_binaries[0]))
    stale_link = link.with_name(f".{link.name}.buildidd-tmp-0123456789ab")
    os.symlink(os.readlink(link), stale_link)  # a crash between symlink() and rename()
    assert st.sweep_temps() == 2
    assert not stale.exists() and not os.path.lexists(stale_link) and res.path.exists() and link.exists()


def test_sweep_temps_walks_a_store_deeper_than_pythons_recursion_limit(st, four_binaries):
    """The store mirrors each file's path (perf's layout), and any user can map a file 1,200 directories
    deep: the sweep still reaches the bottom."""
    deep = "/" + "d/" * 1200 + "prog"
    try:
        res = add(st, four_binaries[0], name=deep)
        assert len(res.path.parts) > 1200
        stale = res.path.with_name(".elf.buildidd-tmp-0123456789ab")
        stale.write_bytes(b"x")
        assert st.sweep_temps() == 1
        assert not stale.exists() and res.path.exists()
    finally:
        remove_tree(st.root)


def test_entry_left_without_link_by_a_crash_is_invisible_then_reused(st, four_binaries):
    exe = four_binaries[0]
    bid = bid_of(exe)
    res = add(st, exe)
    os.unlink(st.linkname(bid))  # as if the daemon died before making the link
    assert not st.contains(bid) and st.entries() == []
    again = add(st, exe)
    assert again.added and again.path == res.path and st.contains(bid)


def test_copy_file_range_answering_zero_falls_back(st, tmp_path, monkeypatch):
    big = build_big(tmp_path, 5 << 19)
    monkeypatch.setattr(copy_mod.fcntl, "ioctl", _fail(errno.EOPNOTSUPP))
    monkeypatch.setattr(copy_mod, "_copy_file_range", lambda *a: 0)
    assert add(st, big).path.read_bytes() == big.read_bytes()


# -- kernel ---------------------------------------------------------------------------------


def _kernel_bid() -> str:
    bid = kernel_build_id()
    need(bid is not None, "the running kernel has no build-id in /sys/kernel/notes")
    with open("/proc/kallsyms") as f:
        need(int(f.readline().split()[0], 16) != 0, "kallsyms addresses hidden (kptr_restrict)")
    return bid


def test_add_kallsyms(st):
    bid = _kernel_bid()
    res = st.add_kallsyms(bid, vmlinux_paths=[])
    entry_dir = st.root / KALLSYMS_DSO / bid
    assert res.added and res.path == entry_dir / "kallsyms" and not res.debuginfo
    assert os.readlink(st.linkname(bid)) == f"../../{KALLSYMS_DSO}/{bid}"
    assert stat.S_IMODE(res.path.stat().st_mode) == 0o640  # perf's copyfile() gives 0o755
    head = res.path.read_text().splitlines()[:100]
    assert head == Path("/proc/kallsyms").read_text().splitlines()[:100]
    expected = {"kallsyms", "modules"} if os.path.exists("/proc/modules") else {"kallsyms"}
    assert set(os.listdir(entry_dir)) == expected
    assert st.contains(bid) and st.path_of(bid) == res.path
    assert [(e.build_id_hex, e.path) for e in st.entries()] == [(bid, KALLSYMS_DSO)]
    again = st.add_kallsyms(bid, vmlinux_paths=[])
    assert not again.added and again.path == res.path


def test_add_kallsyms_with_vmlinux(st, tmp_path):
    bid = _kernel_bid()
    decoy = build(tmp_path, "decoy")
    fake = gcc("int main(void) { return 0; }", tmp_path / "vmlinux-fake", f"-Wl,--build-id=0x{bid}")
    assert bid_of(fake) == bid
    res = st.add_kallsyms(bid, vmlinux_paths=[tmp_path / "absent", decoy, fake])
    assert res.debuginfo
    assert (st.root / KALLSYMS_DSO / bid / "vmlinux").read_bytes() == fake.read_bytes()


def test_add_kallsyms_refuses_other_kernels_and_hidden_addresses(st, tmp_path):
    bid = _kernel_bid()
    with pytest.raises(StoreError, match="running kernel"):
        st.add_kallsyms("ab" * 20)
    hidden = tmp_path / "kallsyms"
    hidden.write_text("0000000000000000 T _stext\n0000000000000000 T _text\n")
    with pytest.raises(StoreError, match="hidden"):
        st.add_kallsyms(bid, kallsyms_path=hidden, vmlinux_paths=[])
    assert files_under(st.root) == [] and not st.contains(bid)


# -- sessions: build-ids and retention ------------------------------------------------------


def write_session(directory: Path, build_ids: list[str | None], *, kernel: str = "ee" * 20,
                  compress: bool = False, pad: int = 0) -> None:
    with SessionWriter(directory, compress=compress) as w:
        w.write({"type": "session", "kernel_build_id": kernel, "module_build_ids": {"ext4": "dd" * 20}})
        for i, bid in enumerate(build_ids):
            kind = "exec" if i == 0 else "mmap"
            w.write({"type": kind, "pid": 1, "path": f"/bin/{i}", "build_id": bid, "pad": "x" * pad})
        w.write({"type": "fork", "pid": 2, "ppid": 1})


def age(directory: Path, seconds_ago: float) -> None:
    t = int((time.time() - seconds_ago) * 1e9)
    for p in [*directory.iterdir(), directory]:
        os.utime(p, ns=(t, t))


def test_session_build_ids(tmp_path):
    s = tmp_path / "s1"
    write_session(s, ["AA" * 20, None, "bb" * 20, "bb" * 20], compress=True)
    assert any(p.suffix == ".zst" for p in s.iterdir())
    assert session_build_ids(s) == {"aa" * 20, "bb" * 20, "ee" * 20, "dd" * 20}


def test_retention_by_age_keeps_current(tmp_path):
    root = tmp_path / "sessions"
    for name, days in (("s-old", 10), ("s-mid", 5), ("s-new", 1), ("s-now", 0)):
        write_session(root / name, ["aa" * 20])
        age(root / name, days * 86400)
    removed = enforce_retention(root, max_age_s=2 * 86400, max_total_bytes=None, keep={"s-old"})
    assert removed == [root / "s-mid"]
    assert sorted(os.listdir(root)) == ["s-new", "s-now", "s-old"]


def test_retention_by_size_oldest_first(tmp_path):
    root = tmp_path / "sessions"
    sizes = {}
    for name, days in (("a", 4), ("b", 3), ("c", 2), ("d", 1)):
        write_session(root / name, ["aa" * 20], pad=10_000)
        age(root / name, days * 86400)
        sizes[name] = sum(p.stat().st_size for p in (root / name).iterdir())
    limit = sizes["c"] + sizes["d"]
    keep = {str(root / "b")}  # a path works as well as a name
    removed = enforce_retention(root, max_age_s=None, max_total_bytes=limit, keep=keep)
    assert removed == [root / "a", root / "c"]
    assert sorted(os.listdir(root)) == ["b", "d"]
    assert enforce_retention(root, max_age_s=None, max_total_bytes=None, keep=set()) == []


def test_retention_protects_the_store(tmp_path, four_binaries):
    """The intended composition: build-ids of retained sessions are protected from the quota."""
    st = Store(tmp_path / "store", debug_root=tmp_path / "no-debug")
    bids = [bid_of(p) for p in four_binaries]
    for p in four_binaries:
        add(st, p)
    root = tmp_path / "sessions"
    write_session(root / "old", bids[:2])
    age(root / "old", 9 * 86400)
    write_session(root / "new", bids[2:3])
    enforce_retention(root, max_age_s=86400, max_total_bytes=None, keep={"new"})
    protected = set().union(*(session_build_ids(d) for d in root.iterdir()))
    st.quota_bytes = 0
    assert sorted(st.enforce_quota(protected)) == sorted(bids[:2] + bids[3:])
    assert [e.build_id_hex for e in st.entries()] == [bids[2]] and st.over_quota

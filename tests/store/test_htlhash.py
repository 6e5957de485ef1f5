"""Files without a GNU build-id: kept under their htlhash (resolve.fileid.file_id), found by Go build ID,
served, archived and imported like build-id entries; the htlhash checked against an independent hashlib
computation over real system files and binaries built here."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from buildidd.errors import StoreError
from buildidd.resolve.fileid import file_id, read_go_build_id
from buildidd.store import Store
from conftest import gcc

SRC = '#include <stdio.h>\nint main(void) { puts("no build-id here"); return 0; }\n'
GO_SRC = 'package main\n\nimport "fmt"\n\nfunc main() { fmt.Println("go without a GNU build-id") }\n'


def htlhash(path: Path) -> str:
    """OpenTelemetry's htlhash, written out from its definition: SHA-256 over the first 4 KiB, the last 4 KiB
    and the length as a big-endian u64, first 128 bits in hex."""
    data = path.read_bytes()
    h = hashlib.sha256()
    h.update(data[:4096])
    h.update(data[-4096:] if data else b"")
    h.update(len(data).to_bytes(8, "big"))
    return h.hexdigest()[:32]


def fid_of(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY)
    try:
        return file_id(fd)
    finally:
        os.close(fd)


def go_build(d: Path, out: str, *ldflags: str) -> Path:
    """A Go binary built here (GOCACHE in d, no modules)."""
    assert shutil.which("go"), "go (golang-go, installed by scripts/setup) is needed"
    (d / "main.go").write_text(GO_SRC)
    env = {**os.environ, "GOCACHE": str(d / "gocache"), "GOPATH": str(d / "gopath"), "GO111MODULE": "off"}
    args = ["go", "build"] + ([f"-ldflags={' '.join(ldflags)}"] if ldflags else []) + ["-o", str(d / out), "main.go"]
    subprocess.run(args, check=True, env=env, cwd=d, capture_output=True, timeout=300)
    return d / out


@pytest.fixture(scope="module")
def bins(tmp_path_factory):
    d = tmp_path_factory.mktemp("htlhash")
    os.chmod(d, 0o755)
    for p in d.parents:          # pytest's base directory is 0700: make this one's way public, as /usr is
        if str(p) in ("/", "/tmp"):
            break
        os.chmod(p, os.stat(p).st_mode | 0o005)
    out = {"nobid": gcc(SRC, d / "nobid", "-Wl,--build-id=none"),
           "static": gcc(SRC, d / "static", "-static", "-Wl,--build-id=none")}
    # The Go linker writes no GNU build-id unless asked (-B); its own note stays.
    out["go"] = go_build(d, "gobin")
    return out


def test_htlhash_equals_an_independent_computation_on_100_system_files_and_built_binaries(bins):
    files = []
    for top in ("/usr/bin", "/usr/lib/x86_64-linux-gnu"):
        for name in sorted(os.listdir(top)):
            p = Path(top, name)
            try:
                st = os.stat(p)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and os.access(p, os.R_OK):
                files.append(p)
    # every size class: empty-ish, under 4 KiB, under 8 KiB (the two edges overlap), large
    files.sort(key=lambda p: os.stat(p).st_size)
    step = max(1, len(files) // 100)
    chosen = files[::step][:100]
    sizes = [os.stat(p).st_size for p in chosen]
    assert len(chosen) == 100 and min(sizes) < 4096 and max(sizes) > 1 << 20, sizes
    assert any(4096 < s < 8192 for s in sizes + [os.stat(p).st_size for p in files[:500]])
    for p in chosen + list(bins.values()):
        assert fid_of(p) == htlhash(p), p


def test_a_file_without_a_build_id_is_kept_under_its_htlhash(bins, tmp_path):
    store = Store(tmp_path / "store", group=None)
    path = bins["nobid"]
    key = htlhash(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        res = store.add_from_fd(fd, str(path), key, key="htlhash")
        with pytest.raises(StoreError, match="htlhash"):          # the copy is checked against its key
            store.add_from_fd(fd, str(path), "ab" * 16, key="htlhash")
        with pytest.raises(ValueError):
            store.add_from_fd(fd, str(path), "ab" * 20, key="htlhash")   # an htlhash is 128 bits
    finally:
        os.close(fd)
    assert res.added and store.contains(key)
    assert store.best(key).read_bytes() == path.read_bytes()
    assert os.readlink(store.linkname(key)) == f"../..{path}/{key}"
    origin = store.origin(key)
    assert (origin.key, origin.file_id, origin.go_build_id) == ("htlhash", key, "")
    assert store.key_kind(key) == "htlhash" and store.counters["verify_failed"] == 1
    # perf reads the tree as its own and checks each entry's GNU build-id: an htlhash entry is no build-id to it
    fd = os.open("/bin/true", os.O_RDONLY)
    try:
        store.add_from_fd(fd, "/bin/true", "c89156ebdabf859f4ee70cb0c303004dccf1ae51")
    except StoreError:
        pytest.skip("/bin/true has another build-id here")
    finally:
        os.close(fd)
    out = subprocess.run(["perf", "--buildid-dir", str(tmp_path / "store"), "buildid-cache", "-l"],
                         capture_output=True, text=True, timeout=60)
    assert "c89156ebdabf859f4ee70cb0c303004dccf1ae51 /bin/true" in out.stdout and key not in out.stdout, out


def test_a_file_with_a_gnu_build_id_is_never_kept_under_an_htlhash(tmp_path):
    store = Store(tmp_path / "store", group=None)
    fd = os.open("/bin/true", os.O_RDONLY)
    try:
        with pytest.raises(StoreError, match="GNU build-id"):
            store.add_from_fd(fd, "/bin/true", file_id(fd), key="htlhash")
    finally:
        os.close(fd)
    assert store.entries() == []


def test_a_go_binary_is_found_by_its_go_build_id(bins, tmp_path):
    store = Store(tmp_path / "store", group=None)
    path = bins["go"]
    fd = os.open(path, os.O_RDONLY)
    try:
        go_id = read_go_build_id(fd)
        key = file_id(fd)
        store.add_from_fd(fd, str(path), key, key="htlhash")
    finally:
        os.close(fd)
    want = subprocess.run(["go", "tool", "buildid", str(path)], capture_output=True, text=True, check=True,
                          env={**os.environ, "GOCACHE": str(tmp_path / "gocache")}).stdout.strip()
    assert go_id == want and store.origin(key).go_build_id == want
    assert store.go_key(want) == key
    assert store.best(store.go_key(want)).read_bytes() == path.read_bytes()
    assert store.go_key(want.replace("/", "/x", 1)) is None
    with pytest.raises(ValueError):
        store.go_key("../../etc/passwd")


def test_go_index_points_at_a_trusted_copy_over_a_users(bins, tmp_path, attacker):
    """The same Go build ID claimed first by a user's file (other content), then by a root-owned system
    copy: the index ends at the trusted entry."""
    store = Store(tmp_path / "store", group=None)
    go = bins["go"]
    fd = os.open(go, os.O_RDONLY)
    try:
        go_id = read_go_build_id(fd)
    finally:
        os.close(fd)
    forged = tmp_path / "forged"
    data = bytearray(go.read_bytes())
    data[-1] ^= 0xFF                              # other content (another htlhash), the same Go note
    forged.write_bytes(bytes(data))
    os.chown(forged, attacker[0], attacker[1])
    for p in (forged, go):
        fd = os.open(p, os.O_RDONLY)
        try:
            store.add_from_fd(fd, str(p), file_id(fd), key="htlhash")
        finally:
            os.close(fd)
    # the build directory is not a system directory: neither copy is trusted, so the first one stays
    assert store.go_key(go_id) == fid_of(forged)
    system = Path("/usr/local/lib/buildidd-test-go") / tmp_path.name
    system.parent.mkdir(parents=True, exist_ok=True)
    try:
        shutil.copy(go, system)
        fd = os.open(system, os.O_RDONLY)
        try:
            store.add_from_fd(fd, str(system), file_id(fd), key="htlhash")
        finally:
            os.close(fd)
    finally:
        shutil.rmtree(system.parent, ignore_errors=True)
    assert store.origin(fid_of(go)).trusted and store.provenance(fid_of(go)) == "trusted"
    assert store.go_key(go_id) == fid_of(go)


def test_a_users_file_with_a_system_files_htlhash_never_stands_for_it(bins, tmp_path, attacker):
    """The htlhash covers only the edges and the length: a user's file with another middle has the
    same one.  Met first, it is kept, untrusted; the root-owned system file met later takes its place
    (promoted), the user's content kept aside, and the trusted copy is the one served."""
    store = Store(tmp_path / "store", group=None)
    system = Path("/usr/local/lib/buildidd-test-htl") / tmp_path.name / "prog"
    system.parent.mkdir(parents=True, exist_ok=True)
    try:
        shutil.copy(bins["static"], system)
        data = bytearray(system.read_bytes())
        assert len(data) > 3 * 4096
        data[len(data) // 2] ^= 0xFF                         # the middle differs, the edges do not
        forged = tmp_path / "forged"
        forged.write_bytes(bytes(data))
        os.chown(forged, attacker[0], attacker[1])
        key = fid_of(system)
        assert fid_of(forged) == key and htlhash(forged) == key
        for p in (forged, system):
            fd = os.open(p, os.O_RDONLY)
            try:
                store.add_from_fd(fd, str(p), key, key="htlhash")
            finally:
                os.close(fd)
        assert store.best(key).read_bytes() == system.read_bytes()
        assert store.origin(key).trusted and store.provenance(key) == "conflict"
        assert store.counters["promoted"] == 1 and store.counters["conflicts"] == 1
    finally:
        shutil.rmtree(system.parent.parent, ignore_errors=True)

"""bpf/pagecache.h against readelf -n and the user-space reader, with real BPF.

Every test loads bpf/pagecache_probe.bpf.c (once per module) and asks it, by
the test's own trigger syscall, for the build-id of a file open in this
process.
"""

from __future__ import annotations

import glob
import os
import shutil
import struct
from pathlib import Path

import pytest

from buildidd.errors import ElfError
from buildidd.kernel.pagecache import PAGE_SIZE, PageCacheProbe, PcStatus, discover_bases
from buildidd.kernel.pagecache_selftest import check_kernel_path, synthetic_elf
from buildidd.resolve.buildid import read_build_id_fd
from conftest import gcc, readelf_build_id

MAIN = "int main(void) { return 0; }\n"


@pytest.fixture(scope="module")
def probe(bpf):
    p = PageCacheProbe()
    discover_bases(p)
    yield p
    p.close()


def kernel_read(probe, path):
    """The kernel's answer for path after the file was read whole (pages cached)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        while os.read(fd, 1 << 20):
            pass
        return probe.build_id(fd)
    finally:
        os.close(fd)


def user_build_id(fd: int) -> bytes | None:
    bid = read_build_id_fd(fd)
    return bid.raw if bid else None


def test_bases_read_every_page_of_a_file_back(probe, tmp_path):
    data = os.urandom(64 * PAGE_SIZE)
    path = tmp_path / "random"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.read(fd, len(data))
        vmemmap = probe.layout["STRUCT_PAGE_SIZE"]
        bases = discover_bases(probe)
        for index in range(64):
            info = probe.folio(fd, index)
            assert info.folio and info.folio_mapping == info.mapping
            pfn = (info.folio - bases.vmemmap_base) // vmemmap + index - info.folio_index
            page = probe.read_kernel(bases.page_offset_base + pfn * PAGE_SIZE, PAGE_SIZE)
            assert page == data[index * PAGE_SIZE:(index + 1) * PAGE_SIZE]
    finally:
        os.close(fd)


@pytest.mark.parametrize(("style", "size"), [("sha1", 20), ("md5", 16), ("0x0123456789abcdef", 8)])
@pytest.mark.parametrize("kind", [(), ("-shared", "-fPIC")])
def test_gcc_build_ids_of_each_size(probe, tmp_path, style, size, kind):
    out = gcc(MAIN, tmp_path / "prog", f"-Wl,--build-id={style}", *kind)
    got = kernel_read(probe, out)
    assert got.status == PcStatus.OK
    assert len(got.build_id) == size and got.build_id.hex() == readelf_build_id(out)


def test_32bit_elf(probe, tmp_path):
    out = tmp_path / "prog32"
    try:
        gcc(MAIN, out, "-m32")
    except AssertionError:
        pytest.skip("gcc -m32 does not link here (gcc-multilib missing)")
    got = kernel_read(probe, out)
    assert got.status == PcStatus.OK and got.build_id.hex() == readelf_build_id(out)


def test_system_libraries_match_user_space(probe):
    paths = sorted({os.path.realpath(p) for p in glob.glob("/usr/lib/x86_64-linux-gnu/*.so*")})
    ok = wrong = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            while os.read(fd, 1 << 20):
                pass
            try:
                user = user_build_id(fd)
            except ElfError:
                user = None
            got = probe.build_id(fd)
        finally:
            os.close(fd)
        if got.status == PcStatus.OK:
            ok += 1
            wrong += got.build_id != user
    assert wrong == 0
    assert ok >= 300, f"only {ok} of {len(paths)} libraries read"


def test_evicted_file_is_not_cached(probe, tmp_path):
    path = Path(shutil.copy("/bin/true", tmp_path / "true"))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        got = probe.build_id(fd)
    finally:
        os.close(fd)
    assert got.status == PcStatus.NOT_CACHED and got.page == 0
    assert kernel_read(probe, path).build_id.hex() == readelf_build_id(path)


def test_non_elf_and_elf_without_note(probe, tmp_path):
    text = tmp_path / "text"
    text.write_bytes(b"#!/bin/sh\necho not an ELF file\n" * 200)
    assert kernel_read(probe, text).status == PcStatus.NOT_ELF
    bare = gcc(MAIN, tmp_path / "bare", "-Wl,--build-id=none")
    assert readelf_build_id(bare) is None
    assert kernel_read(probe, bare).status == PcStatus.NO_NOTE


def move_notes_past(src: Path, dst: Path, offset: int) -> None:
    """Copies the ELF64 file src to dst with every PT_NOTE segment (and the
    sections in it) moved to file offset ``offset`` and beyond; the old note
    bytes are zeroed.  What patchelf does to a library whose headers grow."""
    data = bytearray(src.read_bytes())
    assert data[4] == 2 and offset >= len(data)
    phoff, shoff = struct.unpack_from("<QQ", data, 32)
    phent, phnum, shent, shnum = struct.unpack_from("<HHHH", data, 54)
    data += b"\0" * (offset - len(data))
    for i in range(phnum):
        at = phoff + i * phent
        p_type, _, p_offset = struct.unpack_from("<IIQ", data, at)
        if p_type != 4:
            continue
        p_filesz = struct.unpack_from("<Q", data, at + 32)[0]
        new = len(data) + (-len(data) % 8)
        data += b"\0" * (new - len(data)) + data[p_offset:p_offset + p_filesz]
        data[p_offset:p_offset + p_filesz] = b"\0" * p_filesz
        struct.pack_into("<Q", data, at + 8, new)
        for j in range(shnum):
            sat = shoff + j * shent
            sh_offset = struct.unpack_from("<Q", data, sat + 24)[0]
            if p_offset <= sh_offset < p_offset + p_filesz:
                struct.pack_into("<Q", data, sat + 24, sh_offset - p_offset + new)
    dst.write_bytes(bytes(data))


def test_note_past_the_first_page(probe, tmp_path):
    lib = gcc(MAIN, tmp_path / "lib.so", "-shared", "-fPIC")
    moved = tmp_path / "moved.so"
    move_notes_past(lib, moved, 64 * PAGE_SIZE + 100)
    assert readelf_build_id(moved) == readelf_build_id(lib)
    got = kernel_read(probe, moved)
    assert got.status == PcStatus.OK and got.build_id.hex() == readelf_build_id(lib)
    # Only page 0 cached (no readahead): the kernel names the note's page.
    fd = os.open(moved, os.O_RDONLY)
    try:
        os.fsync(fd)    # dirty pages are not dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        os.pread(fd, 16, 0)
        got = probe.build_id(fd)
    finally:
        os.close(fd)
    assert got.status == PcStatus.NOT_CACHED and got.page == 64


@pytest.mark.parametrize("is64", [True, False])
@pytest.mark.parametrize("align", [4, 8])
def test_synthetic_alignments_and_classes(probe, tmp_path, is64, align):
    path = tmp_path / "synthetic"
    path.write_bytes(synthetic_elf(bytes(range(3, 23)), is64=is64, align=align))
    got = kernel_read(probe, path)
    assert got.status == PcStatus.OK and got.build_id == bytes(range(3, 23))


def test_oversized_and_malformed_notes(probe, tmp_path):
    big = bytearray(synthetic_elf(bytes(range(20))))
    at = big.index(b"GNU\0", 0x100) - 12
    struct.pack_into("<I", big, at + 4, 65)           # descsz 65: past BUILD_ID_MAX
    (tmp_path / "big").write_bytes(big + b"\0" * 128)
    struct.pack_into("<I", big, at + 4, 0x7FFFFFFF)  # overruns its segment
    (tmp_path / "bad").write_bytes(big)
    assert kernel_read(probe, tmp_path / "big").status in (PcStatus.NOTE_TOO_LARGE, PcStatus.MALFORMED)
    assert kernel_read(probe, tmp_path / "bad").status == PcStatus.MALFORMED


def test_selftest_agrees_with_user_space(probe, tmp_path):
    exe = gcc(MAIN, tmp_path / "exe", "-Wl,--build-id=md5")
    verdict = check_kernel_path(probe, tmp_path, user_build_id, [("gcc_md5", exe)])
    assert verdict.ok, verdict.reason
    assert {c.name for c in verdict.cases} >= {"sha1", "md5", "eight_bytes", "elf32", "late_note",
                                                "large_file", "gcc_md5"}
    assert not list(tmp_path.glob("buildidd-selftest-*"))


def test_selftest_reports_a_disagreement(probe, tmp_path):
    exe = gcc(MAIN, tmp_path / "exe")
    verdict = check_kernel_path(probe, tmp_path, lambda fd: b"\x01" * 20, [("exe", exe)])
    assert not verdict.ok and "user space 0101" in verdict.reason


def test_note_at_the_end_of_page_0_needs_only_page_0(probe, tmp_path):
    path = tmp_path / "edge"
    path.write_bytes(synthetic_elf(bytes(range(50, 70)), note_offset=PAGE_SIZE - 64, size=3 * PAGE_SIZE))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        os.pread(fd, 16, 0)
        assert not probe.folio(fd, 1).folio, "page 1 was read ahead"
        got = probe.build_id(fd)
    finally:
        os.close(fd)
    assert got.status == PcStatus.OK and got.build_id == bytes(range(50, 70))

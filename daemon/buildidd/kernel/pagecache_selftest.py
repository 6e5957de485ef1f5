"""Start-up self-test of the page-cache build-id reader against user space.

The daemon writes a few ELF files of known shape (:func:`write_selftest_files`:
build-ids of 20, 16 and 8 bytes, ELF32, a note segment with 8-byte alignment,
a note past the first page, a note deep in a large file whose pages the
page cache may hold as large folios), reads each into the page cache, and
compares what bpf/pagecache.h reads with what user space reads from the same
fd (:func:`run_selftest`).  Any disagreement turns the kernel path off: the
verdict says why, and the daemon records it in the session and in ``status``.

User space's reader is passed in (``user_reader``: fd -> build-id bytes or
None), since buildidd.kernel may not import the resolve stage.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from buildidd.errors import BuildiddError, ProbeError
from buildidd.kernel.pagecache import PAGE_SIZE, KernelBuildId, PageCacheProbe, PcStatus

__all__ = ["SelfTestCase", "SelfTestVerdict", "run_selftest", "synthetic_elf",
           "write_selftest_files", "check_kernel_path"]

#: Bytes of the large self-test file: larger than readahead's first window, so
#: that later pages may be cached as large folios (ext4 on Linux 6.16+).
LARGE_FILE_BYTES = 8 << 20

_PT_NOTE = 4
_NT_GNU_BUILD_ID = 3


def _note(name: bytes, n_type: int, desc: bytes, align: int) -> bytes:
    """One ELF note (gABI "Note Section"), name and descriptor padded to align."""
    def pad(b: bytes, start: int) -> bytes:
        return b + b"\0" * (-(start + len(b)) % align)
    head = struct.pack("<III", len(name), len(desc), n_type) + name
    head = pad(head, 0)
    return pad(head + desc, 0)


def synthetic_elf(build_id: bytes, *, note_offset: int = 0x100, size: int = 0,
                  is64: bool = True, align: int = 4) -> bytes:
    """A little-endian ELF image with two PT_NOTE segments.

    The first (8-aligned, at 0xc0) holds a ``.note.gnu.property``-like note;
    the second, at ``note_offset`` with alignment ``align`` (4 or 8), holds an
    owner "Test\\0" note (whose padding differs between 4 and 8) and then the
    GNU build-id note with descriptor ``build_id``.  The image is zero-padded
    to ``size`` bytes when that is larger.

    Raises:
        ValueError: note_offset overlaps the headers or build_id is not 1..64 bytes.
    """
    if not 1 <= len(build_id) <= 64 or note_offset < 0x100:
        raise ValueError("build_id of 1..64 bytes and note_offset >= 0x100 required")
    prop = _note(b"GNU\0", 5, b"\0" * 16, 8)
    notes = _note(b"Test\0", 0x1234, b"abcd", align) + _note(b"GNU\0", _NT_GNU_BUILD_ID, build_id, align)
    if is64:
        ehdr_size, phent = 64, 56
        phdr = lambda off, n, al: struct.pack("<IIQQQQQQ", _PT_NOTE, 4, off, off, off, n, n, al)  # noqa: E731
    else:
        ehdr_size, phent = 52, 32
        phdr = lambda off, n, al: struct.pack("<IIIIIIII", _PT_NOTE, off, off, off, n, n, 4, al)  # noqa: E731
    ident = b"\x7fELF" + bytes([2 if is64 else 1, 1, 1, 0]) + b"\0" * 8
    machine = 62 if is64 else 3            # EM_X86_64, EM_386
    if is64:
        ehdr = ident + struct.pack("<HHIQQQIHHHHHH", 3, machine, 1, 0, ehdr_size, 0, 0,
                                   ehdr_size, phent, 2, 0, 0, 0)
    else:
        ehdr = ident + struct.pack("<HHIIIIIHHHHHH", 3, machine, 1, 0, ehdr_size, 0, 0,
                                   ehdr_size, phent, 2, 0, 0, 0)
    image = bytearray(ehdr + phdr(0xC0, len(prop), 8) + phdr(note_offset, len(notes), align))
    image += b"\0" * (0xC0 - len(image)) + prop
    image += b"\0" * (note_offset - len(image)) + notes
    image += b"\0" * max(0, size - len(image))
    return bytes(image)


def write_selftest_files(directory: str | os.PathLike[str]) -> list[tuple[str, Path]]:
    """Writes the self-test's ELF files into directory; returns (name, path) pairs.

    Raises:
        OSError: the directory is not writable.
    """
    d = Path(directory)
    cases = {
        "sha1": synthetic_elf(bytes(range(1, 21))),
        "md5": synthetic_elf(bytes(range(40, 56))),
        "eight_bytes": synthetic_elf(bytes(range(90, 98))),
        "align8": synthetic_elf(bytes(range(7, 27)), align=8),
        "elf32": synthetic_elf(bytes(range(100, 120)), is64=False),
        "late_note": synthetic_elf(bytes(range(130, 150)), note_offset=3 * PAGE_SIZE + 200,
                                   size=5 * PAGE_SIZE),
        "large_file": synthetic_elf(bytes(range(160, 180)), note_offset=LARGE_FILE_BYTES // 2 + 40,
                                    size=LARGE_FILE_BYTES),
    }
    out = []
    for name, data in cases.items():
        path = d / f"buildidd-selftest-{name}.elf"
        with open(path, "wb") as f:
            f.write(data)
        out.append((name, path))
    return out


@dataclass(frozen=True)
class SelfTestCase:
    """One file of the self-test.

    Attributes:
        name: what the file exercises; path: where it was.
        kernel: bpf/pagecache.h's answer; user: user space's build-id (None: none).
        agree: the kernel read a build-id equal to user space's.
        large_folio: the file's note page was cached in a large folio.
        error: why user space could not answer, else "".
    """

    name: str
    path: str
    kernel: KernelBuildId
    user: bytes | None
    agree: bool
    large_folio: bool
    error: str = ""


@dataclass(frozen=True)
class SelfTestVerdict:
    """The outcome: ``ok`` when every case agreed; ``reason`` names the first that did not."""

    ok: bool
    reason: str
    cases: tuple[SelfTestCase, ...]

    @property
    def large_folio_seen(self) -> bool:
        """Whether any case's note was read from a large folio (else that path went untested)."""
        return any(c.large_folio for c in self.cases)


def _warm(fd: int) -> None:
    """Reads the whole file once so that its pages are in the page cache."""
    off = 0
    while True:
        n = len(os.pread(fd, 1 << 20, off))
        if not n:
            return
        off += n


def _large_folio(probe: PageCacheProbe, fd: int, index: int) -> bool:
    info = probe.folio(fd, index)
    head_bit = probe.layout["PG_HEAD_BIT"]
    return bool(info.folio and info.folio_flags >> head_bit & 1)


def run_selftest(probe: PageCacheProbe, files: Iterable[tuple[str, str | os.PathLike[str]]],
                 user_reader: Callable[[int], bytes | None]) -> SelfTestVerdict:
    """Compares the kernel path with user_reader on each (name, path).

    Each file is read whole first (page cache warm); a case agrees when the
    kernel answers OK with exactly user space's bytes.  A NOT_CACHED answer
    (the pages were reclaimed meanwhile) is retried once after another read.

    Raises:
        ProbeError: the probe program failed (not a disagreement: it cannot run).
    """
    cases = []
    for name, path in files:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            _warm(fd)
            kernel = probe.build_id(fd)
            if kernel.status == PcStatus.NOT_CACHED:
                _warm(fd)
                kernel = probe.build_id(fd)
            error = ""
            try:
                user = user_reader(fd)
            except (BuildiddError, OSError) as e:
                user, error = None, str(e)
            large = _large_folio(probe, fd, kernel.page) if kernel.status == PcStatus.OK else False
            if kernel.status == PcStatus.OK:
                large = large or _large_folio(probe, fd, os.fstat(fd).st_size // PAGE_SIZE // 2)
        finally:
            os.close(fd)
        agree = kernel.status == PcStatus.OK and user is not None and kernel.build_id == user
        cases.append(SelfTestCase(name, os.fspath(path), kernel, user, agree, large, error))
    bad = next((c for c in cases if not c.agree), None)
    if bad is None:
        return SelfTestVerdict(True, "", tuple(cases))
    user_hex = bad.user.hex() if bad.user is not None else f"none ({bad.error or 'no build-id'})"
    reason = (f"{bad.name} ({bad.path}): kernel {bad.kernel.status.name.lower()} "
              f"{bad.kernel.build_id.hex()}, user space {user_hex}")
    return SelfTestVerdict(False, reason, tuple(cases))


def check_kernel_path(probe: PageCacheProbe, directory: str | os.PathLike[str],
                      user_reader: Callable[[int], bytes | None],
                      extra: Iterable[tuple[str, str | os.PathLike[str]]] = ()) -> SelfTestVerdict:
    """The daemon's start-up check: the synthetic files written in directory
    (removed afterwards) plus ``extra`` (e.g. the daemon's own interpreter and
    libc), through :func:`run_selftest`.

    Raises:
        ProbeError: the files cannot be written, or the probe program failed.
    """
    try:
        written = write_selftest_files(directory)
    except OSError as e:
        raise ProbeError(f"cannot write the page-cache self-test files in {directory}: {e}") from e
    try:
        return run_selftest(probe, [*written, *extra], user_reader)
    finally:
        for _, path in written:
            path.unlink(missing_ok=True)

"""Reading an untrusted archive stream: zstd with a bomb check, tar with each member's name and type checked.

Used by the importer (:mod:`buildidd.offline.importer`, whose docstring lists
the refusals).  Memory is bounded: the zstd window (``max_window_bytes``), one
chunk of decompressed data, and tar's extended headers (``max_header_bytes``),
which tarfile holds whole.
"""

from __future__ import annotations

import io
import posixpath
import tarfile
from dataclasses import dataclass

import zstandard

from buildidd.errors import ArchiveError

__all__ = ["ImportLimits", "Bounded", "tarinfo_class", "check_name", "check_type", "check_symlink", "check_zstd_magic",
           "ZSTD_PEEK_BYTES"]

CHUNK_BYTES = 1 << 20
_MAX_NAME_BYTES = 4096


@dataclass(frozen=True)
class ImportLimits:
    """Bounds on what an archive may make the importer read and write.

    Attributes:
        max_members: tar members (pax headers not counted).
        max_member_bytes: size of one member, bytes.
        max_total_bytes: decompressed bytes of the whole stream.
        max_ratio: decompressed bytes per compressed byte read, checked once
            ``ratio_floor_bytes`` have been decompressed (binaries compress
            a few times, the tar's padding more, and a run of zeros by orders
            of magnitude beyond this cap: docs/performance-history.md, 'Archive').
        ratio_floor_bytes: decompressed bytes before the ratio is checked.
        max_manifest_bytes: the manifest member.
        max_header_bytes: a pax or GNU long-name header member (held in memory by tarfile).
        max_window_bytes: the zstd window the decoder may allocate.
    """

    max_members: int = 200_000
    max_member_bytes: int = 8 << 30
    max_total_bytes: int = 64 << 30
    max_ratio: int = 200
    ratio_floor_bytes: int = 64 << 20
    max_manifest_bytes: int = 32 << 20
    max_header_bytes: int = 1 << 20
    max_window_bytes: int = 1 << 27



class _Counting(io.RawIOBase):
    """The archive file, counting the compressed bytes read."""

    def __init__(self, f):
        super().__init__()
        self.f, self.count = f, 0

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.count += len(data)
        return data


ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
"""The first four bytes of a zstd frame (RFC 8878 §3.1.1), hence of every archive."""

ZSTD_PEEK_BYTES = 512
"""Bytes looked at before reading an archive: the zstd magic, or what the file is instead (a tar's ustar at 257)."""


def check_zstd_magic(path, head: bytes) -> None:
    """Refuse a file that is not zstd before any decoding, naming it and what it looks like.

    Raises:
        ArchiveError: ``not_an_archive``.
    """
    if head[:4] == ZSTD_MAGIC:
        return
    what = ("it is empty" if not head else "it is gzip, not zstd" if head[:2] == b"\x1f\x8b" else
            "it is xz, not zstd" if head[:6] == b"\xfd7zXZ\x00" else
            "it is an uncompressed tar" if head[257:262] == b"ustar" else "it does not start with a zstd frame")
    raise ArchiveError("not_an_archive", f"{path}: not a buildidd archive ({what}); an archive is the tar + zstd "
                       "file buildidd archive SESSION -o FILE writes")


class Bounded(io.RawIOBase):
    """The decompressed tar stream; refuses a zstd bomb and an oversized stream."""

    def __init__(self, f, limits: ImportLimits):
        super().__init__()
        self.raw = _Counting(f)
        self.z = zstandard.ZstdDecompressor(max_window_size=limits.max_window_bytes).stream_reader(
            self.raw, read_size=1 << 16, read_across_frames=True, closefd=False)
        self.limits, self.out = limits, 0

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        try:
            data = self.z.read(min(n, CHUNK_BYTES) if n >= 0 else CHUNK_BYTES)
        except zstandard.ZstdError as e:
            raise ArchiveError("corrupt", f"zstd stream: {e}") from e
        self.out += len(data)
        lim = self.limits
        if self.out > lim.max_total_bytes:
            raise ArchiveError("too_large", f"more than {lim.max_total_bytes} bytes decompressed")
        if self.out > lim.ratio_floor_bytes and self.out > lim.max_ratio * max(1, self.raw.count):
            raise ArchiveError("zstd_bomb", f"{self.out} bytes decompressed from {self.raw.count}: "
                               f"ratio over {lim.max_ratio}")
        return data


def tarinfo_class(limits: ImportLimits) -> type:
    class _TarInfo(tarfile.TarInfo):
        """TarInfo that refuses pax and GNU long-name headers larger than max_header_bytes
        (tarfile reads them whole into memory)."""

        def _proc_member(self, tf):
            if self.type in (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME,
                             tarfile.GNUTYPE_LONGLINK) and self.size > limits.max_header_bytes:
                raise ArchiveError("too_large", f"a {self.size}-byte tar extended header")
            return super()._proc_member(tf)

    return _TarInfo


def check_name(name: str, what: str = "member") -> str:
    if name.startswith("/"):
        raise ArchiveError("absolute_path", f"{what} {name!r}: absolute path")
    parts = name.rstrip("/").split("/")
    if ".." in parts:
        raise ArchiveError("dotdot", f"{what} {name!r}: '..' component")
    if (not name or "\0" in name or len(name.encode("utf-8", "surrogateescape")) > _MAX_NAME_BYTES
            or any(p in ("", ".") for p in parts)):
        raise ArchiveError("bad_name", f"{what} {name!r}: empty, '.' or over-long name")
    return name.rstrip("/")


def check_type(ti: tarfile.TarInfo) -> None:
    """Refuse every member type but a plain regular file, a symlink and a directory.

    A sparse member (GNU type ``S``, or any pax ``GNU.sparse.*`` header: the
    0.0, 0.1 and 1.0 formats) is refused although tarfile's ``isreg()`` is
    true for it: its holes expand, on extraction, far beyond the bytes the
    stream holds, where neither the bomb check (:class:`Bounded` counts
    decompressed bytes) nor the size limits would see them.

    Raises:
        ArchiveError: ``sparse``, ``hard_link``, ``device``, ``fifo`` or ``unsupported_member``.
    """
    if ti.issparse() or ti.type == tarfile.GNUTYPE_SPARSE or any(k.startswith("GNU.sparse.")
                                                                 for k in ti.pax_headers):
        raise ArchiveError("sparse", f"member {ti.name!r}: sparse file (would expand beyond its stored bytes)")
    if ti.islnk():
        raise ArchiveError("hard_link", f"member {ti.name!r}: hard link to {ti.linkname!r}")
    if ti.ischr() or ti.isblk():
        raise ArchiveError("device", f"member {ti.name!r}: device file")
    if ti.isfifo():
        raise ArchiveError("fifo", f"member {ti.name!r}: FIFO")
    if not (ti.isreg() or ti.issym() or ti.isdir()):
        raise ArchiveError("unsupported_member", f"member {ti.name!r}: type {ti.type!r}")


def check_symlink(ti: tarfile.TarInfo, links: dict[str, str]) -> None:
    """Only the ``.build-id`` links the manifest implies, with their exact targets."""
    target = ti.linkname
    if target.startswith("/"):
        raise ArchiveError("symlink_escape", f"symlink {ti.name!r} -> {target!r}: absolute target")
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(ti.name), target))
    top = ti.name.split("/")[0]
    if resolved.startswith("../") or resolved == ".." or resolved.split("/")[0] != top:
        raise ArchiveError("symlink_escape", f"symlink {ti.name!r} -> {target!r} leaves the archive's {top}/")
    if ti.name not in links:
        raise ArchiveError("unlisted_member", f"symlink {ti.name!r}: not a .build-id link of the manifest")
    if target != links[ti.name]:
        raise ArchiveError("bad_link", f"symlink {ti.name!r} -> {target!r}, expected {links[ti.name]!r}")

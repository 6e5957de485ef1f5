"""Keys for files without a GNU build-id: the Go build ID, and a content key (file_id).

Go's linker writes its own note, ``.note.go.buildid`` (cmd/link/internal/ld
elf.go: owner ``"Go\\0\\0"``, type ``ELF_NOTE_GOBUILDID_TAG`` = 4, the
descriptor the text ``actionID/contentID`` that ``go tool buildid`` prints);
binaries built by ``go build`` carry it in a PT_NOTE segment, and a
section-only copy (``objcopy --add-section``) is found through the section
headers.  :func:`read_go_build_id` returns it.

:func:`file_id` is the OpenTelemetry eBPF profiler's FileID
(libpf/fileid.go FileIDFromExecutableReader, read, not copied): SHA-256 over
the first min(size, 4096) bytes, then the last min(size, 4096) bytes (both
once each, overlapping for a file under 8 KiB), then the size as 8 bytes
big-endian; the first 16 bytes (128 bits) of the digest, as 32 lower-case
hex digits.  It equals the profiler's FileID printed as hex, so the two can
be joined.  It is a key to tell files apart, not a proof of content: an
append or a change in the middle of a large file may keep it.

Both read with os.pread under fixed caps, like resolve.elfnotes: at most
:data:`MAX_READ_BYTES` per file, :data:`MAX_HEADERS` header entries,
:data:`MAX_REGION_BYTES` per note region, and never past the size fstat gives.
"""

from __future__ import annotations

import hashlib
import os
import struct

__all__ = ["read_go_build_id", "file_id", "GO_NOTE_OWNER", "GO_NOTE_TYPE", "FILE_ID_EDGE_BYTES"]

#: Note owner and type of the Go build ID (cmd/link/internal/ld/elf.go ELF_NOTE_GO_NAME, ELF_NOTE_GOBUILDID_TAG).
GO_NOTE_OWNER = b"Go\0\0"
GO_NOTE_TYPE = 4
#: Longest Go build ID accepted (bytes; ``go build`` writes 83).
GO_BUILD_ID_MAX_BYTES = 1024
#: Bytes hashed at each end of the file for file_id (the profiler's 4 KiB).
FILE_ID_EDGE_BYTES = 4096

MAX_READ_BYTES = 1 << 20
MAX_HEADERS = 1024
MAX_REGION_BYTES = 64 << 10
_PT_NOTE, _SHT_NOTE = 4, 7


class _Budget:
    """pread within the file's size and a total byte budget; None when a read would pass either."""

    def __init__(self, fd: int, size: int):
        self.fd, self.size, self.left = fd, size, MAX_READ_BYTES

    def read(self, offset: int, length: int) -> bytes | None:
        if offset < 0 or length < 0 or offset + length > self.size or length > self.left:
            return None
        self.left -= length
        data = os.pread(self.fd, length, offset)
        return data if len(data) == length else None


def _notes(buf: bytes, order: str, align: int):
    """(namesz-padded owner bytes, type, descriptor) of each note in buf (ELF gABI note format)."""
    pos, n = 0, 0
    while pos + 12 <= len(buf) and n < MAX_HEADERS:
        namesz, descsz, ntype = struct.unpack_from(order + "III", buf, pos)
        name_at = pos + 12
        desc_at = name_at + ((namesz + align - 1) & ~(align - 1))
        end = desc_at + ((descsz + align - 1) & ~(align - 1))
        if desc_at + descsz > len(buf):
            return
        yield buf[name_at:name_at + namesz], ntype, buf[desc_at:desc_at + descsz]
        pos, n = end, n + 1


def _go_in_region(data: bytes | None, order: str, align: int) -> str | None:
    if not data:
        return None
    for owner, ntype, desc in _notes(data, order, 8 if align == 8 else 4):
        if owner.rstrip(b"\0") == b"Go" and ntype == GO_NOTE_TYPE and 0 < len(desc) <= GO_BUILD_ID_MAX_BYTES:
            text = desc.rstrip(b"\0")
            if text and all(0x20 < c < 0x7F for c in text):
                return text.decode("ascii")
    return None


def read_go_build_id(fd: int) -> str | None:
    """The Go build ID of the ELF file open on fd (the note's text), or None when it has none.

    PT_NOTE segments first, then SHT_NOTE sections.  A malformed or
    truncated header, table or note is taken as "none" (the GNU build-id
    reader reports what is malformed); a descriptor that is not printable
    ASCII is not a Go build ID.
    Raises:
        OSError: a read failed.
    """
    size = os.fstat(fd).st_size
    rd = _Budget(fd, size)
    head = rd.read(0, min(size, 64))
    if head is None or len(head) < 52 or head[:4] != b"\x7fELF" or head[4] not in (1, 2) or head[5] not in (1, 2):
        return None
    order = "<" if head[5] == 1 else ">"
    if head[4] == 2:
        if len(head) < 64:
            return None
        phoff, shoff = struct.unpack_from(order + "QQ", head, 32)
        phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 54)
        ph_fmt, sh_fmt = order + "IIQQQQQQ", order + "IIQQQQIIQQ"
    else:
        phoff, shoff = struct.unpack_from(order + "II", head, 28)
        phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 42)
        ph_fmt, sh_fmt = order + "IIIIIIII", order + "IIIIIIIIII"
    if phentsize >= struct.calcsize(ph_fmt) and 0 < phnum:
        table = rd.read(phoff, phentsize * min(phnum, MAX_HEADERS))
        for i in range(len(table) // phentsize if table else 0):
            ph = struct.unpack_from(ph_fmt, table, i * phentsize)
            if ph[0] != _PT_NOTE:
                continue
            if head[4] == 2:
                offset, filesz, align = ph[2], ph[5], ph[7]
            else:
                offset, filesz, align = ph[1], ph[4], ph[7]
            found = _go_in_region(rd.read(offset, min(filesz, MAX_REGION_BYTES)), order, align)
            if found:
                return found
    if shentsize >= struct.calcsize(sh_fmt) and 0 < shnum:
        table = rd.read(shoff, shentsize * min(shnum, MAX_HEADERS))
        for i in range(len(table) // shentsize if table else 0):
            sh = struct.unpack_from(sh_fmt, table, i * shentsize)
            if sh[1] != _SHT_NOTE:
                continue
            found = _go_in_region(rd.read(sh[4], min(sh[5], MAX_REGION_BYTES)), order, sh[8])
            if found:
                return found
    return None


def file_id(fd: int) -> str:
    """The content key of the file open on fd: 32 hex digits (the profiler's FileID, see the module doc).

    Raises:
        OSError: a read failed, or the file changed size while it was read.
    """
    size = os.fstat(fd).st_size
    edge = min(size, FILE_ID_EDGE_BYTES)
    head = os.pread(fd, edge, 0)
    tail = os.pread(fd, edge, size - edge)
    if len(head) != edge or len(tail) != edge:
        raise OSError(f"file shorter than its size {size} while hashed")
    h = hashlib.sha256(head)
    h.update(tail)
    h.update(size.to_bytes(8, "big"))
    return h.digest()[:16].hex()

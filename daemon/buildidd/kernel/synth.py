"""The executable mappings of the processes already running, read by the BPF task_vma iterator.

perf record synthesizes MMAP2 records for the tasks that run when it starts
by reading every /proc/PID/maps (and, with --buildid-mmap, every mapped
file's build-id from disk).  buildidd's kernel side has an iterator program
instead (``bpf_iter__task_vma`` in bpf/buildidd.bpf.c): one read of it visits
every VMA of every process under the mm's lock and writes a struct map_event
(origin BUILDIDD_ORIGIN_SYNTHESIZED) for each executable file mapping, with
the identity, path and build-id read from the kernel exactly as for a live
mapping.  Measured here: ~0.1 ms per process (ENVIRONMENT.md), against ~2 ms
per process for /proc/PID/maps read and resolved in user space.
"""

from __future__ import annotations

from buildidd.kernel.bpfsys import iter_read
from buildidd.kernel.events import PATH_MAX, EventType, MapEvent

#: The iterator function (LoadSpec.iterators).
ITERATOR = "bpf_iter__task_vma"
#: Most bytes of records one synthesis takes: 64 MiB, ~250,000 mappings of ~260
#: bytes (a host with more is cut there, and says so: SynthResult.truncated).
MAX_BYTES = 64 << 20

_PATH_LEN_OFF = MapEvent.path_len.offset
_PATH_OFF = MapEvent.path.offset


class SynthResult:
    """What one iterator read gave.

    Attributes:
        records: raw struct map_event records (bytes each, as a ring holds them).
        malformed: bytes at the end that were not a whole well-formed record
            (0 unless the stream was cut at MAX_BYTES or is corrupt).
        truncated: True when reading stopped at MAX_BYTES.
    """

    __slots__ = ("records", "malformed", "truncated")

    def __init__(self, records: list[bytes], malformed: int, truncated: bool):
        self.records = records
        self.malformed = malformed
        self.truncated = truncated


def split_records(data: bytes) -> tuple[list[bytes], int]:
    """Cut the iterator's stream into its struct map_event records.

    Each record is offsetof(struct map_event, path) + path_len bytes, back to
    back (bpf_seq_write, no padding).  Stops at the first record that is not a
    map event or whose path_len is out of range.
    Returns:
        (records, bytes left over after the last whole record).
    """
    out = []
    off, n = 0, len(data)
    while n - off >= _PATH_OFF:
        if int.from_bytes(data[off:off + 4], "little") != EventType.MAP:
            break
        plen = int.from_bytes(data[off + _PATH_LEN_OFF:off + _PATH_LEN_OFF + 2], "little")
        end = off + _PATH_OFF + plen
        if plen >= PATH_MAX or end > n:
            break
        out.append(data[off:end])
        off = end
    return out, n - off


def synthesize(prog_fd: int, max_bytes: int = MAX_BYTES) -> SynthResult:
    """Run the task_vma iterator program prog_fd once over every process.

    Raises:
        OSError: the kernel refused the link or the iterator, or a read failed.
    """
    data = iter_read(prog_fd, max_bytes)
    records, left = split_records(data)
    return SynthResult(records, left, len(data) >= max_bytes)

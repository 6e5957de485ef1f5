"""The executable mappings of the processes already running, read by the BPF task_vma iterator.

perf record synthesizes MMAP2 records for the tasks that run when it starts
by reading every /proc/PID/maps (and, with --buildid-mmap, every mapped
file's build-id from disk).  buildidd's kernel side has an iterator program
instead (``bpf_iter__task_vma`` in bpf/buildidd.bpf.c): one pass of it visits
every VMA of every process under the mm's lock and writes a struct map_event
(origin BUILDIDD_ORIGIN_SYNTHESIZED) for each executable file mapping, with
the identity, path and build-id read from the kernel exactly as for a live
mapping, with no /proc/PID/maps to read and no file to open (scripts/bench.py
--footprint measures READY against the number of processes running).
"""

from __future__ import annotations

from typing import Callable

from buildidd.kernel.bpfsys import iter_chunks
from buildidd.kernel.events import PATH_MAX, EventType, MapEvent

#: The iterator function (LoadSpec.iterators).
ITERATOR = "bpf_iter__task_vma"
_PATH_LEN_OFF = MapEvent.path_len.offset
_PATH_OFF = MapEvent.path.offset
#: The longest record: offsetof(path) + PATH_MAX - 1 bytes.
MAX_RECORD_BYTES = _PATH_OFF + PATH_MAX - 1


class SynthResult:
    """What one iterator read gave.

    Attributes:
        records: struct map_event records handed to the sink.
        malformed: bytes that were not a well-formed record (0 unless the
            stream is corrupt; reading stops at the first such byte).
    """

    __slots__ = ("records", "malformed")

    def __init__(self, records: int, malformed: int):
        self.records = records
        self.malformed = malformed


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


def synthesize(prog_fd: int, sink: Callable[[list[bytes]], None]) -> SynthResult:
    """Run the task_vma iterator program prog_fd once over every process; sink takes the records.

    The stream is read and cut a chunk at a time (kernel.bpfsys.iter_chunks):
    sink(records) is called once per chunk, in order, so memory stays bounded
    by one chunk however many processes run (5,000 processes: ~35,000
    records).  A record cut by a chunk's end is completed from the next one.
    Raises:
        OSError: the kernel refused the link or the iterator, or a read failed
            (records already handed to sink stay handed).
    """
    carry, count = b"", 0
    chunks = iter_chunks(prog_fd)
    try:
        for chunk in chunks:
            data = carry + chunk if carry else chunk
            records, left = split_records(data)
            if records:
                count += len(records)
                sink(records)
            carry = data[len(data) - left:] if left else b""
            if len(carry) >= MAX_RECORD_BYTES or (carry and len(carry) >= _PATH_OFF
                                                  and int.from_bytes(carry[:4], "little") != EventType.MAP):
                break                       # not a record cut short: a corrupt stream
    finally:
        chunks.close()
    return SynthResult(count, len(carry))

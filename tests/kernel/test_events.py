"""bpf/events.h and its ctypes mirror agree, field by field (sizes and offsets from gcc)."""

import ctypes
import subprocess

from buildidd.kernel import budget
from buildidd.kernel.events import BPF_DIR, WIRE_STRUCTS

from conftest import gcc


def _fields(cls, prefix="", base=0):
    """(C member designator, offset, size) of every field, nested ones too.

    A nested struct or union is checked whole and member by member
    ("task_event.fork.ppid"); an anonymous one (ctypes _anonymous_, a C11
    anonymous union) has no name of its own in C: only its members are.
    """
    anonymous = getattr(cls, "_anonymous_", ())
    for name, ctype in cls._fields_:
        off = base + getattr(cls, name).offset
        nested = isinstance(ctype, type) and issubclass(ctype, (ctypes.Structure, ctypes.Union))
        if name in anonymous:
            yield from _fields(ctype, prefix, off)
            continue
        yield prefix + name, off, ctypes.sizeof(ctype)
        if nested:
            yield from _fields(ctype, f"{prefix}{name}.", off)


def test_every_wire_struct_matches_the_c_header(tmp_path):
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "events.h"', "int main(void) {"]
    expected = {}
    for cname, cls in {**WIRE_STRUCTS, **budget.WIRE_STRUCTS}.items():
        lines.append(f'printf("{cname} 0 %zu\\n", sizeof(struct {cname}));')
        expected[cname] = (0, ctypes.sizeof(cls))
        for field, off, size in _fields(cls):
            lines.append(f'printf("{cname}.{field} %zu %zu\\n", offsetof(struct {cname}, {field}),'
                         f' sizeof(((struct {cname} *)0)->{field}));')
            expected[f"{cname}.{field}"] = (off, size)
    lines += ["return 0; }"]
    exe = gcc("\n".join(lines), tmp_path / "layout", f"-I{BPF_DIR}")
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    got = {}
    for line in out.splitlines():
        key, off, size = line.split()
        got[key] = (int(off), int(size))
    assert got == expected
    assert len(got) > 40


def test_exec_record_names_filename_then_path_and_rejects_a_short_one():
    from buildidd.kernel.events import PATH_TRUNCATED, DecodeError, EventType, ExecEvent, decode, exec_head
    import pytest

    ev = ExecEvent()
    ev.hdr.type, ev.hdr.pid, ev.hdr.tid, ev.hdr.comm = EventType.EXEC, 7, 7, b"sh\xff"
    ev.id_flags = PATH_TRUNCATED
    filename, path = b"./run\xfe", b"/usr/bin/python3.11"
    ev.filename_len, ev.path_len = len(filename), len(path)
    ev.names = filename + path
    raw = bytes(ev)[:ExecEvent.names.offset + len(filename) + len(path)]
    head = exec_head(raw)
    assert (head.filename, head.path, head.path_cut, head.comm.rstrip(b"\0")) == (filename, path, True, b"sh\xff")
    assert decode(raw).path == "/usr/bin/python3.11"
    with pytest.raises(DecodeError):
        exec_head(raw[:-1])


def test_map_record_carries_the_kernel_build_id_and_ctime():
    import pytest
    from buildidd.kernel.events import (DecodeError, EventType, MapEvent, PcStatus, answer_key, decode,
                                        file_key)

    ev = MapEvent()
    ev.hdr.type, ev.hdr.pid, ev.hdr.tid = EventType.MAP, 5, 6
    ev.file.ino, ev.file.size, ev.file.ctime_sec, ev.file.ctime_nsec = 9, 100, 1_700_000_000, 42
    ev.bid.status, ev.bid.size = PcStatus.OK, 20
    ev.bid.build_id[:20] = bytes(range(1, 21))
    raw = bytes(ev)[:MapEvent.path.offset]
    got = decode(raw)
    assert got.pc_status == PcStatus.OK and got.pc_build_id == bytes(range(1, 21))
    assert got.identity.ctime_ns == 1_700_000_000_000_000_042
    key = file_key(got.identity)
    assert key == raw[MapEvent.file.offset:MapEvent.file.offset + len(key)]
    assert answer_key(key, got) == key + b"\x01" + bytes(range(1, 21))
    ev.bid.status, ev.bid.page = PcStatus.NOT_CACHED, 3
    got = decode(bytes(ev)[:MapEvent.path.offset])
    assert (got.pc_build_id, got.pc_page, answer_key(key, got)) == (b"", 3, key)
    ev.bid.status, ev.bid.size = PcStatus.OK, 65
    with pytest.raises(DecodeError):
        decode(bytes(ev)[:MapEvent.path.offset])

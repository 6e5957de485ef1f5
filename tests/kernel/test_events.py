"""bpf/events.h and its ctypes mirror agree, field by field (sizes and offsets from gcc)."""

import ctypes
import subprocess

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
    for cname, cls in WIRE_STRUCTS.items():
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

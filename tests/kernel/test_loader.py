"""kernel.loader and kernel.bpfsys on a real kernel: BCC compiles in a child, the
parent holds the fds and reads maps through bpf(2).

bpf/loader_test.bpf.c counts, for the tgid written in its `target` map,
getppid() calls (tracepoint), task renames (raw tracepoint) and the tail call the
rename program makes.  The memory-map check runs in a fresh subprocess: the
pytest process itself imports bcc (the ``bpf`` fixture does).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import subprocess
import sys

import pytest

from buildidd.errors import ProbeError

pytestmark = pytest.mark.bpf

#: Run by a fresh interpreter: load, count, drop the tail map, detach; print what it saw.
PARENT = r"""
import ctypes, json, os, sys
from buildidd.kernel.events import BPF_DIR
from buildidd.kernel.loader import LoadSpec, TailCall, load

N = 25
libc = ctypes.CDLL(None)

def trigger():
    for i in range(N):
        os.getppid()
        libc.prctl(15, b"ldr%d" % i)        # PR_SET_NAME: task_rename

def counts(m):
    return {int.from_bytes(k, "little"): int.from_bytes(m.lookup(k), "little") for k in m.keys()}

spec = LoadSpec(os.path.join(BPF_DIR, "loader_test.bpf.c"),
                raw_tracepoints=(("task_rename", "on_task_rename"),),
                tail_calls=(TailCall("tail", 0, "tail_counted"),),
                required_tracepoints=("syscalls:sys_enter_getppid",))
prog = load(spec)
out = {"bcc_imported": any(m == "bcc" or m.startswith("bcc.") for m in sys.modules),
       "compiler_maps": sorted({l.split()[-1] for l in open("/proc/self/maps")
                                if any(s in l for s in ("libLLVM", "libclang", "libbcc"))}),
       "maps": {k: [int(v.info.type), v.info.key_size, v.info.value_size, v.info.max_entries]
                for k, v in prog.maps.items()},
       "links": sorted(prog.links), "progs": sorted(prog.progs)}
prog.maps["target"].update(ctypes.c_uint32(0), ctypes.c_uint32(os.getpid()))
trigger()
out["counted"] = counts(prog.maps["counts"])
out["percpu"] = [int.from_bytes(v, "little") for v in prog.maps["percpu_hits"].lookup(ctypes.c_int(0))]
os.close(prog.maps.pop("tail").fd)            # the program array's last user reference
# The kernel empties the array from a workqueue (prog_array_map_clear schedules
# prog_array_map_clear_deferred): wait for a round of events without tail calls.
for rounds in range(1, 2001):
    before = counts(prog.maps["counts"])
    trigger()
    after = counts(prog.maps["counts"])
    if after[3] == before[3]:
        break
    os.sched_yield()
out["without_tail_map"] = {k: after[k] - before[k] for k in after}
out["rounds"] = rounds
prog.detach()
trigger()
out["detached"] = counts(prog.maps["counts"])
prog.close()
print(json.dumps(out))
"""


def test_child_loads_parent_counts_without_a_compiler(bpf):
    r = subprocess.run([sys.executable, "-c", PARENT], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["bcc_imported"] is False
    assert out["compiler_maps"] == []
    # BPF_HASH, BPF_ARRAY, BPF_PERCPU_ARRAY, BPF_PROG_ARRAY as the kernel describes them.
    assert out["maps"] == {"counts": [1, 4, 8, 16], "target": [2, 4, 4, 1],
                           "percpu_hits": [6, 4, 8, 1], "tail": [3, 4, 4, 1]}
    assert out["links"] == ["raw_tracepoint:task_rename", "tracepoint:syscalls:sys_enter_getppid"]
    assert out["progs"] == ["on_task_rename", "tail_counted", "tracepoint__syscalls__sys_enter_getppid"]
    # The child has exited: its attachments and the tail call work through the parent's fds.
    assert out["counted"] == {"1": 25, "2": 25, "3": 25}
    from buildidd.kernel.bpfsys import possible_cpus
    assert sum(out["percpu"]) == 75 and len(out["percpu"]) == possible_cpus()
    # Closing the program array's fd empties it (prog_array_map_clear, from a
    # workqueue): a round of events comes with no tail call.
    assert out["without_tail_map"] == {"1": 25, "2": 25, "3": 0}, out["rounds"]
    # Closing the attachment fds detaches: nothing counts any more.
    before = {k: 25 * (1 + out["rounds"]) for k in ("1", "2")}
    assert {k: out["detached"][k] for k in ("1", "2")} == before


@pytest.fixture(scope="module")
def loaded(bpf):
    from buildidd.kernel.events import BPF_DIR
    from buildidd.kernel.loader import LoadSpec, load
    prog = load(LoadSpec(os.path.join(BPF_DIR, "loader_test.bpf.c")))
    yield prog
    prog.close()


def test_map_element_operations(loaded):
    from buildidd.kernel.bpfsys import BPF_EXIST, BPF_NOEXIST
    m = loaded.maps["counts"]
    key, val = ctypes.c_uint32(7), ctypes.c_uint64(1234)
    assert m.lookup(key) is None
    m.update(key, val)
    assert m.lookup(key) == (1234).to_bytes(8, "little")
    with pytest.raises(OSError) as e:
        m.update(key, val, BPF_NOEXIST)
    assert e.value.errno == errno.EEXIST
    m.update(key, ctypes.c_uint64(5), BPF_EXIST)
    assert m.lookup(bytes(key)) == (5).to_bytes(8, "little")
    assert list(m.keys()) == [bytes(key)]
    assert m.next_key(key) is None
    m.delete(key)
    with pytest.raises(KeyError):
        m.delete(key)
    with pytest.raises(ValueError):
        m.lookup(ctypes.c_uint64(7))               # 8-byte key, the map's are 4


def test_full_hash_map_refuses(loaded):
    m = loaded.maps["counts"]
    keys = range(100, 100 + m.info.max_entries)
    for k in keys:
        m.update(ctypes.c_uint32(k), ctypes.c_uint64(k))
    with pytest.raises(OSError) as e:
        m.update(ctypes.c_uint32(99), ctypes.c_uint64(0))
    assert e.value.errno == errno.E2BIG
    assert sorted(int.from_bytes(k, "little") for k in m.keys()) == list(keys)
    for k in keys:
        m.delete(ctypes.c_uint32(k))
    assert m.next_key() is None


def test_percpu_values(loaded):
    from buildidd.kernel.bpfsys import possible_cpus
    m = loaded.maps["percpu_hits"]
    n = possible_cpus()
    assert m.ncpus == n and m.value_bytes == 8 * n
    m.update(ctypes.c_int(0), [ctypes.c_uint64(10 + i) for i in range(n)])
    assert m.lookup(ctypes.c_int(0)) == [(10 + i).to_bytes(8, "little") for i in range(n)]
    m.update(ctypes.c_int(0), ctypes.c_uint64(0))      # one value for every CPU
    assert m.lookup(ctypes.c_int(0)) == [bytes(8)] * n
    with pytest.raises(ValueError):
        m.update(ctypes.c_int(0), [ctypes.c_uint64(0)] * (n + 1))


def test_map_info_refuses_a_non_map_fd(bpf):
    from buildidd.kernel.bpfsys import map_info
    fd = os.open("/", os.O_RDONLY)
    try:
        with pytest.raises(OSError) as e:
            map_info(fd)
        assert e.value.errno in (errno.EINVAL, errno.EBADF)
    finally:
        os.close(fd)


def test_possible_cpus_parses_lists(tmp_path):
    from buildidd.kernel.bpfsys import possible_cpus
    f = tmp_path / "possible"
    for text, n in (("0\n", 1), ("0-1\n", 2), ("0-3,6,8-9\n", 7)):
        f.write_text(text)
        assert possible_cpus(str(f)) == n
    f.write_text("zero")
    with pytest.raises(ProbeError):
        possible_cpus(str(f))


def test_compile_error_reaches_the_parent(bpf, tmp_path):
    from buildidd.kernel.loader import LoadSpec, load
    src = tmp_path / "bad.bpf.c"
    src.write_text("int f(void *ctx) { return undeclared_thing; }\n")
    with pytest.raises(ProbeError, match="undeclared_thing"):
        load(LoadSpec(str(src)))


def test_missing_tracepoint_is_refused(bpf):
    from buildidd.kernel.events import BPF_DIR
    from buildidd.kernel.loader import LoadSpec, load
    with pytest.raises(ProbeError, match="no_such_event"):
        load(LoadSpec(os.path.join(BPF_DIR, "loader_test.bpf.c"),
                      required_tracepoints=("syscalls:no_such_event",)))

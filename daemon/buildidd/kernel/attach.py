"""Attach loaded programs as the loader's child does: program-array slots, tracepoints, raw tracepoints.

Used for programs that did not come from BCC in this process's child: taken
back from bpffs pins (kernel.pinned) or loaded from the compile cache
(kernel.progcache).  The attachments are those libbcc makes
(src/cc/libbpf.c: bpf_attach_tracepoint, bpf_attach_raw_tracepoint).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import struct
import threading

from buildidd.errors import ProbeError
from buildidd.kernel.bpfsys import bpf
from buildidd.kernel.loader import LoadedProgram, LoadSpec

__all__ = ["attach", "ensure_tracefs"]

BPF_RAW_TRACEPOINT_OPEN = 17
PERF_TYPE_TRACEPOINT = 2
PERF_SAMPLE_RAW = 1 << 10
PERF_FLAG_FD_CLOEXEC = 8
PERF_EVENT_IOC_ENABLE = 0x2400
PERF_EVENT_IOC_SET_BPF = 0x40042408
PERF_EVENT_OPEN_NR = {"x86_64": 298, "aarch64": 241, "riscv64": 241}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _RawTpAttr(ctypes.Structure):
    """union bpf_attr for BPF_RAW_TRACEPOINT_OPEN (raw_tracepoint.name, prog_fd)."""
    _fields_ = [("name", ctypes.c_uint64), ("prog_fd", ctypes.c_uint32), ("_pad", ctypes.c_uint32)]


#: Serializes ensure_tracefs: the probe and the main program load at once (capture.bpfstart).
_TRACEFS_LOCK = threading.Lock()


def ensure_tracefs(path: str = "/sys/kernel/tracing") -> None:
    """Mount tracefs at path when it is not mounted (BCC reads a TRACEPOINT_PROBE's fields there; a
    tracepoint program is attached by its id there).

    Raises:
        ProbeError: the mount failed.
    """
    with _TRACEFS_LOCK:
        if os.path.exists(os.path.join(path, "events")):
            return
        if _libc.mount(b"nodev", path.encode(), b"tracefs", 0, None) != 0:
            err = ctypes.get_errno()
            raise ProbeError(f"cannot mount tracefs at {path}: {os.strerror(err)}")


def attach(loaded: LoadedProgram, spec: LoadSpec) -> None:
    """Fill spec's program-array slots, attach every ``tracepoint__<category>__<event>`` program
    (BCC's TRACEPOINT_PROBE naming) and spec's raw tracepoints; the attachment fds go into
    loaded.links (closing them detaches).

    Raises:
        KeyError: a program or map spec names is not in loaded.
        OSError: the kernel refused an attachment (what was attached stays in loaded.links).
        ProbeError: perf_event_open's number is unknown on this machine, or tracefs cannot be
            mounted.
    """
    for t in spec.tail_calls:
        loaded.maps[t.table].update(ctypes.c_int(t.index), ctypes.c_uint32(loaded.progs[t.function]))
    if any(prog.startswith("tracepoint__") for prog in loaded.progs):
        ensure_tracefs()
    for prog, fd in loaded.progs.items():
        if prog.startswith("tracepoint__"):
            category, _, event = prog.removeprefix("tracepoint__").partition("__")
            loaded.links[f"tracepoint:{category}:{event}"] = _attach_tracepoint(category, event, fd)
    for tp, fn in spec.raw_tracepoints:
        name = ctypes.create_string_buffer(tp.encode())
        loaded.links[f"raw_tracepoint:{tp}"] = bpf(BPF_RAW_TRACEPOINT_OPEN, _RawTpAttr(
            name=ctypes.addressof(name), prog_fd=loaded.progs[fn]))


def _attach_tracepoint(category: str, event: str, prog_fd: int) -> int:
    """perf_event_open of the tracepoint (pid -1, cpu 0: a tracepoint program runs on every CPU)
    with PERF_EVENT_IOC_SET_BPF, as libbcc's bpf_attach_tracepoint does; the perf event's fd."""
    with open(f"/sys/kernel/tracing/events/{category}/{event}/id") as f:
        tp_id = int(f.read())
    attr = ctypes.create_string_buffer(64)                 # PERF_ATTR_SIZE_VER0
    struct.pack_into("<IIQQQ", attr, 0, PERF_TYPE_TRACEPOINT, 64, tp_id, 1, PERF_SAMPLE_RAW)
    struct.pack_into("<I", attr, 48, 1)                    # wakeup_events
    nr = PERF_EVENT_OPEN_NR.get(os.uname().machine)
    if nr is None:
        raise ProbeError(f"perf_event_open syscall number unknown on {os.uname().machine}")
    fd = _libc.syscall(ctypes.c_long(nr), attr, ctypes.c_int(-1), ctypes.c_int(0), ctypes.c_int(-1),
                       ctypes.c_ulong(PERF_FLAG_FD_CLOEXEC))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"perf_event_open {category}:{event}: {os.strerror(err)}")
    try:
        fcntl.ioctl(fd, PERF_EVENT_IOC_SET_BPF, prog_fd)
        fcntl.ioctl(fd, PERF_EVENT_IOC_ENABLE, 0)
    except OSError:
        os.close(fd)
        raise
    return fd

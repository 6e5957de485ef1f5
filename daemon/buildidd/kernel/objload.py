"""Load a CompiledObject with plain bpf(2): create its maps, load its programs, attach them.

Every load of buildidd's BPF goes through here: in the loader's child right
after BCC's compile (kernel.loader), and at a first start that finds the
compile in the cache (kernel.progcache).  BCC is only the compiler: it cannot
load a program that calls ``bpf_loop`` (it does not relocate a function's
address, BPF_PSEUDO_FUNC), and kernel.compiled links those callbacks into
the program, so the kernel must be handed the instructions by us, with the
BTF ``func_info`` the verifier requires of a program with subprograms.

Layouts are the kernel's UAPI, include/uapi/linux/bpf.h (``union bpf_attr``
for BPF_MAP_CREATE, BPF_PROG_LOAD, BPF_BTF_LOAD; ``struct bpf_func_info``)
and include/uapi/linux/btf.h (the BTF blob: Documentation/bpf/btf.rst).
"""

from __future__ import annotations

import ctypes
import logging
import os
import struct
from concurrent.futures import ThreadPoolExecutor

from buildidd.errors import ProbeError
from buildidd.kernel.attach import attach
from buildidd.kernel.bpfsys import MapRef, bpf, map_info
from buildidd.kernel.compiled import PROG_TYPES, CompiledObject, CompiledProgram
from buildidd.kernel.loader import LoadedProgram, LoadSpec

log = logging.getLogger(__name__)

__all__ = ["load_object", "func_info_btf"]

# enum bpf_cmd
BPF_MAP_CREATE = 0
BPF_PROG_LOAD = 5
BPF_BTF_LOAD = 18
#: Verifier log asked for when a program is refused (the message names the instruction).
REFUSAL_LOG_BYTES = 1 << 20

# include/uapi/linux/btf.h
BTF_MAGIC = 0xEB9F
BTF_KIND_INT, BTF_KIND_PTR, BTF_KIND_FUNC, BTF_KIND_FUNC_PROTO = 1, 2, 12, 13
BTF_INT_SIGNED = 1
BTF_FUNC_STATIC, BTF_FUNC_GLOBAL = 0, 1
#: struct bpf_func_info: insn_off, type_id.
FUNC_INFO = struct.Struct("<II")


class _MapCreateAttr(ctypes.Structure):
    """union bpf_attr for BPF_MAP_CREATE (up to map_extra)."""
    _fields_ = [("map_type", ctypes.c_uint32), ("key_size", ctypes.c_uint32), ("value_size", ctypes.c_uint32),
                ("max_entries", ctypes.c_uint32), ("map_flags", ctypes.c_uint32), ("inner_map_fd", ctypes.c_uint32),
                ("numa_node", ctypes.c_uint32), ("map_name", ctypes.c_char * 16), ("map_ifindex", ctypes.c_uint32),
                ("btf_fd", ctypes.c_uint32), ("btf_key_type_id", ctypes.c_uint32),
                ("btf_value_type_id", ctypes.c_uint32), ("btf_vmlinux_value_type_id", ctypes.c_uint32),
                ("map_extra", ctypes.c_uint64)]


class _ProgLoadAttr(ctypes.Structure):
    """union bpf_attr for BPF_PROG_LOAD (up to attach_btf_obj_fd)."""
    _fields_ = [("prog_type", ctypes.c_uint32), ("insn_cnt", ctypes.c_uint32), ("insns", ctypes.c_uint64),
                ("license", ctypes.c_uint64), ("log_level", ctypes.c_uint32), ("log_size", ctypes.c_uint32),
                ("log_buf", ctypes.c_uint64), ("kern_version", ctypes.c_uint32), ("prog_flags", ctypes.c_uint32),
                ("prog_name", ctypes.c_char * 16), ("prog_ifindex", ctypes.c_uint32),
                ("expected_attach_type", ctypes.c_uint32), ("prog_btf_fd", ctypes.c_uint32),
                ("func_info_rec_size", ctypes.c_uint32), ("func_info", ctypes.c_uint64),
                ("func_info_cnt", ctypes.c_uint32), ("line_info_rec_size", ctypes.c_uint32),
                ("line_info", ctypes.c_uint64), ("line_info_cnt", ctypes.c_uint32),
                ("attach_btf_id", ctypes.c_uint32), ("attach_btf_obj_fd", ctypes.c_uint32)]


class _BtfLoadAttr(ctypes.Structure):
    """union bpf_attr for BPF_BTF_LOAD."""
    _fields_ = [("btf", ctypes.c_uint64), ("btf_log_buf", ctypes.c_uint64), ("btf_size", ctypes.c_uint32),
                ("btf_log_size", ctypes.c_uint32), ("btf_log_level", ctypes.c_uint32)]


def load_object(obj: CompiledObject, spec: LoadSpec) -> LoadedProgram:
    """Create obj's maps, load its programs (one thread per CPU) and attach them as spec says.

    An iterator of spec.iterators that the kernel refuses is left out (its user falls back to
    /proc), as BCC's loader did; any other refusal raises.

    Raises:
        OSError: the kernel refused a map or a program (the verifier's message in it).
        ProbeError: obj lacks a program spec attaches.
        KeyError: as kernel.attach.attach.
    """
    loaded = LoadedProgram()
    try:
        for m in obj.maps:
            fd = bpf(BPF_MAP_CREATE, _MapCreateAttr(
                map_type=m.type, key_size=m.key_size, value_size=m.value_size, max_entries=m.max_entries,
                map_flags=m.flags, map_name=m.kernel_name.encode()[:15]))
            try:
                loaded.maps[m.name] = MapRef(fd, map_info(fd))
            except BaseException:
                os.close(fd)
                raise
        fds = {name: ref.fd for name, ref in loaded.maps.items()}
        kfunc_ids = dict(spec.kfuncs)
        workers = max(1, min(len(obj.programs), os.cpu_count() or 1))
        # Largest first: the verifier's time grows with the program, and two CPUs then share it evenly.
        order = sorted(obj.programs, key=lambda p: -len(p.insns))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(lambda p: _load_one(p, fds, kfunc_ids), order))
        for prog, result in zip(order, results):
            if not isinstance(result, BaseException):
                loaded.progs[prog.function] = result
        for prog, result in zip(order, results):
            if isinstance(result, BaseException):
                if prog.function not in spec.iterators:
                    raise result
                log.warning("BPF iterator %s not loaded (running processes are read from /proc): %s",
                            prog.function, result)
        missing = {t.function for t in spec.tail_calls} | {fn for _, fn in spec.raw_tracepoints}
        missing -= loaded.progs.keys()
        if missing:
            raise ProbeError(f"the compiled object lacks {sorted(missing)}")
        attach(loaded, spec)
    except BaseException:
        loaded.close()
        raise
    return loaded


def func_info_btf(p: CompiledProgram) -> tuple[bytes, bytes]:
    """The BTF blob and ``struct bpf_func_info`` array the verifier needs for p's subprograms.

    The verifier refuses a BPF_PSEUDO_FUNC load (a ``bpf_loop`` callback) without func_info,
    and a callback whose FUNC is not static (kernel/bpf/verifier.c, check_ld_imm).  Types: the
    main program ``int NAME(void *ctx)`` (global) and each callback ``int NAME(int i, void *data)``
    (static), in the order of p.subprogs.
    """
    names = [p.function] + [name for _, name in p.subprogs]
    strings = bytearray(b"\0")
    offsets = {}
    for s in ("int", "ctx", "i", "data", *names):
        if s not in offsets:
            offsets[s] = len(strings)
            strings += s.encode() + b"\0"
    types = bytearray()
    types += struct.pack("<III", offsets["int"], BTF_KIND_INT << 24, 4) + struct.pack("<I", BTF_INT_SIGNED << 24 | 32)
    types += struct.pack("<III", 0, BTF_KIND_PTR << 24, 0)                                  # 2: void *
    types += struct.pack("<III", 0, BTF_KIND_FUNC_PROTO << 24 | 1, 1) + struct.pack("<II", offsets["ctx"], 2)
    types += (struct.pack("<III", 0, BTF_KIND_FUNC_PROTO << 24 | 2, 1)                      # 4
              + struct.pack("<II", offsets["i"], 1) + struct.pack("<II", offsets["data"], 2))
    info = bytearray()
    for k, (off, name) in enumerate([(0, p.function)] + list(p.subprogs)):
        linkage, proto = (BTF_FUNC_GLOBAL, 3) if k == 0 else (BTF_FUNC_STATIC, 4)
        types += struct.pack("<III", offsets[name], BTF_KIND_FUNC << 24 | linkage, proto)
        info += FUNC_INFO.pack(off, 5 + k)
    header = struct.pack("<HBBIIIII", BTF_MAGIC, 1, 0, 24, 0, len(types), len(types), len(strings))
    return header + bytes(types) + bytes(strings), bytes(info)


def _load_btf(blob: bytes) -> int:
    """BPF_BTF_LOAD of blob: the fd.

    Raises:
        OSError: refused (the kernel's BTF log in the message).
    """
    buf = ctypes.create_string_buffer(blob, len(blob))
    logbuf = ctypes.create_string_buffer(4096)
    try:
        return bpf(BPF_BTF_LOAD, _BtfLoadAttr(btf=ctypes.addressof(buf), btf_size=len(blob)))
    except OSError as e:
        try:
            os.close(bpf(BPF_BTF_LOAD, _BtfLoadAttr(btf=ctypes.addressof(buf), btf_size=len(blob),
                                                    btf_log_buf=ctypes.addressof(logbuf), btf_log_size=4096,
                                                    btf_log_level=1)))
        except OSError:
            pass
        tail = logbuf.value.decode(errors="replace").strip().splitlines()[-2:]
        raise OSError(e.errno, f"BTF of callbacks: {e.strerror}; {' | '.join(tail)}") from e


def _load_one(p: CompiledProgram, map_fds: dict[str, int], kfunc_ids: dict[str, int]) -> int | BaseException:
    """BPF_PROG_LOAD of p (the fd), or the error, whatever it is: returned, not raised, so that
    load_object collects every other thread's fd before it raises."""
    try:
        return _load(p, map_fds, kfunc_ids)
    except Exception as e:  # noqa: BLE001 - handed to load_object, which raises it
        return e


def _load(p: CompiledProgram, map_fds: dict[str, int], kfunc_ids: dict[str, int]) -> int | BaseException:
    """BPF_PROG_LOAD of p: the fd, or the kernel's refusal (OSError, returned).

    Raises:
        KeyError: a map or kfunc p references is not in map_fds or kfunc_ids.
    """
    code = p.relocated(map_fds, kfunc_ids)
    insns = ctypes.create_string_buffer(code, len(code))
    license_ = ctypes.create_string_buffer(b"GPL")
    attr = _ProgLoadAttr(prog_type=PROG_TYPES[p.prog_type], insn_cnt=len(code) // 8,
                         insns=ctypes.addressof(insns), license=ctypes.addressof(license_),
                         prog_name=p.function.encode()[:15], expected_attach_type=p.expected_attach_type,
                         attach_btf_id=p.attach_btf_id)
    btf_fd = -1
    try:
        if p.subprogs:
            blob, info = func_info_btf(p)
            btf_fd = _load_btf(blob)
            info_buf = ctypes.create_string_buffer(info, len(info))
            attr.prog_btf_fd, attr.func_info_rec_size = btf_fd, FUNC_INFO.size
            attr.func_info, attr.func_info_cnt = ctypes.addressof(info_buf), len(info) // FUNC_INFO.size
        try:
            return bpf(BPF_PROG_LOAD, attr)
        except OSError as e:
            logbuf = ctypes.create_string_buffer(REFUSAL_LOG_BYTES)
            attr.log_level, attr.log_size, attr.log_buf = 1, REFUSAL_LOG_BYTES, ctypes.addressof(logbuf)
            try:
                os.close(bpf(BPF_PROG_LOAD, attr))
            except OSError:
                pass
            text = logbuf.value.decode(errors="replace").strip()
            log.debug("%s refused; the verifier's log:\n%s", p.function, text)
            return OSError(e.errno, f"{p.function}: {e.strerror}; verifier: {' | '.join(text.splitlines()[-3:])}")
    except OSError as e:
        return e
    finally:
        if btf_fd >= 0:
            os.close(btf_fd)

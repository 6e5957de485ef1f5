"""What BCC compiled, as data: the instructions and map definitions a plain bpf(2) load needs.

The loader's child (:mod:`buildidd.kernel.loader`) captures this right after
BCC's compile, and kernel.objload loads it (there, and from the compile
cache): for each program, the instructions as BCC compiled them
(``BPF.dump_func``: map references already resolved to the child's map fds),
and for each map what BPF_MAP_CREATE needs (from BPF_OBJ_GET_INFO_BY_FD of
the map BCC made).  Every map reference is a
``BPF_LD | BPF_IMM | BPF_DW`` instruction with ``src_reg`` BPF_PSEUDO_MAP_FD
(include/uapi/linux/bpf.h); the capture replaces the child's fd by the map's
name, so :mod:`buildidd.kernel.progcache` can create the maps again in
another process, on another boot, and write its own fds back.

``bpf_loop`` callbacks are linked here: BCC does not relocate a function's
address (an LD_IMM64 with src_reg BPF_PSEUDO_FUNC), so the C source loads the
constant ``BPF_CALLBACK(k)`` (bpf/callbacks.h: :data:`CALLBACK_MAGIC` in the
upper 32 bits, k below) where it names callback k, and the capture appends
that callback's instructions (BCC compiles it as a function of its own) after
the program's, once, and turns each such load into a BPF_PSEUDO_FUNC load of
it (imm: the callback's first instruction, relative to the next one).  The
program's ``subprogs`` list where each callback starts, for the BTF
func_info that kernel.objload hands the verifier.

Kernel functions (kfuncs) are linked the same way: BCC cannot emit a call
with src_reg BPF_PSEUDO_KFUNC_CALL, so the source calls helper number
:data:`KFUNC_MAGIC` + k (bpf/kfuncs.h) for kfunc k, and the
capture makes it a kfunc call with imm 0, its name in ``kfunc_refs``; the
function's BTF id is written in only when the program is loaded
(:meth:`CompiledProgram.relocated`), from the running kernel's BTF, so that a
compiled object read from disk cannot choose which kernel function root calls.
k indexes :data:`KFUNCS`, the only kfuncs linked: they read nothing and change
nothing.

An LD_IMM64 with any other pseudo source (a map value, a BTF id), any other
kernel function call, or a map type outside :data:`MAP_TYPES` (map-in-map,
storage and BTF-typed maps need more than BPF_MAP_CREATE's sizes) is not
captured: it raises, and the source does not load (nothing else loads what BCC
compiled).
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
from dataclasses import dataclass

from buildidd.errors import ProbeError
from buildidd.kernel.bpfsys import MapType

__all__ = ["CompiledMap", "CompiledProgram", "CompiledObject", "capture_program", "PROG_TYPES"]

#: enum bpf_prog_type values (include/uapi/linux/bpf.h) of the kinds LoadSpec names.
PROG_TYPES = {"tracepoint": 5, "perf_event": 7, "raw_tracepoint": 17, "tracing": 26}
#: struct bpf_insn: code, dst_reg:4 | src_reg:4, off, imm (8 bytes).
INSN = struct.Struct("<BBhi")
#: BPF_LD | BPF_IMM | BPF_DW: a 64-bit immediate over two instructions.
LD_IMM64 = 0x18
#: src_reg of an LD_IMM64 whose imm is a map fd; of one whose imm is a subprogram (relative).
PSEUDO_MAP_FD = 1
PSEUDO_FUNC = 4
#: Upper 32 bits of BPF_CALLBACK(k) in bpf/callbacks.h.
CALLBACK_MAGIC = 0xB1DDCA11
#: BPF_JMP | BPF_CALL, and the src_reg of a call of a kernel function (kfunc).
CALL = 0x85
PSEUDO_KFUNC_CALL = 2
#: Helper number of the call of kfunc 0 in bpf/kfuncs.h (kfunc k: KFUNC_MAGIC + k).
KFUNC_MAGIC = 0x0B1DDF00
#: The kernel functions a program may call, kfunc k at index k (bpf/kfuncs.h: KFUNC_<name>); the
#: vmlinux BTF id of each is written in at load.  bpf_rdonly_cast (Linux 6.2) only retypes a
#: pointer, and the verifier inlines it as a move.
KFUNCS = ("bpf_rdonly_cast",)
#: Helper numbers from KFUNC_MAGIC up to this many more are taken as kfunc calls.
MAX_KFUNCS = 16
#: enum bpf_map_type values a CompiledMap can make again from its sizes and flags alone.
MAP_TYPES = frozenset({MapType.HASH, MapType.ARRAY, MapType.PROG_ARRAY, MapType.PERF_EVENT_ARRAY,
                       MapType.PERCPU_HASH, MapType.PERCPU_ARRAY, MapType.LRU_HASH, MapType.LRU_PERCPU_HASH,
                       MapType.RINGBUF})
#: The verifier's limit on a program's instructions (BPF_COMPLEXITY_LIMIT_INSNS).
MAX_INSNS = 1_000_000
#: Bounds a cached object must respect (it is read from disk, see progcache).
MAX_MAPS = 256
MAX_PROGRAMS = 64
#: bpf_map_info.name and bpf_attr.prog_name hold 15 characters and a NUL (BPF_OBJ_NAME_LEN).
OBJ_NAME_CHARS = 15


@dataclass(frozen=True)
class CompiledMap:
    """One map as BPF_MAP_CREATE makes it (union bpf_attr, map_create).

    Attributes:
        name: BCC's table name (the key of LoadedProgram.maps).
        type: enum bpf_map_type.
        key_size, value_size: bytes.
        max_entries: entries (bytes for a ring buffer).
        flags: map_flags (BPF_F_NO_PREALLOC, ...).
        kernel_name: the kernel's name for it (at most 15 characters).
    """

    name: str
    type: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int
    kernel_name: str


@dataclass(frozen=True)
class CompiledProgram:
    """One program as BPF_PROG_LOAD loads it.

    Attributes:
        function: the C function (the key of LoadedProgram.progs).
        prog_type: a key of :data:`PROG_TYPES`.
        insns: struct bpf_insn array; the imm of every map reference is 0.
        map_refs: (instruction index, map name) of each map reference.
        expected_attach_type: enum bpf_attach_type (BPF_TRACE_ITER for an iterator), else 0.
        attach_btf_id: the vmlinux BTF id it attaches to (an iterator's ``bpf_iter_<target>``
            function), else 0.  Valid for the kernel it was compiled on only.
        subprogs: (first instruction, C function) of each bpf_loop callback linked after the
            program's own instructions, in increasing order; empty when it calls none.
        kfunc_refs: (instruction index, kernel function name) of each kfunc call (imm 0 until
            relocated), names from :data:`KFUNCS`.
    """

    function: str
    prog_type: str
    insns: bytes
    map_refs: tuple[tuple[int, str], ...]
    expected_attach_type: int = 0
    attach_btf_id: int = 0
    subprogs: tuple[tuple[int, str], ...] = ()
    kfunc_refs: tuple[tuple[int, str], ...] = ()

    def relocated(self, map_fds: dict[str, int], kfunc_ids: dict[str, int] | None = None) -> bytes:
        """The instructions with map_fds[name] written into each map reference and
        kfunc_ids[name] (the function's vmlinux BTF id) into each kfunc call.

        Raises:
            KeyError: a referenced map or called kfunc is not in map_fds or kfunc_ids.
        """
        out = bytearray(self.insns)
        for index, name in self.map_refs:
            struct.pack_into("<i", out, index * 8 + 4, map_fds[name])
        for index, name in self.kfunc_refs:
            struct.pack_into("<i", out, index * 8 + 4, (kfunc_ids or {})[name])
        return bytes(out)


@dataclass(frozen=True)
class CompiledObject:
    """Every map and program of one LoadSpec, compiled for one kernel."""

    maps: tuple[CompiledMap, ...]
    programs: tuple[CompiledProgram, ...]

    def to_json(self) -> dict:
        """JSON-ready form (instructions in base64), with a SHA-256 digest of the rest."""
        body = {"maps": [[m.name, m.type, m.key_size, m.value_size, m.max_entries, m.flags, m.kernel_name]
                         for m in self.maps],
                "programs": [[p.function, p.prog_type, base64.b64encode(p.insns).decode(),
                              [list(r) for r in p.map_refs], p.expected_attach_type, p.attach_btf_id,
                              [list(x) for x in p.subprogs], [list(x) for x in p.kfunc_refs]]
                             for p in self.programs]}
        return {"body": body, "sha256": _digest(body)}

    @classmethod
    def from_json(cls, data: object) -> "CompiledObject":
        """Inverse of to_json, every field checked (the data comes from a file).

        Raises:
            ValueError: malformed, out of bounds, or the digest does not match.
        """
        try:
            body = data["body"]                                     # type: ignore[index]
            if data["sha256"] != _digest(body):                     # type: ignore[index]
                raise ValueError("digest mismatch")
            if not 0 < len(body["maps"]) <= MAX_MAPS or not 0 < len(body["programs"]) <= MAX_PROGRAMS:
                raise ValueError("too many or no maps or programs")
            maps = tuple(CompiledMap(_text(n), _u32(t), _u32(k), _u32(v), _u32(e), _u32(f), _text(kn))
                         for n, t, k, v, e, f, kn in body["maps"])
            names = {m.name for m in maps}
            if len(names) != len(maps) or len({p[0] for p in body["programs"]}) != len(body["programs"]):
                raise ValueError("a map or program named twice")
            if any(m.type not in MAP_TYPES for m in maps):
                raise ValueError("a map of a type that cannot be made again from its sizes")
            programs = []
            for fn, kind, insns, refs, eat, btf_id, subs, kfuncs in body["programs"]:
                code = base64.b64decode(_text(insns), validate=True)
                programs.append(CompiledProgram(_text(fn), _text(kind), code,
                                                tuple((_u32(i), _text(n)) for i, n in refs), _u32(eat), _u32(btf_id),
                                                tuple((_u32(i), _text(n)) for i, n in subs),
                                                tuple((_u32(i), _text(n)) for i, n in kfuncs)))
                _check_program(programs[-1], names)
            return cls(maps, tuple(programs))
        except (KeyError, TypeError, IndexError, AttributeError, ValueError) as e:
            raise ValueError(f"malformed compiled object: {e}") from e


def capture_program(function: str, prog_type: str, insns: bytes, fd_names: dict[int, str], *,
                    attach: tuple[int, int] = (0, 0),
                    callbacks: dict[int, tuple[str, bytes]] | None = None) -> CompiledProgram:
    """A CompiledProgram from the instructions BCC compiled (BPF.dump_func) in the child, with the
    bpf_loop callbacks it names linked in and its kfunc calls recorded (see the module docstring).

    Args:
        fd_names: the child's map fd → BCC table name.
        attach: (expected_attach_type, attach_btf_id) of CompiledProgram.
        callbacks: k of BPF_CALLBACK(k) → (C function, its instructions from BPF.dump_func).
    Raises:
        ProbeError: an LD_IMM64 whose source is not a map fd of fd_names or a known callback, a
            kfunc call other than KFUNC_MAGIC + k for k in KFUNCS, a callback that names a
            callback, or a malformed array.
    """
    out, refs, links, calls = _scan(function, insns, fd_names, callbacks is not None)
    subprogs: list[tuple[int, str]] = []
    bases: dict[int, int] = {}
    for _, k in links:
        if k in bases:
            continue
        if not callbacks or k not in callbacks:
            raise ProbeError(f"{function}: BPF_CALLBACK({k}) names no callback")
        name, code = callbacks[k]
        cb_out, cb_refs, _, cb_calls = _scan(name, code, fd_names, False)
        bases[k] = len(out) // 8
        subprogs.append((bases[k], name))
        refs += [(bases[k] + i, n) for i, n in cb_refs]
        calls += [(bases[k] + i, n) for i, n in cb_calls]
        out += cb_out
    for i, k in links:
        code, regs, off, _imm = INSN.unpack_from(out, i * 8)
        INSN.pack_into(out, i * 8, code, (regs & 0x0F) | PSEUDO_FUNC << 4, off, bases[k] - (i + 1))
        INSN.pack_into(out, (i + 1) * 8, 0, 0, 0, 0)
    prog = CompiledProgram(function, prog_type, bytes(out), tuple(refs), attach[0], attach[1], tuple(subprogs),
                           tuple(calls))
    _check_program(prog, set(fd_names.values()))
    return prog


def _scan(function: str, insns: bytes, fd_names: dict[int, str], linkable: bool
          ) -> tuple[bytearray, list[tuple[int, str]], list[tuple[int, int]], list[tuple[int, str]]]:
    """insns with map fds zeroed and kfunc calls made (imm 0), the (index, map name) references,
    the (index, k) of each BPF_CALLBACK(k) load (refused unless linkable), and the (index, name)
    of each kfunc call.

    Raises:
        ProbeError: as capture_program.
    """
    if len(insns) % 8 or not 0 < len(insns) // 8 <= MAX_INSNS:
        raise ProbeError(f"{function}: {len(insns)} bytes of instructions")
    out = bytearray(insns)
    refs: list[tuple[int, str]] = []
    links: list[tuple[int, int]] = []
    calls: list[tuple[int, str]] = []
    count = len(insns) // 8
    i = 0
    while i < count:
        code, regs, _off, imm = INSN.unpack_from(insns, i * 8)
        if code == CALL and regs >> 4 == PSEUDO_KFUNC_CALL:
            raise ProbeError(f"{function}: instruction {i} calls a kernel function (not cached)")
        if code == CALL and regs >> 4 == 0 and 0 <= imm - KFUNC_MAGIC < MAX_KFUNCS:
            if imm - KFUNC_MAGIC >= len(KFUNCS):
                raise ProbeError(f"{function}: instruction {i} calls kfunc {imm - KFUNC_MAGIC}, which names none")
            calls.append((i, KFUNCS[imm - KFUNC_MAGIC]))
            INSN.pack_into(out, i * 8, CALL, PSEUDO_KFUNC_CALL << 4, 0, 0)
        if code == LD_IMM64:
            src = regs >> 4
            high = INSN.unpack_from(insns, (i + 1) * 8)[3] & 0xFFFFFFFF if i + 1 < count else 0
            if src == PSEUDO_MAP_FD and imm in fd_names:
                refs.append((i, fd_names[imm]))
                struct.pack_into("<i", out, i * 8 + 4, 0)
            elif src == 0 and high == CALLBACK_MAGIC:
                if not linkable:
                    raise ProbeError(f"{function}: instruction {i} names a callback where none can be linked")
                links.append((i, imm & 0xFFFFFFFF))
            elif src != 0:
                raise ProbeError(f"{function}: instruction {i} loads pseudo source {src} (not cached)")
            i += 2
            continue
        i += 1
    return out, refs, links, calls


#: Longest C function name accepted (BTF and the kernel take far longer ones; this bounds the file).
MAX_NAME_CHARS = 128


def _name_ok(name: str) -> bool:
    """An ASCII C identifier of at most MAX_NAME_CHARS: what BTF's FUNC names (func_info) accept."""
    return name.isascii() and name.isidentifier() and len(name) <= MAX_NAME_CHARS


def _check_program(p: CompiledProgram, map_names: set[str]) -> None:
    """Every instruction that names something outside the program is one the capture made: a map
    load at a map_refs index (imm 0 until relocated), a function load of a subprogram start
    (each start named by one), a kfunc call at a kfunc_refs index (imm 0 until relocated) of a
    function of KFUNCS; names are identifiers.  The file is read by root and loaded into the
    kernel: nothing in it may reach another fd or function."""
    if p.prog_type not in PROG_TYPES:
        raise ValueError(f"{p.function}: unknown program type {p.prog_type!r}")
    if not _name_ok(p.function) or any(not _name_ok(name) for _, name in p.subprogs):
        raise ValueError(f"{p.function!r}: a program or subprogram name that is not a C identifier")
    count = len(p.insns) // 8
    if len(p.insns) % 8 or not 0 < count <= MAX_INSNS:
        raise ValueError(f"{p.function}: {len(p.insns)} bytes of instructions")
    refs = {}
    for index, name in p.map_refs:
        if name not in map_names:
            raise ValueError(f"{p.function}: references unknown map {name!r}")
        refs[index] = name
    kcalls = {}
    for index, name in p.kfunc_refs:
        if name not in KFUNCS:
            raise ValueError(f"{p.function}: calls kernel function {name!r}, not one of {sorted(KFUNCS)}")
        kcalls[index] = name
    starts = [off for off, _ in p.subprogs]
    if starts != sorted(set(starts)) or any(not 0 < off < count for off in starts):
        raise ValueError(f"{p.function}: malformed subprogram list {list(p.subprogs)}")
    targets, loads = set(), set()
    i = 0
    while i < count:
        code, regs, off, imm = INSN.unpack_from(p.insns, i * 8)
        src = regs >> 4
        if code == CALL and src == PSEUDO_KFUNC_CALL:
            if i not in kcalls or imm != 0 or off != 0:
                raise ValueError(f"{p.function}: instruction {i} calls a kernel function that is not a kfunc call "
                                 "the capture made")
            kcalls.pop(i)
        if code != LD_IMM64:
            i += 1
            continue
        if i + 1 >= count:
            raise ValueError(f"{p.function}: a 64-bit load cut at the end")
        high = INSN.unpack_from(p.insns, (i + 1) * 8)
        loads.add(i)
        if (i in refs) != (src == PSEUDO_MAP_FD):
            raise ValueError(f"{p.function}: map reference {i} is not a map load, or a map load is not listed")
        if src == PSEUDO_MAP_FD:
            if imm != 0 or high[3] != 0:
                raise ValueError(f"{p.function}: instruction {i} loads a map that is not a map reference")
        elif src == PSEUDO_FUNC:
            if i + 1 + imm not in starts or high != (0, 0, 0, 0):
                raise ValueError(f"{p.function}: instruction {i} loads a function that is not a subprogram")
            targets.add(i + 1 + imm)
        elif src != 0:
            raise ValueError(f"{p.function}: instruction {i} loads pseudo source {src}")
        i += 2
    if set(refs) - loads:
        raise ValueError(f"{p.function}: a map reference that is not a 64-bit load")
    if kcalls:
        raise ValueError(f"{p.function}: kfunc references {sorted(kcalls)} are not kfunc calls")
    if targets != set(starts):
        raise ValueError(f"{p.function}: a subprogram no instruction names")


def _digest(body: object) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _text(x: object) -> str:
    if not isinstance(x, str):
        raise ValueError(f"expected text, got {type(x).__name__}")
    return x


def _u32(x: object) -> int:
    if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < 1 << 32:
        raise ValueError(f"expected an unsigned 32-bit integer, got {x!r}")
    return x

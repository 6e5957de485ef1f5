"""Compile a BPF program with BCC in a short-lived child; load what it compiled here, without BCC.

BCC stays the compiler, but importing it maps libbcc, libLLVM and
libclang-cpp (tens of MiB each) into the process for good.  :func:`load` runs BCC in a
child process (``python -m buildidd.kernel.loader``) that compiles the source
and captures what BCC compiled as data (kernel.compiled: each program's
instructions with its map references by name and its ``bpf_loop`` callbacks
linked in, each map's sizes), sends that to the parent over a socketpair and
exits.  The parent loads and attaches it with plain bpf(2) (kernel.objload,
the same code that loads it from the compile cache).  The parent never
imports bcc, and BCC loads nothing: it cannot load a program that calls
bpf_loop (it does not relocate a callback's address).

The capture is also what kernel.progcache keeps on disk and loads at a later
first start without compiling; on a restart the daemon takes back what was
pinned in bpffs (kernel.pinned) instead.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from buildidd.errors import ProbeError
from buildidd.kernel.bpfsys import BPF_TRACE_ITER, MapRef, map_info
from buildidd.kernel.compiled import KFUNC_MAGIC, KFUNCS, MAP_TYPES, CompiledMap, CompiledObject, capture_program

log = logging.getLogger(__name__)

#: Largest message either side accepts (the spec; one chunk of names).
MAX_MESSAGE_BYTES = 1 << 20
#: Characters of the compiled object's JSON per message (kernel.compiled; ~110 KB in all).
COMPILED_PART_CHARS = 48 * 1024
#: Child stderr kept for an error message (BCC prints compiler errors there).
STDERR_TAIL_BYTES = 8192


@dataclass(frozen=True)
class TailCall:
    """A program put into a BPF_MAP_TYPE_PROG_ARRAY slot by the child.

    Attributes:
        table: the BCC name of the program array (``BPF_PROG_ARRAY(name, n)``).
        index: the slot.
        function: the C function to load.
        prog_type: ``raw_tracepoint``, ``tracepoint``, ``perf_event`` or
            ``tracing`` (must match the type of the programs calling it).
    """

    table: str
    index: int
    function: str
    prog_type: str = "raw_tracepoint"


@dataclass(frozen=True)
class LoadSpec:
    """What the child compiles, loads and attaches.

    Attributes:
        src_file: path of the ``.bpf.c`` source.
        cflags: compiler flags (``-DOFF_...=N``, ``-I...``).
        raw_tracepoints: (tracepoint name, C function) pairs attached with
            attach_raw_tracepoint; TRACEPOINT_PROBE(category, event) functions
            are attached by BCC itself when the module loads.
        tail_calls: program-array slots to fill.
        required_tracepoints: ``category:event`` names that must exist in
            tracefs (BCC's auto-attach gives a poor message otherwise).
        iterators: BPF iterator functions (``bpf_iter__<target>``, e.g.
            ``bpf_iter__task_vma``) loaded as BPF_PROG_TYPE_TRACING and left
            unattached: the parent makes a link and an iterator for each pass
            (kernel.bpfsys.iter_chunks).  Optional: one the kernel refuses is
            left out of LoadedProgram.progs (said in the log).
        callbacks: the C functions of the source's ``bpf_loop`` callbacks; the k-th is the one
            ``BPF_CALLBACK(k)`` names (bpf/callbacks.h), and the compile defines
            ``CALLBACK_<function>`` as k (:meth:`compile_flags`).
        kfuncs: (name, vmlinux BTF id) of the kernel functions the source calls (bpf/kfuncs.h,
            compiled.KFUNCS), written into its kfunc calls at load; the running kernel's
            (kernel.layout.kld_support).
    """

    src_file: str
    cflags: tuple[str, ...] = ()
    raw_tracepoints: tuple[tuple[str, str], ...] = ()
    tail_calls: tuple[TailCall, ...] = ()
    required_tracepoints: tuple[str, ...] = ()
    iterators: tuple[str, ...] = ()
    callbacks: tuple[str, ...] = ()
    kfuncs: tuple[tuple[str, int], ...] = ()

    def compile_flags(self) -> list[str]:
        """cflags, ``-DCALLBACK_<function>=k`` for the k-th of callbacks, and the kfunc
        numbers of bpf/kfuncs.h: ``-DKFUNC_MAGIC`` and ``-DKFUNC_<name>=k`` for compiled.KFUNCS[k]."""
        return [*self.cflags, *(f"-DCALLBACK_{fn}={k}" for k, fn in enumerate(self.callbacks)),
                f"-DKFUNC_MAGIC={KFUNC_MAGIC:#x}", *(f"-DKFUNC_{name}={k}" for k, name in enumerate(KFUNCS))]

    @property
    def name(self) -> str:
        """The source's name as bpffs and file names take it (no dot): ``buildidd_bpf`` for
        ``buildidd.bpf.c``."""
        return os.path.splitext(os.path.basename(self.src_file))[0].replace(".", "_")

    def to_json(self) -> bytes:
        """The spec as the child reads it."""
        d = {"src_file": self.src_file, "cflags": list(self.cflags),
             "raw_tracepoints": [list(x) for x in self.raw_tracepoints],
             "tail_calls": [[t.table, t.index, t.function, t.prog_type] for t in self.tail_calls],
             "required_tracepoints": list(self.required_tracepoints),
             "iterators": list(self.iterators), "callbacks": list(self.callbacks),
             "kfuncs": [list(x) for x in self.kfuncs]}
        return json.dumps(d).encode()

    def digest(self) -> "hashlib._Hash":
        """SHA-256 (hashlib object, to extend) over the source, every header in its directory
        and to_json(): what the compiled program depends on besides the kernel and BCC.

        Raises:
            OSError: a source file cannot be read.
        """
        h = hashlib.sha256()
        src_dir = os.path.dirname(self.src_file)
        for name in [os.path.basename(self.src_file)] + sorted(n for n in os.listdir(src_dir) if n.endswith(".h")):
            with open(os.path.join(src_dir, name), "rb") as f:
                h.update(name.encode() + b"\0" + f.read() + b"\0")
        h.update(self.to_json())
        return h

    @classmethod
    def from_json(cls, data: bytes) -> "LoadSpec":
        """Inverse of to_json (raises ValueError/KeyError/TypeError on a malformed spec)."""
        d = json.loads(data)
        return cls(str(d["src_file"]), tuple(str(x) for x in d["cflags"]),
                   tuple((str(tp), str(fn)) for tp, fn in d["raw_tracepoints"]),
                   tuple(TailCall(str(t), int(i), str(f), str(p)) for t, i, f, p in d["tail_calls"]),
                   tuple(str(x) for x in d["required_tracepoints"]),
                   tuple(str(x) for x in d["iterators"]), tuple(str(x) for x in d["callbacks"]),
                   tuple((str(n), int(i)) for n, i in d["kfuncs"]))


@dataclass
class LoadedProgram:
    """The loaded, attached program as file descriptors owned by this process.

    Attributes:
        maps: BCC table name → :class:`MapRef` (fd and the kernel's map info).
        progs: C function name → program fd (each loaded program).
        links: ``kind:target`` (``tracepoint:syscalls:sys_exit_mmap``,
            ``raw_tracepoint:sched_process_exec``) → the fd holding the attachment.
        compile_s: seconds the child spent in BCC's compile.
        attach_s: seconds spent loading (the verifier) and attaching what was compiled.
        load_s: seconds from spawning the child to holding every fd (all of it).
        reused: True when taken from bpffs pins (kernel.pinned): nothing compiled or verified.
        cached: True when loaded from the on-disk compile cache (kernel.progcache): nothing
            compiled, verified again.
        compiled: what the child compiled, as data (kernel.compiled), for that cache; None when
            taken from pins or the cache.
        lock_fd: the kernel.pinned lock this program holds (-1: none), released by close().
    """

    maps: dict[str, MapRef] = field(default_factory=dict)
    progs: dict[str, int] = field(default_factory=dict)
    links: dict[str, int] = field(default_factory=dict)
    compile_s: float = 0.0
    attach_s: float = 0.0
    load_s: float = 0.0
    reused: bool = False
    cached: bool = False
    compiled: CompiledObject | None = None
    lock_fd: int = -1

    def detach(self) -> None:
        """Close the attachment fds: the programs stop running; maps stay readable.  Idempotent."""
        for fd in self.links.values():
            os.close(fd)
        self.links.clear()

    def close(self) -> None:
        """Detach, then drop the programs and maps.  Idempotent."""
        self.detach()
        for fd in self.progs.values():
            os.close(fd)
        self.progs.clear()
        for ref in self.maps.values():
            os.close(ref.fd)
        self.maps.clear()
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1

    def __enter__(self) -> "LoadedProgram":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load(spec: LoadSpec, timeout_s: float = 120.0) -> LoadedProgram:
    """Compile spec in a child process, then load and attach what it compiled (kernel.objload).

    The child is ``sys.executable -m buildidd.kernel.loader``: this interpreter,
    which must see both buildidd and bcc (python3-bpfcc).

    Args:
        spec: what to load.
        timeout_s: longest wait for the child's compile, seconds.
    Returns:
        The :class:`LoadedProgram`, with ``compiled`` the capture; the child has exited.
    Raises:
        ProbeError: the child failed (BCC's message and the tail of its stderr
            included), timed out, or sent something malformed; or the kernel
            refused a map, a program (the verifier's message) or an attachment.
    """
    from buildidd.kernel.objload import load_object     # objload imports this module
    t0 = time.monotonic()
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with parent, tempfile.TemporaryFile() as err:
        with child:
            try:
                proc = subprocess.Popen([sys.executable, "-m", "buildidd.kernel.loader", str(child.fileno())],
                                        pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL,
                                        stdout=err, stderr=err)
            except OSError as e:
                raise ProbeError(f"cannot start the BPF loader child: {e}") from e
        try:
            parent.settimeout(timeout_s)
            parent.sendall(spec.to_json())
            result = _receive(parent)
            proc.wait(timeout=max(1.0, timeout_s - (time.monotonic() - t0)))
            if "error" in result or proc.returncode != 0:
                raise ProbeError(f"exit {proc.returncode}: {result.get('error', 'no result')}")
            obj = CompiledObject.from_json(result.get("compiled"))
        except (OSError, ValueError, subprocess.TimeoutExpired, ProbeError) as e:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            raise ProbeError(f"BPF loader child failed: {e}{_tail(err)}") from e
        warnings = _tail(err)
        if warnings:
            log.debug("BPF loader child said:%s", warnings)
    t1 = time.monotonic()
    try:
        loaded = load_object(obj, spec)
    except (OSError, KeyError) as e:
        raise ProbeError(f"{spec.src_file}: cannot load or attach: {e}") from e
    loaded.compiled = obj
    loaded.compile_s = float(result.get("compile_s", 0.0))
    loaded.attach_s = time.monotonic() - t1
    loaded.load_s = time.monotonic() - t0
    return loaded


def _tail(f) -> str:
    """The last STDERR_TAIL_BYTES of the child's output, as a suffix for a message."""
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(max(0, size - STDERR_TAIL_BYTES))
    text = f.read().decode(errors="replace").strip()
    return f"\n{text}" if text else ""


def _receive(sock: socket.socket) -> dict:
    """The child's final message as a dict: ``{"done": ..., "compile_s": s}`` or ``{"error": ...}``.

    ``{"compiled_part": text}`` messages before it are joined into its ``compiled`` (the JSON
    of a kernel.compiled.CompiledObject).

    Raises:
        ProbeError: the socket closed first, or a message was truncated or not a JSON object.
        ValueError: a message or the joined parts are not JSON.
    """
    parts: list[str] = []
    while True:
        msg, _, flags, _ = sock.recvmsg(MAX_MESSAGE_BYTES)
        if not msg:
            raise ProbeError("the loader child closed the socket without a result")
        if flags & socket.MSG_TRUNC:
            raise ProbeError("truncated message from the loader child")
        body = json.loads(msg)
        if not isinstance(body, dict):
            raise ProbeError("malformed message from the loader child")
        if "compiled_part" in body:
            parts.append(str(body["compiled_part"]))
            continue
        if parts:
            body["compiled"] = json.loads("".join(parts))
        return body


# ---- the child ---------------------------------------------------------------------------

def _table_fds(b) -> list[tuple[str, int]]:
    """(BCC table name, fd) of every map of the module (libbcc's bpf_num_tables,
    bpf_table_name, bpf_table_fd_id, which bcc's Python does not wrap)."""
    import ctypes
    from bcc import lib
    lib.bpf_num_tables.restype = ctypes.c_size_t
    lib.bpf_num_tables.argtypes = [ctypes.c_void_p]
    lib.bpf_table_name.restype = ctypes.c_char_p
    lib.bpf_table_name.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.bpf_table_fd_id.restype = ctypes.c_int
    lib.bpf_table_fd_id.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return [(lib.bpf_table_name(b.module, i).decode(), lib.bpf_table_fd_id(b.module, i))
            for i in range(lib.bpf_num_tables(b.module))]


def _child_load(spec: LoadSpec) -> dict:
    """Compile spec with BCC and capture it (kernel.compiled): ``{"compiled": the capture's JSON,
    "compile_s": seconds}``.

    Raises:
        ProbeError: a required tracepoint is missing, BCC cannot compile, or the capture fails.
        OSError: as _capture.
    """
    from bcc import BPF
    from buildidd.kernel.attach import ensure_tracefs

    class CompileOnly(BPF):
        """BCC's module without its autoload of ``tracepoint__*`` functions: the parent loads and
        attaches every program (kernel.objload; BCC cannot load one that calls bpf_loop)."""

        def _trace_autoload(self) -> None:
            pass

    ensure_tracefs()        # BCC reads a TRACEPOINT_PROBE's fields from tracefs
    for tp in spec.required_tracepoints:
        category, _, event = tp.partition(":")
        if not BPF.tracepoint_exists(category, event):
            raise ProbeError(f"tracepoint {tp} does not exist on this kernel")
    t0 = time.monotonic()
    try:
        b = CompileOnly(src_file=spec.src_file.encode(), cflags=spec.compile_flags())
    except Exception as e:  # BCC raises bare Exception on compile failure
        raise ProbeError(f"{spec.src_file} failed to compile: {e}") from e
    compile_s = time.monotonic() - t0
    return {"compiled": _capture(b, _table_fds(b), spec).to_json(), "compile_s": compile_s}


def _function_kinds(spec: LoadSpec) -> dict[str, str]:
    """C function → program kind (a key of compiled.PROG_TYPES) of every program spec names
    (``tracepoint__*`` functions, attached by their name, are added by _capture)."""
    kinds = {t.function: t.prog_type for t in spec.tail_calls}
    kinds.update((fn, "raw_tracepoint") for _, fn in spec.raw_tracepoints)
    kinds.update((fn, "tracing") for fn in spec.iterators)
    return kinds


def _capture(b, tables: list[tuple[str, int]], spec: LoadSpec) -> CompiledObject:
    """The maps and programs of the compiled module b as a CompiledObject (kernel.compiled), each
    program with the callbacks it names linked in.

    Raises:
        ProbeError: a program cannot be captured (see compiled.capture_program), or a callback
            or program spec names is not in the module.
        OSError: a map's info cannot be read.
    """
    from bcc import lib
    fd_names = {fd: name for name, fd in tables}
    maps = []
    for name, fd in tables:
        info = map_info(fd)
        if info.type not in MAP_TYPES:
            raise ProbeError(f"map {name}: type {info.type} is not made again from its sizes")
        maps.append(CompiledMap(name, int(info.type), info.key_size, info.value_size, info.max_entries,
                                info.flags, info.name))
    functions = [lib.bpf_function_name(b.module, i).decode() for i in range(lib.bpf_num_functions(b.module))]
    kinds = _function_kinds(spec)
    kinds.update((fn, "tracepoint") for fn in functions if fn.startswith("tracepoint__"))
    missing = (set(kinds) | set(spec.callbacks)) - set(functions)
    if missing:
        raise ProbeError(f"{spec.src_file} defines no {sorted(missing)}")
    callbacks = {k: (fn, b.dump_func(fn.encode())) for k, fn in enumerate(spec.callbacks)}
    programs = []
    for fn, kind in kinds.items():
        eat = btf_id = 0
        if kind == "tracing":
            try:
                eat, btf_id = BPF_TRACE_ITER, _iterator_btf_id(fn)
            except ProbeError as e:     # optional: its user falls back (a kernel without iterators)
                print(f"iterator {fn} left out: {e}", file=sys.stderr)
                continue
        programs.append(capture_program(fn, kind, b.dump_func(fn.encode()), fd_names, attach=(eat, btf_id),
                                        callbacks=callbacks))
    return CompiledObject(tuple(maps), tuple(programs))


def _iterator_btf_id(function: str) -> int:
    """vmlinux BTF id of the function an iterator ``bpf_iter__<target>`` attaches to, found as
    BCC finds it (libbpf's libbpf_find_vmlinux_btf_id, which prefixes ``bpf_iter_``).

    Raises:
        ProbeError: not an iterator name, or libbpf does not find it.
    """
    import ctypes
    if not function.startswith("bpf_iter__"):
        raise ProbeError(f"{function}: a tracing program that is not an iterator")
    libbpf = ctypes.CDLL("libbpf.so.1")
    libbpf.libbpf_find_vmlinux_btf_id.argtypes = [ctypes.c_char_p, ctypes.c_int]
    found = libbpf.libbpf_find_vmlinux_btf_id(function.removeprefix("bpf_iter__").encode(), BPF_TRACE_ITER)
    if found <= 0:
        raise ProbeError(f"{function}: no BTF id for its target ({found})")
    return found


def _child_main(fd: int) -> int:
    """Entry point of the child: read the spec, compile and capture, send the capture."""
    sock = socket.socket(fileno=fd)
    try:
        spec = LoadSpec.from_json(sock.recv(MAX_MESSAGE_BYTES))
        report = _child_load(spec)
        compiled = json.dumps(report.pop("compiled"))
        for i in range(0, len(compiled), COMPILED_PART_CHARS):     # a datagram stays below wmem_default
            sock.send(json.dumps({"compiled_part": compiled[i:i + COMPILED_PART_CHARS]}).encode())
        sock.send(json.dumps({"done": True, **report}).encode())
        return 0
    except (ProbeError, OSError, ValueError, KeyError, TypeError) as e:
        sock.send(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
        return 1


if __name__ == "__main__":
    sys.stdout.flush()
    # os._exit: skip BCC's atexit cleanup; nothing the child made outlives it.
    os._exit(_child_main(int(sys.argv[1])))

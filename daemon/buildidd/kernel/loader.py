"""Compile and load a BPF program in a short-lived child; keep only file descriptors.

BCC stays the compiler, but importing it maps libbcc, libLLVM (~55 MiB) and
libclang-cpp (~28 MiB) into the process for good.  :func:`load` runs BCC in a
child process (``python -m buildidd.kernel.loader``) that compiles the source,
captures what BCC compiled as data (kernel.compiled: each program's
instructions with its map references by name and its ``bpf_loop`` callbacks
linked in, each map's sizes), loads and attaches that capture with plain
bpf(2) (kernel.objload, the same code that loads it from the compile cache),
then hands every file descriptor that matters to the parent over a socketpair
with SCM_RIGHTS and exits.  The parent never imports bcc.  BCC does not load
anything itself: it cannot load a program that calls bpf_loop (it does not
relocate a callback's address).

What keeps things alive once the child is gone (the kernel counts references
to the open files, not to the process that opened them):

- a tracepoint program: the perf event fd it is attached to
  (perf_event_open + PERF_EVENT_IOC_SET_BPF, kernel.attach), holding the
  program;
- a raw tracepoint program: the fd of BPF_RAW_TRACEPOINT_OPEN, holding the
  program;
- a tail-called program: its slot in the BPF_MAP_TYPE_PROG_ARRAY.  The kernel
  empties a program array when its last user reference goes away
  (kernel/bpf/arraymap.c, prog_array_map_clear on map_release_uref), so the
  parent must keep that map's fd open for tail calls to keep working;
- a map: every program using it, and the fd the parent holds.

Closing the attachment fds (:meth:`LoadedProgram.close`) detaches.  The child
also sends the capture, which kernel.progcache keeps on disk and loads at a
later first start without compiling; on a restart the daemon takes back what
was pinned in bpffs (kernel.pinned) instead.
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
from buildidd.kernel.compiled import MAP_TYPES, CompiledMap, CompiledObject, capture_program

log = logging.getLogger(__name__)

#: File descriptors per SCM_RIGHTS message (the kernel's SCM_MAX_FD is 253).
FDS_PER_MESSAGE = 64
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
    """

    src_file: str
    cflags: tuple[str, ...] = ()
    raw_tracepoints: tuple[tuple[str, str], ...] = ()
    tail_calls: tuple[TailCall, ...] = ()
    required_tracepoints: tuple[str, ...] = ()
    iterators: tuple[str, ...] = ()
    callbacks: tuple[str, ...] = ()

    def compile_flags(self) -> list[str]:
        """cflags, and ``-DCALLBACK_<function>=k`` for the k-th of callbacks."""
        return [*self.cflags, *(f"-DCALLBACK_{fn}={k}" for k, fn in enumerate(self.callbacks))]

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
             "iterators": list(self.iterators), "callbacks": list(self.callbacks)}
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
                   tuple(str(x) for x in d["iterators"]), tuple(str(x) for x in d["callbacks"]))


@dataclass
class LoadedProgram:
    """The loaded, attached program as file descriptors owned by this process.

    Attributes:
        maps: BCC table name → :class:`MapRef` (fd and the kernel's map info).
        progs: C function name → program fd (each loaded program).
        links: ``kind:target`` (``tracepoint:syscalls:sys_exit_mmap``,
            ``raw_tracepoint:sched_process_exec``) → the fd holding the attachment.
        compile_s: seconds the child spent in BCC's compile.
        attach_s: seconds the child spent capturing, loading (the verifier) and attaching.
        load_s: seconds from spawning the child to holding every fd (all of it).
        reused: True when taken from bpffs pins (kernel.pinned): nothing compiled or verified.
        cached: True when loaded from the on-disk compile cache (kernel.progcache): nothing
            compiled, verified again.
        compiled: what the child compiled, as data (kernel.compiled), for that cache; None when
            taken from pins or the child could not capture it.
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
    """Compile, load and attach spec in a child process and take over its file descriptors.

    The child is ``sys.executable -m buildidd.kernel.loader``: this interpreter,
    which must see both buildidd and bcc (python3-bpfcc).

    Args:
        spec: what to load.
        timeout_s: longest wait for the child (compile + load + attach), seconds.
    Returns:
        The :class:`LoadedProgram`; the child has exited.
    Raises:
        ProbeError: the child failed (BCC's message and the tail of its stderr
            included), timed out, or sent something malformed.
    """
    t0 = time.monotonic()
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    loaded = LoadedProgram()
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
            result = _receive(parent, loaded)
            proc.wait(timeout=max(1.0, timeout_s - (time.monotonic() - t0)))
        except (OSError, ValueError, subprocess.TimeoutExpired, ProbeError) as e:
            proc.kill()
            proc.wait()
            loaded.close()
            raise ProbeError(f"BPF loader child failed: {e}{_tail(err)}") from e
        if "error" in result or proc.returncode != 0:
            loaded.close()
            raise ProbeError(f"BPF loader child failed (exit {proc.returncode}): "
                             f"{result.get('error', 'no result')}{_tail(err)}")
        warnings = _tail(err)
        if warnings:
            log.debug("BPF loader child said:%s", warnings)
    if result.get("compiled") is not None:
        try:
            loaded.compiled = CompiledObject.from_json(result["compiled"])
        except ValueError as e:
            log.warning("BPF loader child sent a malformed compiled object: %s", e)
    loaded.compile_s = float(result.get("compile_s", 0.0))
    loaded.attach_s = float(result.get("attach_s", 0.0))
    loaded.load_s = time.monotonic() - t0
    return loaded


def _tail(f) -> str:
    """The last STDERR_TAIL_BYTES of the child's output, as a suffix for a message."""
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(max(0, size - STDERR_TAIL_BYTES))
    text = f.read().decode(errors="replace").strip()
    return f"\n{text}" if text else ""


def _receive(sock: socket.socket, loaded: LoadedProgram) -> dict:
    """Read the child's messages into loaded until its final one (returned as a dict).

    Each message is JSON ``{"kind": "map"|"prog"|"link", "names": [...]}`` with
    as many fds (SCM_RIGHTS) as names, or the final ``{"done": ...}`` /
    ``{"error": ...}``.  Every fd received ends up owned by loaded or closed.
    ``{"compiled_part": text}`` messages (no fds) are joined into the final dict's
    ``compiled`` (the JSON of a kernel.compiled.CompiledObject, or null).
    """
    parts: list[str] = []
    while True:
        msg, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE_BYTES, FDS_PER_MESSAGE)
        pending = list(fds)
        try:
            if not msg and not fds:
                raise ProbeError("the loader child closed the socket without a result")
            if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
                raise ProbeError("truncated message from the loader child")
            body = json.loads(msg)
            if not isinstance(body, dict):
                raise ProbeError("malformed message from the loader child")
            if "kind" not in body:
                if fds:
                    raise ProbeError("file descriptors with the final message")
                if "compiled_part" in body:
                    parts.append(str(body["compiled_part"]))
                    continue
                if parts:
                    body["compiled"] = json.loads("".join(parts))
                return body
            kind, names = body["kind"], [str(n) for n in body["names"]]
            table = {"map": loaded.maps, "prog": loaded.progs, "link": loaded.links}.get(kind)
            if table is None or len(names) != len(fds):
                raise ProbeError(f"{len(fds)} fds for {len(names)} names of kind {kind!r}")
            while pending:
                name = names[len(fds) - len(pending)]
                if name in table:
                    raise ProbeError(f"{kind} {name!r} sent twice")
                fd = pending[0]
                table[name] = MapRef(fd, map_info(fd)) if kind == "map" else fd
                pending.pop(0)
        finally:
            for fd in pending:
                os.close(fd)


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


def _child_load(spec: LoadSpec) -> tuple[list[tuple[str, list[tuple[str, int]]]], dict]:
    """Compile spec with BCC, capture it (kernel.compiled) and load and attach the capture with
    kernel.objload; return the fds to send by kind, and timings."""
    from bcc import BPF
    from buildidd.kernel.objload import load_object
    from buildidd.kernel.tracer import ensure_tracefs

    class CompileOnly(BPF):
        """BCC's module without its autoload of ``tracepoint__*`` functions: kernel.objload
        loads and attaches every program (BCC cannot load one that calls bpf_loop)."""

        def _trace_autoload(self) -> None:
            pass

    ensure_tracefs()
    for tp in spec.required_tracepoints:
        category, _, event = tp.partition(":")
        if not BPF.tracepoint_exists(category, event):
            raise ProbeError(f"tracepoint {tp} does not exist on this kernel")
    t0 = time.monotonic()
    try:
        b = CompileOnly(src_file=spec.src_file.encode(), cflags=spec.compile_flags())
    except Exception as e:  # BCC raises bare Exception on compile failure
        raise ProbeError(f"{spec.src_file} failed to compile: {e}") from e
    t1 = time.monotonic()
    obj = _capture(b, _table_fds(b), spec)
    try:
        loaded = load_object(obj, spec)
    except (OSError, KeyError) as e:
        raise ProbeError(f"cannot load or attach: {e}") from e
    t2 = time.monotonic()
    groups = [("map", [(name, ref.fd) for name, ref in loaded.maps.items()]),
              ("prog", list(loaded.progs.items())),
              ("link", list(loaded.links.items()))]
    return groups, {"compile_s": t1 - t0, "attach_s": t2 - t1, "compiled": obj.to_json()}


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
    """Entry point of the child: read the spec, load, send fds, report."""
    sock = socket.socket(fileno=fd)
    try:
        spec = LoadSpec.from_json(sock.recv(MAX_MESSAGE_BYTES))
        groups, report = _child_load(spec)
        for kind, items in groups:
            for i in range(0, len(items), FDS_PER_MESSAGE):
                chunk = items[i:i + FDS_PER_MESSAGE]
                socket.send_fds(sock, [json.dumps({"kind": kind, "names": [n for n, _ in chunk]}).encode()],
                                [f for _, f in chunk])
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
    # os._exit: skip BCC's atexit cleanup (it would detach what the parent now holds
    # where detaching is more than closing an fd, e.g. kprobe_events entries).
    os._exit(_child_main(int(sys.argv[1])))

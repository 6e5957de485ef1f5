"""Build-ids from the page cache in BPF: kernel layout, start-up discovery, self-test.

bpf/pagecache.h reads a file's GNU build-id straight from its page cache.  It
needs, besides struct offsets from BTF (:func:`pagecache_layout`), two
addresses the kernel does not publish: ``vmemmap_base`` (the ``struct page``
of pfn 0) and ``page_offset_base`` (the direct map's address of physical
address 0).  With CONFIG_RANDOMIZE_MEMORY they move at each boot and they are
not in /proc/kallsyms, so :func:`discover_bases` measures them at start-up
with the small program bpf/pagecache_probe.bpf.c (recipe and measurements:
../shared/ENVIRONMENT.md "Reading the page cache from BPF"):

1. ``vmemmap_base``: a memfd page of random bytes, its PFN from
   /proc/self/pagemap (bits 0-54, real PFNs for root), and the folio the BPF
   program finds for it by walking current->files->fdt->fd[fd]->f_mapping->
   i_pages: ``vmemmap_base = folio - pfn * sizeof(struct page)``.
2. ``page_offset_base``: 1 GiB-aligned, at most the highest physical RAM
   address (/proc/iomem) below any direct-map pointer, e.g. the memfd's
   ``struct file``: candidates are tried downwards from that pointer until the
   page's bytes are found at ``candidate + pfn * 4096``.
3. Checked: both bases 1 GiB-aligned, the folio belongs to the file, the
   whole page reads back through the bases; otherwise retried, then
   :class:`~buildidd.errors.ProbeError`.

:mod:`buildidd.kernel.pagecache_selftest` then compares the kernel path with
user space on known files; the daemon turns the kernel path off when they
disagree.

The page-cache build-id read is these files, in the order data flows:

- ``bpf/pagecache.h``: the read itself (xarray walk, folio checks, ELF header,
  program headers, notes), and ``bpf/buildid_memo.h``: the per-inode memo of
  its answers;
- ``bpf/pagecache_probe.bpf.c`` and this module: the layout and the two bases;
- :mod:`buildidd.kernel.pagecache_selftest`: the check against user space;
- :mod:`buildidd.capture.bpfstart`: the start-up that runs discovery and the
  self-test and gives the verdict (``kernel_build_id_path`` in the session
  record and ``status``);
- :func:`buildidd.resolve.resolution.kernel_resolution`: a record's kernel answer
  as a Resolution (``build_id_source: "kernel"``).
"""

from __future__ import annotations

import ctypes
import enum
import errno
import mmap
import os
import secrets
import struct
from dataclasses import dataclass

from buildidd.errors import BtfError, ProbeError
from buildidd.kernel.btf import Btf
from buildidd.kernel.events import BPF_DIR, PagecacheBuildId, PcStatus
from buildidd.kernel.loader import LoadSpec
from buildidd.kernel.progcache import load_program

__all__ = [
    "Bases", "FolioInfo", "KernelBuildId", "PageCacheProbe", "PagecacheBases", "PcStatus",
    "discover_bases", "pagecache_layout", "probe_layout",
]

PAGE_SIZE = 4096
GIB = 1 << 30
#: posix_fadvise arguments that mark a request to bpf/pagecache_probe.bpf.c: the
#: offset spells "buildidd"; the advice is invalid, so the call fails with EINVAL
#: and does nothing.
TRIGGER_OFFSET = 0x6275696C64696464
TRIGGER_ADVICE = 0x62696464
PROBE_SOURCE = "pagecache_probe.bpf.c"
#: Probes of the downward page_offset_base search; the highest RAM address over
#: 1 GiB bounds it, this caps it on any machine.
MAX_BASE_PROBES = 4096
# enum pc_op of bpf/pagecache_probe.bpf.c
_OP_FOLIO, _OP_READ, _OP_BUILD_ID, _OP_FILE = 1, 2, 3, 4
#: PC_READ_MAX of bpf/pagecache_probe.bpf.c, bytes.
PC_READ_MAX = 4096


class PagecacheBases(ctypes.Structure):
    """struct pagecache_bases of bpf/pagecache.h (kernel addresses; zeros: reads off)."""
    _fields_ = [("vmemmap_base", ctypes.c_uint64), ("page_offset_base", ctypes.c_uint64)]


class _PcRequest(ctypes.Structure):
    """struct pc_request of bpf/pagecache_probe.bpf.c."""
    _fields_ = [("tgid", ctypes.c_uint32), ("op", ctypes.c_uint32), ("index", ctypes.c_uint64),
                ("addr", ctypes.c_uint64), ("len", ctypes.c_uint32), ("_pad", ctypes.c_uint32)]


class _PcReply(ctypes.Structure):
    """struct pc_reply of bpf/pagecache_probe.bpf.c (err: 0 or a negative errno)."""
    _fields_ = [("err", ctypes.c_int64), ("seq", ctypes.c_uint64), ("file", ctypes.c_uint64),
                ("mapping", ctypes.c_uint64), ("size", ctypes.c_uint64), ("folio", ctypes.c_uint64),
                ("folio_mapping", ctypes.c_uint64), ("folio_index", ctypes.c_uint64),
                ("folio_flags", ctypes.c_uint64), ("folio_flags_1", ctypes.c_uint64),
                ("bid", PagecacheBuildId), ("data", ctypes.c_uint8 * PC_READ_MAX)]


def pagecache_layout(btf: Btf) -> dict[str, int]:
    """The macros bpf/pagecache.h needs, from BTF: offsets (bytes), bit numbers, sizes.

    Sources: struct file.f_mapping, address_space.i_pages, xarray.xa_head,
    xa_node.shift/slots, folio.flags/mapping/index/_flags_1, enum pageflags
    (PG_locked, PG_uptodate, PG_head), sizeof(struct page).

    Raises:
        BtfError: a type or member is missing, or the folio fields lie beyond
            the first 256 bytes of struct folio (one probe read fetches them).
    """
    out = {
        "OFF_FILE_F_MAPPING": btf.offsetof("file", "f_mapping"),
        "OFF_ADDRESS_SPACE_I_PAGES": btf.offsetof("address_space", "i_pages"),
        "OFF_XARRAY_XA_HEAD": btf.offsetof("xarray", "xa_head"),
        "OFF_XA_NODE_SHIFT": btf.offsetof("xa_node", "shift"),
        "OFF_XA_NODE_SLOTS": btf.offsetof("xa_node", "slots"),
        "OFF_FOLIO_FLAGS": btf.offsetof("folio", "flags"),
        "OFF_FOLIO_MAPPING": btf.offsetof("folio", "mapping"),
        "OFF_FOLIO_INDEX": btf.offsetof("folio", "index"),
        "OFF_FOLIO_FLAGS_1": btf.offsetof("folio", "_flags_1"),
        "PG_LOCKED_BIT": btf.enum_value("pageflags", "PG_locked"),
        "PG_UPTODATE_BIT": btf.enum_value("pageflags", "PG_uptodate"),
        "PG_HEAD_BIT": btf.enum_value("pageflags", "PG_head"),
        "STRUCT_PAGE_SIZE": btf.sizeof("page"),
    }
    slots = btf.array_len("xa_node", "slots")
    if slots & (slots - 1) or slots < 2:
        raise BtfError(f"xa_node.slots has {slots} entries, not a power of two")
    out["XA_CHUNK_SHIFT"] = slots.bit_length() - 1
    span = max(out[k] for k in ("OFF_FOLIO_FLAGS", "OFF_FOLIO_MAPPING", "OFF_FOLIO_INDEX",
                                "OFF_FOLIO_FLAGS_1")) + 8
    if span > 256:
        raise BtfError(f"struct folio fields span {span} bytes; one probe read takes at most 256")
    out["FOLIO_SPAN_LEN"] = span
    return out


def probe_layout(btf: Btf) -> dict[str, int]:
    """The extra macros of bpf/pagecache_probe.bpf.c: fd -> struct file -> size.

    Sources: task_struct.files, files_struct.fdt, fdtable.max_fds/fd,
    file.f_inode, inode.i_size.

    Raises:
        BtfError: a type or member is missing.
    """
    return {
        "OFF_TASK_STRUCT_FILES": btf.offsetof("task_struct", "files"),
        "OFF_FILES_STRUCT_FDT": btf.offsetof("files_struct", "fdt"),
        "OFF_FDTABLE_MAX_FDS": btf.offsetof("fdtable", "max_fds"),
        "OFF_FDTABLE_FD": btf.offsetof("fdtable", "fd"),
        "OFF_FILE_F_INODE": btf.offsetof("file", "f_inode"),
        "OFF_INODE_I_SIZE": btf.offsetof("inode", "i_size"),
        "PC_TRIGGER_OFFSET": TRIGGER_OFFSET,
        "PC_TRIGGER_ADVICE": TRIGGER_ADVICE,
    }


@dataclass(frozen=True)
class Bases:
    """Where the kernel keeps page structs and the direct map (x86_64, this boot).

    Attributes:
        vmemmap_base: kernel address of the struct page of pfn 0.
        page_offset_base: kernel address of physical address 0 in the direct map.
    """

    vmemmap_base: int
    page_offset_base: int


@dataclass(frozen=True)
class FolioInfo:
    """What the probe program found for one page of an open file.

    Attributes:
        file, mapping: the fd's struct file * and its f_mapping.
        size: the file's i_size, bytes.
        folio: the struct folio * holding the page, 0 when none is cached.
        folio_mapping, folio_index, folio_flags, folio_flags_1: its fields.
    """

    file: int
    mapping: int
    size: int
    folio: int
    folio_mapping: int
    folio_index: int
    folio_flags: int
    folio_flags_1: int


@dataclass(frozen=True)
class KernelBuildId:
    """The answer of bpf/pagecache.h for one file.

    Attributes:
        status: the outcome.
        build_id: the descriptor bytes (1..64) when status is OK, else b"".
        page: the file page (offset / 4096) not cached or raced, else 0.
    """

    status: PcStatus
    build_id: bytes
    page: int


class PageCacheProbe:
    """bpf/pagecache_probe.bpf.c, loaded: serves this process's requests.

    Args:
        btf: the kernel's BTF (loaded from /sys/kernel/btf/vmlinux when None).
        cflags: extra compiler flags (e.g. ``-DPC_NO_BUILD_ID`` for a baseline).
        pin_root: as :class:`buildidd.kernel.tracer.Tracer`'s (None: loaded afresh).
        cache_dir: the compile cache (kernel.progcache; None: compiled when not pinned).

    Raises:
        ProbeError: BTF lacks a field, or the program does not compile, load
            or attach (in the loader's child: BCC missing there too).
    """

    def __init__(self, btf: Btf | None = None, cflags: tuple[str, ...] = (), pin_root: str | None = None,
                 cache_dir: str | None = None):
        btf = btf or Btf.load()
        self.layout = pagecache_layout(btf) | probe_layout(btf)
        self.struct_page_size = self.layout["STRUCT_PAGE_SIZE"]
        flags = [f"-D{k}={v}" for k, v in sorted(self.layout.items())]
        flags += [f"-I{BPF_DIR}", "-Wno-unused-function", *cflags]
        # BCC runs in the loader's child: this process never maps the compiler.
        spec = LoadSpec(os.path.join(BPF_DIR, PROBE_SOURCE), tuple(flags),
                        required_tracepoints=("syscalls:sys_enter_fadvise64",), callbacks=("pc_step_probe",))
        self.prog = load_program(spec, pin_root, cache_dir)
        try:
            self._req = self.prog.maps["pc_request"]
            self._rep = self.prog.maps["pc_reply"]
            self._bases = self.prog.maps["pagecache_bases"]
            sizes = {"pc_request": (self._req, _PcRequest), "pc_reply": (self._rep, _PcReply),
                     "pagecache_bases": (self._bases, PagecacheBases)}
            for name, (ref, ctype) in sizes.items():
                if ref.info.value_size != ctypes.sizeof(ctype):
                    raise ProbeError(f"{PROBE_SOURCE}: map {name} holds {ref.info.value_size}-byte values, "
                                     f"its mirror here is {ctypes.sizeof(ctype)}")
        except (KeyError, ProbeError) as e:
            self.prog.close()
            raise ProbeError(f"{PROBE_SOURCE} lacks what the probe needs: {e}") from e
        self._key = ctypes.c_int(0)
        self._pid = os.getpid()

    @property
    def prog_fd(self) -> int:
        """File descriptor of the loaded tracepoint program."""
        return self.prog.progs["tracepoint__syscalls__sys_enter_fadvise64"]

    def _reply(self) -> _PcReply:
        return _PcReply.from_buffer_copy(self._rep.lookup(self._key))

    def _call(self, fd: int, op: int, **fields: int) -> _PcReply:
        req = _PcRequest(tgid=self._pid, op=op, **fields)
        self._req.update(self._key, req)
        before = self._reply().seq
        try:
            os.posix_fadvise(fd, TRIGGER_OFFSET, 0, TRIGGER_ADVICE)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise ProbeError(f"probe trigger failed: {e}") from e
        rep = self._reply()
        if rep.seq != before + 1:
            raise ProbeError("the page-cache probe program did not run for its trigger")
        if rep.err:
            raise ProbeError(f"page-cache probe request {op} failed: {os.strerror(-rep.err)}")
        return rep

    def folio(self, fd: int, index: int) -> FolioInfo:
        """The folio holding page ``index`` of the open file ``fd`` (an xarray walk).

        Raises:
            ProbeError: fd is not open, or the walk met a concurrent change.
        """
        r = self._call(fd, _OP_FOLIO, index=index)
        return FolioInfo(r.file, r.mapping, r.size, r.folio, r.folio_mapping, r.folio_index,
                         r.folio_flags, r.folio_flags_1)

    def read_kernel(self, addr: int, length: int) -> bytes | None:
        """``length`` (<= 4096) bytes of kernel memory at ``addr``; None when unreadable."""
        if not 0 < length <= PAGE_SIZE:
            raise ValueError(f"read of {length} bytes; 1..{PAGE_SIZE} allowed")
        fd = os.open("/", os.O_RDONLY | os.O_CLOEXEC)  # the trigger needs some fd
        try:
            r = self._call(fd, _OP_READ, addr=addr, len=length)
        except ProbeError:
            return None
        finally:
            os.close(fd)
        return bytes(r.data[:length])

    def build_id(self, fd: int) -> KernelBuildId:
        """bpf/pagecache.h's answer for the file open on ``fd``.

        Raises:
            ProbeError: fd is not open, or the program did not run.
        """
        r = self._call(fd, _OP_BUILD_ID)
        bid = r.bid
        raw = bytes(bid.build_id[:bid.size]) if bid.status == PcStatus.OK else b""
        return KernelBuildId(PcStatus(bid.status), raw, bid.page)

    def baseline(self, fd: int) -> None:
        """A request doing everything but the build-id read (cost measurements)."""
        self._call(fd, _OP_FILE)

    def set_bases(self, bases: Bases) -> None:
        """Hand the discovered bases to the BPF side (zeros turn the reads off)."""
        self._bases.update(self._key, PagecacheBases(bases.vmemmap_base, bases.page_offset_base))

    def close(self) -> None:
        """Detach and unload (closes every fd the loader handed over).  Idempotent."""
        self.prog.close()


def _pfn_of(addr: int) -> int:
    """The PFN backing this process's virtual address addr (/proc/self/pagemap,
    Documentation/admin-guide/mm/pagemap.rst: bit 63 present, bits 0-54 PFN;
    zero without CAP_SYS_ADMIN)."""
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(addr // PAGE_SIZE * 8)
        (entry,) = struct.unpack("<Q", f.read(8))
    if not entry >> 63 or not entry & ((1 << 55) - 1):
        raise ProbeError("/proc/self/pagemap gives no PFN (page not present, or not root)")
    return entry & ((1 << 55) - 1)


def max_physical_address(iomem: str = "/proc/iomem") -> int:
    """One past the highest "System RAM" byte in /proc/iomem (real addresses as root).

    Raises:
        ProbeError: no System RAM line, or only zeros (not root).
    """
    top = 0
    try:
        with open(iomem) as f:
            for line in f:
                span, _, name = line.strip().partition(" : ")
                if name == "System RAM" and not line.startswith((" ", "\t")):
                    top = max(top, int(span.split("-")[1], 16) + 1)
    except (OSError, ValueError) as e:
        raise ProbeError(f"cannot read {iomem}: {e}") from e
    if top <= 1:
        raise ProbeError(f"{iomem} shows no System RAM address (not root?)")
    return top


def _memfd_page(data: bytes) -> tuple[int, int]:
    """``(fd, pfn)``: a memfd holding data (one page), mapped and touched so that
    its page is in the page cache, and the PFN of that page."""
    fd = os.memfd_create("buildidd-pagecache-probe", os.MFD_CLOEXEC)
    try:
        os.write(fd, data)
        with mmap.mmap(fd, PAGE_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as m:
            if m[:PAGE_SIZE] != data:   # the read faults the page in
                raise ProbeError("memfd page reads back wrong")
            cell = ctypes.c_char.from_buffer(m)
            try:
                pfn = _pfn_of(ctypes.addressof(cell))
            finally:
                del cell
    except BaseException:
        os.close(fd)
        raise
    return fd, pfn


def _discover_once(probe: PageCacheProbe, maxphys: int) -> Bases:
    """One attempt of the recipe in the module docstring."""
    data = secrets.token_bytes(PAGE_SIZE)
    fd, pfn = _memfd_page(data)
    try:
        info = probe.folio(fd, 0)
    finally:
        os.close(fd)
    if not info.folio or info.folio_mapping != info.mapping or info.folio_index != 0:
        raise ProbeError("the memfd page's folio was not found in its page cache")
    vmemmap = info.folio - pfn * probe.struct_page_size
    start = info.file & ~(GIB - 1)  # struct file is slab memory: in the direct map
    page_offset = None
    for k in range(min(maxphys // GIB + 2, MAX_BASE_PROBES)):
        cand = start - k * GIB
        if probe.read_kernel(cand + pfn * PAGE_SIZE, 16) == data[:16]:
            page_offset = cand
            break
    if page_offset is None:
        raise ProbeError("page_offset_base not found below the memfd's struct file")
    if vmemmap % GIB or page_offset % GIB:
        raise ProbeError(f"bases not 1 GiB-aligned: vmemmap_base {vmemmap:#x}, "
                         f"page_offset_base {page_offset:#x}")
    if probe.read_kernel(page_offset + pfn * PAGE_SIZE, PAGE_SIZE) != data:
        raise ProbeError("the memfd page does not read back whole through the discovered bases")
    return Bases(vmemmap, page_offset)


def discover_bases(probe: PageCacheProbe, attempts: int = 3) -> Bases:
    """vmemmap_base and page_offset_base of this boot, verified (module docstring);
    also handed to the probe program (:meth:`PageCacheProbe.set_bases`).

    Args:
        probe: the loaded probe program.
        attempts: tries, each with a new memfd page, before giving up.
    Raises:
        ProbeError: not root, /proc/iomem or /proc/self/pagemap unreadable, or
            no attempt could be verified (the message of the last one).
    """
    maxphys = max_physical_address()
    last: ProbeError | None = None
    for _ in range(attempts):
        try:
            bases = _discover_once(probe, maxphys)
        except ProbeError as e:
            last = e
            continue
        probe.set_bases(bases)
        return bases
    raise ProbeError(f"page-cache bases not found in {attempts} attempts: {last}") from last

"""Where the kernel's structs keep the fields the BPF side reads: offsets from BTF, never headers.

Every kernel struct field bpf/buildidd.bpf.c reads is located here, at
start-up, in the running kernel's BTF (/sys/kernel/btf/vmlinux, read by
:mod:`buildidd.kernel.btf`), and reaches the C code as
``-DOFF_<STRUCT>_<FIELD>=<bytes>``; the structs it reads with KLD
(bpf/kfuncs.h) get ``-DBTF_ID_<STRUCT>=<type id>``.  The installed kernel
headers may describe another kernel and are never used for a layout.
:mod:`buildidd.kernel.tracer` compiles the programs with these.
"""

from __future__ import annotations

import gzip
import logging
import os

from buildidd.errors import BtfError
from buildidd.kernel import compiled
from buildidd.kernel.btf import Btf
from buildidd.kernel.btf_blob import KIND_FUNC, KIND_NAMES, KIND_STRUCT
from buildidd.kernel.pagecache import pagecache_layout

log = logging.getLogger(__name__)

__all__ = ["KERNEL_FIELDS", "KLD_STRUCTS", "btf_id", "field_span", "inode_ctime_fields", "kernel_config",
           "kernel_layout", "kld_support", "syscall_regs_layout"]


#: (macro, struct, dotted member path) for every kernel field the BPF side reads.
KERNEL_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("OFF_TASK_STRUCT_MM", "task_struct", "mm"),
    ("OFF_TASK_STRUCT_TGID", "task_struct", "tgid"),
    ("OFF_TASK_STRUCT_PID", "task_struct", "pid"),
    ("OFF_TASK_STRUCT_COMM", "task_struct", "comm"),
    ("OFF_TASK_STRUCT_EXIT_CODE", "task_struct", "exit_code"),
    ("OFF_TASK_STRUCT_PERSONALITY", "task_struct", "personality"),
    ("OFF_TASK_STRUCT_CRED", "task_struct", "cred"),
    ("OFF_CRED_UID", "cred", "uid.val"),
    ("OFF_MM_STRUCT_MM_MT", "mm_struct", "mm_mt"),
    ("OFF_MM_STRUCT_SAVED_AUXV", "mm_struct", "saved_auxv"),
    ("OFF_MAPLE_TREE_MA_ROOT", "maple_tree", "ma_root"),
    ("OFF_MAPLE_RANGE_64_PIVOT", "maple_node", "mr64.pivot"),
    ("OFF_MAPLE_RANGE_64_SLOT", "maple_node", "mr64.slot"),
    ("OFF_MAPLE_ARANGE_64_PIVOT", "maple_node", "ma64.pivot"),
    ("OFF_MAPLE_ARANGE_64_SLOT", "maple_node", "ma64.slot"),
    ("OFF_VM_AREA_STRUCT_VM_START", "vm_area_struct", "vm_start"),
    ("OFF_VM_AREA_STRUCT_VM_END", "vm_area_struct", "vm_end"),
    ("OFF_VM_AREA_STRUCT_VM_PGOFF", "vm_area_struct", "vm_pgoff"),
    ("OFF_VM_AREA_STRUCT_VM_FILE", "vm_area_struct", "vm_file"),
    ("OFF_VM_AREA_STRUCT_VM_FLAGS", "vm_area_struct", "vm_flags"),
    ("OFF_FILE_F_INODE", "file", "f_inode"),
    ("OFF_FILE_F_PATH", "file", "f_path"),
    ("OFF_FILE_F_MODE", "file", "f_mode"),
    ("OFF_PATH_MNT", "path", "mnt"),
    ("OFF_PATH_DENTRY", "path", "dentry"),
    ("OFF_DENTRY_D_INODE", "dentry", "d_inode"),
    ("OFF_INODE_I_INO", "inode", "i_ino"),
    ("OFF_INODE_I_SIZE", "inode", "i_size"),
    ("OFF_INODE_I_GENERATION", "inode", "i_generation"),
    ("OFF_INODE_I_NLINK", "inode", "i_nlink"),
    ("OFF_INODE_I_SB", "inode", "i_sb"),
    ("OFF_SUPER_BLOCK_S_DEV", "super_block", "s_dev"),
    ("OFF_SUPER_BLOCK_S_MAGIC", "super_block", "s_magic"),
    ("OFF_INODE_I_WRITECOUNT", "inode", "i_writecount"),
    ("OFF_DENTRY_D_PARENT", "dentry", "d_parent"),
    ("OFF_DENTRY_D_NAME_LEN", "dentry", "d_name.len"),
    ("OFF_DENTRY_D_NAME_NAME", "dentry", "d_name.name"),
    ("OFF_MOUNT_MNT", "mount", "mnt"),
    ("OFF_MOUNT_MNT_PARENT", "mount", "mnt_parent"),
    ("OFF_MOUNT_MNT_MOUNTPOINT", "mount", "mnt_mountpoint"),
    ("OFF_VFSMOUNT_MNT_ROOT", "vfsmount", "mnt_root"),
    ("OFF_LINUX_BINPRM_FILE", "linux_binprm", "file"),
    ("OFF_LINUX_BINPRM_FILENAME", "linux_binprm", "filename"),
)


def kernel_config() -> dict[str, str]:
    """The running kernel's build options (``CONFIG_X`` → value) from /proc/config.gz
    or /boot/config-RELEASE; empty when neither is readable."""
    release = os.uname().release
    for path, opener in (("/proc/config.gz", gzip.open), (f"/boot/config-{release}", open)):
        try:
            with opener(path, "rt") as f:
                return dict(line.rstrip("\n").split("=", 1) for line in f
                            if line.startswith("CONFIG_") and "=" in line)
        except OSError:
            continue
    return {}


def syscall_regs_layout(btf: Btf, machine: str | None = None,
                        config: dict[str, str] | None = None) -> dict[str, int]:
    """The saved user registers the raw sys_exit program reads (x86_64 only; else {}).

    SYSCALL_REGS says the layout is known: on_sys_exit (raw_syscalls:sys_exit)
    then handles mmap, mprotect and pkey_mprotect, native and i386, from the
    struct pt_regs the tracepoint hands over (offsets of orig_ax, ax, di, si,
    dx, bx, cx from BTF, each read with KLD).  Without it the BPF side falls
    back to the syscalls tracepoints.  config (default: the running kernel's)
    says whether i386 syscalls exist (CONFIG_IA32_EMULATION).
    """
    if (machine or os.uname().machine) != "x86_64":
        return {}
    config = kernel_config() if config is None else config
    names = ("orig_ax", "ax", "di", "si", "dx", "bx", "cx")
    out = {f"OFF_PT_REGS_{r.upper()}": btf.offsetof("pt_regs", r) for r in names}
    out["SYSCALL_REGS"] = 1
    out["NR_MMAP"] = 9          # arch/x86/entry/syscalls/syscall_64.tbl
    if config.get("CONFIG_IA32_EMULATION") == "y":
        # i386 processes: thread_info.status & TS_COMPAT (arch/x86/include/asm/thread_info.h).
        out["OFF_TASK_STRUCT_THREAD_INFO_STATUS"] = btf.offsetof("task_struct", "thread_info.status")
        out["TS_COMPAT"] = 0x0002
    return out


def field_span(btf: Btf, struct: str, fields: tuple[str, ...]) -> tuple[int, int]:
    """``(base, length)`` in bytes, 8-aligned, of the smallest span of struct holding
    every field: what one bpf_probe_read_kernel fetches (at most 256 bytes).

    Raises:
        BtfError: a field is missing, or the span is longer than 256 bytes.
    """
    starts = [btf.offsetof(struct, f) for f in fields]
    ends = [o + btf.member_size(struct, f) for o, f in zip(starts, fields)]
    base = min(starts) & ~7
    length = (max(ends) - base + 7) & ~7
    if length > 256:
        raise BtfError(f"{struct} fields span {length} bytes; the BPF side reads at most 256 at once")
    return base, length


def inode_ctime_fields(btf: Btf) -> tuple[str, str]:
    """The struct inode members holding ctime seconds and nanoseconds on this kernel.

    ``i_ctime_sec``/``i_ctime_nsec`` since the timestamps became discrete
    integers (Linux 6.11, the series of the mtime change above), ``__i_ctime``
    (struct timespec64, behind the ctime accessors of Linux 6.6) before that,
    ``i_ctime`` earlier.
    Raises:
        BtfError: none of them is in this kernel's BTF.
    """
    for sec, nsec in (("i_ctime_sec", "i_ctime_nsec"), ("__i_ctime.tv_sec", "__i_ctime.tv_nsec"),
                      ("i_ctime.tv_sec", "i_ctime.tv_nsec")):
        try:
            btf.offsetof("inode", sec)
        except BtfError:
            continue
        return sec, nsec
    raise BtfError("struct inode has no ctime member this reader knows")


def kernel_layout(btf: Btf) -> dict[str, int]:
    """Every macro the BPF program needs, from BTF: offsets (bytes), array lengths, enum values.

    The inode mtime moved from ``i_mtime`` (struct timespec64) to
    ``i_mtime_sec``/``i_mtime_nsec`` in Linux 6.7 (commit 3aa63a569c64); both are
    handled.

    Raises:
        BtfError: a struct or member the BPF side needs is not in this kernel's BTF.
    """
    out = {macro: btf.offsetof(struct, path) for macro, struct, path in KERNEL_FIELDS}
    mtime = ("i_mtime_sec", "i_mtime_nsec")
    try:
        btf.offsetof("inode", mtime[0])
    except BtfError:
        mtime = ("i_mtime.tv_sec", "i_mtime.tv_nsec")
    out["OFF_INODE_I_MTIME_SEC"] = btf.offsetof("inode", mtime[0])
    out["OFF_INODE_I_MTIME_NSEC"] = btf.offsetof("inode", mtime[1])
    ctime = inode_ctime_fields(btf)
    out["OFF_INODE_I_CTIME_SEC"] = btf.offsetof("inode", ctime[0])
    out["OFF_INODE_I_CTIME_NSEC"] = btf.offsetof("inode", ctime[1])
    out["PATH_SPAN_BASE"], span = field_span(btf, "path", ("mnt", "dentry"))
    if span != 16:
        raise BtfError(f"struct path is {span} bytes, not two pointers")
    # overlayfs backing files (Linux 6.6+): the path the user opened.
    if btf.has_struct("backing_file"):
        out["OFF_BACKING_FILE_USER_PATH"] = btf.offsetof("backing_file", "user_path")
    out["MAPLE_NODE_SIZE"] = btf.sizeof("maple_node")
    if out["MAPLE_NODE_SIZE"] != 256:
        raise BtfError(f"struct maple_node is {out['MAPLE_NODE_SIZE']} bytes, not 256")
    # task_struct.in_execve (a 1-bit field; absent before Linux 2.6.30): comm
    # changes inside execve are not reported, the exec event carries the comm.
    try:
        bit, size = btf.bit_member("task_struct", "in_execve")
        if size == 1:
            out["IN_EXECVE_BIT"] = bit
    except BtfError:
        log.info("task_struct.in_execve not in BTF: execve's comm change is reported as a comm event too")
    out.update(syscall_regs_layout(btf))
    out.update(pagecache_layout(btf))
    out["AUXV_LEN"] = btf.array_len("mm_struct", "saved_auxv")
    out["MR64_NPIVOTS"] = btf.array_len("maple_range_64", "pivot")
    out["MA64_NPIVOTS"] = btf.array_len("maple_arange_64", "pivot")
    out["MAPLE_LEAF_64"] = btf.enum_value("maple_type", "maple_leaf_64")
    out["MAPLE_RANGE_64"] = btf.enum_value("maple_type", "maple_range_64")
    out["MAPLE_ARANGE_64"] = btf.enum_value("maple_type", "maple_arange_64")
    if out["MR64_NPIVOTS"] > 16 or out["MA64_NPIVOTS"] > out["MR64_NPIVOTS"]:
        raise BtfError(f"unexpected maple node layout: {out['MR64_NPIVOTS']}/{out['MA64_NPIVOTS']} pivots")
    return out


#: Structs bpf/buildidd.bpf.c reads with KLD (bpf/kfuncs.h): -DBTF_ID_<STRUCT>=<vmlinux type id>.
KLD_STRUCTS = ("pt_regs", "vm_area_struct", "file", "inode", "super_block", "dentry", "mount", "vfsmount")


def btf_id(btf: Btf, kind: int, name: str) -> int:
    """The one type id of kind (btf_blob.KIND_STRUCT, KIND_FUNC) named name in btf: what
    bpf_rdonly_cast's btf_id argument and a kfunc call's imm name.

    Raises:
        BtfError: none, or more than one.
    """
    ids = btf.type_ids(kind, name)
    if len(ids) != 1:
        raise BtfError(f"{len(ids)} BTF {KIND_NAMES[kind]} types named {name!r}, not one")
    return ids[0]


def kld_support(btf: Btf) -> tuple[dict[str, int], tuple[tuple[str, int], ...]]:
    """What KLD (bpf/kfuncs.h) needs of this kernel: the ``BTF_ID_<STRUCT>`` macros of
    KLD_STRUCTS, and LoadSpec.kfuncs, (name, vmlinux BTF id) of each of compiled.KFUNCS.
    ({}, ()) when BTF lacks one of them (bpf_rdonly_cast is Linux 6.2+): the BPF side is
    then compiled with -DNO_KFUNCS and reads those fields with bpf_probe_read_kernel."""
    try:
        ids = {f"BTF_ID_{name.upper()}": btf_id(btf, KIND_STRUCT, name) for name in KLD_STRUCTS}
        return ids, tuple((name, btf_id(btf, KIND_FUNC, name)) for name in compiled.KFUNCS)
    except BtfError as e:
        log.warning("KLD loads are off (%s): kernel fields are read with bpf_probe_read_kernel", e)
        return {}, ()

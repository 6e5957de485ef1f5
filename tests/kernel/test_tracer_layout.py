"""Where the raw sys_exit program finds a syscall's number and arguments: struct pt_regs from BTF."""

from __future__ import annotations

import os
import re

import pytest

from buildidd.kernel.btf import Btf
from buildidd.kernel.layout import kernel_config, syscall_regs_layout

VMLINUX = "/sys/kernel/btf/vmlinux"


@pytest.fixture(scope="module")
def btf() -> Btf:
    if not os.path.exists(VMLINUX):
        pytest.skip(f"{VMLINUX} absent")
    return Btf.load(VMLINUX)


def test_registers_are_known_on_x86_64_only_and_i386_with_ia32_emulation(btf):
    assert syscall_regs_layout(btf, "aarch64", {}) == {}
    native = syscall_regs_layout(btf, "x86_64", {})
    assert native["SYSCALL_REGS"] == 1 and "TS_COMPAT" not in native
    both = syscall_regs_layout(btf, "x86_64", {"CONFIG_IA32_EMULATION": "y"})
    assert both["TS_COMPAT"] == 2 and both["OFF_TASK_STRUCT_THREAD_INFO_STATUS"] > 0


def test_registers_read_are_distinct_words_of_pt_regs(btf):
    out = syscall_regs_layout(btf, "x86_64", {})
    offs = [out[f"OFF_PT_REGS_{reg}"] for reg in ("ORIG_AX", "AX", "DI", "SI", "DX", "BX", "CX")]
    assert len(set(offs)) == 7 and all(o % 8 == 0 and o + 8 <= btf.sizeof("pt_regs") for o in offs)
    assert out["NR_MMAP"] == 9


def test_running_kernel_config_is_read():
    cfg = kernel_config()
    if not (os.path.exists("/proc/config.gz") or os.path.exists(f"/boot/config-{os.uname().release}")):
        pytest.skip("kernel config not exposed")
    assert cfg.get("CONFIG_BPF") == "y" and cfg.get("CONFIG_BPF_SYSCALL") == "y"


#: Bytes of each type KLD loads (bpf/kfuncs.h) in bpf/buildidd.bpf.c.
KLD_TYPE_BYTES = {"__u64": 8, "__s64": 8, "__u32": 4, "__s32": 4, "const void *": 8}
KLD_USE = re.compile(r"\bKLD\(\s*[^,()]+,\s*(\w+),\s*([A-Z0-9_ +]+?),\s*([\w ]+?\s*\*?)\s*\)")
REG_USE = re.compile(r"\bREG\(regs, (OFF_PT_REGS_\w+)\)")


def _kld_macros(btf) -> dict[str, tuple[str, str]]:
    """OFF_* macro -> (struct, dotted member path), as layout.kernel_layout computes them."""
    from buildidd.kernel.layout import KERNEL_FIELDS, inode_ctime_fields
    out = {macro: (struct, path) for macro, struct, path in KERNEL_FIELDS}
    out.update((f"OFF_PT_REGS_{r.upper()}", ("pt_regs", r)) for r in ("orig_ax", "ax", "di", "si", "dx", "bx", "cx"))
    ctime = inode_ctime_fields(btf)
    out["OFF_INODE_I_CTIME_SEC"], out["OFF_INODE_I_CTIME_NSEC"] = ("inode", ctime[0]), ("inode", ctime[1])
    out["OFF_INODE_I_MTIME_SEC"], out["OFF_INODE_I_MTIME_NSEC"] = ("inode", "i_mtime_sec"), ("inode", "i_mtime_nsec")
    out["OFF_FILE_F_MAPPING"] = ("file", "f_mapping")            # kernel.pagecache.pagecache_layout
    return out


def test_every_kld_load_is_as_wide_as_its_btf_member(btf):
    """The verifier does not hold a scalar load through a bpf_rdonly_cast pointer to the member's
    size (bpf/kfuncs.h): every KLD(p, STRUCT, OFF..., type) of the BPF source is checked here
    against the running kernel's BTF: the struct it casts to holds the member, and the type
    loaded is the member's size.  A sum of offsets is a path through a nested member
    (OFF_FILE_F_PATH + OFF_PATH_MNT: file.f_path.mnt)."""
    from buildidd.kernel.events import BPF_DIR
    from buildidd.kernel.layout import KLD_STRUCTS
    macros = _kld_macros(btf)
    src = open(os.path.join(BPF_DIR, "buildidd.bpf.c")).read()
    assert "#define REG(regs, off) KLD(regs, PT_REGS, off, __u64)" in src
    uses = KLD_USE.findall(src) + [("PT_REGS", off, "__u64") for off in REG_USE.findall(src)]
    assert len(uses) >= 30, uses
    for struct_macro, offset, type_ in uses:
        parts = [macros[m.strip()] for m in offset.split("+")]
        struct = parts[0][0]
        path = ".".join(p for _, p in parts)
        assert struct.upper() == struct_macro and struct in KLD_STRUCTS, (struct_macro, offset)
        assert btf.member_size(struct, path) == KLD_TYPE_BYTES[type_.strip()], (struct, path, type_)

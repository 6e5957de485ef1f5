"""Where the raw sys_exit program finds a syscall's number and arguments: struct pt_regs from BTF."""

from __future__ import annotations

import os

import pytest

from buildidd.kernel.btf import Btf
from buildidd.kernel.tracer import kernel_config, syscall_regs_layout

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

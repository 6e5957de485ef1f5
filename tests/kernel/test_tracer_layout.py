"""Where sys_exit_mmap finds the call's saved registers: task_pt_regs() per kernel config."""

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


def test_pt_regs_sit_below_the_top_of_a_16k_stack_unless_kasan_or_fred(btf):
    regs = btf.sizeof("pt_regs")
    assert syscall_regs_layout(btf, "x86_64", {})["PT_REGS_OFFSET"] == 16384 - regs
    assert syscall_regs_layout(btf, "x86_64", {"CONFIG_KASAN": "y"})["PT_REGS_OFFSET"] == 32768 - regs
    assert syscall_regs_layout(btf, "x86_64", {"CONFIG_X86_FRED": "y"})["PT_REGS_OFFSET"] == 16384 - 16 - regs
    assert syscall_regs_layout(btf, "aarch64", {}) == {}


def test_register_span_covers_the_registers_read(btf):
    out = syscall_regs_layout(btf, "x86_64", {})
    for reg in ("ORIG_AX", "AX", "DX"):
        off = out[f"OFF_PT_REGS_{reg}"]
        assert out["REGS_SPAN_BASE"] <= off and off + 8 <= out["REGS_SPAN_BASE"] + out["REGS_SPAN_LEN"]
    assert out["NR_MMAP"] == 9


def test_running_kernel_config_is_read():
    cfg = kernel_config()
    if not (os.path.exists("/proc/config.gz") or os.path.exists(f"/boot/config-{os.uname().release}")):
        pytest.skip("kernel config not exposed")
    assert cfg.get("CONFIG_BPF") == "y" and cfg.get("CONFIG_BPF_SYSCALL") == "y"

/*
 * The BPF programs of scripts/bench_syscall_tax.py (BCC C, one per build):
 *   -DTAX_SYSCALL_TP  an empty program on the classic syscalls:sys_exit_mmap tracepoint;
 *   -DTAX_ORIG_AX     on_exit reads pt_regs->orig_ax (-DORIG_AX=its offset, from BTF), as
 *                     on_sys_exit's first step did before it became a KLD load (bpf/kfuncs.h);
 *   neither           on_exit returns at once: the least any raw tracepoint hook costs.
 */
#if defined(TAX_SYSCALL_TP)
TRACEPOINT_PROBE(syscalls, sys_exit_mmap) { return 0; }
#elif defined(TAX_ORIG_AX)
int on_exit(struct bpf_raw_tracepoint_args *ctx)
{
	unsigned long nr = 0;

	bpf_probe_read_kernel(&nr, sizeof(nr), (void *)(ctx->args[0] + ORIG_AX));
	if (nr == 9)
		bpf_trace_printk("mmap\n");
	return 0;
}
#else
int on_exit(struct bpf_raw_tracepoint_args *ctx) { return 0; }
#endif

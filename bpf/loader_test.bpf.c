/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The loader's test program (tests/kernel/test_loader.py): one tracepoint,
 * one raw tracepoint and a tail call, counting in a hash map the events of
 * one process only (the tgid user space writes into `target`).
 *
 * counts keys: 1 syscalls:sys_enter_getppid hits, 2 raw task_rename hits,
 * 3 hits of the tail-called program (called from the task_rename one).
 */
#include <uapi/linux/bpf.h>

BPF_HASH(counts, __u32, __u64, 16);
BPF_ARRAY(target, __u32, 1);		/* tgid whose events count; 0: none */
BPF_PERCPU_ARRAY(percpu_hits, __u64, 1);	/* every counted event, per CPU */
BPF_PROG_ARRAY(tail, 1);

static __always_inline int targeted(void)
{
	int zero = 0;
	__u32 *tgid = target.lookup(&zero);

	return tgid && *tgid && *tgid == (__u32)(bpf_get_current_pid_tgid() >> 32);
}

static __always_inline void bump(__u32 key)
{
	int zero = 0;
	__u64 one = 1, *n = counts.lookup(&key), *pc = percpu_hits.lookup(&zero);

	if (n)
		__sync_fetch_and_add(n, 1);
	else
		counts.update(&key, &one);
	if (pc)
		*pc += 1;
}

TRACEPOINT_PROBE(syscalls, sys_enter_getppid)
{
	if (targeted())
		bump(1);
	return 0;
}

int on_task_rename(struct bpf_raw_tracepoint_args *ctx)
{
	if (!targeted())
		return 0;
	bump(2);
	tail.call(ctx, 0);
	return 0;
}

int tail_counted(struct bpf_raw_tracepoint_args *ctx)
{
	bump(3);
	return 0;
}

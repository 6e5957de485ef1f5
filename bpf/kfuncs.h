/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Kernel functions (kfuncs) with BCC as the compiler, and KLD: a kernel
 * struct field read as a load through a BTF pointer.
 *
 * A kfunc is called with src_reg BPF_PSEUDO_KFUNC_CALL and imm the
 * function's vmlinux BTF id, which BCC cannot emit.  So the source calls
 * helper number KFUNC_MAGIC + k, a plain call, and daemon/buildidd/kernel/
 * compiled.py records it as a call of kfunc k (compiled.KFUNCS[k]);
 * kernel/objload.py writes the running kernel's BTF id of that function
 * into it when it loads the program.
 *
 * bpf_rdonly_cast(obj, btf_id) (kernel/bpf/helpers.c, Linux 6.2) gives obj
 * the type "untrusted pointer to vmlinux BTF type btf_id".  The verifier
 * walks each load through it in that type's BTF layout (the running
 * kernel's, never the headers'): a load of a pointer member must be the
 * member, whole, and gives another such pointer (to a struct) or memory; a
 * load of a scalar is not held to the member's size (for an untrusted
 * pointer the verifier skips that check), so the widths are checked by
 * tests/kernel/test_tracer_layout.py against BTF.  Each load becomes a
 * fault-safe load (BPF_PROBE_MEM: a bad address reads 0), and the call
 * itself a register move: a load, where bpf_probe_read_kernel is a helper
 * call per field.
 *
 * KLD(p, T, off, type): the `type` at byte off of the struct at kernel
 * address p, whose vmlinux BTF id is BTF_ID_<T> (-D from tracer.py), off a
 * constant (the verifier refuses a variable offset into a BTF pointer).
 * Compiled with -DNO_KFUNCS (a kernel without bpf_rdonly_cast or without a
 * BTF id it needs) it is a bpf_probe_read_kernel of the same bytes: one
 * helper call per field, slower than KLD (scripts/bench_kernel_ns.py
 * --no-kfuncs measures by how much).
 */
#ifndef BUILDIDD_KFUNCS_H
#define BUILDIDD_KFUNCS_H

/*
 * KFUNC_MAGIC (no helper has a number near it) and KFUNC_<name>, k of each
 * kfunc, come from compiled.py as -D flags (LoadSpec.compile_flags).
 */

#ifndef NO_KFUNCS
static void *(*bpf_rdonly_cast_)(const void *obj, __u32 btf_id) =
	(void *)(KFUNC_MAGIC + KFUNC_bpf_rdonly_cast);

#define KLD(p, T, off, type) \
	(*(const type *)((const char *)bpf_rdonly_cast_((const void *)(p), BTF_ID_##T) + (off)))
#else
#define KLD(p, T, off, type) ({						\
	type __kld_v = 0;						\
	bpf_probe_read_kernel(&__kld_v, sizeof(__kld_v),		\
			      (const char *)(p) + (off));		\
	__kld_v;							\
})
#endif

#endif /* BUILDIDD_KFUNCS_H */

/* SPDX-License-Identifier: GPL-2.0 */
/*
 * bpf_loop(2) callbacks with BCC as the compiler.
 *
 * bpf_loop (Linux 5.17) runs a callback nr_loops times, and the verifier
 * checks the callback's body once, where a bounded loop is followed
 * iteration by iteration (a 1024-step path walk cost some 220,000
 * instructions of verification in each program that held one).  The callback
 * is named by an LD_IMM64 of its address with src_reg BPF_PSEUDO_FUNC, a
 * relocation BCC does not make.  So a program loads BPF_CALLBACK(k), a plain
 * 64-bit constant, and daemon/buildidd/kernel/compiled.py links callback k in
 * its place: it appends the callback's instructions (BCC compiles a callback,
 * a non-static function, as a function of its own) and turns the constant
 * into a BPF_PSEUDO_FUNC load of them; kernel/objload.py gives the verifier
 * the BTF func_info it requires.  k is LoadSpec.callbacks' index of the
 * callback, passed as -DCALLBACK_<function>=k.
 *
 * Kernel requirements: bpf_loop (5.17), and the BPF JIT for a program that
 * has both a callback and a tail call (exec_vmas, on_sched_process_exec):
 * the verifier refuses that mix to the interpreter ("tail_calls are not
 * allowed in programs with bpf-to-bpf calls"); x86_64 and arm64 JIT it
 * (this project's kernels: CONFIG_BPF_JIT_ALWAYS_ON).
 *
 * A callback takes one argument, the iteration (BCC treats the first
 * argument of a non-static function as its context, and would rewrite any
 * other), so it finds its state in a per-CPU map, and returns 0 to go on, 1
 * to stop.
 */
#ifndef BUILDIDD_CALLBACKS_H
#define BUILDIDD_CALLBACKS_H

/* The upper half is CALLBACK_MAGIC of kernel/compiled.py. */
#define BPF_CALLBACK(k) ((void *)(0xB1DDCA1100000000ULL | (k)))

#endif /* BUILDIDD_CALLBACKS_H */

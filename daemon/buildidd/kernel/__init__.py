"""kernel: everything that talks to the kernel.

The BTF reader and the offset table built from it (btf, layout.kernel_layout),
the BCC loader that compiles, loads and attaches bpf/buildidd.bpf.c (tracer),
the child that runs BCC and hands over fds (loader), the programs kept pinned
in bpffs across restarts (pinned), bpf(2) map access (bpfsys), the one ctypes
mirror of bpf/events.h and the decoder of raw records (events), the running
processes' mappings read by the task_vma iterator (synth), a file's
statfs type (fsinfo), and scheduling knobs for our own threads (sched).

May import: the shared modules (config, errors, clock, memo) only.
"""

/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The page-cache reader's start-up program (daemon/buildidd/kernel/pagecache.py)
 * and its tests (tests/kernel/test_pagecache.py): it serves requests of its own
 * process only, one at a time.
 *
 * A request is written to pc_request, then triggered by the requester's own
 * posix_fadvise(fd, PC_TRIGGER_OFFSET, 0, PC_TRIGGER_ADVICE): an advice value
 * the kernel rejects with EINVAL after the syscall tracepoint fired, so the
 * call has no effect.  The answer is in pc_reply when the call returns.
 *
 * Needs, besides pagecache.h's macros: OFF_TASK_STRUCT_FILES,
 * OFF_FILES_STRUCT_FDT, OFF_FDTABLE_MAX_FDS, OFF_FDTABLE_FD, OFF_FILE_F_INODE,
 * OFF_INODE_I_SIZE, PC_TRIGGER_OFFSET, PC_TRIGGER_ADVICE.
 */
#include "pagecache.h"

enum pc_op {
	PC_OP_FOLIO = 1,	/* the folio holding page `index` of fd: raw walk, no bases needed */
	PC_OP_READ = 2,		/* `len` bytes of kernel memory at `addr` */
	PC_OP_BUILD_ID = 3,	/* pagecache_build_id() of fd */
	PC_OP_FILE = 4,		/* fd -> file and size only: the baseline of a cost measurement */
};

#define PC_READ_MAX 4096

struct pc_request {
	__u32 tgid;		/* requests of this process only */
	__u32 op;		/* enum pc_op */
	__u64 index;		/* PC_OP_FOLIO: file page index */
	__u64 addr;		/* PC_OP_READ: kernel address */
	__u32 len;		/* PC_OP_READ: bytes, at most PC_READ_MAX */
	__u32 _pad;
};

struct pc_reply {
	__s64 err;		/* 0, or a negative errno: -EBADF (no such fd), -EFAULT (read failed) */
	__u64 seq;		/* requests served so far */
	__u64 file;		/* struct file * of fd */
	__u64 mapping;		/* file->f_mapping */
	__u64 size;		/* file->f_inode->i_size, bytes */
	__u64 folio;		/* PC_OP_FOLIO: the folio, 0 when the page is not cached */
	__u64 folio_mapping;	/* folio->mapping */
	__u64 folio_index;	/* folio->index */
	__u64 folio_flags;	/* folio->flags */
	__u64 folio_flags_1;	/* folio->_flags_1 (order in its low byte when PG_head) */
	struct pagecache_build_id bid;	/* PC_OP_BUILD_ID */
	__u8 data[PC_READ_MAX];	/* PC_OP_READ */
};

BPF_ARRAY(pagecache_bases, struct pagecache_bases, 1);
BPF_PERCPU_ARRAY(pagecache_scratch, struct pc_scratch, 1);
BPF_ARRAY(pc_request, struct pc_request, 1);
BPF_ARRAY(pc_reply, struct pc_reply, 1);

/* The page-cache walk's step, a bpf_loop callback (bpf/callbacks.h; kernel/pagecache.py). */
int pc_step_probe(__u32 i)
{
	__u32 zero = 0;
	struct pc_scratch *s = pagecache_scratch.lookup(&zero);
	struct pagecache_bases *b = pagecache_bases.lookup(&zero);

	return s && b ? pc_step(s, b) : 1;
}

/* current->files->fdt->fd[fd], or NULL (fs/file.c files_lookup_fd_raw). */
static __always_inline const void *pc_fd_file(__u64 fd)
{
	const void *task = (const void *)bpf_get_current_task();
	const void *files = (const void *)pc_rd64(PC_AT(task, OFF_TASK_STRUCT_FILES));
	const void *fdt, *fds;
	__u32 max_fds = 0;

	if (!files)
		return NULL;
	fdt = (const void *)pc_rd64(PC_AT(files, OFF_FILES_STRUCT_FDT));
	if (!fdt || bpf_probe_read_kernel(&max_fds, sizeof(max_fds), PC_AT(fdt, OFF_FDTABLE_MAX_FDS)))
		return NULL;
	if (fd >= max_fds)
		return NULL;
	fds = (const void *)pc_rd64(PC_AT(fdt, OFF_FDTABLE_FD));
	return fds ? (const void *)pc_rd64(PC_AT(fds, fd * 8)) : NULL;
}

TRACEPOINT_PROBE(syscalls, sys_enter_fadvise64)
{
	struct pc_request *req;
	struct pc_reply *rep;
	const void *file, *inode;
	__u32 zero = 0;
	int retry = 0;

	if ((__s64)args->offset != PC_TRIGGER_OFFSET || (__s64)args->advice != PC_TRIGGER_ADVICE)
		return 0;
	req = pc_request.lookup(&zero);
	rep = pc_reply.lookup(&zero);
	if (!req || !rep || req->tgid != bpf_get_current_pid_tgid() >> 32)
		return 0;
	rep->seq += 1;
	rep->err = 0;
	if (req->op == PC_OP_READ) {
		__u32 len = req->len;

		if (len > PC_READ_MAX || bpf_probe_read_kernel(rep->data, len, (const void *)req->addr))
			rep->err = -14;		/* EFAULT */
		return 0;
	}
	file = pc_fd_file((__u64)args->fd);
	if (!file) {
		rep->err = -9;			/* EBADF */
		return 0;
	}
	rep->file = (__u64)file;
	rep->mapping = pc_rd64(PC_AT(file, OFF_FILE_F_MAPPING));
	inode = (const void *)pc_rd64(PC_AT(file, OFF_FILE_F_INODE));
	rep->size = inode ? pc_rd64(PC_AT(inode, OFF_INODE_I_SIZE)) : 0;
	if (req->op == PC_OP_FOLIO) {
		__u64 folio = pc_xa_load((const void *)rep->mapping, req->index, &retry);

		rep->folio = folio;
		rep->folio_mapping = folio ? pc_rd64(PC_AT(folio, OFF_FOLIO_MAPPING)) : 0;
		rep->folio_index = folio ? pc_rd64(PC_AT(folio, OFF_FOLIO_INDEX)) : 0;
		rep->folio_flags = folio ? pc_rd64(PC_AT(folio, OFF_FOLIO_FLAGS)) : 0;
		rep->folio_flags_1 = folio ? pc_rd64(PC_AT(folio, OFF_FOLIO_FLAGS_1)) : 0;
		if (retry)
			rep->err = -11;		/* EAGAIN */
		return 0;
	}
#ifndef PC_NO_BUILD_ID
	if (req->op == PC_OP_BUILD_ID)
		pagecache_build_id((const void *)rep->mapping, rep->size, &rep->bid, pagecache_scratch.lookup(&zero),
				   pagecache_bases.lookup(&zero), BPF_CALLBACK(CALLBACK_pc_step_probe));
#endif
	return 0;
}

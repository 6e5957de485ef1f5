/* SPDX-License-Identifier: GPL-2.0 */
/*
 * buildidd kernel side: one program per hook, each named after where it attaches.
 *
 * Every kernel struct field is read with bpf_probe_read_kernel() at an offset
 * that user space took from /sys/kernel/btf/vmlinux at start-up and passes in
 * as -DOFF_<STRUCT>_<FIELD>=N (see daemon/buildidd/tracer.py).  Nothing here
 * dereferences a kernel struct through a header type: the installed headers may
 * describe another kernel release.
 *
 * Events go to one BPF ring buffer without wake-ups; user space consumes it every
 * few milliseconds.  What cannot be delivered is counted per cause in "drops".
 */
#include "events.h"

#define PROT_EXEC	0x4
#define MAP_SHARED	0x01
#define MAP_PRIVATE	0x02
#define MAP_ANONYMOUS	0x20
/* vm_area_struct.vm_flags bits, include/linux/mm.h (stable since 2.6) */
#define VM_READ		0x1
#define VM_WRITE	0x2
#define VM_EXEC		0x4
#define VM_SHARED	0x8

/* include/uapi/linux/auxvec.h */
#define AT_NULL		0
#define AT_PHDR		3
#define AT_BASE		7
#define AT_ENTRY	9

#define PATH_MASK	(BUILDIDD_PATH_MAX - 1)
#define NAME_MASK	255		/* a dentry name is at most NAME_MAX (255) bytes */
#ifndef PATH_MAX_DEPTH
#define PATH_MAX_DEPTH	32		/* dentries walked per path */
#endif
#ifndef MAPLE_MAX_DEPTH
#define MAPLE_MAX_DEPTH	8		/* maple tree levels walked */
#endif
#define MAPLE_MAX_PIVOTS 16
#ifndef EXEC_MAX_VMAS
#define EXEC_MAX_VMAS	8
#endif		/* VMAs of one file walked after execve */

#define MAPLE_NODE_MASK	0xffULL		/* lib/maple_tree.c: MAPLE_NODE_MASK */

#ifndef PAGE_SHIFT
#define PAGE_SHIFT 12
#endif
#ifndef RINGBUF_PAGES
#define RINGBUF_PAGES 4096
#endif
#ifndef KNOWN_IDS_MAX
#define KNOWN_IDS_MAX 65536
#endif

struct pending_mprotect {
	__u64 start;
	__u64 len;
	__u32 prot;
	__u32 _pad;
};

struct map_scratch {
	struct map_event ev;
	/* read_path's walk state */
	const void *w_dentry, *w_mnt, *w_root;
	__u32 w_off, w_done;
	char buf[2 * BUILDIDD_PATH_MAX];	/* path assembled backwards from its end */
};

struct exec_scratch {
	struct exec_event ev;
	__u64 auxv[AUXV_LEN];
};

/*
 * One ring buffer per CPU (CPUs share one when there are more than 8): on
 * Linux 6.18, reservations in a ring that several CPUs produce into fail now
 * and then even when it is nearly empty (its lock is an rqspinlock since 6.15,
 * which can give up).  User space merges the rings by time.
 */
#ifndef NRINGS
#define NRINGS 1
#endif
BPF_RINGBUF_OUTPUT(events0, RINGBUF_PAGES);
#if NRINGS > 1
BPF_RINGBUF_OUTPUT(events1, RINGBUF_PAGES);
#endif
#if NRINGS > 2
BPF_RINGBUF_OUTPUT(events2, RINGBUF_PAGES);
#endif
#if NRINGS > 3
BPF_RINGBUF_OUTPUT(events3, RINGBUF_PAGES);
#endif
#if NRINGS > 4
BPF_RINGBUF_OUTPUT(events4, RINGBUF_PAGES);
#endif
#if NRINGS > 5
BPF_RINGBUF_OUTPUT(events5, RINGBUF_PAGES);
#endif
#if NRINGS > 6
BPF_RINGBUF_OUTPUT(events6, RINGBUF_PAGES);
#endif
#if NRINGS > 7
BPF_RINGBUF_OUTPUT(events7, RINGBUF_PAGES);
#endif
BPF_PERCPU_ARRAY(drops, __u64, BUILDIDD_DROP_NCAUSES);
BPF_PERCPU_ARRAY(drop_times, struct drop_time, 1);
BPF_PERCPU_ARRAY(map_scratch, struct map_scratch, 1);
BPF_PERCPU_ARRAY(exec_scratch, struct exec_scratch, 1);
BPF_HASH(pending_mprotect, __u32, struct pending_mprotect, 16384);
BPF_HASH(known_ids, struct known_key, struct known_value, KNOWN_IDS_MAX);

#define AT(base, off) ((const void *)((const char *)(base) + (off)))

static __always_inline __u64 rd64(const void *p)
{
	__u64 v = 0;

	bpf_probe_read_kernel(&v, sizeof(v), p);
	return v;
}

static __always_inline __u32 rd32(const void *p)
{
	__u32 v = 0;

	bpf_probe_read_kernel(&v, sizeof(v), p);
	return v;
}

static __always_inline const void *rdptr(const void *p)
{
	return (const void *)rd64(p);
}

static __always_inline void count_drop(__u32 cause);

static __always_inline long ring_output(void *data, __u64 size)
{
	switch (bpf_get_smp_processor_id() % NRINGS) {
#if NRINGS > 1
	case 1: return events1.ringbuf_output(data, size, BPF_RB_NO_WAKEUP);
#endif
#if NRINGS > 2
	case 2: return events2.ringbuf_output(data, size, BPF_RB_NO_WAKEUP);
#endif
#if NRINGS > 3
	case 3: return events3.ringbuf_output(data, size, BPF_RB_NO_WAKEUP);
#endif
#if NRINGS > 4
	case 4: return events4.ringbuf_output(data, size, BPF_RB_NO_WAKEUP);
#endif
#if NRINGS > 5
	case 5: return events5.ringbuf_output(data, size, BPF_RB_NO_WAKEUP);
#endif
#if NRINGS > 6
	case 6: return events6.ringbuf_output(data, size, BPF_RB_NO_WAKEUP);
#endif
#if NRINGS > 7
	case 7: return events7.ringbuf_output(data, size, BPF_RB_NO_WAKEUP);
#endif
	default: return events0.ringbuf_output(data, size, BPF_RB_NO_WAKEUP);
	}
}

/*
 * Output to this CPU's ring, retried: a reservation on 6.18 sometimes fails
 * for a few consecutive attempts (~0.5 µs each) with the ring nearly empty.
 * Measured over 20 s of mixed storms on 2 CPUs: one shared ring lost 7 events
 * even with 16 tries; one ring per CPU lost 73 with 4 tries, 0-1 with 16.  A
 * full ring fails every try: only then is the event counted as dropped.
 */
#define OUTPUT_TRIES 64

static __always_inline void output_event(void *data, __u64 size)
{
	int i;

	for (i = 0; i < OUTPUT_TRIES; i++) {
		if (!ring_output(data, size))
			return;
	}
	count_drop(BUILDIDD_DROP_RINGBUF_FULL);
}

static __always_inline void count_drop(__u32 cause)
{
	__u64 *n = drops.lookup(&cause);
	__u32 zero = 0;
	struct drop_time *t;
	__u64 now;

	if (n)
		*n += 1;
	t = drop_times.lookup(&zero);
	if (t) {
		now = bpf_ktime_get_boot_ns();
		if (!t->first_ns)
			t->first_ns = now;
		t->last_ns = now;
	}
}

static __always_inline void fill_header(struct event_header *h, __u32 type)
{
	__u64 id = bpf_get_current_pid_tgid();

	h->type = type;
	h->pid = id >> 32;
	h->tid = (__u32)id;
	h->_pad0 = 0;
	h->time_ns = bpf_ktime_get_boot_ns();
	bpf_get_current_comm(h->comm, sizeof(h->comm));
}

static __always_inline void fill_task_header(struct event_header *h, __u32 type,
					     const void *task)
{
	h->type = type;
	h->pid = rd32(AT(task, OFF_TASK_STRUCT_TGID));
	h->tid = rd32(AT(task, OFF_TASK_STRUCT_PID));
	h->_pad0 = 0;
	h->time_ns = bpf_ktime_get_boot_ns();
	bpf_probe_read_kernel(h->comm, sizeof(h->comm), AT(task, OFF_TASK_STRUCT_COMM));
}

/*
 * Identity of file->f_inode, as stat(2) would report it.  The inode fields
 * lie within INODE_SPAN_LEN bytes from INODE_SPAN_BASE (computed from BTF by
 * tracer.py), so one probe read fetches them all.
 */
#define INODE_FIELD(buf, off, type) (*(type *)((buf) + (off) - INODE_SPAN_BASE))

static __always_inline int read_file_id(const void *file, struct file_id *id)
{
	const void *inode = rdptr(AT(file, OFF_FILE_F_INODE));
	__u8 buf[INODE_SPAN_LEN];
	const void *sb;

	if (!inode || bpf_probe_read_kernel(buf, sizeof(buf), AT(inode, INODE_SPAN_BASE)))
		return -1;
	id->ino = INODE_FIELD(buf, OFF_INODE_I_INO, __u64);
	id->size = INODE_FIELD(buf, OFF_INODE_I_SIZE, __u64);
	id->mtime_sec = INODE_FIELD(buf, OFF_INODE_I_MTIME_SEC, __s64);
	id->mtime_nsec = INODE_FIELD(buf, OFF_INODE_I_MTIME_NSEC, __u32);
	id->generation = INODE_FIELD(buf, OFF_INODE_I_GENERATION, __u32);
	id->nlink = INODE_FIELD(buf, OFF_INODE_I_NLINK, __u32);
	sb = INODE_FIELD(buf, OFF_INODE_I_SB, const void *);
	id->dev = sb ? rd32(AT(sb, OFF_SUPER_BLOCK_S_DEV)) : 0;
	return 0;
}

/* True when user space already resolved this identity (then no path is sent). */
static __always_inline int identity_known(const struct file_id *id)
{
	struct known_key key = {
		.ino = id->ino, .dev = id->dev, .generation = id->generation,
	};
	struct known_value *v = known_ids.lookup(&key);

	return v && v->size == id->size && v->mtime_sec == id->mtime_sec &&
	       v->mtime_nsec == id->mtime_nsec;
}

/*
 * The path of file->f_path in its mount namespace, assembled backwards into
 * s->buf[0..BUILDIDD_PATH_MAX) by walking dentry->d_parent and, at a mount's
 * root, struct mount->mnt_mountpoint (what d_path() does, fs/d_path.c).
 * Returns the offset in s->buf where the path starts; it ends at
 * BUILDIDD_PATH_MAX.
 *
 * The walk keeps its state in the per-CPU scratch value, not in registers:
 * reloaded from memory each iteration, the state looks the same to the
 * verifier at every loop head, so it verifies in linear rather than
 * exponential time in PATH_MAX_DEPTH.
 */
static __always_inline __u32 read_path(const void *file, struct map_scratch *s, __u32 *flags)
{
	const void *vfsmnt = rdptr(AT(file, OFF_FILE_F_PATH_MNT));
	int i;

	s->w_dentry = rdptr(AT(file, OFF_FILE_F_PATH_DENTRY));
	s->w_mnt = AT(vfsmnt, -OFF_MOUNT_MNT);
	s->w_root = rdptr(AT(vfsmnt, OFF_VFSMOUNT_MNT_ROOT));
	s->w_off = BUILDIDD_PATH_MAX;
	s->w_done = 0;
	for (i = 0; i < PATH_MAX_DEPTH; i++) {
		const void *dentry = s->w_dentry, *mnt = s->w_mnt;
		const void *parent, *name;
		__u32 len, off;

		if (s->w_done)
			break;
		if (dentry == s->w_root) {
			const void *mparent = rdptr(AT(mnt, OFF_MOUNT_MNT_PARENT));

			if (!mparent || mparent == mnt) {
				s->w_done = 1;
				continue;
			}
			s->w_dentry = rdptr(AT(mnt, OFF_MOUNT_MNT_MOUNTPOINT));
			s->w_mnt = mparent;
			s->w_root = rdptr(AT(mparent, OFF_MOUNT_MNT + OFF_VFSMOUNT_MNT_ROOT));
			continue;
		}
		parent = rdptr(AT(dentry, OFF_DENTRY_D_PARENT));
		if (!parent) {
			s->w_done = 1;
			continue;
		}
		/*
		 * A root dentry that is not its mount's root: a pseudo file
		 * (memfd, anon inode: alloc_file_pseudo) or a disconnected
		 * dentry.  Its own name is the path, as d_path() shows
		 * "/memfd:NAME (deleted)"; then the walk ends.
		 */
		if (parent == dentry)
			s->w_done = 1;
		len = rd32(AT(dentry, OFF_DENTRY_D_NAME_LEN)) & NAME_MASK;
		name = rdptr(AT(dentry, OFF_DENTRY_D_NAME_NAME));
		off = s->w_off;
		if (len + 1 >= off || off > BUILDIDD_PATH_MAX) {
			*flags |= BUILDIDD_PATH_TRUNCATED;
			s->w_done = 1;
			continue;
		}
		off -= len;
		bpf_probe_read_kernel(s->buf + (off & PATH_MASK), len, name);
		off -= 1;
		s->buf[off & PATH_MASK] = '/';
		s->w_off = off;
		s->w_dentry = parent;
	}
	if (!s->w_done)
		*flags |= BUILDIDD_PATH_UNREACHABLE;
	if (s->w_off >= BUILDIDD_PATH_MAX) {
		s->w_off = BUILDIDD_PATH_MAX - 1;
		s->buf[(BUILDIDD_PATH_MAX - 1) & PATH_MASK] = '/';
	}
	return s->w_off;
}

/*
 * The VMA of mm covering addr, or NULL: the lookup walk of lib/maple_tree.c
 * (mtree_lookup_walk) over mm->mm_mt, with node layouts from BTF.  With
 * or_next, an addr in a gap yields the VMA right after the gap when the same
 * leaf holds it (the exec walk crosses the gaps between an ELF file's
 * segments, e.g. binaries linked with -z max-page-size=0x200000).
 */
static __always_inline const void *find_vma_in(const void *mm, __u64 addr, int or_next)
{
	__u64 entry = rd64(AT(mm, OFF_MM_STRUCT_MM_MT + OFF_MAPLE_TREE_MA_ROOT));
	__u64 pivots[MAPLE_MAX_PIVOTS];
	int depth;

	/* A root that is a node carries the internal-node bits (xa_is_node). */
	if ((entry & 3) != 2)
		return NULL;
	for (depth = 0; depth < MAPLE_MAX_DEPTH; depth++) {
		const void *node = (const void *)(entry & ~MAPLE_NODE_MASK);
		__u32 type = (entry >> 3) & 0xf;
		__u32 npivots, pivot_off, slot_off, i, idx;

		if (type == MAPLE_ARANGE_64) {
			npivots = MA64_NPIVOTS;
			pivot_off = OFF_MAPLE_ARANGE_64_PIVOT;
			slot_off = OFF_MAPLE_ARANGE_64_SLOT;
		} else if (type == MAPLE_RANGE_64 || type == MAPLE_LEAF_64) {
			npivots = MR64_NPIVOTS;
			pivot_off = OFF_MAPLE_RANGE_64_PIVOT;
			slot_off = OFF_MAPLE_RANGE_64_SLOT;
		} else {
			return NULL;
		}
		if (bpf_probe_read_kernel(pivots, MR64_NPIVOTS * sizeof(__u64),
					  AT(node, pivot_off)))
			return NULL;
		/*
		 * The first pivot >= addr selects the slot; none does: the last slot.
		 * Unrolled so that pivots[] is indexed by constants only: a variable
		 * stack index would make the verifier track every value of i and
		 * explode across tree levels.
		 */
		idx = npivots;
#pragma unroll
		for (i = 0; i < MR64_NPIVOTS; i++) {
			if (idx == npivots && i < npivots && pivots[i] >= addr)
				idx = i;
		}
		entry = rd64(AT(node, slot_off + (idx & (MAPLE_MAX_PIVOTS - 1)) * 8));
		if (!entry && or_next && type == MAPLE_LEAF_64 && idx < npivots)
			entry = rd64(AT(node, slot_off + ((idx + 1) & (MAPLE_MAX_PIVOTS - 1)) * 8));
		if (!entry)
			return NULL;
		if (type == MAPLE_LEAF_64) {
			const void *vma = (const void *)entry;

			if ((!or_next && rd64(AT(vma, OFF_VM_AREA_STRUCT_VM_START)) > addr) ||
			    rd64(AT(vma, OFF_VM_AREA_STRUCT_VM_END)) <= addr)
				return NULL;
			return vma;
		}
	}
	return NULL;
}

static __always_inline const void *find_vma(const void *mm, __u64 addr)
{
	return find_vma_in(mm, addr, 0);
}

/*
 * Fills ev's identity and path for file (path only when the identity is not
 * known yet).  Returns the number of path bytes, or -1 if the file is unreadable.
 */
static __always_inline int prepare_map_event(struct map_scratch *s, const void *file)
{
	struct map_event *ev = &s->ev;
	__u32 off, plen;

	ev->id_flags = 0;
	ev->path_len = 0;
	if (read_file_id(file, &ev->file))
		return -1;
	if (identity_known(&ev->file)) {
		ev->id_flags |= BUILDIDD_ID_KNOWN;
		return 0;
	}
	off = read_path(file, s, &ev->id_flags);
	plen = (BUILDIDD_PATH_MAX - off) & PATH_MASK;
	bpf_probe_read_kernel(ev->path, plen, s->buf + (off & PATH_MASK));
	ev->path_len = plen;
	return plen;
}

static __always_inline void submit_map_event(struct map_scratch *s)
{
	__u32 size = offsetof(struct map_event, path) + (s->ev.path_len & PATH_MASK);

	output_event(&s->ev, size);
}

static __always_inline __u32 vm_flags_to_prot(__u64 vm_flags)
{
	return vm_flags & (VM_READ | VM_WRITE | VM_EXEC);	/* same bits as PROT_* */
}

static __always_inline __u32 vm_flags_to_map(__u64 vm_flags)
{
	return (vm_flags & VM_SHARED) ? MAP_SHARED : MAP_PRIVATE;
}

/*
 * mmap(2): everything is read from the new VMA at syscall exit, as perf's
 * PERF_RECORD_MMAP2 does (vm_start, vm_end - vm_start, vm_pgoff, vm_flags):
 * no state between enter and exit, and the file is the one actually mapped.
 */
TRACEPOINT_PROBE(syscalls, sys_exit_mmap)
{
	struct map_scratch *s;
	const void *task, *mm, *vma, *file;
	__u64 ret = (__u64)args->ret, vm_start, vm_end, vm_flags;
	__u32 zero = 0;

	if (ret >= (__u64)-4095)	/* IS_ERR_VALUE: the mmap failed */
		return 0;
	task = (const void *)bpf_get_current_task();
	mm = rdptr(AT(task, OFF_TASK_STRUCT_MM));
	vma = mm ? find_vma(mm, ret) : NULL;
	if (!vma) {
		count_drop(BUILDIDD_DROP_NO_VMA);
		return 0;
	}
	vm_flags = rd64(AT(vma, OFF_VM_AREA_STRUCT_VM_FLAGS));
	if (!(vm_flags & VM_EXEC))
		return 0;
	file = rdptr(AT(vma, OFF_VM_AREA_STRUCT_VM_FILE));
	if (!file)
		return 0;
	vm_start = rd64(AT(vma, OFF_VM_AREA_STRUCT_VM_START));
	vm_end = rd64(AT(vma, OFF_VM_AREA_STRUCT_VM_END));
	s = map_scratch.lookup(&zero);
	if (!s)
		return 0;
	fill_header(&s->ev.hdr, BUILDIDD_EV_MAP);
	s->ev.start = vm_start;
	s->ev.len = vm_end - vm_start;
	s->ev.pgoff = rd64(AT(vma, OFF_VM_AREA_STRUCT_VM_PGOFF)) << PAGE_SHIFT;
	s->ev.prot = vm_flags_to_prot(vm_flags);
	s->ev.flags = vm_flags_to_map(vm_flags);
	s->ev.origin = BUILDIDD_ORIGIN_MMAP;
	if (prepare_map_event(s, file) < 0) {
		count_drop(BUILDIDD_DROP_READ_FAILED);
		return 0;
	}
	submit_map_event(s);
	return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_mprotect)
{
	struct pending_mprotect p = {};
	const void *task, *mm, *vma;
	__u32 tid;

	if (!(args->prot & PROT_EXEC))
		return 0;
	task = (const void *)bpf_get_current_task();
	mm = rdptr(AT(task, OFF_TASK_STRUCT_MM));
	vma = mm ? find_vma(mm, args->start) : NULL;
	/* Only a file mapping that is not executable yet becomes a new exec mapping. */
	if (!vma || !rdptr(AT(vma, OFF_VM_AREA_STRUCT_VM_FILE)) ||
	    (rd64(AT(vma, OFF_VM_AREA_STRUCT_VM_FLAGS)) & VM_EXEC))
		return 0;
	tid = (__u32)bpf_get_current_pid_tgid();
	p.start = args->start;
	p.len = args->len;
	p.prot = args->prot;
	if (pending_mprotect.update(&tid, &p))
		count_drop(BUILDIDD_DROP_PENDING_FULL);
	return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_mprotect)
{
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	struct pending_mprotect *pp = pending_mprotect.lookup(&tid);
	struct pending_mprotect p;
	struct map_scratch *s;
	const void *task, *mm, *vma, *file;
	__u64 vm_start, vm_pgoff, vm_flags;
	__u32 zero = 0;

	if (!pp)
		return 0;
	p = *pp;
	pending_mprotect.delete(&tid);
	if (args->ret != 0)
		return 0;
	task = (const void *)bpf_get_current_task();
	mm = rdptr(AT(task, OFF_TASK_STRUCT_MM));
	vma = mm ? find_vma(mm, p.start) : NULL;
	file = vma ? rdptr(AT(vma, OFF_VM_AREA_STRUCT_VM_FILE)) : NULL;
	if (!file) {
		count_drop(BUILDIDD_DROP_NO_VMA);
		return 0;
	}
	vm_start = rd64(AT(vma, OFF_VM_AREA_STRUCT_VM_START));
	vm_pgoff = rd64(AT(vma, OFF_VM_AREA_STRUCT_VM_PGOFF));
	vm_flags = rd64(AT(vma, OFF_VM_AREA_STRUCT_VM_FLAGS));
	s = map_scratch.lookup(&zero);
	if (!s)
		return 0;
	fill_header(&s->ev.hdr, BUILDIDD_EV_MAP);
	s->ev.start = p.start;
	s->ev.len = p.len;
	s->ev.pgoff = (vm_pgoff << PAGE_SHIFT) + (p.start - vm_start);
	s->ev.prot = p.prot;
	s->ev.flags = vm_flags_to_map(vm_flags);
	s->ev.origin = BUILDIDD_ORIGIN_MPROTECT;
	if (prepare_map_event(s, file) < 0) {
		count_drop(BUILDIDD_DROP_READ_FAILED);
		return 0;
	}
	submit_map_event(s);
	return 0;
}

/*
 * After execve the new mm holds the executable's and the interpreter's
 * segments, mapped by the kernel itself (fs/binfmt_elf.c), not through mmap(2).
 * exec_vmas walks them, one VMA per (tail) call so that each call verifies as
 * a small program: starting at the VMA holding AT_PHDR (then AT_BASE), it
 * emits every executable VMA of that same struct file among the next
 * EXEC_MAX_VMAS VMAs.  Its state lives in exec_stages between calls.
 */
struct exec_stage {
	const void *mm;
	__u64 addr[2];		/* AT_PHDR (or AT_ENTRY), AT_BASE; 0: none */
	__u32 k;		/* index into addr of the file being walked */
	__u32 remaining;	/* VMAs left to look at for this file */
	const void *file;	/* the file being walked; NULL: start file k */
	__u64 cur;		/* address of the next VMA to look at */
};

BPF_PERCPU_ARRAY(exec_stages, struct exec_stage, 1);
/* Slot 0: exec_vmas.  A tail call gives each file walk its own verifier budget. */
BPF_PROG_ARRAY(exec_tail, 1);

/* Attached by tracer.py to the raw tracepoint sched_process_exec. */
int on_sched_process_exec(struct bpf_raw_tracepoint_args *ctx)
{
	/* TP_PROTO(struct task_struct *p, pid_t old_pid, struct linux_binprm *bprm) */
	const void *task = (const void *)ctx->args[0];
	const void *bprm = (const void *)ctx->args[2];
	const void *file, *mm, *filename;
	struct exec_scratch *s;
	struct exec_stage *st;
	__u64 at_phdr = 0, at_base = 0, at_entry = 0;
	__u32 zero = 0, size;
	int i, n;

	s = exec_scratch.lookup(&zero);
	st = exec_stages.lookup(&zero);
	if (!s || !st)
		return 0;
	fill_header(&s->ev.hdr, BUILDIDD_EV_EXEC);
	s->ev.old_pid = (__u32)ctx->args[1];
	s->ev.id_flags = 0;
	file = rdptr(AT(bprm, OFF_LINUX_BINPRM_FILE));
	if (!file || read_file_id(file, &s->ev.file)) {
		count_drop(BUILDIDD_DROP_READ_FAILED);
		return 0;
	}
	filename = rdptr(AT(bprm, OFF_LINUX_BINPRM_FILENAME));
	n = bpf_probe_read_kernel_str(s->ev.path, sizeof(s->ev.path), filename);
	s->ev.path_len = n > 0 ? n - 1 : 0;
	size = offsetof(struct exec_event, path) + (s->ev.path_len & PATH_MASK);
	output_event(&s->ev, size);

	mm = rdptr(AT(task, OFF_TASK_STRUCT_MM));
	if (!mm || bpf_probe_read_kernel(s->auxv, sizeof(s->auxv),
					 AT(mm, OFF_MM_STRUCT_SAVED_AUXV))) {
		count_drop(BUILDIDD_DROP_READ_FAILED);
		return 0;
	}
	for (i = 0; i + 1 < AUXV_LEN; i += 2) {
		__u64 type = s->auxv[i], val = s->auxv[i + 1];

		if (type == AT_NULL)
			break;
		if (type == AT_PHDR)
			at_phdr = val;
		else if (type == AT_BASE)
			at_base = val;
		else if (type == AT_ENTRY)
			at_entry = val;
	}
	st->mm = mm;
	st->addr[0] = at_phdr ? at_phdr : at_entry;
	st->addr[1] = at_base;
	st->k = 0;
	st->file = NULL;
	exec_tail.call(ctx, 0);
	count_drop(BUILDIDD_DROP_READ_FAILED);	/* the tail call failed */
	return 0;
}

/* Tail-called from sched_process_exec, then from itself: one VMA per call. */
int exec_vmas(struct bpf_raw_tracepoint_args *ctx)
{
	struct exec_stage *st;
	struct map_scratch *s;
	const void *vma, *file;
	__u64 vm_start, vm_end, vm_flags;
	__u32 zero = 0, k;

	st = exec_stages.lookup(&zero);
	s = map_scratch.lookup(&zero);
	if (!st || !s)
		return 0;
	k = st->k;
	if (k >= 2)
		return 0;
	if (!st->file) {
		/* Start walking file k: the one mapped at addr[k]. */
		__u64 addr = st->addr[k & 1];

		vma = addr ? find_vma(st->mm, addr) : NULL;
		file = vma ? rdptr(AT(vma, OFF_VM_AREA_STRUCT_VM_FILE)) : NULL;
		if (!file) {
			if (addr)
				count_drop(BUILDIDD_DROP_NO_VMA);
			st->k = k + 1;
			exec_tail.call(ctx, 0);
			return 0;
		}
		fill_header(&s->ev.hdr, BUILDIDD_EV_MAP);
		s->ev.origin = k == 0 ? BUILDIDD_ORIGIN_EXEC_MAIN : BUILDIDD_ORIGIN_EXEC_INTERP;
		if (prepare_map_event(s, file) < 0) {
			count_drop(BUILDIDD_DROP_READ_FAILED);
			st->k = k + 1;
			exec_tail.call(ctx, 0);
			return 0;
		}
		st->file = file;
		st->cur = addr;
		st->remaining = EXEC_MAX_VMAS;
	}
	vma = st->remaining ? find_vma_in(st->mm, st->cur, 1) : NULL;
	if (!vma || rdptr(AT(vma, OFF_VM_AREA_STRUCT_VM_FILE)) != st->file) {
		/* Past this file's VMAs: on to the next file. */
		st->file = NULL;
		st->k = k + 1;
		exec_tail.call(ctx, 0);
		return 0;
	}
	vm_start = rd64(AT(vma, OFF_VM_AREA_STRUCT_VM_START));
	vm_end = rd64(AT(vma, OFF_VM_AREA_STRUCT_VM_END));
	vm_flags = rd64(AT(vma, OFF_VM_AREA_STRUCT_VM_FLAGS));
	if (vm_flags & VM_EXEC) {
		s->ev.start = vm_start;
		s->ev.len = vm_end - vm_start;
		s->ev.pgoff = rd64(AT(vma, OFF_VM_AREA_STRUCT_VM_PGOFF)) << PAGE_SHIFT;
		s->ev.prot = vm_flags_to_prot(vm_flags);
		s->ev.flags = vm_flags_to_map(vm_flags);
		submit_map_event(s);
	}
	st->cur = vm_end;
	st->remaining -= 1;
	exec_tail.call(ctx, 0);
	return 0;
}

static __always_inline void submit_task_event(struct task_event *ev)
{
	output_event(ev, sizeof(*ev));
}

/* Attached by tracer.py to the raw tracepoint sched_process_fork. */
int on_sched_process_fork(struct bpf_raw_tracepoint_args *ctx)
{
	/* TP_PROTO(struct task_struct *parent, struct task_struct *child) */
	const void *parent = (const void *)ctx->args[0];
	const void *child = (const void *)ctx->args[1];
	struct task_event ev = {};

	fill_task_header(&ev.hdr, BUILDIDD_EV_FORK, child);
	ev.ppid = rd32(AT(parent, OFF_TASK_STRUCT_TGID));
	ev.ptid = rd32(AT(parent, OFF_TASK_STRUCT_PID));
	submit_task_event(&ev);
	return 0;
}

/* Attached by tracer.py to the raw tracepoint sched_process_exit. */
int on_sched_process_exit(struct bpf_raw_tracepoint_args *ctx)
{
	/* TP_PROTO(struct task_struct *p, ...): only the thread-group leader's exit is a process exit */
	const void *task = (const void *)ctx->args[0];
	struct task_event ev = {};

	fill_task_header(&ev.hdr, BUILDIDD_EV_EXIT, task);
	if (ev.hdr.pid != ev.hdr.tid)
		return 0;
	ev.ppid = rd32(AT(task, OFF_TASK_STRUCT_EXIT_CODE));
	submit_task_event(&ev);
	return 0;
}

/* Attached by tracer.py to the raw tracepoint task_rename. */
int on_task_rename(struct bpf_raw_tracepoint_args *ctx)
{
	/* TP_PROTO(struct task_struct *task, const char *comm) */
	const void *task = (const void *)ctx->args[0];
	struct task_event ev = {};

	fill_task_header(&ev.hdr, BUILDIDD_EV_COMM, task);
	bpf_probe_read_kernel_str(ev.hdr.comm, sizeof(ev.hdr.comm), (const void *)ctx->args[1]);
	submit_task_event(&ev);
	return 0;
}

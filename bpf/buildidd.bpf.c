/* SPDX-License-Identifier: GPL-2.0 */
/*
 * buildidd kernel side: one program per hook, each named after where it attaches.
 *
 * Every kernel struct field is read at an offset that user space took from
 * /sys/kernel/btf/vmlinux at start-up and passes in as -DOFF_<STRUCT>_<FIELD>=N
 * (see daemon/buildidd/tracer.py).  On the paths every mapping takes, a field is
 * read with KLD (bpf/kfuncs.h): a load through a pointer retyped by
 * bpf_rdonly_cast, which the verifier checks against the running kernel's BTF
 * and makes fault-safe, at a fraction of a bpf_probe_read_kernel's cost; the
 * rest use bpf_probe_read_kernel.  Nothing here dereferences a kernel struct
 * through a header type: the installed headers may describe another kernel
 * release.
 *
 * Events go to a BPF ring buffer per CPU, waking the consumer only every eighth
 * of a ring (wake_flag); user space drains them every few milliseconds while
 * events come.  What cannot be delivered is counted per cause in "drops".
 */
#include "events.h"
#include "pagecache.h"
#include "buildid_memo.h"
#include "callbacks.h"
#include "kfuncs.h"

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
/*
 * Dentries walked per path (mount roots crossed count too).  A path of
 * BUILDIDD_PATH_MAX - 1 bytes has up to 2047 components ("/a" each): the
 * walk is a bpf_loop, whose callback the verifier checks once, so its bound
 * costs nothing to verify.  A deeper path (mount roots crossed) is sent cut
 * (its end), with BUILDIDD_PATH_UNREACHABLE.
 */
#ifndef PATH_MAX_DEPTH
#define PATH_MAX_DEPTH	(BUILDIDD_PATH_MAX / 2 + 64)
#endif
#ifndef MAPLE_MAX_DEPTH
#define MAPLE_MAX_DEPTH	8		/* maple tree levels walked */
#endif
#ifndef EXEC_MAX_VMAS
#define EXEC_MAX_VMAS	8
#endif		/* VMAs of one file walked after execve */

#define EXEC_BATCH	4		/* executable VMAs emitted per leaf read */

#define MAPLE_NODE_MASK	0xffULL		/* lib/maple_tree.c: MAPLE_NODE_MASK */

#ifndef PAGE_SHIFT
#define PAGE_SHIFT 12
#endif
#ifndef RINGBUF_PAGES
#define RINGBUF_PAGES 4096
#endif

#ifndef SYSCALL_REGS
struct pending_mprotect {
	__u64 start;
	__u64 len;
	__u32 prot;
	__u32 _pad;
};
#endif

struct map_scratch {
	struct map_event ev;
	/* read_path's walk state */
	const void *w_dentry, *w_mnt, *w_root;
	__u32 w_off, w_done;		/* w_done: 1 at the root, 2 a dentry read nothing */
	__u32 w_flags;			/* BUILDIDD_PATH_TRUNCATED when the walk cut the path */
	char buf[2 * BUILDIDD_PATH_MAX];	/* path assembled backwards from its end */
};

struct exec_scratch {
	struct exec_event ev;
	__u64 auxv[AUXV_LEN];
	__u64 at_phdr, at_base, at_entry;	/* found in auxv; 0: absent */
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
/*
 * Drops by cause: one counter for all CPUs, added to atomically (drops are
 * rare), BPF_F_MMAPABLE so that user space reads them with loads from its
 * mapping every drop_check_interval_s, not a bpf(2) lookup per cause.
 */
BPF_F_TABLE("array", int, __u64, drops, BUILDIDD_DROP_NCAUSES, BPF_F_MMAPABLE);
/*
 * Wake-up accounting (see wake_flag): drain_gen counts the consumer's drains;
 * it is BPF_F_MMAPABLE, so user space bumps it with a plain store into its
 * mapping (Tracer.reset_wakeups), not a bpf(2) call per drain.
 * wake_state is per CPU: the bytes written since the consumer's last drain or
 * this CPU's last wake-up, and the drain_gen they count from.
 */
struct wake_state {
	__u64 bytes;
	__u64 gen;
};
/*
 * drain_gen[DRAIN_GEN_SLEEPING] is non-zero while the consumer sleeps
 * without polling (a quiet wait, capture/loop.py): records then go in with
 * the ring's own adaptive wake-up (flags 0: bpf_ringbuf_commit wakes the
 * consumer when the record is the first it has not read), so the first
 * record after an idle spell wakes it, and none after it until it drains.
 */
#define DRAIN_GEN_SLEEPING 1
BPF_F_TABLE("array", int, __u64, drain_gen, 2, BPF_F_MMAPABLE);
BPF_PERCPU_ARRAY(wake_state, struct wake_state, 1);
/*
 * Per-user record budgets (struct uid_budget, bpf/events.h): an LRU hash, so that
 * a uid unseen for long makes room; user space reads the counts every drop check.
 */
#ifndef UID_BUDGET_ENTRIES
#define UID_BUDGET_ENTRIES 10240
#endif
BPF_TABLE("lru_hash", __u32, struct uid_budget, uid_budget, UID_BUDGET_ENTRIES);
BPF_ARRAY(uid_budget_cfg, struct uid_budget_cfg, 1);
BPF_PERCPU_ARRAY(drop_times, struct drop_time, 1);
/*
 * Per-CPU scratch slots: the programs on tracepoints run with preemption off
 * and use SLOT_LIVE; the task_vma iterator runs with only migration off
 * (bpf_iter_run_prog), so on a preemptible kernel a live program could run on
 * its CPU in the middle of it: it has a slot of its own, SLOT_ITER.
 */
#define SLOT_LIVE	0
#define SLOT_ITER	1
#define SCRATCH_SLOTS	2
BPF_PERCPU_ARRAY(map_scratch, struct map_scratch, SCRATCH_SLOTS);
BPF_PERCPU_ARRAY(exec_scratch, struct exec_scratch, 1);
#ifndef SYSCALL_REGS
BPF_HASH(pending_mprotect, __u32, struct pending_mprotect, 16384);
#endif
/* bpf/pagecache.h: the bases user space found at start-up (zeros: the kernel path is off), its scratch. */
BPF_ARRAY(pagecache_bases, struct pagecache_bases, 1);
BPF_PERCPU_ARRAY(pagecache_scratch, struct pc_scratch, SCRATCH_SLOTS);
/* bpf/buildid_memo.h: build-ids read before, by struct inode *; the entry being made; counters. */
BPF_TABLE("lru_hash", __u64, struct bid_memo, bid_memo, BID_MEMO_ENTRIES);
BPF_PERCPU_ARRAY(memo_scratch, struct bid_memo, SCRATCH_SLOTS);
BPF_PERCPU_ARRAY(bid_memo_stats, __u64, BID_MEMO_NSTATS);

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

/*
 * Loads through a BTF pointer (bpf_get_current_task_btf(), and the pointers
 * read from it): the verifier checks each against the kernel's own BTF
 * layout (not the headers) and makes it a fault-safe load, cheaper than a
 * bpf_probe_read_kernel.  BTF_LD(p, off, type): the type at byte off of *p.
 */
#define BTF_LD(p, off, type) (*(const type *)((const char *)(p) + (off)))

static __always_inline void count_drop(__u32 cause);

static __always_inline long ring_output(void *data, __u64 size, __u64 flags)
{
	switch (bpf_get_smp_processor_id() % NRINGS) {
#if NRINGS > 1
	case 1: return events1.ringbuf_output(data, size, flags);
#endif
#if NRINGS > 2
	case 2: return events2.ringbuf_output(data, size, flags);
#endif
#if NRINGS > 3
	case 3: return events3.ringbuf_output(data, size, flags);
#endif
#if NRINGS > 4
	case 4: return events4.ringbuf_output(data, size, flags);
#endif
#if NRINGS > 5
	case 5: return events5.ringbuf_output(data, size, flags);
#endif
#if NRINGS > 6
	case 6: return events6.ringbuf_output(data, size, flags);
#endif
#if NRINGS > 7
	case 7: return events7.ringbuf_output(data, size, flags);
#endif
	default: return events0.ringbuf_output(data, size, flags);
	}
}

/*
 * Output to this CPU's ring, retried: a reservation on 6.18 sometimes fails
 * for a few consecutive attempts with the ring nearly empty (contention on
 * the ring's lock between CPUs' producers: kernel/bpf/ringbuf.c
 * __bpf_ringbuf_reserve can fail without the ring being full).  A full ring
 * fails every try: only then is the event counted as dropped.
 */
#define OUTPUT_TRIES 64

/*
 * Wake-ups, as perf's wakeup_watermark: records go in without waking the
 * consumer (it polls every few ms while busy), except that once a CPU has
 * written WAKE_BYTES since the consumer last drained (user space bumps
 * drain_gen after each drain: Tracer.reset_wakeups) it forces one, so a
 * burst after an idle spell (the consumer then sleeps up to
 * idle_poll_interval_s, longer than a mapping storm takes to fill a ring)
 * wakes it long before its ring is full.
 * bpf_ringbuf_query(AVAIL_DATA) would say how full the ring is, but BCC 0.26
 * cannot hand a ring's map pointer to a helper it does not wrap.
 */
#ifndef WAKE_BYTES
#define WAKE_BYTES (RINGBUF_PAGES << (PAGE_SHIFT - 3))	/* an eighth of a ring */
#endif

static __always_inline __u64 wake_flag(__u64 size)
{
	int zero = 0, sleeping_key = DRAIN_GEN_SLEEPING;
	struct wake_state *w = wake_state.lookup(&zero);
	__u64 *gen = drain_gen.lookup(&zero), g;
	__u64 *sleeping = drain_gen.lookup(&sleeping_key);

	if (sleeping && *(volatile __u64 *)sleeping)
		return 0;		/* adaptive: wakes a consumer that has read everything */
	if (!w || !gen)
		return BPF_RB_NO_WAKEUP;
	g = *(volatile __u64 *)gen;
	if (w->gen != g) {		/* drained since: count from zero */
		w->gen = g;
		w->bytes = 0;
	}
	w->bytes += size;
	if (w->bytes < WAKE_BYTES)
		return BPF_RB_NO_WAKEUP;
	w->bytes = 0;
	return BPF_RB_FORCE_WAKEUP;
}

/*
 * urgent: a record user space must act on while its process lives (a file
 * met for the first time: BUILDIDD_BID_NEW, whose hand-over pins it) wakes
 * the consumer at once instead of waiting for its next paced drain.  Such
 * records are few: one per inode the build-id memo had not met.
 */
static __always_inline void output_event_wake(void *data, __u64 size, int urgent)
{
	__u64 flags = wake_flag(size);
	int i;

	if (urgent && flags == BPF_RB_NO_WAKEUP)
		flags = BPF_RB_FORCE_WAKEUP;

	for (i = 0; i < OUTPUT_TRIES; i++) {
		if (!ring_output(data, size, flags))
			return;
	}
	count_drop(BUILDIDD_DROP_RINGBUF_FULL);
}

static __always_inline void output_event(void *data, __u64 size)
{
	output_event_wake(data, size, 0);
}

/*
 * What one uid other than root may write into the rings between two drains of
 * the consumer, whatever its token bucket holds: a quarter of a CPU's share of
 * a ring, so that one user's burst while the consumer is late leaves root's and
 * other users' records room.
 */
#ifndef UID_RING_BYTES
#define UID_RING_BYTES (RINGBUF_PAGES << (PAGE_SHIFT - 2))
#endif

/*
 * Whether a MAP or EXEC record of size bytes is over its user's budget (then it is
 * counted in uid_budget and not sent): the uid's token bucket, and its share of
 * the rings between drains (UID_RING_BYTES).  Root's records are never held back; nor
 * are fork, exit and comm records (small, and an exit frees user space's state).
 * The refill is computed from at most the time that fills the bucket, so the
 * product cannot overflow.  Two CPUs may refill one entry at once: the budget
 * is then a little more generous, never stricter.
 */
static __always_inline int over_budget(const void *data, __u64 size)
{
	__u32 uid = ((const struct event_header *)data)->uid, zero = 0;
	struct uid_budget_cfg *cfg;
	struct uid_budget *b;
	__u64 now, elapsed, tokens, full_ns, *gen;

	if (uid == 0)
		return 0;
	cfg = uid_budget_cfg.lookup(&zero);
	if (!cfg || !cfg->bytes_per_s)
		return 0;
	now = bpf_ktime_get_boot_ns();
	b = uid_budget.lookup(&uid);
	if (!b) {
		struct uid_budget fresh = {.tokens = cfg->burst_bytes, .last_ns = now};

		uid_budget.update(&uid, &fresh);
		b = uid_budget.lookup(&uid);
		if (!b)
			return 0;
	}
	gen = drain_gen.lookup(&zero);
	if (gen && b->gen != *(volatile __u64 *)gen) {	/* the consumer drained since */
		b->gen = *(volatile __u64 *)gen;
		b->since_drain = 0;
	}
	if (b->since_drain + size > UID_RING_BYTES)
		goto held;
	elapsed = now > b->last_ns ? now - b->last_ns : 0;
	full_ns = cfg->burst_bytes / cfg->bytes_per_s * 1000000000ULL + 1000000000ULL;
	if (elapsed > full_ns)
		elapsed = full_ns;
	tokens = b->tokens + elapsed * cfg->bytes_per_s / 1000000000ULL;
	if (tokens > cfg->burst_bytes)
		tokens = cfg->burst_bytes;
	b->last_ns = now;
	if (tokens >= size) {
		b->tokens = tokens - size;
		b->since_drain += size;
		return 0;
	}
	b->tokens = tokens;
held:
	__sync_fetch_and_add(&b->records, 1);
	__sync_fetch_and_add(&b->bytes, size);
	if (!b->first_ns)
		b->first_ns = now;
	b->latest_ns = now;
	return 1;
}

static __always_inline void count_drop(__u32 cause)
{
	int key = cause;
	__u64 *n = drops.lookup(&key);
	__u32 zero = 0;
	struct drop_time *t;
	__u64 now;

	if (n)
		__sync_fetch_and_add(n, 1);
	t = drop_times.lookup(&zero);
	if (t) {
		now = bpf_ktime_get_boot_ns();
		if (!t->first_ns)
			t->first_ns = now;
		t->last_ns = now;
	}
}

static __always_inline void memo_count(__u32 stat)
{
	__u64 *n = bid_memo_stats.lookup(&stat);

	if (n)
		*n += 1;
}

/*
 * The current task's header.  comm is copied from task_struct.comm with two
 * BTF loads (bpf_get_current_comm is a helper call): the kernel keeps its
 * last byte NUL (__set_task_comm: strscpy_pad), so a copy is a NUL-terminated
 * name even when taken during a rename, as perf's comm records are; bytes
 * after the first NUL may then be the old name's (user space stops at it).
 */
static __always_inline void fill_header(struct event_header *h, __u32 type)
{
	const char *task = (const char *)bpf_get_current_task_btf();
	__u64 id = bpf_get_current_pid_tgid();

	h->type = type;
	h->pid = id >> 32;
	h->tid = (__u32)id;
	h->uid = (__u32)bpf_get_current_uid_gid();
	h->time_ns = bpf_ktime_get_boot_ns();
	_Static_assert(BUILDIDD_COMM_LEN == 16, "comm is copied as two words");
	*(__u64 *)h->comm = BTF_LD(task, OFF_TASK_STRUCT_COMM, __u64);
	*(__u64 *)(h->comm + 8) = BTF_LD(task, OFF_TASK_STRUCT_COMM + 8, __u64);
}

static __always_inline void fill_task_header(struct event_header *h, __u32 type,
					     const void *task)
{
	h->type = type;
#if OFF_TASK_STRUCT_TGID == OFF_TASK_STRUCT_PID + 4
	{
		__u32 ids[2] = {};	/* task_struct: pid_t pid; pid_t tgid; */

		bpf_probe_read_kernel(ids, sizeof(ids), AT(task, OFF_TASK_STRUCT_PID));
		h->pid = ids[1];
		h->tid = ids[0];
	}
#else
	h->pid = rd32(AT(task, OFF_TASK_STRUCT_TGID));
	h->tid = rd32(AT(task, OFF_TASK_STRUCT_PID));
#endif
	/* task_struct.cred -> cred.uid: the real uid, as bpf_get_current_uid_gid gives current's */
	h->uid = rd32(AT(rdptr(AT(task, OFF_TASK_STRUCT_CRED)), OFF_CRED_UID));
	h->time_ns = bpf_ktime_get_boot_ns();
	bpf_probe_read_kernel(h->comm, sizeof(h->comm), AT(task, OFF_TASK_STRUCT_COMM));
}

/*
 * What the user opened: file->f_path and file->f_inode, except for an
 * overlayfs backing file (FMODE_BACKING, Linux 6.6, commit 62d53c4a1dfe:
 * ovl_mmap() puts the real file in vma->vm_file), embedded in a struct
 * backing_file whose user_path is the overlay path; its dentry's inode is
 * the overlay inode that stat(2) and /proc/PID/maps show.
 */
#define FMODE_BACKING	(1U << 24)	/* include/linux/fs.h */

struct user_view {
	const void *dentry;	/* struct dentry * */
	const void *vfsmnt;	/* struct vfsmount * */
	const void *inode;	/* struct inode * */
	const void *mapping;	/* file->f_mapping: the page cache of the mapped (real) file */
	const void *real_inode;	/* file->f_inode: the mapped file's inode (on overlayfs the real one) */
};

static __always_inline int user_view(const void *file, struct user_view *u, __u32 *flags)
{
	if (!file)
		return -1;
	u->mapping = KLD(file, FILE, OFF_FILE_F_MAPPING, const void *);
	u->vfsmnt = KLD(file, FILE, OFF_FILE_F_PATH + OFF_PATH_MNT, const void *);
	u->dentry = KLD(file, FILE, OFF_FILE_F_PATH + OFF_PATH_DENTRY, const void *);
	u->inode = u->real_inode = KLD(file, FILE, OFF_FILE_F_INODE, const void *);
#ifdef OFF_BACKING_FILE_USER_PATH
	if (KLD(file, FILE, OFF_FILE_F_MODE, __u32) & FMODE_BACKING) {
		/* struct path: vfsmount *mnt, dentry *dentry (one read when adjacent) */
		const void *pp[2] = {};

		*flags |= BUILDIDD_FILE_BACKING;
		if (bpf_probe_read_kernel(pp, sizeof(pp), AT(file, OFF_BACKING_FILE_USER_PATH + PATH_SPAN_BASE)))
			return -1;
		u->vfsmnt = pp[(OFF_PATH_MNT - PATH_SPAN_BASE) / 8 & 1];
		u->dentry = pp[(OFF_PATH_DENTRY - PATH_SPAN_BASE) / 8 & 1];
		u->inode = u->dentry ? rdptr(AT(u->dentry, OFF_DENTRY_D_INODE)) : NULL;
	}
#endif
	return u->inode && u->dentry && u->vfsmnt ? 0 : -1;
}

/*
 * Identity of the inode, as stat(2) would report it (struct inode's i_ino,
 * i_size, i_mtime, i_generation, i_ctime, i_nlink; super_block.s_dev).
 * *magic: the file system's super_block.s_magic (include/uapi/linux/magic.h).
 * -1 when inode is NULL or reads nothing: a live inode's i_sb is never NULL,
 * so a NULL i_sb is a load through a bad pointer (BPF_PROBE_MEM reads 0).
 */
static __always_inline int read_file_id(const void *inode, struct file_id *id, __u64 *magic)
{
	const void *sb;

	if (!inode)
		return -1;
	id->ino = KLD(inode, INODE, OFF_INODE_I_INO, __u64);
	id->size = KLD(inode, INODE, OFF_INODE_I_SIZE, __u64);
	id->mtime_sec = KLD(inode, INODE, OFF_INODE_I_MTIME_SEC, __s64);
	id->mtime_nsec = KLD(inode, INODE, OFF_INODE_I_MTIME_NSEC, __u32);
	id->generation = KLD(inode, INODE, OFF_INODE_I_GENERATION, __u32);
	id->ctime_sec = KLD(inode, INODE, OFF_INODE_I_CTIME_SEC, __s64);
	/* Linux 6.13 (commit 4e40eff0b573, multigrain timestamps) keeps a flag in bit 31. */
	id->ctime_nsec = KLD(inode, INODE, OFF_INODE_I_CTIME_NSEC, __u32) & 0x3fffffff;
	id->_pad = 0;
	id->nlink = KLD(inode, INODE, OFF_INODE_I_NLINK, __u32);
	sb = KLD(inode, INODE, OFF_INODE_I_SB, const void *);
	if (!sb)
		return -1;
	id->dev = KLD(sb, SUPER_BLOCK, OFF_SUPER_BLOCK_S_DEV, __u32);
	*magic = KLD(sb, SUPER_BLOCK, OFF_SUPER_BLOCK_S_MAGIC, __u64);
	return 0;
}

/*
 * One step of read_path's walk: the dentry s->w_dentry, or the crossing of a
 * mount root.  Returns 1 when the walk is over (s->w_done set), else 0.
 */
static __always_inline int path_step(struct map_scratch *s)
{
	const void *dentry = s->w_dentry, *mnt = s->w_mnt;
	const void *parent, *name;
	__u32 len, off;

	if (s->w_done)
		return 1;
	if (dentry == s->w_root) {
		const void *mparent = KLD(mnt, MOUNT, OFF_MOUNT_MNT_PARENT, const void *);

		if (!mparent || mparent == mnt) {
			s->w_done = 1;
			return 1;
		}
		s->w_dentry = KLD(mnt, MOUNT, OFF_MOUNT_MNT_MOUNTPOINT, const void *);
		s->w_mnt = mparent;
		s->w_root = KLD(mparent, MOUNT, OFF_MOUNT_MNT + OFF_VFSMOUNT_MNT_ROOT, const void *);
		return 0;
	}
	/*
	 * A dentry's d_parent is never NULL (a root's is itself): NULL is a
	 * load through a bad pointer (BPF_PROBE_MEM reads 0), and the path is
	 * cut there (BUILDIDD_PATH_UNREACHABLE), as when a probe read failed.
	 */
	parent = dentry ? KLD(dentry, DENTRY, OFF_DENTRY_D_PARENT, const void *) : NULL;
	if (!parent) {
		s->w_done = 2;
		return 1;
	}
	/*
	 * A root dentry that is not its mount's root: a pseudo file
	 * (memfd, anon inode: alloc_file_pseudo) or a disconnected
	 * dentry.  Its own name is the path, as d_path() shows
	 * "/memfd:NAME (deleted)"; then the walk ends.
	 */
	if (parent == dentry)
		s->w_done = 1;
	len = KLD(dentry, DENTRY, OFF_DENTRY_D_NAME_LEN, __u32) & NAME_MASK;
	name = KLD(dentry, DENTRY, OFF_DENTRY_D_NAME_NAME, const void *);
	off = s->w_off;
	if (len + 1 >= off || off > BUILDIDD_PATH_MAX) {
		s->w_flags |= BUILDIDD_PATH_TRUNCATED;
		s->w_done = 1;
		return 1;
	}
	off -= len;
	bpf_probe_read_kernel(s->buf + (off & PATH_MASK), len, name);
	off -= 1;
	s->buf[off & PATH_MASK] = '/';
	s->w_off = off;
	s->w_dentry = parent;
	return s->w_done ? 1 : 0;
}

/* read_path's and the page-cache walk's steps over this CPU's scratch slot slot. */
static __always_inline int path_step_slot(__u32 slot)
{
	struct map_scratch *s = map_scratch.lookup(&slot);

	return s ? path_step(s) : 1;
}

static __always_inline int pc_step_slot(__u32 slot)
{
	__u32 zero = 0;
	struct pc_scratch *s = pagecache_scratch.lookup(&slot);
	struct pagecache_bases *b = pagecache_bases.lookup(&zero);

	return s && b ? pc_step(s, b) : 1;
}

/* The bpf_loop callbacks (bpf/callbacks.h; tracer.py CALLBACKS), one per scratch slot. */
int path_step_live(__u32 i) { return path_step_slot(SLOT_LIVE); }
int path_step_iter(__u32 i) { return path_step_slot(SLOT_ITER); }
int pc_step_live(__u32 i) { return pc_step_slot(SLOT_LIVE); }
int pc_step_iter(__u32 i) { return pc_step_slot(SLOT_ITER); }

/*
 * The path of (u->dentry, u->vfsmnt) in its mount namespace, assembled
 * backwards into s->buf[0..BUILDIDD_PATH_MAX) by walking dentry->d_parent
 * and, at a mount's root, struct mount->mnt_mountpoint (what d_path() does,
 * fs/d_path.c).  Returns the offset in s->buf where the path starts; it ends
 * at BUILDIDD_PATH_MAX.  d_parent and d_name are KLD loads, the name a
 * probe read of its bytes.  s is map_scratch's slot (SLOT_LIVE or
 * SLOT_ITER, a constant): the walk is a bpf_loop of that slot's callback,
 * its state in s.
 */
static __always_inline __u32 read_path(const struct user_view *u, struct map_scratch *s, __u32 *flags,
				       __u32 slot)
{
	const void *vfsmnt = u->vfsmnt;

	s->w_dentry = u->dentry;
	s->w_mnt = AT(vfsmnt, -OFF_MOUNT_MNT);
	s->w_root = KLD(vfsmnt, VFSMOUNT, OFF_VFSMOUNT_MNT_ROOT, const void *);
	s->w_off = BUILDIDD_PATH_MAX;
	s->w_done = 0;
	s->w_flags = 0;
	bpf_loop(PATH_MAX_DEPTH, slot == SLOT_ITER ? BPF_CALLBACK(CALLBACK_path_step_iter)
						   : BPF_CALLBACK(CALLBACK_path_step_live), NULL, 0);
	*flags |= s->w_flags;
	if (s->w_done != 1)
		*flags |= BUILDIDD_PATH_UNREACHABLE;
	if (s->w_off >= BUILDIDD_PATH_MAX) {
		s->w_off = BUILDIDD_PATH_MAX - 1;
		s->buf[(BUILDIDD_PATH_MAX - 1) & PATH_MASK] = '/';
	}
	return s->w_off;
}

/*
 * A maple node is fetched with one probe read into per-CPU scratch (its
 * pivots and slots are then plain reads); a VMA's fields are KLD loads.
 */
#define MAPLE_NODE_WORDS (MAPLE_NODE_SIZE / 8)
#define MAPLE_WORD_MASK	(MAPLE_NODE_WORDS - 1)
#define MR64_PIVOT_W	(OFF_MAPLE_RANGE_64_PIVOT / 8)
#define MR64_SLOT_W	(OFF_MAPLE_RANGE_64_SLOT / 8)
struct walk_scratch {
	__u64 node[MAPLE_NODE_WORDS];	/* struct maple_node */
};

BPF_PERCPU_ARRAY(walk_scratch, struct walk_scratch, SCRATCH_SLOTS);

/* The vm_area_struct fields a mapping event needs. */
struct vma_info {
	__u64 start;		/* vm_start */
	__u64 end;		/* vm_end */
	__u64 flags;		/* vm_flags */
	__u64 pgoff;		/* vm_pgoff, pages */
	const void *file;	/* vm_file */
};

/* A bad vma pointer reads zeros (BPF_PROBE_MEM): an empty range, which no caller accepts. */
static __always_inline int read_vma(const void *vma, struct vma_info *v)
{
	v->start = KLD(vma, VM_AREA_STRUCT, OFF_VM_AREA_STRUCT_VM_START, __u64);
	v->end = KLD(vma, VM_AREA_STRUCT, OFF_VM_AREA_STRUCT_VM_END, __u64);
	v->flags = KLD(vma, VM_AREA_STRUCT, OFF_VM_AREA_STRUCT_VM_FLAGS, __u64);
	v->pgoff = KLD(vma, VM_AREA_STRUCT, OFF_VM_AREA_STRUCT_VM_PGOFF, __u64);
	v->file = KLD(vma, VM_AREA_STRUCT, OFF_VM_AREA_STRUCT_VM_FILE, const void *);
	return v->end > v->start ? 0 : -1;
}

/* 1 when p < a (unsigned), else 0, computed without a branch (Hacker's Delight 2-12). */
static __always_inline __u64 below(__u64 p, __u64 a)
{
	return ((~p & a) | (~(p ^ a) & (p - a))) >> 63;
}

/* mm->mm_mt.ma_root: the root entry of an mm_struct's maple tree of VMAs (probe read). */
static __always_inline __u64 mm_root(const void *mm)
{
	return rd64(AT(mm, OFF_MM_STRUCT_MM_MT + OFF_MAPLE_TREE_MA_ROOT));
}

/* The current task's mm (NULL for a kernel thread) and its maple tree's root, through BTF_LD. */
static __always_inline __u64 current_mm_root(const void *btf_task)
{
	const void *mm = BTF_LD(btf_task, OFF_TASK_STRUCT_MM, void *);

	return mm ? BTF_LD(mm, OFF_MM_STRUCT_MM_MT + OFF_MAPLE_TREE_MA_ROOT, __u64) : 0;
}

/*
 * Descends from root (mm->mm_mt.ma_root) to the leaf whose range holds addr, as mtree_lookup_walk
 * (lib/maple_tree.c) does, with node layouts from BTF.  On success the leaf is
 * in w->node and the index of addr's slot is returned; -1 otherwise.
 */
static __always_inline int maple_leaf(__u64 root, __u64 addr, struct walk_scratch *w)
{
	__u64 entry = root;
	int depth;

	/* A root that is a node carries the internal-node bits (xa_is_node). */
	if ((entry & 3) != 2)
		return -1;
	for (depth = 0; depth < MAPLE_MAX_DEPTH; depth++) {
		__u32 type = (entry >> 3) & 0xf;
		__u32 npivots, pw, sw, i, idx;
		__u64 run;

		if (type == MAPLE_ARANGE_64) {
			npivots = MA64_NPIVOTS;
			pw = OFF_MAPLE_ARANGE_64_PIVOT / 8;
			sw = OFF_MAPLE_ARANGE_64_SLOT / 8;
		} else if (type == MAPLE_RANGE_64 || type == MAPLE_LEAF_64) {
			npivots = MR64_NPIVOTS;
			pw = MR64_PIVOT_W;
			sw = MR64_SLOT_W;
		} else {
			return -1;
		}
		if (bpf_probe_read_kernel(w->node, sizeof(w->node),
					  (const void *)(entry & ~MAPLE_NODE_MASK)))
			return -1;
		/*
		 * The first pivot >= addr selects the slot; none does: the last
		 * slot.  Pivots ascend, so that is the count of leading pivots
		 * below addr, computed without branches: the verifier then sees
		 * one unknown idx instead of following each of its values.
		 */
		idx = 0;
		run = 1;
		for (i = 0; i < MR64_NPIVOTS; i++) {
			if (i < npivots) {
				run &= below(w->node[(pw + i) & MAPLE_WORD_MASK], addr);
				idx += run;
			}
		}
		if (type == MAPLE_LEAF_64)
			return idx;
		entry = w->node[(sw + idx) & MAPLE_WORD_MASK];
		if (!entry)
			return -1;
	}
	return -1;
}

/* The VMA of mm covering addr, or NULL; its fields in *v. */
static __always_inline const void *find_vma(__u64 root, __u64 addr, struct walk_scratch *w,
					    struct vma_info *v)
{
	int idx = maple_leaf(root, addr, w);
	const void *vma;

	if (idx < 0)
		return NULL;
	vma = (const void *)w->node[(MR64_SLOT_W + idx) & MAPLE_WORD_MASK];
	if (!vma || read_vma(vma, v) || v->start > addr || v->end <= addr)
		return NULL;
	return vma;
}

/*
 * The build-id of ev's file from the memo when a confirmed entry for inode
 * matches ev->file and the file has no writer: returns 1 with ev->bid filled.
 * Otherwise returns 0 and leaves in ms->confirmed whether memo_learn may
 * remember what the page-cache walk finds (1: a local file system, no writer).
 */
static __always_inline int memo_answer(const void *inode, __u64 magic, struct map_event *ev,
				       struct bid_memo *ms)
{
	__u64 key = (__u64)inode;
	struct bid_memo *m;

	ms->confirmed = 0;
	if (!memo_local_fs(magic))
		return 0;
	if (KLD(inode, INODE, OFF_INODE_I_WRITECOUNT, __s32) > 0) {
		memo_count(BID_MEMO_WRITER);
		return 0;
	}
	ms->confirmed = 1;
	m = bid_memo.lookup(&key);
	if (!m || !m->confirmed || !memo_same_id(&m->id, &ev->file))
		return 0;
	ev->bid.status = PC_OK;
	ev->bid.size = m->size & (PC_BUILD_ID_MAX * 2 - 1);
	ev->bid.page = 0;
	__builtin_memcpy(ev->bid.build_id, m->build_id, PC_BUILD_ID_MAX);
	ev->id_flags |= BUILDIDD_BID_MEMO;
	memo_count(BID_MEMO_HIT);
	return 1;
}

/*
 * After a page-cache walk of inode's file that memo_answer allowed
 * (ms->confirmed): an entry that agrees with it (same identity, same
 * build-id) and is BID_MEMO_CONFIRM_NS old is confirmed; one that does not
 * is replaced by a new, unconfirmed one.
 */
static __always_inline void memo_learn(const void *inode, struct map_event *ev, struct bid_memo *ms)
{
	__u64 key = (__u64)inode;
	struct bid_memo *m;

	if (!ms->confirmed || ev->bid.status != PC_OK)
		return;
	m = bid_memo.lookup(&key);
	if (m && memo_same_id(&m->id, &ev->file) && memo_same_bid(m, &ev->bid)) {
		if (!m->confirmed && ev->hdr.time_ns - m->first_ns >= BID_MEMO_CONFIRM_NS) {
			m->confirmed = 1;
			memo_count(BID_MEMO_CONFIRM);
		}
		return;
	}
	ms->id = ev->file;
	ms->first_ns = ev->hdr.time_ns;
	ms->confirmed = 0;
	ms->size = ev->bid.size;
	__builtin_memcpy(ms->build_id, ev->bid.build_id, PC_BUILD_ID_MAX);
	bid_memo.update(&key, ms);
	memo_count(BID_MEMO_FILL);
	ev->id_flags |= BUILDIDD_BID_NEW;
}

/*
 * The GNU build-id of the mapped file into ev->bid: from the build-id memo
 * (bpf/buildid_memo.h) when it holds a confirmed entry for this inode with
 * this identity and the file has no writer, else read now from its page
 * cache (bpf/pagecache.h), and then remembered.  An overlayfs backing file
 * (vma->vm_file is the real file; ev->file describes the overlay inode) is
 * read every time, with the real inode's size.  magic: the file system of
 * u->inode.
 */
static __always_inline void read_build_id(const struct user_view *u, __u64 magic, struct map_event *ev,
					  __u32 slot)
{
	struct pc_scratch *pcs;
	struct pagecache_bases *b;
	struct bid_memo *ms;
	__u32 zero = 0;
	__u64 size;

	pcs = pagecache_scratch.lookup(&slot);
	b = pagecache_bases.lookup(&zero);
	ms = memo_scratch.lookup(&slot);
	if (!ms)
		return;
	if (ev->id_flags & BUILDIDD_FILE_BACKING) {
		ms->confirmed = 0;	/* read every time, never remembered */
		/* A probe read: as a KLD load, clang merges it with the load of ev->file.size below into one
		 * instruction on two kinds of pointer, which the verifier refuses. */
		size = rd64(AT(u->real_inode, OFF_INODE_I_SIZE));
	} else {
		if (memo_answer(u->inode, magic, ev, ms))
			return;
		size = ev->file.size;
	}
	/*
	 * One page-cache walk for both kinds of file (the program holds one
	 * copy of it), and nothing but memory is live across it
	 * (ms->confirmed holds memo_answer's verdict): a register that differed
	 * between the branches would multiply the states the verifier follows
	 * through the walk's loops.
	 */
	pagecache_build_id(u->mapping, size, &ev->bid, pcs, b,
			   slot == SLOT_ITER ? BPF_CALLBACK(CALLBACK_pc_step_iter) : BPF_CALLBACK(CALLBACK_pc_step_live));
	memo_learn(u->inode, ev, ms);
}

/*
 * Fills ev's identity and path for file (the one the user opened, see
 * user_view), read now for this event.  Returns the number of path bytes,
 * or -1 if the file is unreadable.
 */
static __always_inline int prepare_map_event(struct map_scratch *s, const void *file, __u32 slot)
{
	struct map_event *ev = &s->ev;
	struct user_view u;
	__u32 off, plen;
	__u64 magic;

	ev->id_flags = 0;
	ev->path_len = 0;
	if (user_view(file, &u, &ev->id_flags) || read_file_id(u.inode, &ev->file, &magic))
		return -1;
	off = read_path(&u, s, &ev->id_flags, slot);
	plen = (BUILDIDD_PATH_MAX - off) & PATH_MASK;
	bpf_probe_read_kernel(ev->path, plen, s->buf + (off & PATH_MASK));
	ev->path_len = plen;
	read_build_id(&u, magic, ev, slot);
	return plen;
}

static __always_inline void submit_map_event(struct map_scratch *s)
{
	__u32 size = offsetof(struct map_event, path) + (s->ev.path_len & PATH_MASK);

	if (over_budget(&s->ev, size))
		return;
	output_event_wake(&s->ev, size, s->ev.id_flags & BUILDIDD_BID_NEW);
}

static __always_inline __u32 vm_flags_to_prot(__u64 vm_flags)
{
	return vm_flags & (VM_READ | VM_WRITE | VM_EXEC);	/* same bits as PROT_* */
}

static __always_inline __u32 vm_flags_to_map(__u64 vm_flags)
{
	return (vm_flags & VM_SHARED) ? MAP_SHARED : MAP_PRIVATE;
}

#define READ_IMPLIES_EXEC 0x0400000	/* include/uapi/linux/personality.h */
#define PROT_READ	0x1

/*
 * A file mapping that may have become executable at addr: mmap(2) returned
 * addr (origin BUILDIDD_ORIGIN_MMAP: everything is read from the new VMA, as
 * perf's PERF_RECORD_MMAP2 does: vm_start, vm_end - vm_start, vm_pgoff,
 * vm_flags; the file is the one actually mapped), or mprotect(2) made
 * [addr, addr + len) executable with prot (BUILDIDD_ORIGIN_MPROTECT).  One
 * function for both, so that a program handling both (on_sys_exit) holds
 * one copy of the path walk and of the build-id reader.
 */
static __always_inline void map_exit(const void *task, __u64 addr, __u64 len, __u32 prot, __u32 origin)
{
	struct map_scratch *s;
	struct walk_scratch *w;
	struct vma_info v;
	__u32 zero = 0;
	__u64 root;

	w = walk_scratch.lookup(&zero);
	s = map_scratch.lookup(&zero);
	if (!w || !s)
		return;
	root = current_mm_root(task);
	if (!root || !find_vma(root, addr, w, &v)) {
		count_drop(BUILDIDD_DROP_NO_VMA);
		return;
	}
	/*
	 * No file: anonymous memory (a JIT's mprotect(PROT_EXEC), a shared
	 * anonymous mmap is shmem and has one).  Not a file mapping, not a loss.
	 */
	if (!v.file)
		return;
	fill_header(&s->ev.hdr, BUILDIDD_EV_MAP);
	if (origin == BUILDIDD_ORIGIN_MMAP) {
		if (!(v.flags & VM_EXEC))
			return;
		s->ev.start = v.start;
		s->ev.len = v.end - v.start;
		s->ev.pgoff = v.pgoff << PAGE_SHIFT;
		s->ev.prot = vm_flags_to_prot(v.flags);
	} else {
		s->ev.start = addr;
		s->ev.len = len;
		s->ev.pgoff = (v.pgoff << PAGE_SHIFT) + (addr - v.start);
		s->ev.prot = prot;
	}
	s->ev.flags = vm_flags_to_map(v.flags);
	s->ev.origin = origin;
	if (prepare_map_event(s, v.file, SLOT_LIVE) < 0) {
		count_drop(BUILDIDD_DROP_READ_FAILED);
		return;
	}
	submit_map_event(s);
}

#ifdef SYSCALL_REGS
/*
 * Every mmap, mprotect and pkey_mprotect, native or i386 (compat), at one
 * hook: raw_syscalls:sys_exit, which fires for every syscall of every task.
 * The syscalls:sys_{enter,exit}_* tracepoints would cost more per call
 * (each runs through perf's tracepoint buffer before the program) and skip
 * compat syscalls altogether; a raw tracepoint hands over the saved user
 * registers (struct pt_regs) and the return value.  Any other syscall
 * returns after one read of orig_ax.
 *
 * The arguments are read from the registers the syscall left: x86_64 passes
 * them in di, si, dx; i386 in bx, cx, dx; ax holds the return value.  An
 * mprotect is seen at exit only: a file mapping made executable is reported
 * even when it was executable already (perf reports a change of flags).
 */
#define NR_MPROTECT		10	/* arch/x86/entry/syscalls/syscall_64.tbl */
#define NR_PKEY_MPROTECT	329
#define IA32_NR_OLD_MMAP	90	/* arch/x86/entry/syscalls/syscall_32.tbl */
#define IA32_NR_MPROTECT	125
#define IA32_NR_MMAP2		192
#define IA32_NR_PKEY_MPROTECT	380
#define REG(regs, off) KLD(regs, PT_REGS, off, __u64)

int on_sys_exit(struct bpf_raw_tracepoint_args *ctx)
{
	/* TP_PROTO(struct pt_regs *regs, long ret) */
	const void *regs = (const void *)ctx->args[0];
	__u64 ret = ctx->args[1], nr, start, len, prot;
	const char *task;
	__u32 origin;
	int compat = 0;

	nr = REG(regs, OFF_PT_REGS_ORIG_AX);
	if (nr != NR_MMAP && nr != NR_MPROTECT && nr != NR_PKEY_MPROTECT
#ifdef TS_COMPAT
	    && nr != IA32_NR_MMAP2 && nr != IA32_NR_OLD_MMAP && nr != IA32_NR_MPROTECT && nr != IA32_NR_PKEY_MPROTECT
#endif
	    )
		return 0;
	/*
	 * A BTF pointer: the verifier checks each load against the kernel's own
	 * struct task_struct (BTF, not the headers) and makes it fault-safe.
	 */
	task = (const char *)bpf_get_current_task_btf();
#ifdef TS_COMPAT
	/* Set at each 32-bit syscall entry (arch/x86); the numbers overlap the native table. */
	compat = !!(*(const __u32 *)(task + OFF_TASK_STRUCT_THREAD_INFO_STATUS) & TS_COMPAT);
#endif
	prot = REG(regs, OFF_PT_REGS_DX);
	if (!compat && nr == NR_MMAP) {
		if (ret >= (__u64)-4095)	/* IS_ERR_VALUE: the mmap failed */
			return 0;
		/*
		 * Nothing executable: no PROT_EXEC, and not PROT_READ under
		 * READ_IMPLIES_EXEC (do_mmap()).  MAP_ANONYMOUS proves nothing: a
		 * shared anonymous mapping has a vm_file (shmem, "/dev/zero
		 * (deleted)"), and perf reports it.
		 */
		if (!(prot & PROT_EXEC) && (!(prot & PROT_READ) ||
		    !(*(const __u32 *)(task + OFF_TASK_STRUCT_PERSONALITY) & READ_IMPLIES_EXEC)))
			return 0;
		start = ret;
		len = prot = 0;
		origin = BUILDIDD_ORIGIN_MMAP;
	} else if (!compat) {
		/* Past the number filter a native task may also be in chmod (90), capget (125)... */
		if ((nr != NR_MPROTECT && nr != NR_PKEY_MPROTECT) || ret != 0 || !(prot & PROT_EXEC))
			return 0;
		start = REG(regs, OFF_PT_REGS_DI);
		len = REG(regs, OFF_PT_REGS_SI);
		origin = BUILDIDD_ORIGIN_MPROTECT;
	} else if (nr == IA32_NR_MMAP2 || nr == IA32_NR_OLD_MMAP) {
		if (ret >= (__u64)-4095)
			return 0;
		start = (__u32)ret;
		len = prot = 0;
		origin = BUILDIDD_ORIGIN_MMAP;
	} else {
		prot &= 0xffffffff;
		if ((nr != IA32_NR_MPROTECT && nr != IA32_NR_PKEY_MPROTECT) || ret != 0 || !(prot & PROT_EXEC))
			return 0;
		start = REG(regs, OFF_PT_REGS_BX) & 0xffffffff;
		len = REG(regs, OFF_PT_REGS_CX) & 0xffffffff;
		origin = BUILDIDD_ORIGIN_MPROTECT;
	}
	map_exit(task, start, len, prot, origin);
	return 0;
}
#else
/*
 * Other architectures (no saved-register layout in tracer.py; not tested on
 * this project's machines): the syscalls tracepoints, mprotect's request
 * kept from enter to exit.  i386 compat syscalls are not seen here.
 */
TRACEPOINT_PROBE(syscalls, sys_exit_mmap)
{
	__u64 ret = (__u64)args->ret;
	const void *task;

	if (ret >= (__u64)-4095)	/* IS_ERR_VALUE: the mmap failed */
		return 0;
	task = (const void *)bpf_get_current_task_btf();
	map_exit(task, ret, 0, 0, BUILDIDD_ORIGIN_MMAP);
	return 0;
}

/*
 * mprotect(2) that makes a file mapping executable.  sys_enter_mprotect keeps
 * the request per thread for the exit; pending_count lets every other
 * mprotect's exit skip the hash lookup.
 */
BPF_ARRAY(pending_count, __u64, 1);

TRACEPOINT_PROBE(syscalls, sys_enter_mprotect)
{
	struct pending_mprotect p = {};
	struct walk_scratch *w;
	struct vma_info v;
	__u64 *count, root;
	__u32 tid, zero = 0;
	int replaced;

	if (!(args->prot & PROT_EXEC))
		return 0;
	w = walk_scratch.lookup(&zero);
	count = pending_count.lookup(&zero);
	if (!w || !count)
		return 0;
	root = current_mm_root((const void *)bpf_get_current_task_btf());
	/* Only a file mapping that is not executable yet becomes a new exec mapping. */
	if (!root || !find_vma(root, args->start, w, &v) || !v.file || (v.flags & VM_EXEC))
		return 0;
	tid = (__u32)bpf_get_current_pid_tgid();
	p.start = args->start;
	p.len = args->len;
	p.prot = args->prot;
	/* An entry this thread left behind is replaced, and stays counted once. */
	replaced = pending_mprotect.lookup(&tid) != NULL;
	if (pending_mprotect.update(&tid, &p)) {
		count_drop(BUILDIDD_DROP_PENDING_FULL);
		return 0;
	}
	if (!replaced)
		__sync_fetch_and_add(count, 1);
	return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_mprotect)
{
	__u32 tid, zero = 0;
	__u64 *count = pending_count.lookup(&zero);
	struct pending_mprotect *pp, p;

	/* Read without a lock: this thread's own increment is always visible to it. */
	if (!count || !*count)
		return 0;
	tid = (__u32)bpf_get_current_pid_tgid();
	pp = pending_mprotect.lookup(&tid);
	if (!pp)
		return 0;
	p = *pp;
	pending_mprotect.delete(&tid);
	__sync_fetch_and_add(count, -1);
	if (args->ret != 0)
		return 0;
	map_exit((const void *)bpf_get_current_task_btf(), p.start, p.len, p.prot, BUILDIDD_ORIGIN_MPROTECT);
	return 0;
}

#endif

/*
 * After execve the new mm holds the executable's and the interpreter's
 * segments, mapped by the kernel itself (fs/binfmt_elf.c), not through mmap(2).
 * exec_vmas finds them: starting at the VMA holding AT_PHDR (then AT_BASE), it
 * reads the maple leaf that holds it and emits every executable VMA of that
 * same struct file in the slots that follow, crossing gaps (binaries linked
 * with -z max-page-size=0x200000) and, when the file's VMAs go on past the
 * leaf, descending again from where the leaf ends.  Each step is a tail call,
 * so that each verifies as a small program; the state lives in exec_stages.
 */
struct exec_stage {
	const void *mm;
	__u64 addr[2];		/* AT_PHDR (or AT_ENTRY), AT_BASE; 0: none */
	__u32 k;		/* index into addr of the file being walked */
	__u32 remaining;	/* VMAs of this file still to look at */
	const void *file;	/* the file being walked; NULL: start file k */
	__u64 cur;		/* the address from which to look on */
	__u32 leaves;		/* leaves still to look at for this file */
	__u32 nfound;		/* entries of found[] filled by this leaf */
	/*
	 * The scan's outcome, kept here while found[] is emitted: in registers,
	 * each of their values would have the verifier follow the emission
	 * (and output_event's retries) once more.
	 */
	__u64 scan_end;		/* where the scan stopped: the end of the last VMA of the file */
	__u64 last_pivot;	/* pivot of the last slot the scan looked at */
	__u32 leaf_end;		/* 0: the file ends here, 1: it may go on in the next leaf, 2: found[] full */
	struct {
		__u64 start, len, pgoff;
		__u32 prot, flags;
	} found[EXEC_BATCH];	/* executable VMAs found in this leaf, emitted after the scan */
};

#define EXEC_MAX_LEAVES 3	/* maple leaves read per file */

BPF_PERCPU_ARRAY(exec_stages, struct exec_stage, 1);
/* Slot 0: exec_vmas.  A tail call gives each step its own verifier budget. */
BPF_PROG_ARRAY(exec_tail, 1);

/* Lowest kernel address (x86_64): a leaf slot below it holds node metadata, not a VMA. */
#define KERNEL_MIN_ADDR	0xffff800000000000ULL

static __always_inline void exec_next_file(struct bpf_raw_tracepoint_args *ctx, struct exec_stage *st)
{
	st->file = NULL;
	st->k += 1;
	if (st->k < 2 && st->addr[1])
		exec_tail.call(ctx, 0);
}

/* Attached by tracer.py to the raw tracepoint sched_process_exec. */
int on_sched_process_exec(struct bpf_raw_tracepoint_args *ctx)
{
	/* TP_PROTO(struct task_struct *p, pid_t old_pid, struct linux_binprm *bprm) */
	const void *task = (const void *)ctx->args[0];
	const void *bprm = (const void *)ctx->args[2];
	const void *file, *mm, *filename;
	struct exec_scratch *s;
	struct map_scratch *ms;
	struct exec_stage *st;
	struct user_view u;
	__u32 zero = 0, size, flen, plen, off, compat = 0;
	__u64 magic;
	int i, n;

	s = exec_scratch.lookup(&zero);
	ms = map_scratch.lookup(&zero);
	st = exec_stages.lookup(&zero);
	if (!s || !ms || !st)
		return 0;
	fill_header(&s->ev.hdr, BUILDIDD_EV_EXEC);
	s->ev.old_tid = (__u32)ctx->args[1];
	s->ev.id_flags = 0;
	/* At this tracepoint bprm->file is the ELF that runs (exec_binprm() swapped a #! script for its interpreter). */
	file = rdptr(AT(bprm, OFF_LINUX_BINPRM_FILE));
	if (!file || user_view(file, &u, &s->ev.id_flags) || read_file_id(u.inode, &s->ev.file, &magic)) {
		count_drop(BUILDIDD_DROP_READ_FAILED);
		return 0;
	}
	filename = rdptr(AT(bprm, OFF_LINUX_BINPRM_FILENAME));
	n = bpf_probe_read_kernel_str(s->ev.names, BUILDIDD_PATH_MAX, filename);
	flen = (n > 0 ? n - 1 : 0) & PATH_MASK;
	s->ev.filename_len = flen;
	off = read_path(&u, ms, &s->ev.id_flags, SLOT_LIVE);
	plen = (BUILDIDD_PATH_MAX - off) & PATH_MASK;
	bpf_probe_read_kernel(s->ev.names + flen, plen, ms->buf + (off & PATH_MASK));
	s->ev.path_len = plen;
	size = offsetof(struct exec_event, names) + flen + plen;
	if (size > sizeof(s->ev))
		size = sizeof(s->ev);
	if (!over_budget(&s->ev, size))
		output_event(&s->ev, size);

	mm = rdptr(AT(task, OFF_TASK_STRUCT_MM));
	if (!mm || bpf_probe_read_kernel(s->auxv, sizeof(s->auxv),
					 AT(mm, OFF_MM_STRUCT_SAVED_AUXV))) {
		count_drop(BUILDIDD_DROP_READ_FAILED);
		return 0;
	}
#ifdef TS_COMPAT
	/* An i386 process: create_elf_tables() wrote 32-bit (elf_addr_t) pairs. */
	compat = rd32(AT(task, OFF_TASK_STRUCT_THREAD_INFO_STATUS)) & TS_COMPAT;
#endif
	s->at_phdr = s->at_base = s->at_entry = 0;
	for (i = 0; i < AUXV_LEN; i++) {
		__u64 type, val;

		if (compat) {
			type = ((__u32 *)s->auxv)[2 * i];
			val = ((__u32 *)s->auxv)[2 * i + 1];
		} else {
			if (2 * i + 1 >= AUXV_LEN)
				break;
			type = s->auxv[2 * i];
			val = s->auxv[2 * i + 1];
		}

		/* Into memory, not registers: the loop then verifies once, not once per combination. */
		if (type == AT_NULL)
			break;
		if (type == AT_PHDR)
			s->at_phdr = val;
		else if (type == AT_BASE)
			s->at_base = val;
		else if (type == AT_ENTRY)
			s->at_entry = val;
	}
	st->mm = mm;
	st->addr[0] = s->at_phdr ? s->at_phdr : s->at_entry;
	st->addr[1] = s->at_base;
	st->k = 0;
	st->file = NULL;
	exec_tail.call(ctx, 0);
	count_drop(BUILDIDD_DROP_READ_FAILED);	/* the tail call failed */
	return 0;
}

/*
 * Tail-called from sched_process_exec, then from itself: a call reads one
 * leaf, and the first call for file k also finds its first VMA there and
 * reads the file's identity and path.
 */
int exec_vmas(struct bpf_raw_tracepoint_args *ctx)
{
	struct exec_stage *st;
	struct map_scratch *s;
	struct walk_scratch *w;
	struct vma_info v;
	__u64 cur, last_pivot = 0;
	__u32 zero = 0, k, j, n, leaf_end = 1;
	int idx;

	st = exec_stages.lookup(&zero);
	s = map_scratch.lookup(&zero);
	w = walk_scratch.lookup(&zero);
	if (!st || !s || !w)
		return 0;
	k = st->k;
	if (k >= 2)
		return 0;
	if (!st->file) {
		/*
		 * Start walking file k: the one mapped at addr[k].  Its leaf,
		 * read to find that VMA, is then scanned by this same call.
		 */
		__u64 addr = st->addr[k & 1];
		const void *vma;

		idx = addr ? maple_leaf(mm_root(st->mm), addr, w) : -1;
		vma = idx >= 0 ? (const void *)w->node[(MR64_SLOT_W + idx) & MAPLE_WORD_MASK] : NULL;
		if (!vma || read_vma(vma, &v) || v.start > addr || v.end <= addr || !v.file) {
			if (addr)
				count_drop(BUILDIDD_DROP_NO_VMA);
			exec_next_file(ctx, st);
			return 0;
		}
		fill_header(&s->ev.hdr, BUILDIDD_EV_MAP);
		s->ev.origin = k == 0 ? BUILDIDD_ORIGIN_EXEC_MAIN : BUILDIDD_ORIGIN_EXEC_INTERP;
		if (prepare_map_event(s, v.file, SLOT_LIVE) < 0) {
			count_drop(BUILDIDD_DROP_READ_FAILED);
			exec_next_file(ctx, st);
			return 0;
		}
		st->file = v.file;
		st->cur = cur = v.start;
		st->remaining = EXEC_MAX_VMAS;
		st->leaves = EXEC_MAX_LEAVES;
	} else {
		cur = st->cur;
		idx = st->leaves && st->remaining ? maple_leaf(mm_root(st->mm), cur, w) : -1;
		if (idx < 0) {
			exec_next_file(ctx, st);
			return 0;
		}
	}
	st->leaves -= 1;
	st->nfound = 0;
	for (j = 0; j <= MR64_NPIVOTS; j++) {
		__u64 entry, prev;

		if (j < idx)
			continue;
		/* Slot j spans (pivot[j-1], pivot[j]]; a zero pivot[j-1]: past the data. */
		prev = j ? w->node[(MR64_PIVOT_W + j - 1) & MAPLE_WORD_MASK] : 0;
		if (j && !prev)
			break;
		last_pivot = prev;
		entry = w->node[(MR64_SLOT_W + j) & MAPLE_WORD_MASK];
		if (!entry)
			continue;	/* a gap between VMAs */
		if (entry < KERNEL_MIN_ADDR)
			break;		/* node metadata in the last slot */
		if (read_vma((const void *)entry, &v) || v.file != st->file ||
		    (j && v.start != prev + 1)) {
			leaf_end = 0;	/* another file, anonymous memory, or a stale slot */
			break;
		}
		if (v.flags & VM_EXEC) {
			n = st->nfound;
			if (n >= EXEC_BATCH) {
				leaf_end = 2;	/* found[] is full: go on from here */
				break;
			}
			st->found[n].start = v.start;
			st->found[n].len = v.end - v.start;
			st->found[n].pgoff = v.pgoff << PAGE_SHIFT;
			st->found[n].prot = vm_flags_to_prot(v.flags);
			st->found[n].flags = vm_flags_to_map(v.flags);
			st->nfound = n + 1;
		}
		cur = v.end;
		st->remaining -= 1;
		if (!st->remaining) {
			leaf_end = 0;
			break;
		}
	}
	st->scan_end = cur;
	st->last_pivot = last_pivot;
	st->leaf_end = leaf_end;
	/* Emitted outside the scan: the verifier then walks output_event's retries once per entry. */
	for (n = 0; n < EXEC_BATCH; n++) {
		if (n >= st->nfound)
			break;
		s->ev.start = st->found[n].start;
		s->ev.len = st->found[n].len;
		s->ev.pgoff = st->found[n].pgoff;
		s->ev.prot = st->found[n].prot;
		s->ev.flags = st->found[n].flags;
		submit_map_event(s);
	}
	st->nfound = 0;
	cur = st->scan_end;
	/* Past the leaf's last slot: the file may go on in the next leaf. */
	if (st->leaf_end == 1 && st->last_pivot + 1 > cur)
		cur = st->last_pivot + 1;
	if (!st->leaf_end || cur <= st->cur) {
		exec_next_file(ctx, st);
		return 0;
	}
	st->cur = cur;
	exec_tail.call(ctx, 0);
	return 0;
}

/*
 * Synthesis of the processes that run at start-up, as perf record synthesizes
 * them from /proc/PID/maps: a task_vma iterator (kernel/bpf/task_iter.c)
 * visits every VMA of every process (one task per mm and files: it skips
 * threads sharing both with their leader) under the mm's mmap lock, and each
 * executable file mapping becomes a map_event with origin
 * BUILDIDD_ORIGIN_SYNTHESIZED: the identity, path and build-id read exactly
 * as for a live mapping.  Written with bpf_seq_write to the reader of the
 * iterator (kernel.synth), not to the rings: read() paces it, and nothing is
 * lost however many processes run.  One record is offsetof(path) +
 * path_len bytes, as in a ring.
 */
struct iter_task_vma_ctx {	/* struct bpf_iter__task_vma: every member a BTF pointer */
	void *meta;		/* struct bpf_iter_meta *: its first member is the seq_file */
	void *task;		/* struct task_struct *, NULL at the end */
	void *vma;		/* struct vm_area_struct *, NULL at the end */
};

int bpf_iter__task_vma(struct iter_task_vma_ctx *ctx)
{
	void *seq = (void *)BTF_LD(ctx->meta, 0, void *);
	const void *task = ctx->task, *vma = ctx->vma;
	struct map_scratch *s;
	struct vma_info v;
	__u32 slot = SLOT_ITER, size;

	if (!task || !vma)
		return 0;
	s = map_scratch.lookup(&slot);
	if (!s || read_vma(vma, &v) || !v.file || !(v.flags & VM_EXEC))
		return 0;
	fill_task_header(&s->ev.hdr, BUILDIDD_EV_MAP, task);
	if (s->ev.hdr.pid != s->ev.hdr.tid)	/* a thread with its own files: its leader's mm was seen */
		return 0;
	s->ev.start = v.start;
	s->ev.len = v.end - v.start;
	s->ev.pgoff = v.pgoff << PAGE_SHIFT;
	s->ev.prot = vm_flags_to_prot(v.flags);
	s->ev.flags = vm_flags_to_map(v.flags);
	s->ev.origin = BUILDIDD_ORIGIN_SYNTHESIZED;
	if (prepare_map_event(s, v.file, SLOT_ITER) < 0) {
		count_drop(BUILDIDD_DROP_READ_FAILED);	/* user space rescans /proc after the lost record */
		return 0;
	}
	size = offsetof(struct map_event, path) + (s->ev.path_len & PATH_MASK);
	bpf_seq_write(seq, &s->ev, size);
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
	ev.fork.ppid = rd32(AT(parent, OFF_TASK_STRUCT_TGID));
	ev.fork.ptid = rd32(AT(parent, OFF_TASK_STRUCT_PID));
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
	ev.exit.exit_code = rd32(AT(task, OFF_TASK_STRUCT_EXIT_CODE));
	submit_task_event(&ev);
	return 0;
}

/* Attached by tracer.py to the raw tracepoint task_rename. */
int on_task_rename(struct bpf_raw_tracepoint_args *ctx)
{
	/* TP_PROTO(struct task_struct *task, const char *comm) */
	const void *task = (const void *)ctx->args[0];
	struct task_event ev = {};

#ifdef IN_EXECVE_BIT
	/*
	 * execve names the task after the new program (begin_new_exec) while
	 * task_struct.in_execve is set; the exec event carries that comm.
	 */
	if (rd32(AT(task, IN_EXECVE_BIT / 32 * 4)) & (1U << (IN_EXECVE_BIT % 32)))
		return 0;
#endif
	fill_task_header(&ev.hdr, BUILDIDD_EV_COMM, task);
	bpf_probe_read_kernel_str(ev.hdr.comm, sizeof(ev.hdr.comm), (const void *)ctx->args[1]);
	submit_task_event(&ev);
	return 0;
}

/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The one definition of every struct the kernel side hands to user space.
 *
 * Mirrored once, with ctypes, in daemon/buildidd/events.py; tests/test_events.py
 * compiles this header with gcc and checks that sizes and offsets agree.
 * Fixed-width types only, explicit padding, no bitfields.
 */
#ifndef BUILDIDD_EVENTS_H
#define BUILDIDD_EVENTS_H

#include <linux/types.h>

#define BUILDIDD_COMM_LEN 16
/* Bytes of path carried by an event; a power of two (the BPF side masks with it). */
#define BUILDIDD_PATH_MAX 4096

/* event_header.type */
enum buildidd_event_type {
	BUILDIDD_EV_MAP = 1,	/* struct map_event: an executable file mapping */
	BUILDIDD_EV_EXEC = 2,	/* struct exec_event: execve() succeeded */
	BUILDIDD_EV_FORK = 3,	/* struct task_event: a task was created */
	BUILDIDD_EV_EXIT = 4,	/* struct task_event: a process (thread-group leader) exited */
	BUILDIDD_EV_COMM = 5,	/* struct task_event: comm changed (prctl, /proc/PID/comm) */
};

/* map_event.origin: how the mapping came to be */
enum buildidd_map_origin {
	BUILDIDD_ORIGIN_MMAP = 1,	  /* mmap(2) with PROT_EXEC of a file */
	BUILDIDD_ORIGIN_MPROTECT = 2,	  /* mprotect(2) made a file mapping executable */
	BUILDIDD_ORIGIN_EXEC_MAIN = 3,	  /* mapped by execve: the main executable */
	BUILDIDD_ORIGIN_EXEC_INTERP = 4,  /* mapped by execve: the ELF interpreter (ld.so) */
	BUILDIDD_ORIGIN_SYNTHESIZED = 5,  /* mapped before start-up: found by the task_vma iterator
					   * (bpf_iter__task_vma), as perf synthesizes running tasks */
};

/* map_event.id_flags / exec_event.id_flags (0x1 was "identity known, path not sent") */
#define BUILDIDD_PATH_TRUNCATED 0x2	/* path longer than BUILDIDD_PATH_MAX - 1 bytes: its end is sent */
#define BUILDIDD_PATH_UNREACHABLE 0x4	/* dentry walk hit its depth limit or a dentry read nothing */
#define BUILDIDD_FILE_BACKING 0x8	/* the mapped file is an overlayfs backing file: path and
					 * identity are its user_path's (what the user opened) */
#define BUILDIDD_BID_MEMO 0x10		/* map_event.bid came from the build-id memo: read from this
					 * inode's page cache at an earlier mapping, identity unchanged
					 * since, no writer (bpf/buildid_memo.h) */
#define BUILDIDD_BID_NEW 0x20		/* the build-id memo made an entry at this mapping (an inode, or
					 * an identity or build-id, it had not met): user space may want
					 * the file while its process still lives, so the record forced
					 * a wake-up of the consumer (output_event) */

/* Indexes of the drop counters (map "drops", BPF_F_MMAPABLE: read by user space through its mapping). */
enum buildidd_drop_cause {
	BUILDIDD_DROP_RINGBUF_FULL = 0,	/* bpf_ringbuf_output failed: consumer too slow */
	BUILDIDD_DROP_PENDING_FULL = 1,	/* no room to remember a syscall between enter and exit
					 * (only without SYSCALL_REGS: the syscalls tracepoints) */
	BUILDIDD_DROP_NO_VMA = 2,	/* the mapping's VMA was not found in the mm's maple tree */
	BUILDIDD_DROP_READ_FAILED = 3,	/* a task/mm/file/inode field read nothing (a failed probe
					 * read, or a KLD load of a bad pointer: 0) */
	BUILDIDD_DROP_NCAUSES = 4,
};

/* Common to every event. */
struct event_header {
	__u32 type;		/* enum buildidd_event_type */
	__u32 pid;		/* tgid of the task (the user-space "pid") */
	__u32 tid;		/* pid of the task (the user-space "tid") */
	__u32 uid;		/* the task's real uid (cred->uid in the initial user namespace):
				 * the user the event's costs are charged to */
	__u64 time_ns;		/* bpf_ktime_get_boot_ns(): ns since boot, incl. suspend */
	char comm[BUILDIDD_COMM_LEN];	/* task_struct.comm, NUL-terminated (bytes after the NUL: undefined) */
};

/* Identity of a file, read from its inode at the moment of the event. */
struct file_id {
	__u64 ino;		/* inode.i_ino */
	__u64 size;		/* inode.i_size, bytes */
	__s64 mtime_sec;	/* inode.i_mtime_sec (time64_t) */
	__u32 mtime_nsec;	/* inode.i_mtime_nsec */
	__u32 dev;		/* inode.i_sb->s_dev: kernel dev_t, MAJOR << 20 | MINOR */
	__u32 generation;	/* inode.i_generation (FS_IOC_GETVERSION) */
	__u32 ctime_nsec;	/* inode.i_ctime_nsec (multigrain flag bit 31 cleared) */
	__s64 ctime_sec;	/* inode.i_ctime_sec (time64_t): status change, stat's st_ctime */
	/* the identity key (events.py file_key, _fastpath.c KEY_LEN) ends here */
	__u32 nlink;		/* inode.i_nlink: 0 once the file is deleted */
	__u32 _pad;
};

/* pagecache_build_id.status */
enum pagecache_status {
	PC_NONE = 0,		/* not tried: the kernel path is off or there is no file */
	PC_OK = 1,		/* build_id[0..size) is the first GNU build-id note's descriptor */
	PC_NOT_CACHED = 2,	/* file page `page` is not in the page cache (or not uptodate) */
	PC_NOT_ELF = 3,		/* no ELF magic (or a file shorter than 4 bytes) */
	PC_NO_NOTE = 4,		/* sound ELF, no GNU build-id note in any PT_NOTE segment */
	PC_NOTE_TOO_LARGE = 5,	/* the only GNU build-id note has more than 64 bytes */
	PC_RACED = 6,		/* the folio of page `page` changed while it was read */
	PC_MALFORMED = 7,	/* header, table, segment or note out of the file or inconsistent */
	PC_UNSUPPORTED = 8,	/* big-endian, PN_XNUM, or more headers/notes than the walk takes */
	PC_FAULT = 9,		/* a kernel read failed, or the bases are not known (kernel path off) */
};

#define PC_BUILD_ID_MAX 64	/* longest build-id taken, bytes (resolve/buildid.py BUILD_ID_MAX_BYTES) */

/* The build-id of a mapped file as the BPF side read it from the page cache (bpf/pagecache.h). */
struct pagecache_build_id {
	__u32 status;		/* enum pagecache_status */
	__u32 size;		/* bytes of build_id used (PC_OK), else 0 */
	__u64 page;		/* PC_NOT_CACHED, PC_RACED: the file page index (offset / 4096) */
	__u8 build_id[PC_BUILD_ID_MAX];
};

struct map_event {
	struct event_header hdr;
	__u64 start;		/* vm_start of the mapping, bytes */
	__u64 len;		/* bytes */
	__u64 pgoff;		/* file offset of start, bytes (as PERF_RECORD_MMAP2 pgoff) */
	__u32 prot;		/* PROT_* */
	__u32 flags;		/* MAP_* (for exec-time mappings: MAP_PRIVATE or MAP_SHARED) */
	__u32 origin;		/* enum buildidd_map_origin */
	__u32 id_flags;		/* BUILDIDD_ID_* / BUILDIDD_PATH_* */
	struct file_id file;
	struct pagecache_build_id bid;	/* the GNU build-id of the mapped file (the real file
					 * on overlayfs), read from its page cache at the event */
	__u16 path_len;		/* bytes of path used, no NUL */
	__u8 _pad1[6];
	char path[BUILDIDD_PATH_MAX];	/* path in the task's mount namespace, read for
					 * this event; only path_len bytes of it are sent */
};

struct exec_event {
	struct event_header hdr;
	__u32 old_tid;		/* sched_process_exec's old_pid: the task's pid (the user-space
				 * "tid") before exec; differs from hdr.tid when a non-leader
				 * thread execs (de_thread gives it the leader's pid) */
	__u32 id_flags;		/* BUILDIDD_PATH_* of path (filename is never cut: see names) */
	struct file_id file;	/* linux_binprm.file: the ELF that runs (for a #! script,
				 * its interpreter; = mm_struct.exe_file) */
	__u16 filename_len;	/* bytes of filename in names, no NUL */
	__u16 path_len;		/* bytes of path in names, no NUL */
	__u8 _pad1[4];
	/*
	 * filename_len bytes of linux_binprm.filename (as passed to execve;
	 * longer ones end at BUILDIDD_PATH_MAX - 1 bytes), then path_len bytes
	 * of the path of linux_binprm.file in the task's mount namespace.  Only
	 * filename_len + path_len bytes are sent.
	 */
	char names[2 * BUILDIDD_PATH_MAX];
};

/* What a BUILDIDD_EV_FORK task_event says besides its header: the parent. */
struct task_fork {
	__u32 ppid;		/* tgid of the parent (the user-space "pid") */
	__u32 ptid;		/* pid of the parent thread (the user-space "tid") */
};

/* What a BUILDIDD_EV_EXIT task_event says besides its header. */
struct task_exit {
	__u32 exit_code;	/* task_struct.exit_code: wait(2) status (code << 8 | signal) */
	__u32 _pad;
};

struct task_event {
	struct event_header hdr;
	union {			/* by hdr.type; all zero for BUILDIDD_EV_COMM */
		struct task_fork fork;
		struct task_exit exit;
	};
};

/*
 * A user's record budget (map "uid_budget", key: event_header.uid): a token bucket in bytes of ring
 * records, and a share of the rings between two drains of the consumer.  A MAP or EXEC record of a uid other than 0 that finds too few tokens is not sent; it is
 * counted here, so one user's flood costs that user's own records, never the ring space of root's
 * or another user's.
 */
struct uid_budget {
	__u64 tokens;		/* bytes the uid may send now */
	__u64 last_ns;		/* when tokens were last refilled, ns since boot */
	__u64 records;		/* records not sent since this entry was made */
	__u64 bytes;		/* their bytes */
	__u64 first_ns;		/* the first record not sent, ns since boot (0: none yet) */
	__u64 latest_ns;	/* the latest record not sent, ns since boot */
	__u64 gen;		/* the consumer's drain count (map drain_gen) since_drain counts from */
	__u64 since_drain;	/* bytes sent since the consumer's last drain */
};

/* The budget's settings (map "uid_budget_cfg", one entry), written by user space at start. */
struct uid_budget_cfg {
	__u64 bytes_per_s;	/* refill rate, bytes per second; 0: no budget, every record is sent */
	__u64 burst_bytes;	/* the bucket's size, bytes */
};

/* Per-CPU record of when drops happened (map "drop_times"), ns since boot. */
struct drop_time {
	__u64 first_ns;
	__u64 last_ns;
};

#endif /* BUILDIDD_EVENTS_H */

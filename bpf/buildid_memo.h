/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The build-id memo: what the page-cache reader (bpf/pagecache.h) found for
 * an inode, kept so that the next mapping of the same, unchanged file need
 * not walk its page cache again.  A mmap storm of one library, or an exec
 * storm of one binary, reads the note once and then looks it up.
 *
 * The rule of the project is that a build-id comes from the very file, with
 * the very contents, that was mapped.  A memo entry answers for a mapping
 * only when all of the following hold, checked at that mapping:
 *
 *  - the same struct inode (the key), with the same identity as when it was
 *    read: s_dev, i_ino, i_generation, i_size, i_mtime and i_ctime (struct
 *    file_id, all read again for this event);
 *  - nobody holds the file open for writing: i_writecount <= 0 (fs/open.c
 *    get_write_access; a shared writable mapping holds its struct file, and
 *    so its write access, until it is unmapped).  Stores through such a
 *    mapping change the bytes without touching i_ctime, so a file with a
 *    writer is read from its page cache at every mapping, and never memoized;
 *  - the entry is confirmed: a second page-cache read, at least
 *    BID_MEMO_CONFIRM_NS after the first, found the same identity and the
 *    same build-id.  A write changes i_ctime unless it lands in the coarse
 *    clock tick that set the current i_ctime (inode_set_ctime_current(),
 *    fs/inode.c: the coarse realtime clock, one jiffy, at most 10 ms).  The
 *    first read came after the write that set i_ctime; the second, two ticks
 *    or more later, so any write after it moves i_ctime and the identity no
 *    longer matches.  Writes between the two reads in that same tick are
 *    what the second read checks: it must find the same build-id;
 *  - the file lives on a local file system whose page cache is the file
 *    (memo_local_fs): not FUSE, NFS or another network file system, where
 *    the server can change the bytes without this kernel moving i_ctime.
 *    overlayfs backing files are read every time (the caller skips them).
 *
 * An entry is what user space's strict identity check (resolve/procfs.py)
 * asks of a file it reads after the event, with two more guards: the kernel
 * read the bytes itself, and no writer may exist.
 *
 * The includer declares, after this header:
 *	BPF_TABLE("lru_hash", __u64, struct bid_memo, bid_memo, BID_MEMO_ENTRIES);
 *	BPF_PERCPU_ARRAY(bid_memo_stats, __u64, BID_MEMO_NSTATS);
 */
#ifndef BUILDIDD_BUILDID_MEMO_H
#define BUILDIDD_BUILDID_MEMO_H

#include <linux/types.h>

#include "events.h"	/* struct file_id, struct pagecache_build_id, PC_BUILD_ID_MAX */

#ifndef BID_MEMO_ENTRIES
#define BID_MEMO_ENTRIES 4096	/* inodes remembered (LRU); 160 bytes each */
#endif
#ifndef BID_MEMO_CONFIRM_NS
#define BID_MEMO_CONFIRM_NS 50000000ULL	/* 50 ms: five jiffies at HZ=100 */
#endif

/* include/uapi/linux/magic.h: local file systems whose page cache is the file. */
#define MEMO_EXT4_MAGIC		0xEF53		/* ext2, ext3, ext4 */
#define MEMO_XFS_MAGIC		0x58465342
#define MEMO_BTRFS_MAGIC	0x9123683E
#define MEMO_TMPFS_MAGIC	0x01021994
#define MEMO_SQUASHFS_MAGIC	0x73717368
#define MEMO_EROFS_MAGIC	0xE0F5E1E2
#define MEMO_F2FS_MAGIC		0xF2F52010

struct bid_memo {
	struct file_id id;	/* the inode's identity at the reads (nlink not compared) */
	__u64 first_ns;		/* ns since boot of the read that made the entry */
	__u32 confirmed;	/* 1: a second read >= BID_MEMO_CONFIRM_NS later agreed */
	__u32 size;		/* bytes of build_id */
	__u8 build_id[PC_BUILD_ID_MAX];
};

/* bid_memo_stats indexes (per CPU, summed by user space for `status`). */
enum bid_memo_stat {
	BID_MEMO_HIT = 0,	/* a mapping's build-id answered by a confirmed entry */
	BID_MEMO_FILL = 1,	/* an entry made (or remade: identity or build-id changed) */
	BID_MEMO_CONFIRM = 2,	/* an entry confirmed */
	BID_MEMO_WRITER = 3,	/* not used: the file had a writer (i_writecount > 0) */
	BID_MEMO_NSTATS = 4,
};

static __always_inline int memo_local_fs(__u64 magic)
{
	switch (magic) {
	case MEMO_EXT4_MAGIC:
	case MEMO_XFS_MAGIC:
	case MEMO_BTRFS_MAGIC:
	case MEMO_TMPFS_MAGIC:
	case MEMO_SQUASHFS_MAGIC:
	case MEMO_EROFS_MAGIC:
	case MEMO_F2FS_MAGIC:
		return 1;
	}
	return 0;
}

/* The identity fields of struct file_id up to and including ctime_sec (nlink excluded). */
#define MEMO_ID_WORDS ((offsetof(struct file_id, ctime_sec) + 8) / 8)

static __always_inline int memo_same_id(const struct file_id *a, const struct file_id *b)
{
	const __u64 *x = (const __u64 *)a, *y = (const __u64 *)b;
	__u64 diff = 0;
	int i;

	for (i = 0; i < MEMO_ID_WORDS; i++)
		diff |= x[i] ^ y[i];
	return diff == 0;
}

static __always_inline int memo_same_bid(const struct bid_memo *m, const struct pagecache_build_id *b)
{
	const __u64 *x = (const __u64 *)m->build_id, *y = (const __u64 *)b->build_id;
	__u64 diff = m->size ^ b->size;
	int i;

	for (i = 0; i < PC_BUILD_ID_MAX / 8; i++)
		diff |= x[i] ^ y[i];
	return diff == 0;
}

#endif /* BUILDIDD_BUILDID_MEMO_H */

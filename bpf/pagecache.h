/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The GNU build-id of a file, read in BPF from the file's page cache, as the
 * kernel's lib/buildid.c reads it for perf's PERF_RECORD_MMAP2: the ELF header,
 * the program headers, the notes of every PT_NOTE segment, wherever in the
 * file they lie.  Nothing is read from disk: a page that is not cached ends
 * the read with PC_NOT_CACHED and its index.
 *
 * How a file page is found (Linux 6.18's structures):
 *   file->f_mapping->i_pages is an xarray (lib/xarray.c, include/linux/xarray.h):
 *   xa_head; an internal entry ((e & 3) == 2) above 4096 is a node (node =
 *   e - 2) with xa_node.shift and slots[XA_CHUNK_SIZE]; an internal entry
 *   below 64 << 2 is a sibling of a multi-index (large folio) entry and
 *   names the slot that holds it; a value entry ((e & 1) == 1) is a shadow
 *   or swap entry: the page is not cached.
 *   The folio must be PG_uptodate, not PG_locked, with folio->mapping == the
 *   file's mapping and folio->index <= page < folio->index + (1 << order)
 *   (order = folio->_flags_1 & 0xff when PG_head, include/linux/mm.h
 *   folio_large_order).  The same is checked again after the bytes were
 *   copied: if anything changed, the result is PC_RACED.
 *   Its kernel address: page_offset_base + pfn * 4096 with pfn = (folio -
 *   vmemmap_base) / sizeof(struct page) (the x86_64 direct map and vmemmap;
 *   both bases move with CONFIG_RANDOMIZE_MEMORY and are not in kallsyms:
 *   user space finds them at start-up and writes them to pagecache_bases,
 *   daemon/buildidd/kernel/pagecache.py).
 *
 * Every kernel field is read at a BTF offset passed as -D (pagecache_layout()
 * in daemon/buildidd/kernel/pagecache.py): OFF_FILE_F_MAPPING,
 * OFF_ADDRESS_SPACE_I_PAGES, OFF_XARRAY_XA_HEAD, OFF_XA_NODE_SHIFT,
 * OFF_XA_NODE_SLOTS, XA_CHUNK_SHIFT, OFF_FOLIO_FLAGS, OFF_FOLIO_MAPPING,
 * OFF_FOLIO_INDEX, OFF_FOLIO_FLAGS_1, FOLIO_SPAN_LEN, PG_LOCKED_BIT,
 * PG_UPTODATE_BIT, PG_HEAD_BIT, STRUCT_PAGE_SIZE.
 *
 * The walk is a bounded state machine: at most PC_MAX_STEPS steps, each of
 * which (re)fills a window of at most PC_WIN file bytes when the bytes it
 * needs are not in it, then goes on with the ELF header, the program headers
 * or the notes of the current PT_NOTE segment as far as the window allows.
 * The steps are a bpf_loop (bpf/callbacks.h): the verifier checks one step,
 * once per program, and the step finds its state in the per-CPU scratch
 * value.
 * An ordinary library takes one window (its first PC_WIN bytes) and two or
 * three steps.
 *
 * Only little-endian ELF is read (x86_64 and i386 files); both ELF classes.
 */
#ifndef BUILDIDD_PAGECACHE_H
#define BUILDIDD_PAGECACHE_H

#include <linux/types.h>

#include "callbacks.h"
#include "events.h"	/* enum pagecache_status, struct pagecache_build_id, PC_BUILD_ID_MAX */

/* Filled by user space (pagecache.py) after its start-up discovery; zeros: kernel path off. */
struct pagecache_bases {
	__u64 vmemmap_base;	/* address of struct page of pfn 0 */
	__u64 page_offset_base;	/* kernel (direct map) address of physical address 0 */
};

#ifndef PC_WIN
#define PC_WIN		1024	/* window bytes; a power of two, at most one page (1024: a
				 * read costs less than a whole page's, and the headers and
				 * notes of ordinary files lie in the first KiB) */
#endif
#ifndef PC_MAX_STEPS
#define PC_MAX_STEPS	16	/* windows filled or walked per file */
#endif
#ifndef PC_MAX_PHDRS
#define PC_MAX_PHDRS	256	/* program headers looked at (lib/buildid.c MAX_PHDR_CNT) */
#endif
/*
 * Headers and notes looked at per step.  The verifier follows every step's
 * loops to their end on one path, and refuses a path of more than 8192 jumps
 * ("The sequence of 8193 jumps is too complex").
 */
#ifndef PC_PHDRS_PER_STEP
#define PC_PHDRS_PER_STEP 16
#endif
#ifndef PC_NOTES_PER_STEP
#define PC_NOTES_PER_STEP 8
#endif
#define PC_XA_MAX_DEPTH	6	/* xarray levels: files of up to 2^(6*6) pages */
#define PC_PAGE_SHIFT	12
#define PC_PAGE_SIZE	(1UL << PC_PAGE_SHIFT)
#define PC_WIN_MASK	(PC_WIN - 1)

/* ELF gABI constants (<elf.h>) */
#define PC_ELFCLASS32	1
#define PC_ELFCLASS64	2
#define PC_ELFDATA2LSB	1
#define PC_PT_NOTE	4
#define PC_PN_XNUM	0xffff
#define PC_NT_GNU_BUILD_ID 3
#define PC_GNU_OWNER	0x00554e47U	/* "GNU\0" read as a little-endian u32 */

enum pc_phase {
	PC_PH_EHDR = 0,		/* needs the ELF header */
	PC_PH_PHDRS = 1,	/* scanning program headers from ph_i */
	PC_PH_NOTES = 2,	/* walking the notes of [seg_cur, seg_end) */
	PC_PH_DONE = 3,
};

/*
 * The walk's state.  Its scalar fields are volatile: the compiler must not
 * keep them in registers across steps, or the verifier would see a different
 * state at each loop head for every path through the previous step (phase 1,
 * 2 or 3 ...) and verify the rest once per path (exponential in the steps).
 */
struct pc_scratch {
	/* the file */
	const void *mapping;		/* file->f_mapping */
	volatile __u64 size;		/* file size, bytes */
	/* the window: file bytes [win_off, win_off + win_len) are buf[0, win_len) */
	volatile __u64 win_off;
	volatile __u32 win_len;
	volatile __u32 phase;		/* enum pc_phase */
	volatile __u32 status;		/* the answer once phase is PC_PH_DONE */
	volatile __u32 problem;		/* first problem met, reported if no build-id is found */
	volatile __u64 page;		/* page of a PC_NOT_CACHED/PC_RACED answer */
	/* program headers */
	volatile __u64 phoff;
	volatile __u32 phent, phnum;	/* entry size; count looked at (<= PC_MAX_PHDRS) */
	volatile __u32 ph_i;		/* next header to look at */
	volatile __u32 is64;
	/* the note segment being walked */
	volatile __u64 seg_cur, seg_end;
	volatile __u32 seg_align;	/* 4 or 8 */
	volatile __u32 bid_size;
	volatile __u64 bid_pos;		/* position in buf of the build-id (PC_OK) */
	/* the folio last used (a cache: page 0 usually serves all reads) */
	const void *volatile folio;
	volatile __u64 f_index;		/* folio->index: its first file page */
	volatile __u64 f_nr;		/* pages in the folio */
	volatile __u64 f_kaddr;		/* kernel address of its first page */
	__u8 fhead[FOLIO_SPAN_LEN];
	__u8 buf[2 * PC_WIN];	/* window; twice PC_WIN so that offset + length checks verify */
};

/*
 * The including program declares the two maps (BCC rewrites map calls in the
 * main file only) and passes their values in:
 *	BPF_ARRAY(pagecache_bases, struct pagecache_bases, 1);
 *	BPF_PERCPU_ARRAY(pagecache_scratch, struct pc_scratch, 1);
 */

#define PC_AT(base, off) ((const void *)((const char *)(base) + (off)))
#define PC_FH(s, off, type) (*(type *)((s)->fhead + (off)))

static __always_inline __u64 pc_rd64(const void *p)
{
	__u64 v = 0;

	bpf_probe_read_kernel(&v, sizeof(v), p);
	return v;
}

static __always_inline __u32 pc_buf32(struct pc_scratch *s, __u64 pos)
{
	return *(__u32 *)(s->buf + (pos & PC_WIN_MASK));
}

static __always_inline __u16 pc_buf16(struct pc_scratch *s, __u64 pos)
{
	return *(__u16 *)(s->buf + (pos & PC_WIN_MASK));
}

static __always_inline __u64 pc_buf64(struct pc_scratch *s, __u64 pos)
{
	return *(__u64 *)(s->buf + (pos & PC_WIN_MASK));
}

/* xa_is_node(): an internal entry above 4096 (include/linux/xarray.h). */
static __always_inline int pc_xa_is_node(__u64 e)
{
	return (e & 3) == 2 && e > 4096;
}

/* xa_is_sibling(): an internal entry below xa_mk_internal(XA_CHUNK_SIZE - 1). */
static __always_inline int pc_xa_is_sibling(__u64 e)
{
	return (e & 3) == 2 && e < (((1UL << XA_CHUNK_SHIFT) - 1) << 2);
}

#define PC_XA_RETRY_ENTRY ((256UL << 2) | 2)	/* xa_mk_internal(256): a node being freed */

/*
 * The entry for file page idx in mapping->i_pages, as xas_load() finds it;
 * 0 when there is none.  *retry is set for a retry entry (a concurrent change).
 */
static __always_inline __u64 pc_xa_load(const void *mapping, __u64 idx, int *retry)
{
	__u64 e = pc_rd64(PC_AT(mapping, OFF_ADDRESS_SPACE_I_PAGES + OFF_XARRAY_XA_HEAD));
	const void *node;
	__u64 off;
	__u8 shift;
	int depth;

	if (!pc_xa_is_node(e))
		return idx ? 0 : e;	/* a single entry at the head holds index 0 only */
	for (depth = 0; depth < PC_XA_MAX_DEPTH; depth++) {
		node = (const void *)(e - 2);
		shift = 0;
		if (bpf_probe_read_kernel(&shift, sizeof(shift), PC_AT(node, OFF_XA_NODE_SHIFT)))
			return 0;
		off = idx >> (shift & 63);
		if (depth == 0 && off >> XA_CHUNK_SHIFT)
			return 0;	/* beyond what the tree holds (xas_start) */
		off &= (1UL << XA_CHUNK_SHIFT) - 1;
		e = pc_rd64(PC_AT(node, OFF_XA_NODE_SLOTS + off * 8));
		if (pc_xa_is_sibling(e))
			e = pc_rd64(PC_AT(node, OFF_XA_NODE_SLOTS + ((e >> 2) & ((1UL << XA_CHUNK_SHIFT) - 1)) * 8));
		if (e == PC_XA_RETRY_ENTRY) {
			*retry = 1;
			return 0;
		}
		if (!pc_xa_is_node(e))
			return (e & 3) ? 0 : e;	/* value (shadow) or other internal entry: not cached */
	}
	return 0;
}

/*
 * Reads the first FOLIO_SPAN_LEN bytes of folio into s->fhead and checks it
 * holds file page idx of s->mapping, uptodate and unlocked.
 * Returns PC_OK, PC_NOT_CACHED (not uptodate: being read in), PC_RACED or PC_FAULT.
 */
static __always_inline __u32 pc_folio_check(struct pc_scratch *s, const void *folio, __u64 idx)
{
	__u64 flags, index, nr = 1;

	if (bpf_probe_read_kernel(s->fhead, sizeof(s->fhead), folio))
		return PC_FAULT;
	flags = PC_FH(s, OFF_FOLIO_FLAGS, __u64);
	index = PC_FH(s, OFF_FOLIO_INDEX, __u64);
	if (PC_FH(s, OFF_FOLIO_MAPPING, const void *) != s->mapping)
		return PC_RACED;	/* truncated, or reused for another file */
	if (!(flags & (1UL << PG_UPTODATE_BIT)))
		return PC_NOT_CACHED;
	if (flags & (1UL << PG_LOCKED_BIT))
		return PC_RACED;	/* being written, truncated or migrated */
	if (flags & (1UL << PG_HEAD_BIT))
		nr = 1UL << (PC_FH(s, OFF_FOLIO_FLAGS_1, __u64) & 31);
	if (idx < index || idx - index >= nr)
		return PC_RACED;
	s->f_index = index;
	s->f_nr = nr;
	return PC_OK;
}

/*
 * Makes s->folio the folio holding file page idx (walking the xarray unless
 * the cached folio holds it).  Returns a pagecache_status, PC_OK on success.
 */
static __always_inline __u32 pc_find_folio(struct pc_scratch *s, const struct pagecache_bases *b,
					   __u64 idx)
{
	__u64 folio, pfn;
	__u32 st;
	int retry = 0;

	if (s->folio && idx >= s->f_index && idx - s->f_index < s->f_nr)
		return PC_OK;
	s->folio = NULL;
	folio = pc_xa_load(s->mapping, idx, &retry);
	if (retry)
		return PC_RACED;
	if (!folio)
		return PC_NOT_CACHED;
	if (folio < b->vmemmap_base || (folio - b->vmemmap_base) % STRUCT_PAGE_SIZE)
		return PC_FAULT;
	st = pc_folio_check(s, (const void *)folio, idx);
	if (st != PC_OK)
		return st;
	pfn = (folio - b->vmemmap_base) / STRUCT_PAGE_SIZE;
	s->f_kaddr = b->page_offset_base + (pfn << PC_PAGE_SHIFT);
	s->folio = (const void *)folio;
	return PC_OK;
}

/*
 * Fills the window with the file bytes from off: min(PC_WIN, size - off)
 * bytes (off < size), from at most two folios, each checked again after
 * its bytes were copied.  A second page that cannot be read only shortens
 * the window when the first `need` bytes are in it (a note at the end of
 * page 0 needs nothing from page 1).  Returns a pagecache_status; on
 * failure s->page says which page.
 */
static __always_inline __u32 pc_fill(struct pc_scratch *s, const struct pagecache_bases *b,
				     __u64 off, __u64 need)
{
	__u64 len, done = 0;
	__u32 st;
	int k;

	len = s->size - off;
	if (len > PC_WIN)
		len = PC_WIN;
	s->win_len = 0;
	for (k = 0; k < 2; k++) {
		__u64 pos = off + done, idx = pos >> PC_PAGE_SHIFT, n, src;
		const void *folio;

		if (done >= len)
			break;
		n = PC_PAGE_SIZE - (pos & (PC_PAGE_SIZE - 1));
		if (n > len - done)
			n = len - done;
		s->page = idx;
		st = pc_find_folio(s, b, idx);
		if (st != PC_OK && done && done >= need)
			break;
		if (st != PC_OK)
			return st;
		folio = s->folio;
		src = s->f_kaddr + ((idx - s->f_index) << PC_PAGE_SHIFT) + (pos & (PC_PAGE_SIZE - 1));
		if (n > PC_WIN || done > PC_WIN)
			return PC_FAULT;
		if (bpf_probe_read_kernel(s->buf + (done & (2 * PC_WIN - 1)), n, (const void *)src))
			return PC_FAULT;
		/* The folio again: still this file's page, uptodate, unlocked. */
		st = pc_folio_check(s, folio, idx);
		if (st != PC_OK) {
			s->folio = NULL;
			return PC_RACED;
		}
		done += n;
	}
	s->win_off = off;
	s->win_len = done;
	return PC_OK;
}

static __always_inline void pc_finish(struct pc_scratch *s, __u32 status)
{
	s->status = status;
	s->phase = PC_PH_DONE;
}

static __always_inline void pc_remember(struct pc_scratch *s, __u32 problem)
{
	if (!s->problem)
		s->problem = problem;
}

/* Window position of file bytes [off, off + len), or -1 when they are not all in it. */
static __always_inline __s64 pc_in_window(struct pc_scratch *s, __u64 off, __u64 len)
{
	if (off < s->win_off || off - s->win_off > s->win_len || len > s->win_len - (off - s->win_off))
		return -1;
	return off - s->win_off;
}

/* The ELF header (window from offset 0): class, program header table. */
static __always_inline void pc_ehdr(struct pc_scratch *s)
{
	__u64 need, phoff;
	__u32 ident, phent, phnum;

	if (s->size < 4 || pc_buf32(s, 0) != 0x464c457fU) {	/* "\x7fELF" */
		pc_finish(s, PC_NOT_ELF);
		return;
	}
	ident = pc_buf32(s, 4);		/* EI_CLASS, EI_DATA, EI_VERSION, EI_OSABI */
	if ((ident >> 8 & 0xff) != PC_ELFDATA2LSB) {
		pc_finish(s, PC_UNSUPPORTED);
		return;
	}
	if ((ident & 0xff) == PC_ELFCLASS64) {
		s->is64 = 1;
		need = 64;
	} else if ((ident & 0xff) == PC_ELFCLASS32) {
		s->is64 = 0;
		need = 52;
	} else {
		pc_finish(s, PC_UNSUPPORTED);
		return;
	}
	if (s->win_len < need) {
		pc_finish(s, PC_MALFORMED);	/* shorter than its ELF header */
		return;
	}
	if (s->is64) {
		phoff = pc_buf64(s, 32);	/* Elf64_Ehdr.e_phoff */
		phent = pc_buf16(s, 54);	/* e_phentsize */
		phnum = pc_buf16(s, 56);	/* e_phnum */
	} else {
		phoff = pc_buf32(s, 28);
		phent = pc_buf16(s, 42);
		phnum = pc_buf16(s, 44);
	}
	if (phnum == 0) {
		pc_finish(s, PC_NO_NOTE);
		return;
	}
	if (phnum == PC_PN_XNUM) {
		pc_finish(s, PC_UNSUPPORTED);	/* the count is in section 0 */
		return;
	}
	if (phent != (s->is64 ? 56 : 32) || phoff > s->size || (__u64)phent * phnum > s->size - phoff) {
		pc_finish(s, PC_MALFORMED);
		return;
	}
	s->phoff = phoff;
	s->phent = phent;
	s->phnum = phnum > PC_MAX_PHDRS ? PC_MAX_PHDRS : phnum;
	if (phnum > PC_MAX_PHDRS)
		pc_remember(s, PC_UNSUPPORTED);
	s->ph_i = 0;
	s->phase = PC_PH_PHDRS;
}

/*
 * Program headers from ph_i while they are in the window; the first PT_NOTE
 * segment found becomes the current one (phase PC_PH_NOTES, ph_i past it).
 */
static __always_inline void pc_phdrs(struct pc_scratch *s)
{
	__u64 off, filesz, align;
	__s64 pos;
	int j;

	for (j = 0; j < PC_PHDRS_PER_STEP; j++) {
		if (s->phase != PC_PH_PHDRS)
			break;
		if (s->ph_i >= s->phnum) {
			pc_finish(s, s->problem ? s->problem : PC_NO_NOTE);
			break;
		}
		pos = pc_in_window(s, s->phoff + (__u64)s->ph_i * s->phent, s->phent);
		if (pos < 0)
			break;		/* the next step moves the window */
		s->ph_i += 1;
		if (pc_buf32(s, pos) != PC_PT_NOTE)
			continue;
		if (s->is64) {
			off = pc_buf64(s, pos + 8);	/* Elf64_Phdr.p_offset */
			filesz = pc_buf64(s, pos + 32);	/* p_filesz */
			align = pc_buf64(s, pos + 48);	/* p_align */
		} else {
			off = pc_buf32(s, pos + 4);
			filesz = pc_buf32(s, pos + 16);
			align = pc_buf32(s, pos + 28);
		}
		if (!filesz)
			continue;
		if (off > s->size || filesz > s->size - off) {
			pc_remember(s, PC_MALFORMED);
			continue;
		}
		s->seg_cur = off;
		s->seg_end = off + filesz;
		s->seg_align = align == 8 ? 8 : 4;
		s->phase = PC_PH_NOTES;
	}
}

/*
 * Notes of the current segment while they are in the window (ELF gABI "Note
 * Section": namesz, descsz, type, then name and descriptor each padded to
 * the alignment).  The first GNU build-id note of 1..64 bytes ends the walk.
 */
static __always_inline void pc_notes(struct pc_scratch *s)
{
	__u64 namesz, descsz, type, mask, desc_off, desc_end;
	__s64 pos;
	int j;

	for (j = 0; j < PC_NOTES_PER_STEP; j++) {
		if (s->phase != PC_PH_NOTES)
			break;
		if (s->seg_end - s->seg_cur < 12) {
			s->phase = PC_PH_PHDRS;		/* segment done */
			break;
		}
		pos = pc_in_window(s, s->seg_cur, 12);
		if (pos < 0)
			break;
		mask = s->seg_align - 1;
		namesz = pc_buf32(s, pos);
		descsz = pc_buf32(s, pos + 4);
		type = pc_buf32(s, pos + 8);
		desc_off = (12 + namesz + mask) & ~mask;
		desc_end = desc_off + descsz;
		if (12 + namesz > s->seg_end - s->seg_cur || desc_end > s->seg_end - s->seg_cur) {
			pc_remember(s, PC_MALFORMED);	/* overruns its segment */
			s->phase = PC_PH_PHDRS;
			break;
		}
		if (type == PC_NT_GNU_BUILD_ID && namesz == 4) {
			if (pc_in_window(s, s->seg_cur, desc_end) < 0 && descsz <= PC_BUILD_ID_MAX)
				break;		/* the next step brings the whole note */
			if (pc_buf32(s, pos + 12) == PC_GNU_OWNER) {
				if (descsz > PC_BUILD_ID_MAX) {
					pc_remember(s, PC_NOTE_TOO_LARGE);
				} else if (!descsz) {
					pc_remember(s, PC_MALFORMED);
				} else {
					s->bid_pos = pos + desc_off;
					s->bid_size = descsz;
					pc_finish(s, PC_OK);
					break;
				}
			}
		}
		s->seg_cur += (desc_end + mask) & ~mask;
	}
}

/* The file offset the next step needs in the window, and how many bytes from it. */
static __always_inline __u64 pc_need(struct pc_scratch *s, __u64 *len)
{
	if (s->phase == PC_PH_PHDRS) {
		*len = s->phent;
		return s->phoff + (__u64)s->ph_i * s->phent;
	}
	if (s->phase == PC_PH_NOTES) {
		*len = 12 + 4 + PC_BUILD_ID_MAX;	/* a build-id note's header, name, descriptor */
		if (*len > s->seg_end - s->seg_cur)
			*len = s->seg_end - s->seg_cur;
		return s->seg_cur;
	}
	*len = 64;
	return 0;
}

/*
 * One step of the walk: (re)fill the window if the bytes the current phase
 * needs are not in it, then go on with the ELF header, the program headers
 * or the notes as far as the window allows.  Returns 1 when the walk is over
 * (s->phase PC_PH_DONE), else 0: the body of the bpf_loop callback
 * (bpf/callbacks.h) that the including program defines for its scratch slot:
 *	int NAME(__u32 i) { ...look up s and b...; return s && b ? pc_step(s, b) : 1; }
 */
static __always_inline int pc_step(struct pc_scratch *s, const struct pagecache_bases *b)
{
	__u64 off, len;
	__u32 st;

	if (s->phase == PC_PH_DONE)
		return 1;
	off = pc_need(s, &len);
	if (pc_in_window(s, off, len) < 0) {
		if (off >= s->size || (off == s->win_off && s->win_len)) {
			pc_finish(s, PC_MALFORMED);	/* cannot be in the file */
			return 1;
		}
		st = pc_fill(s, b, off, len);
		if (st != PC_OK) {
			pc_finish(s, st);
			return 1;
		}
	}
	if (s->phase == PC_PH_EHDR)
		pc_ehdr(s);
	pc_phdrs(s);
	pc_notes(s);
	return s->phase == PC_PH_DONE ? 1 : 0;
}

/*
 * The GNU build-id of the file whose page cache is mapping (its struct
 * file's f_mapping, a struct address_space *) and whose size is size bytes,
 * into *out.  s: this CPU's scratch; b: the bases (NULL or zeros: off);
 * step: BPF_CALLBACK(k) of the program's callback that runs pc_step over
 * this same s and b (bpf/callbacks.h): the steps are a bpf_loop, verified
 * once.
 */
static __always_inline void pagecache_build_id(const void *mapping, __u64 size,
					       struct pagecache_build_id *out,
					       struct pc_scratch *s, const struct pagecache_bases *b,
					       void *step)
{
	out->status = PC_FAULT;
	out->size = 0;
	out->page = 0;
	if (!s || !b || !b->vmemmap_base || !b->page_offset_base)
		return;
	s->mapping = mapping;
	if (!s->mapping)
		return;
	s->size = size;
	s->win_off = 0;
	s->win_len = 0;
	s->phase = PC_PH_EHDR;
	s->status = PC_UNSUPPORTED;	/* the steps ran out */
	s->problem = 0;
	s->folio = NULL;
	s->page = 0;
	if (size < 4) {
		out->status = PC_NOT_ELF;
		return;
	}
	bpf_loop(PC_MAX_STEPS, step, NULL, 0);
	out->status = s->phase == PC_PH_DONE ? s->status : PC_UNSUPPORTED;
	out->page = s->page;
	if (out->status == PC_OK) {
		out->size = s->bid_size & (PC_BUILD_ID_MAX * 2 - 1);
		bpf_probe_read_kernel(out->build_id, PC_BUILD_ID_MAX, s->buf + (s->bid_pos & PC_WIN_MASK));
	}
}

#endif /* BUILDIDD_PAGECACHE_H */

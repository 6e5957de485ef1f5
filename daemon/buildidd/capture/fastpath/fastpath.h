/* SPDX-License-Identifier: GPL-2.0 */
/*
 * What the parts of the fast path share (capture/_fastpath.c is the module;
 * fastpath/rings.c reads the rings and sleeps, fastpath/templates.c formats
 * lines from records.py's templates, fastpath/records.c is run()).
 */
#ifndef BUILDIDD_FASTPATH_H
#define BUILDIDD_FASTPATH_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/epoll.h>
#include <time.h>
#include <unistd.h>

#include "events.h"

/* Shared between the files of the module only, not exported from the .so. */
#define FP_INTERNAL __attribute__((visibility("hidden")))

/* kernel/bpf/ringbuf.c: record header bits and size */
#define RINGBUF_BUSY_BIT (1U << 31)
#define RINGBUF_DISCARD_BIT (1U << 30)
#define RINGBUF_HDR_SZ 8

/* The identity key: struct file_id without nlink (events.py: file_key). */
#define KEY_LEN offsetof(struct file_id, nlink)
/*
 * The fast table's key of a mapping (events.py: answer_key): the identity
 * key, followed, when the kernel's read is the whole answer (kernel_final),
 * by the status byte and the build-id the kernel read.
 */
#define ANSWER_KEY_MAX (KEY_LEN + 1 + PC_BUILD_ID_MAX)
#define MAP_MIN_LEN offsetof(struct map_event, path)
#define TASK_LEN sizeof(struct task_event)
/* live sets stop growing at this many mappings per process (capture/tables.py) */
#define LIVE_MAX 4096
#define U64_DIGITS 20

static inline uint64_t ld_u64(const char *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline uint32_t ld_u32(const char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint16_t ld_u16(const char *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/*
 * A records.py template (bytes with %d and %s conversions only) split once
 * into literal pieces: lit[0] conv[0] lit[1] conv[1] ... lit[nconv].
 */
#define MAX_CONV 16
struct tmpl {
	PyObject *owner;		/* the template bytes (the pieces point into it), owned */
	const char *lit[MAX_CONV + 1];
	Py_ssize_t litlen[MAX_CONV + 1];
	char conv[MAX_CONV];
	int nconv;
	Py_ssize_t fixed;		/* bytes of literal text */
};

struct arg {
	uint64_t u;			/* %d: an unsigned integer */
	const char *s;			/* %s: bytes */
	Py_ssize_t len;
};

enum { T_MMAP, T_FORK, T_EXIT, T_COMM, T_EXEC, T_EXEC_PREFIX, T_N };

enum { HELD_F_RECORD, HELD_F_STEP, HELD_F_KEY, HELD_F_PREFIX, HELD_NF };
enum { FAST_F_RESOLUTION, FAST_F_ERROR, FAST_F_RES_TAIL, FAST_NF };

/* The line templates of records.py, parsed by configure() (templates.c). */
extern FP_INTERNAL struct tmpl templates[T_N];
extern FP_INTERNAL PyObject *kernel_status_json;

/* Formatting, inlined into run()'s loop (records.c) and used by templates.c. */
static const char digit_pairs[201] =
	"00010203040506070809101112131415161718192021222324252627282930313233343536373839"
	"40414243444546474849505152535455565758596061626364656667686970717273747576777879"
	"8081828384858687888990919293949596979899";

/* v in decimal at o; returns the end.  Two digits per division (most values have 10 to 19). */
static inline char *put_u64(char *o, uint64_t v)
{
	char tmp[U64_DIGITS];
	int n = U64_DIGITS;

	while (v >= 100) {
		unsigned r = (unsigned)(v % 100);

		v /= 100;
		tmp[--n] = digit_pairs[2 * r + 1];
		tmp[--n] = digit_pairs[2 * r];
	}
	if (v >= 10) {
		tmp[--n] = digit_pairs[2 * v + 1];
		tmp[--n] = digit_pairs[2 * v];
	} else {
		tmp[--n] = (char)('0' + v);
	}
	memcpy(o, tmp + n, U64_DIGITS - n);
	return o + (U64_DIGITS - n);
}

/* The most bytes t filled with a can take (each %d at its widest). */
static inline Py_ssize_t tmpl_cap(const struct tmpl *t, const struct arg *a)
{
	Py_ssize_t cap = t->fixed;

	for (int i = 0; i < t->nconv; i++)
		cap += t->conv[i] == 'd' ? U64_DIGITS : a[i].len;
	return cap;
}

/* The template t with args a substituted, at o (tmpl_cap() bytes of room); returns the end. */
static inline char *format_into(char *o, const struct tmpl *t, const struct arg *a)
{
	for (int i = 0; i < t->nconv; i++) {
		memcpy(o, t->lit[i], t->litlen[i]);
		o += t->litlen[i];
		if (t->conv[i] == 'd') {
			o = put_u64(o, a[i].u);
		} else {
			memcpy(o, a[i].s, a[i].len);
			o += a[i].len;
		}
	}
	memcpy(o, t->lit[t->nconv], t->litlen[t->nconv]);
	return o + t->litlen[t->nconv];
}

/*
 * A new bytes object: the template with args substituted.  The line is put
 * together in a scratch buffer and copied once into a bytes object of its
 * exact size: an object allocated at the worst case and shrunk afterwards
 * costs a realloc per line (most lines are over pymalloc's 512 bytes).  One
 * static scratch is enough: callers hold the GIL, and nothing here releases it.
 */
static inline PyObject *format_line(const struct tmpl *t, const struct arg *a)
{
	static char scratch[8192];
	Py_ssize_t cap = tmpl_cap(t, a);
	PyObject *out;
	char *end;

	if (cap <= (Py_ssize_t)sizeof(scratch))
		return PyBytes_FromStringAndSize(scratch, format_into(scratch, t, a) - scratch);
	out = PyBytes_FromStringAndSize(NULL, cap);
	if (out == NULL)
		return NULL;
	end = format_into(PyBytes_AS_STRING(out), t, a);
	if (_PyBytes_Resize(&out, end - PyBytes_AS_STRING(out)) < 0)
		return NULL;
	return out;
}

/* The LineBuffer type (linebuf.c): a step's pending lines, each ending in a newline. */
struct linebuf {
	PyObject_HEAD
	char *buf;
	Py_ssize_t len, cap;	/* bytes used, allocated */
	Py_ssize_t lines;	/* newlines in buf[0..len) */
	Py_ssize_t exports;	/* buffer views alive: no change meanwhile */
};
extern FP_INTERNAL PyTypeObject *LineBuffer;
extern FP_INTERNAL PyType_Spec linebuf_spec;
/* Room for more bytes after len (grown by doubling): 0, or -1 with an error set. */
FP_INTERNAL int linebuf_reserve(struct linebuf *b, Py_ssize_t more);

/*
 * Append the template with args substituted, and a newline, to the
 * LineBuffer out: formatted in place, no object per line.  0, or -1 with an
 * error set.
 */
static inline int append_line(struct linebuf *out, const struct tmpl *t, const struct arg *a)
{
	char *end;

	if (linebuf_reserve(out, tmpl_cap(t, a) + 1) < 0)
		return -1;
	end = format_into(out->buf + out->len, t, a);
	*end++ = '\n';
	out->len = end - out->buf;
	out->lines++;
	return 0;
}

/* A record and its event_header.time_ns, as the merge orders them. */
struct timed {
	uint64_t time_ns;
	const void *p;		/* sort_by_time: the bytes object (borrowed); Batch: the record in ring memory */
	uint32_t len;		/* Batch: the record's bytes */
	uint32_t ring;		/* Batch: the index of its ring */
};

/* event_header.time_ns of a record at s, len bytes (of a short one: the bytes present of 16..24). */
static inline uint64_t record_time_at(const char *s, Py_ssize_t len)
{
	uint64_t t = 0;

	if (len >= 24)
		return ld_u64(s + 16);
	for (Py_ssize_t i = len - 1; i >= 16; i--)
		t = (t << 8) | (unsigned char)s[i];
	return t;
}

/* A BPF ring's mappings hold its layout (read_ring's doc): 0, or -1 with ValueError set. */
FP_INTERNAL int ring_layout_check(const Py_buffer *cons, const Py_buffer *data, Py_ssize_t page, uint64_t mask);

/*
 * The one walk of a ring (kernel/bpf/ringbuf.c's layout and ordering): every
 * complete record from consumer_pos to producer_pos is noted in place into
 * *recs (n used, cap allocated; grown as needed), stopping at one still being
 * written (BUSY), discarded ones skipped.  *end: the position after the last
 * record walked (at a bad record when it fails).  Stores nothing.  0, or -1
 * with an error set (a record larger than the ring, no memory).  *begin: the
 * consumer_pos the walk started from (read once, here).
 */
FP_INTERNAL int walk_ring(const Py_buffer *cons, const Py_buffer *data, Py_ssize_t page, uint64_t mask,
			  struct timed **recs, Py_ssize_t *n, Py_ssize_t *cap, uint64_t *begin, uint64_t *end);

/*
 * Stable natural merge of v[0..n) by time_ns into v or tmp (rings.c); returns
 * the one that holds the result, NULL when out of memory.
 */
FP_INTERNAL struct timed *merge_runs(struct timed *v, struct timed *tmp, Py_ssize_t n);

/* The Batch type (batch.c): a step's records in ring memory. */
extern FP_INTERNAL PyTypeObject *Batch;
extern FP_INTERNAL PyType_Spec batch_spec;
FP_INTERNAL int batch_record(PyObject *batch, Py_ssize_t i, const char **r, Py_ssize_t *len);
FP_INTERNAL Py_ssize_t batch_len(PyObject *batch);
/*
 * Give back to the kernel the rings' space of every record before index i of
 * the batch that is no longer needed (to the last checkpoint at or below i:
 * batch.c RELEASE_STRIDE); the mappings stay held.  Never fails.
 */
FP_INTERNAL void batch_release_to(PyObject *batch, Py_ssize_t i);
/* Records between two partial releases inside run() (a power of two). */
#define RELEASE_STRIDE 1024

/* The named types and the interned attribute names (_fastpath.c). */
extern FP_INTERNAL PyTypeObject *HeldExec, *FastEntry, *RunCounts;
extern FP_INTERNAL PyObject *s_fast, *s_held, *s_live, *s_comm_json, *s_filename_json, *s_path_json, *s_origins,
	*s_missing, *s_out, *s_step, *s_entries, *s_fill, *s_hits, *s_path_cut_json, *s_execs, *s_live_entries,
	*s_live_max_entries;

/* The module's functions and their docs. */
extern FP_INTERNAL const char read_ring_doc[], quiet_wait_doc[], sort_by_time_doc[], configure_doc[], run_doc[],
	take_doc[];
FP_INTERNAL PyObject *read_ring(PyObject *self, PyObject *args);
FP_INTERNAL PyObject *quiet_wait(PyObject *self, PyObject *args);
FP_INTERNAL PyObject *sort_by_time(PyObject *self, PyObject *arg);
FP_INTERNAL PyObject *configure(PyObject *self, PyObject *args);
FP_INTERNAL PyObject *run(PyObject *self, PyObject *args);
FP_INTERNAL PyObject *take(PyObject *self, PyObject *arg);

#endif /* BUILDIDD_FASTPATH_H */

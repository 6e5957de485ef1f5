/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The recorder's per-event hot path, in C: reading the BPF ring buffers and
 * turning the common records into session-log lines.
 *
 * Python (the recorder and its exec join) owns every decision that needs more than a dict lookup:
 * resolving an identity, holding an exec, a record with a path, a malformed
 * record.  run() handles records for as long as they need nothing of that,
 * and returns the index of the first one that does; Python records that one
 * and calls run() again.  Lines are formatted from the templates of
 * records.py (given once to configure()), so the JSON of a record is defined
 * in one place; tests/capture/test_fastpath.py checks the lines byte for byte against
 * the Python path.
 *
 * Record layouts come from bpf/events.h, the one definition of the wire format.
 */
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

/* ---- ring buffers ------------------------------------------------------ */

PyDoc_STRVAR(read_ring_doc,
"read_ring(cons, data, page, mask, out) -> (records, bytes)\n\n"
"Append every complete record now in one BPF ring buffer to the list out (as\n"
"bytes, without the 8-byte record header) and advance consumer_pos; returns how\n"
"many, and how many bytes of the ring they took (headers, discarded records and\n"
"padding included: the backlog this read cleared).  cons: writable buffer over the consumer page; data: buffer over the\n"
"producer page followed by the data area mapped twice (page bytes, then\n"
"2 * (mask + 1)); mask: data size - 1 (a power of two minus one).  The layout\n"
"and the ordering rules are the kernel's (kernel/bpf/ringbuf.c): producer_pos\n"
"and each length are read with acquire semantics, consumer_pos is stored with\n"
"release semantics.  Stops at a record still being written (BUSY bit).\n"
"Raises ValueError when a buffer is smaller than the layout needs.");

static PyObject *read_ring(PyObject *self, PyObject *args)
{
	PyObject *cons_obj, *data_obj, *out;
	Py_ssize_t page;
	unsigned long long mask;
	Py_buffer cons, data;
	long n = 0;
	unsigned long long consumed = 0;

	if (!PyArg_ParseTuple(args, "OOnKO!", &cons_obj, &data_obj, &page, &mask, &PyList_Type, &out))
		return NULL;
	if (PyObject_GetBuffer(cons_obj, &cons, PyBUF_WRITABLE) < 0)
		return NULL;
	if (PyObject_GetBuffer(data_obj, &data, PyBUF_SIMPLE) < 0) {
		PyBuffer_Release(&cons);
		return NULL;
	}
	if (cons.len < 8 || page < 8 || (mask & (mask + 1)) != 0 ||
	    (unsigned long long)data.len < (unsigned long long)page + 2 * (mask + 1)) {
		PyErr_SetString(PyExc_ValueError, "ring buffer mappings smaller than their layout");
		goto out;
	}
	{
		uint64_t *cons_pos = (uint64_t *)cons.buf;
		const uint64_t *prod_pos = (const uint64_t *)data.buf;
		const char *area = (const char *)data.buf + page;
		uint64_t c = __atomic_load_n(cons_pos, __ATOMIC_RELAXED);
		uint64_t p = __atomic_load_n(prod_pos, __ATOMIC_ACQUIRE);

		while (c < p) {
			const char *rec = area + (c & mask);
			uint32_t len = __atomic_load_n((const uint32_t *)rec, __ATOMIC_ACQUIRE);

			if (len & RINGBUF_BUSY_BIT)
				break;
			uint32_t size = len & ~(RINGBUF_BUSY_BIT | RINGBUF_DISCARD_BIT);
			if (size > mask + 1 - RINGBUF_HDR_SZ) {
				PyErr_Format(PyExc_ValueError, "ring record of %u bytes in a %llu-byte ring",
					     size, mask + 1);
				break;
			}
			if (!(len & RINGBUF_DISCARD_BIT)) {
				PyObject *b = PyBytes_FromStringAndSize(rec + RINGBUF_HDR_SZ, size);
				if (b == NULL || PyList_Append(out, b) < 0) {
					Py_XDECREF(b);
					break;
				}
				Py_DECREF(b);
				n++;
			}
			c += (size + RINGBUF_HDR_SZ + 7) & ~7ULL;
		}
		/* Records before c are consumed even when an error stopped the loop. */
		consumed = c - __atomic_load_n(cons_pos, __ATOMIC_RELAXED);
		__atomic_store_n(cons_pos, c, __ATOMIC_RELEASE);
	}
out:
	PyBuffer_Release(&data);
	PyBuffer_Release(&cons);
	if (PyErr_Occurred())
		return NULL;
	return Py_BuildValue("(lK)", n, consumed);
}

/* ---- the quiet wait ------------------------------------------------------ */

/* quiet_wait()'s results: why it returned (capture/rings.py QuietEnd mirrors them). */
enum quiet_end { QUIET_TIMEOUT = 0, QUIET_RECORDS = 1, QUIET_WOKEN = 2, QUIET_DROPS = 3, QUIET_KICKED = 4 };

PyDoc_STRVAR(quiet_wait_doc,
"quiet_wait(epfd, rings, drops, drops_seen, sleeping, wake_fd, poll_s, max_s) -> int\n\n"
"Sleep, without running any Python, until there is something to record;\n"
"returns why it stopped: 0 max_s seconds passed, 1 a ring holds a record\n"
"(producer_pos != consumer_pos), 2 the epoll instance epfd reported a ring's\n"
"wake-up, 3 a kernel drop counter differs from drops_seen, 4 only wake_fd\n"
"was ready (another thread's kick, a signal).\n"
"rings: a tuple of buffers, for each ring its consumer page then its producer\n"
"page (read_ring's cons and data; only the first u64 of each, the position,\n"
"is read).  drops: a buffer of the drops map's counters (u64 each);\n"
"drops_seen: bytes of the same length, the totals last reported.  sleeping:\n"
"a writable u64 buffer (the mapped drain_gen[DRAIN_GEN_SLEEPING]) set to 1\n"
"for the wait and back to 0 after it: meanwhile the BPF side commits records\n"
"with the ring's adaptive wake-up, which wakes epfd at the first record.  A\n"
"program that read the flag before it was set may still commit a record\n"
"without waking: the first sleep is therefore at most poll_s, the checks are\n"
"made again after it, and only then does the thread sleep until the next\n"
"event or max_s.  wake_fd (-1 for none): a non-blocking pipe's read end in\n"
"epfd (written by signal.set_wakeup_fd and by other threads), read dry when\n"
"it is ready.  Pending signal handlers run before each check and after a\n"
"wake-up; the GIL is released while asleep.\n"
"Raises OSError (epoll_wait failed), ValueError (a buffer too small), or what\n"
"a signal handler raises.");

static double mono_s(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return (double)t.tv_sec + t.tv_nsec / 1e9;
}

#define QUIET_RINGS_MAX 64

/* The first reason among a ring holding a record and moved drop counters; -1 for none. */
static int quiet_reason(const Py_buffer *bufs, Py_ssize_t nbuf, const Py_buffer *drops, const char *seen)
{
	for (Py_ssize_t i = 0; i + 1 < nbuf; i += 2) {
		uint64_t c = __atomic_load_n((const uint64_t *)bufs[i].buf, __ATOMIC_RELAXED);
		uint64_t p = __atomic_load_n((const uint64_t *)bufs[i + 1].buf, __ATOMIC_ACQUIRE);

		if (p != c)
			return QUIET_RECORDS;
	}
	if (memcmp((const void *)drops->buf, seen, (size_t)drops->len) != 0)
		return QUIET_DROPS;
	return -1;
}

static PyObject *quiet_wait(PyObject *self, PyObject *args)
{
	PyObject *rings, *drops_obj, *sleeping_obj;
	const char *seen;
	Py_ssize_t seen_len, nbuf = 0;
	int epfd, wake_fd, rc = -1, have_drops = 0, have_sleeping = 0;
	double poll_s, max_s, deadline, recheck;
	Py_buffer bufs[QUIET_RINGS_MAX], drops, sleeping;
	uint64_t *flag = NULL;

	if (!PyArg_ParseTuple(args, "iO!Oy#Oidd", &epfd, &PyTuple_Type, &rings, &drops_obj, &seen, &seen_len,
			      &sleeping_obj, &wake_fd, &poll_s, &max_s))
		return NULL;
	if (PyTuple_GET_SIZE(rings) % 2 || PyTuple_GET_SIZE(rings) > QUIET_RINGS_MAX) {
		PyErr_SetString(PyExc_ValueError, "rings: a consumer and a producer buffer per ring");
		return NULL;
	}
	if (PyObject_GetBuffer(drops_obj, &drops, PyBUF_SIMPLE) < 0)
		goto out;
	have_drops = 1;
	if (PyObject_GetBuffer(sleeping_obj, &sleeping, PyBUF_WRITABLE) < 0)
		goto out;
	have_sleeping = 1;
	if (drops.len != seen_len || sleeping.len < 8) {
		PyErr_SetString(PyExc_ValueError, "drops and drops_seen differ in length, or sleeping is not a u64");
		goto out;
	}
	for (; nbuf < PyTuple_GET_SIZE(rings); nbuf++) {
		if (PyObject_GetBuffer(PyTuple_GET_ITEM(rings, nbuf), &bufs[nbuf], PyBUF_SIMPLE) < 0)
			goto out;
		if (bufs[nbuf].len < 8) {
			nbuf++;
			PyErr_SetString(PyExc_ValueError, "a ring page smaller than its position");
			goto out;
		}
	}
	flag = (uint64_t *)sleeping.buf;
	/* seq_cst: the flag is visible before the positions are read below */
	__atomic_store_n(flag, 1, __ATOMIC_SEQ_CST);
	deadline = mono_s() + max_s;
	recheck = deadline - max_s + poll_s;	/* the one check after the flag is surely seen */
	for (;;) {
		struct epoll_event ev[4];
		double now, left;
		int n, err;

		if (PyErr_CheckSignals() < 0)
			goto out;
		rc = quiet_reason(bufs, nbuf, &drops, seen);
		if (rc >= 0)
			break;
		now = mono_s();
		left = deadline - now;
		if (left <= 0) {
			rc = QUIET_TIMEOUT;
			break;
		}
		if (now < recheck && left > recheck - now)
			left = recheck - now;	/* an EINTR before it does not skip it */
		Py_BEGIN_ALLOW_THREADS
		n = epoll_wait(epfd, ev, 4, left > 86400 ? 86400000 : (int)(left * 1000) + 1);
		err = errno;
		Py_END_ALLOW_THREADS
		if (n < 0 && err != EINTR) {
			errno = err;
			PyErr_SetFromErrno(PyExc_OSError);
			goto out;
		}
		if (n <= 0)
			continue;	/* timed out or interrupted: check again */
		rc = QUIET_KICKED;
		for (int i = 0; i < n; i++) {
			if (wake_fd >= 0 && ev[i].data.fd == wake_fd) {
				char sink[256];

				while (read(wake_fd, sink, sizeof(sink)) > 0)
					;
			} else {
				rc = QUIET_WOKEN;
			}
		}
		if (PyErr_CheckSignals() < 0)	/* what woke it may be a signal: its handler first */
			goto out;
		break;
	}
out:
	if (flag != NULL)
		__atomic_store_n(flag, 0, __ATOMIC_RELEASE);
	while (nbuf > 0)
		PyBuffer_Release(&bufs[--nbuf]);
	if (have_sleeping)
		PyBuffer_Release(&sleeping);
	if (have_drops)
		PyBuffer_Release(&drops);
	if (PyErr_Occurred())
		return NULL;
	return PyLong_FromLong(rc);
}

struct timed {
	uint64_t time_ns;
	PyObject *obj;		/* borrowed from the list being sorted */
};

/*
 * Stable natural merge sort: the records come as one ascending run per ring,
 * so this takes log2(rings) linear passes.  Equal times keep list order.
 * Returns v or tmp, whichever holds the result; NULL when out of memory.
 */
static struct timed *merge_runs(struct timed *v, struct timed *tmp, Py_ssize_t n)
{
	Py_ssize_t *starts = PyMem_Malloc(sizeof(*starts) * (size_t)(n + 1));
	Py_ssize_t nruns = 0;

	if (starts == NULL)
		return NULL;
	for (Py_ssize_t i = 0; i < n; i++)
		if (i == 0 || v[i].time_ns < v[i - 1].time_ns)
			starts[nruns++] = i;
	starts[nruns] = n;		/* sentinel: the end of the last run */
	while (nruns > 1) {
		Py_ssize_t out = 0, m = 0;
		struct timed *swap;

		for (Py_ssize_t k = 0; k < nruns; k += 2) {
			Py_ssize_t a = starts[k], amid = starts[k + 1];
			Py_ssize_t b = amid, bend = k + 2 <= nruns ? starts[k + 2] : n;

			starts[m++] = out;
			while (a < amid && b < bend)
				tmp[out++] = v[b].time_ns < v[a].time_ns ? v[b++] : v[a++];
			while (a < amid)
				tmp[out++] = v[a++];
			while (b < bend)
				tmp[out++] = v[b++];
		}
		nruns = m;
		starts[nruns] = n;
		swap = v;
		v = tmp;
		tmp = swap;
	}
	PyMem_Free(starts);
	return v;
}

/* event_header.time_ns, little-endian (of a short record: the bytes present of 16..24) */
static uint64_t record_time(PyObject *b)
{
	const unsigned char *s = (const unsigned char *)PyBytes_AS_STRING(b);
	Py_ssize_t len = PyBytes_GET_SIZE(b), end = len < 24 ? len : 24;
	uint64_t t = 0;

	for (Py_ssize_t i = end - 1; i >= 16; i--)
		t = (t << 8) | s[i];
	return t;
}

PyDoc_STRVAR(sort_by_time_doc,
"sort_by_time(records) -> None\n\n"
"Sort a list of raw records (bytes) in place by event_header.time_ns (ns since\n"
"boot), stably: records of one ring keep their order.  Raises TypeError for an\n"
"item that is not bytes.");

static PyObject *sort_by_time(PyObject *self, PyObject *arg)
{
	Py_ssize_t n;
	struct timed *v, *sorted;

	if (!PyList_Check(arg)) {
		PyErr_SetString(PyExc_TypeError, "sort_by_time() needs a list");
		return NULL;
	}
	n = PyList_GET_SIZE(arg);
	if (n < 2)
		Py_RETURN_NONE;
	v = PyMem_Malloc(2 * sizeof(*v) * (size_t)n);	/* the items, then merge space */
	if (v == NULL)
		return PyErr_NoMemory();
	for (Py_ssize_t i = 0; i < n; i++) {
		PyObject *o = PyList_GET_ITEM(arg, i);

		if (!PyBytes_Check(o)) {
			PyMem_Free(v);
			PyErr_SetString(PyExc_TypeError, "sort_by_time() needs a list of bytes");
			return NULL;
		}
		v[i].time_ns = record_time(o);
		v[i].obj = o;
	}
	sorted = merge_runs(v, v + n, n);
	if (sorted == NULL) {
		PyMem_Free(v);
		return PyErr_NoMemory();
	}
	/* Same objects, permuted: the list's references carry over unchanged. */
	for (Py_ssize_t i = 0; i < n; i++)
		PyList_SET_ITEM(arg, i, sorted[i].obj);
	PyMem_Free(v);
	Py_RETURN_NONE;
}

/* ---- line templates ---------------------------------------------------- */

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
static const char *const tmpl_convs[T_N] = {"dddsdddddssssss", "dddsdd", "dddsd", "ddds", "ss", "dddsdsss"};
static const char *const tmpl_names[T_N] = {"MMAP_LINE", "FORK_LINE", "EXIT_LINE", "COMM_LINE", "EXEC_LINE",
					    "EXEC_PREFIX"};
static struct tmpl templates[T_N];
/* records.py KERNEL_STATUS_JSON: what follows a mapping's fields, by enum pagecache_status (owned). */
static PyObject *kernel_status_json;

static int parse_tmpl(struct tmpl *t, PyObject *b, int which)
{
	const char *s, *start, *end;
	int k = 0;

	if (!PyBytes_Check(b)) {
		PyErr_Format(PyExc_TypeError, "%s must be bytes", tmpl_names[which]);
		return -1;
	}
	s = start = PyBytes_AS_STRING(b);
	end = s + PyBytes_GET_SIZE(b);
	t->fixed = 0;
	for (; s < end; s++) {
		if (*s != '%')
			continue;
		if (s + 1 >= end || (s[1] != 'd' && s[1] != 's') || k == MAX_CONV) {
			PyErr_Format(PyExc_ValueError, "%s: only %%d and %%s conversions are supported",
				     tmpl_names[which]);
			return -1;
		}
		t->lit[k] = start;
		t->litlen[k] = s - start;
		t->fixed += s - start;
		t->conv[k++] = s[1];
		start = ++s + 1;
	}
	t->lit[k] = start;
	t->litlen[k] = end - start;
	t->fixed += end - start;
	t->nconv = k;
	if (k != (int)strlen(tmpl_convs[which]) || memcmp(t->conv, tmpl_convs[which], k) != 0) {
		PyErr_Format(PyExc_ValueError, "%s: conversions are not %s", tmpl_names[which],
			     tmpl_convs[which]);
		return -1;
	}
	return 0;
}

static const char digit_pairs[201] =
	"00010203040506070809101112131415161718192021222324252627282930313233343536373839"
	"40414243444546474849505152535455565758596061626364656667686970717273747576777879"
	"8081828384858687888990919293949596979899";

/* v in decimal at o; returns the end.  Two digits per division (most values have 10 to 19). */
static char *put_u64(char *o, uint64_t v)
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

/*
 * A new bytes object: the template with args substituted.  The line is put
 * together in a scratch buffer and copied once into a bytes object of its
 * exact size: an object allocated at the worst case and shrunk afterwards
 * costs a realloc per line (most lines are over pymalloc's 512 bytes).  One
 * static scratch is enough: callers hold the GIL, and nothing here releases it.
 */
static PyObject *format_line(const struct tmpl *t, const struct arg *a)
{
	static char scratch[8192];
	Py_ssize_t cap = t->fixed;
	PyObject *out;
	char *o, *base;

	for (int i = 0; i < t->nconv; i++)
		cap += t->conv[i] == 'd' ? U64_DIGITS : a[i].len;
	if (cap <= (Py_ssize_t)sizeof(scratch)) {
		out = NULL;
		base = scratch;
	} else {
		out = PyBytes_FromStringAndSize(NULL, cap);
		if (out == NULL)
			return NULL;
		base = PyBytes_AS_STRING(out);
	}
	o = base;
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
	o += t->litlen[t->nconv];
	if (out == NULL)
		return PyBytes_FromStringAndSize(scratch, o - base);
	if (_PyBytes_Resize(&out, o - base) < 0)
		return NULL;
	return out;
}

PyDoc_STRVAR(configure_doc,
"configure(mmap_line, fork_line, exit_line, comm_line, exec_line, exec_prefix, kernel_status_json) -> None\n\n"
"Give the line templates of records.py (MMAP_LINE, FORK_LINE, EXIT_LINE,\n"
"COMM_LINE, EXEC_LINE, EXEC_PREFIX): bytes with %d (unsigned decimal) and %s (bytes)\n"
"conversions, and KERNEL_STATUS_JSON (a tuple of bytes indexed by map_event.bid.status).\n"
"Raises ValueError when a template's conversions are not the ones run() fills.");

static PyObject *configure(PyObject *self, PyObject *args)
{
	PyObject *b[T_N];
	struct tmpl parsed[T_N] = {0};

	PyObject *ks;

	if (!PyArg_ParseTuple(args, "OOOOOOO!", &b[0], &b[1], &b[2], &b[3], &b[4], &b[5], &PyTuple_Type, &ks))
		return NULL;
	if (PyTuple_GET_SIZE(ks) < 1) {
		PyErr_SetString(PyExc_ValueError, "kernel_status_json must not be empty");
		return NULL;
	}
	for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(ks); k++)
		if (!PyBytes_Check(PyTuple_GET_ITEM(ks, k))) {
			PyErr_SetString(PyExc_TypeError, "kernel_status_json must be a tuple of bytes");
			return NULL;
		}
	for (int i = 0; i < T_N; i++)
		if (parse_tmpl(&parsed[i], b[i], i) < 0)
			return NULL;
	/* All parsed: only now replace the ones in use. */
	for (int i = 0; i < T_N; i++) {
		Py_INCREF(b[i]);
		parsed[i].owner = b[i];
		Py_XDECREF(templates[i].owner);
		templates[i] = parsed[i];
	}
	Py_INCREF(ks);
	Py_XSETREF(kernel_status_json, ks);
	Py_RETURN_NONE;
}

/* ---- named types shared with Python ------------------------------------ */

/*
 * Struct sequences (named tuples made in C): Python reads their fields by
 * name, this file by index (the *_F_* constants below follow the field order).
 */
static PyStructSequence_Field held_exec_fields[] = {
	{"record", "the raw EXEC ring record (bytes)"},
	{"step", "the recorder step it came in (int)"},
	{"key", "identity key of its executable: struct file_id bytes before nlink"},
	{"prefix", "its line up to the identity fields (records.py EXEC_PREFIX, filled)"},
	{NULL, NULL},
};
enum { HELD_F_RECORD, HELD_F_STEP, HELD_F_KEY, HELD_F_PREFIX, HELD_NF };
static PyStructSequence_Desc held_exec_desc = {
	"buildidd.capture._fastpath.HeldExec",
	"An exec waiting for its executable's mapping: HeldExec((record, step, key, prefix)).",
	held_exec_fields, HELD_NF,
};

static PyStructSequence_Field fast_entry_fields[] = {
	{"resolution", "the identity's Resolution (final)"},
	{"error", "None when the build-id is known, else the reason (str)"},
	{"res_tail", "identity and build-id fields (bytes), records.res_tail()"},
	{NULL, NULL},
};
enum { FAST_F_RESOLUTION, FAST_F_ERROR, FAST_F_RES_TAIL, FAST_NF };
static PyStructSequence_Desc fast_entry_desc = {
	"buildidd.capture._fastpath.FastEntry",
	"What the fast path writes for an identity with a final answer:\n"
	"FastEntry((resolution, error, res_tail)).",
	fast_entry_fields, FAST_NF,
};

static PyStructSequence_Field run_counts_fields[] = {
	{"next", "index of the first record not handled (len(raws) when all were)"},
	{"mmap", "mappings recorded"},
	{"resolved", "mappings recorded with a build-id"},
	{"fork", "fork records"},
	{"exit", "exit records"},
	{"comm", "comm records"},
	{"exec", "exec records written (completed by their mapping)"},
	{NULL, NULL},
};
static PyStructSequence_Desc run_counts_desc = {
	"buildidd.capture._fastpath.RunCounts", "What one run() call did.", run_counts_fields, 7,
};

static PyTypeObject *HeldExec, *FastEntry, *RunCounts;

/* Attribute names read from run()'s tables object and from a Memo. */
static PyObject *s_fast, *s_held, *s_live, *s_comm_json, *s_filename_json, *s_path_json, *s_origins,
	*s_missing, *s_lines, *s_step, *s_entries, *s_fill, *s_hits, *s_path_cut_json;

/* ---- records ----------------------------------------------------------- */

/* A memo.Memo as run() uses it: its entries (an OrderedDict) read directly. */
struct memo_ref {
	PyObject *memo;		/* owned */
	PyObject *entries;	/* owned: memo.entries */
	PyObject *fill;		/* owned: memo.fill, called on a miss (counts it, computes, stores) */
	long hits;		/* added to memo.hits when run() returns */
};

/* State of one run() call: the tables' attributes it reads and updates (owned). */
struct run_state {
	PyObject *fast, *held, *live, *origins, *missing, *lines, *step;
	struct memo_ref comm, filename, path;
	PyObject *path_cut;	/* owned: tables.path_cut_json, 2 bytes: read whole / cut */
	char last_comm[BUILDIDD_COMM_LEN];
	PyObject *last_comm_json;	/* owned: the JSON of last_comm */
	PyObject *last_path;	/* owned: raw bytes of the previous mapping's path */
	PyObject *last_path_json;	/* owned: its JSON */
};

static PyObject *get_attr_of(PyObject *obj, PyObject *name, PyTypeObject *type)
{
	PyObject *v = PyObject_GetAttr(obj, name);

	if (v != NULL && type != NULL && !PyObject_TypeCheck(v, type)) {
		PyErr_Format(PyExc_TypeError, "run(): tables.%U must be %s, not %s", name, type->tp_name,
			     Py_TYPE(v)->tp_name);
		Py_CLEAR(v);
	}
	return v;
}

static int load_memo(struct memo_ref *m, PyObject *tables, PyObject *name)
{
	m->memo = get_attr_of(tables, name, NULL);
	if (m->memo == NULL || (m->entries = get_attr_of(m->memo, s_entries, &PyDict_Type)) == NULL ||
	    (m->fill = get_attr_of(m->memo, s_fill, NULL)) == NULL)
		return -1;
	return 0;
}

/* Add the hits counted in C to memo.hits and drop the references.  Keeps a pending error. */
static void release_memo(struct memo_ref *m)
{
	if (m->hits && m->memo != NULL) {
		PyObject *exc_type, *exc, *tb, *old, *sum = NULL;

		PyErr_Fetch(&exc_type, &exc, &tb);
		old = PyObject_GetAttr(m->memo, s_hits);
		if (old != NULL) {
			PyObject *n = PyLong_FromLong(m->hits);

			sum = n ? PyNumber_Add(old, n) : NULL;
			Py_XDECREF(n);
			Py_DECREF(old);
		}
		if (sum == NULL || PyObject_SetAttr(m->memo, s_hits, sum) < 0)
			PyErr_WriteUnraisable(m->memo);
		Py_XDECREF(sum);
		PyErr_Restore(exc_type, exc, tb);
	}
	Py_CLEAR(m->fill);
	Py_CLEAR(m->entries);
	Py_CLEAR(m->memo);
}

static int load_state(struct run_state *st, PyObject *tables)
{
	if ((st->fast = get_attr_of(tables, s_fast, &PyDict_Type)) == NULL ||
	    (st->held = get_attr_of(tables, s_held, &PyDict_Type)) == NULL ||
	    (st->live = get_attr_of(tables, s_live, &PyDict_Type)) == NULL ||
	    (st->origins = get_attr_of(tables, s_origins, &PyTuple_Type)) == NULL ||
	    (st->missing = get_attr_of(tables, s_missing, &PyDict_Type)) == NULL ||
	    (st->lines = get_attr_of(tables, s_lines, &PyList_Type)) == NULL ||
	    (st->step = get_attr_of(tables, s_step, &PyLong_Type)) == NULL ||
	    (st->path_cut = get_attr_of(tables, s_path_cut_json, &PyTuple_Type)) == NULL ||
	    load_memo(&st->comm, tables, s_comm_json) < 0 || load_memo(&st->filename, tables, s_filename_json) < 0 ||
	    load_memo(&st->path, tables, s_path_json) < 0)
		return -1;
	if (PyTuple_GET_SIZE(st->path_cut) != 2 || !PyBytes_Check(PyTuple_GET_ITEM(st->path_cut, 0)) ||
	    !PyBytes_Check(PyTuple_GET_ITEM(st->path_cut, 1))) {
		PyErr_SetString(PyExc_TypeError, "run(): tables.path_cut_json must be a tuple of 2 bytes");
		return -1;
	}
	if (PyTuple_GET_SIZE(st->origins) == 0) {
		PyErr_SetString(PyExc_ValueError, "run(): tables.origins must not be empty");
		return -1;
	}
	for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(st->origins); k++)
		if (!PyBytes_Check(PyTuple_GET_ITEM(st->origins, k))) {
			PyErr_SetString(PyExc_TypeError, "run(): tables.origins must be a tuple of bytes");
			return -1;
		}
	return 0;
}

static void release_state(struct run_state *st)
{
	release_memo(&st->comm);
	release_memo(&st->filename);
	release_memo(&st->path);
	Py_CLEAR(st->path_cut);
	Py_CLEAR(st->last_path);
	Py_CLEAR(st->last_path_json);
	Py_CLEAR(st->last_comm_json);
	Py_CLEAR(st->fast);
	Py_CLEAR(st->held);
	Py_CLEAR(st->live);
	Py_CLEAR(st->origins);
	Py_CLEAR(st->missing);
	Py_CLEAR(st->lines);
	Py_CLEAR(st->step);
}

/*
 * memo(key) for a Memo's entries: a hit is counted (not made the most recent:
 * a call of move_to_end per lookup cost ~4% of the fast path's time per
 * event, and an entry evicted in its turn is only computed again); a miss
 * calls memo.fill(key) (which counts it and stores the value).
 * New reference to bytes, or NULL with an error set.
 */
static PyObject *memo_get(struct memo_ref *m, PyObject *key, const char *what)
{
	PyObject *v = PyDict_GetItemWithError(m->entries, key);

	if (v != NULL) {
		Py_INCREF(v);
		m->hits++;
	} else if (!PyErr_Occurred()) {
		v = PyObject_CallOneArg(m->fill, key);
	}
	if (v != NULL && !PyBytes_Check(v)) {
		PyErr_Format(PyExc_TypeError, "%s values must be bytes", what);
		Py_CLEAR(v);
	}
	return v;
}

/* JSON of a raw 16-byte comm (tables.comm_json).  Borrowed from st (valid until the next call). */
static PyObject *comm_of(struct run_state *st, const char *comm)
{
	PyObject *key, *v;

	if (st->last_comm_json != NULL && memcmp(st->last_comm, comm, BUILDIDD_COMM_LEN) == 0)
		return st->last_comm_json;
	key = PyBytes_FromStringAndSize(comm, BUILDIDD_COMM_LEN);
	if (key == NULL)
		return NULL;
	v = memo_get(&st->comm, key, "comm_json");
	Py_DECREF(key);
	if (v == NULL)
		return NULL;
	/* Own a reference: the memo may evict it later in this run. */
	Py_XSETREF(st->last_comm_json, v);
	memcpy(st->last_comm, comm, BUILDIDD_COMM_LEN);
	return v;
}

/* JSON of a raw exec filename (tables.filename_json).  New reference. */
static PyObject *filename_of(struct run_state *st, const char *path, Py_ssize_t len)
{
	PyObject *key = PyBytes_FromStringAndSize(path, len), *v;

	if (key == NULL)
		return NULL;
	v = memo_get(&st->filename, key, "filename_json");
	Py_DECREF(key);
	return v;
}

/*
 * JSON of a raw path (tables.path_json), the previous one's answer reused
 * when the bytes are the same.  Borrowed from st (valid until the next call).
 */
static PyObject *path_of(struct run_state *st, const char *path, Py_ssize_t len)
{
	PyObject *key, *v;

	if (st->last_path != NULL && PyBytes_GET_SIZE(st->last_path) == len &&
	    memcmp(PyBytes_AS_STRING(st->last_path), path, len) == 0)
		return st->last_path_json;
	key = PyBytes_FromStringAndSize(path, len);
	if (key == NULL)
		return NULL;
	v = memo_get(&st->path, key, "path_json");
	if (v == NULL) {
		Py_DECREF(key);
		return NULL;
	}
	Py_XSETREF(st->last_path, key);
	Py_XSETREF(st->last_path_json, v);
	return v;
}

/* tables.path_cut_json[1 when id_flags says the path was not read whole]: borrowed. */
static PyObject *path_cut_of(struct run_state *st, uint32_t id_flags)
{
	return PyTuple_GET_ITEM(st->path_cut, (id_flags & (BUILDIDD_PATH_TRUNCATED | BUILDIDD_PATH_UNREACHABLE)) ? 1 : 0);
}

static int emit(struct run_state *st, PyObject *line)
{
	int r;

	if (line == NULL)
		return -1;
	r = PyList_Append(st->lines, line);
	Py_DECREF(line);
	return r;
}

/* The pid's live mappings are gone (exit, exec): live.pop(pid, None).  0, or -1 with an error set. */
static int forget_pid(struct run_state *st, uint32_t pid)
{
	PyObject *k = PyLong_FromUnsignedLong(pid);
	int r;

	if (k == NULL)
		return -1;
	r = PyDict_DelItem(st->live, k);
	Py_DECREF(k);
	if (r < 0) {
		if (!PyErr_ExceptionMatches(PyExc_KeyError))
			return -1;
		PyErr_Clear();
	}
	return 0;
}

/* 1: handled; 0: not for this path (Python records it); -1: error set. */
static int task_record(struct run_state *st, const char *r, uint32_t type, long *counts)
{
	const struct event_header *h = (const struct event_header *)r;
	uint32_t pid = ld_u32(r + offsetof(struct event_header, pid));
	uint32_t tid = ld_u32(r + offsetof(struct event_header, tid));
	uint64_t time_ns = ld_u64(r + offsetof(struct event_header, time_ns));
	PyObject *cj;
	struct arg args[6];
	int which = type == BUILDIDD_EV_FORK ? T_FORK : type == BUILDIDD_EV_EXIT ? T_EXIT : T_COMM;

	if (type == BUILDIDD_EV_EXIT && forget_pid(st, pid) < 0)
		return -1;
	cj = comm_of(st, h->comm);
	if (cj == NULL)
		return -1;
	args[0].u = time_ns;
	args[1].u = pid;
	args[2].u = tid;
	args[3].s = PyBytes_AS_STRING(cj);
	args[3].len = PyBytes_GET_SIZE(cj);
	if (type == BUILDIDD_EV_FORK) {
		args[4].u = ld_u32(r + offsetof(struct task_event, fork.ppid));
		args[5].u = ld_u32(r + offsetof(struct task_event, fork.ptid));
	} else if (type == BUILDIDD_EV_EXIT) {
		args[4].u = ld_u32(r + offsetof(struct task_event, exit.exit_code));
	}
	if (emit(st, format_line(&templates[which], args)) < 0)
		return -1;
	counts[which]++;
	return 1;
}

/* Cache of the previous mapping's identity lookup within one run() call. */
struct last_key {
	char key[ANSWER_KEY_MAX];
	Py_ssize_t key_len;
	PyObject *key_obj;	/* owned: the answer key (key[0..key_len)) */
	PyObject *id_obj;	/* owned: its first KEY_LEN bytes, the identity key */
	PyObject *hit;		/* owned: tables.fast[key], a FastEntry */
};

/*
 * A mapping from a tid whose exec is held: when the exec's executable is this
 * mapping's file, write the exec's line and release it (1); 0 when the tid
 * holds nothing, or an exec of another file (Python decides); -1 on error.
 */
static int held_exec(struct run_state *st, uint32_t tid, const struct last_key *lk, long *counts)
{
	PyObject *t = PyLong_FromUnsignedLong(tid), *h, *key, *prefix, *res_tail;
	struct arg args[2];

	if (t == NULL)
		return -1;
	h = PyDict_GetItemWithError(st->held, t);
	if (h == NULL) {
		Py_DECREF(t);
		return PyErr_Occurred() ? -1 : 1;	/* nothing held: just the mapping */
	}
	if (!Py_IS_TYPE(h, HeldExec) || !PyBytes_Check(key = PyStructSequence_GET_ITEM(h, HELD_F_KEY)) ||
	    !PyBytes_Check(prefix = PyStructSequence_GET_ITEM(h, HELD_F_PREFIX))) {
		Py_DECREF(t);
		PyErr_SetString(PyExc_TypeError, "tables.held values must be HeldExec with bytes key and prefix");
		return -1;
	}
	if (PyBytes_GET_SIZE(key) != (Py_ssize_t)KEY_LEN || memcmp(PyBytes_AS_STRING(key), lk->key, KEY_LEN) != 0) {	/* identity only */
		Py_DECREF(t);
		return 0;
	}
	res_tail = PyStructSequence_GET_ITEM(lk->hit, FAST_F_RES_TAIL);
	args[0].s = PyBytes_AS_STRING(prefix);
	args[0].len = PyBytes_GET_SIZE(prefix);
	args[1].s = PyBytes_AS_STRING(res_tail);
	args[1].len = PyBytes_GET_SIZE(res_tail);
	if (emit(st, format_line(&templates[T_EXEC], args)) < 0 || PyDict_DelItem(st->held, t) < 0) {
		Py_DECREF(t);
		return -1;
	}
	Py_DECREF(t);
	counts[T_EXEC]++;
	return 1;
}

/* missing[reason] += 1.  0, or -1 with an error set. */
static int count_missing(struct run_state *st, PyObject *reason)
{
	PyObject *old = PyDict_GetItemWithError(st->missing, reason), *inc;
	Py_ssize_t was = 0;

	if (old == NULL && PyErr_Occurred())
		return -1;
	if (old != NULL && (was = PyLong_AsSsize_t(old)) == -1 && PyErr_Occurred())
		return -1;
	inc = PyLong_FromSsize_t(was + 1);
	if (inc == NULL)
		return -1;
	if (PyDict_SetItem(st->missing, reason, inc) < 0) {
		Py_DECREF(inc);
		return -1;
	}
	Py_DECREF(inc);
	return 0;
}

/* live[pid].add((start, key)), at most LIVE_MAX per process.  0, or -1 with an error set. */
static int add_live(struct run_state *st, uint32_t pid, uint64_t start, PyObject *key)
{
	PyObject *pid_obj = PyLong_FromUnsignedLong(pid), *pl, *item;

	if (pid_obj == NULL)
		return -1;
	pl = PyDict_GetItemWithError(st->live, pid_obj);
	if (pl == NULL) {
		if (PyErr_Occurred() || (pl = PySet_New(NULL)) == NULL) {
			Py_DECREF(pid_obj);
			return -1;
		}
		if (PyDict_SetItem(st->live, pid_obj, pl) < 0) {
			Py_DECREF(pl);
			Py_DECREF(pid_obj);
			return -1;
		}
		Py_DECREF(pl);			/* the dict holds it */
	}
	Py_DECREF(pid_obj);
	if (!PySet_Check(pl)) {
		PyErr_SetString(PyExc_TypeError, "tables.live values must be sets");
		return -1;
	}
	if (PySet_GET_SIZE(pl) < LIVE_MAX) {
		item = Py_BuildValue("(KO)", (unsigned long long)start, key);
		if (item == NULL || PySet_Add(pl, item) < 0) {
			Py_XDECREF(item);
			return -1;
		}
		Py_DECREF(item);
	}
	return 0;
}

/* enum pagecache_status values whose kernel answer is the whole answer (events.py KERNEL_FINAL). */
static inline int kernel_final(uint32_t status)
{
	return status == PC_OK || status == PC_NOT_ELF || status == PC_NOTE_TOO_LARGE || status == PC_MALFORMED;
}

/* The answer key of a map record into key (events.py answer_key); its length, or -1 for a bad build-id size. */
static Py_ssize_t answer_key(const char *r, char *key)
{
	const char *bid = r + offsetof(struct map_event, bid);
	uint32_t status = ld_u32(bid + offsetof(struct pagecache_build_id, status));
	uint32_t size = ld_u32(bid + offsetof(struct pagecache_build_id, size));

	memcpy(key, r + offsetof(struct map_event, file), KEY_LEN);
	if (!kernel_final(status))
		return KEY_LEN;
	key[KEY_LEN] = (char)status;
	if (status != PC_OK)
		return KEY_LEN + 1;
	if (size == 0 || size > PC_BUILD_ID_MAX)
		return -1;
	memcpy(key + KEY_LEN + 1, bid + offsetof(struct pagecache_build_id, build_id), size);
	return KEY_LEN + 1 + size;
}

static int map_record(struct run_state *st, const char *r, Py_ssize_t len, struct last_key *lk, long *counts)
{
	const char *file = r + offsetof(struct map_event, file);
	uint32_t tid = ld_u32(r + offsetof(struct event_header, tid));
	uint32_t pid = ld_u32(r + offsetof(struct event_header, pid));
	uint64_t start = ld_u64(r + offsetof(struct map_event, start));
	uint32_t origin = ld_u32(r + offsetof(struct map_event, origin));
	uint32_t nlink = ld_u32(file + offsetof(struct file_id, nlink));
	uint32_t id_flags = ld_u32(r + offsetof(struct map_event, id_flags));
	Py_ssize_t plen = ld_u16(r + offsetof(struct map_event, path_len));
	uint32_t pc_status = ld_u32(r + offsetof(struct map_event, bid.status));
	PyObject *hit, *tail, *error, *cj, *pj, *cut, *origin_name, *ks;
	struct arg args[15];
	char key_now[ANSWER_KEY_MAX];
	Py_ssize_t klen;

	if ((Py_ssize_t)MAP_MIN_LEN + plen > len)
		return 0;		/* a path past the record's end: Python counts it */
	klen = answer_key(r, key_now);
	if (klen < 0)
		return 0;		/* Python refuses it */

	if (lk->key_obj == NULL || lk->key_len != klen || memcmp(lk->key, key_now, klen) != 0) {
		PyObject *key = PyBytes_FromStringAndSize(key_now, klen), *id;

		if (key == NULL)
			return -1;
		hit = PyDict_GetItemWithError(st->fast, key);
		if (hit == NULL) {
			Py_DECREF(key);
			return PyErr_Occurred() ? -1 : 0;
		}
		if (!Py_IS_TYPE(hit, FastEntry) || !PyBytes_Check(PyStructSequence_GET_ITEM(hit, FAST_F_RES_TAIL))) {
			Py_DECREF(key);
			PyErr_SetString(PyExc_TypeError, "tables.fast values must be FastEntry with a bytes res_tail");
			return -1;
		}
		if (klen == (Py_ssize_t)KEY_LEN) {
			id = key;
			Py_INCREF(id);
		} else if ((id = PyBytes_FromStringAndSize(file, KEY_LEN)) == NULL) {
			Py_DECREF(key);
			return -1;
		}
		Py_INCREF(hit);
		Py_XSETREF(lk->hit, hit);
		Py_XSETREF(lk->key_obj, key);
		Py_XSETREF(lk->id_obj, id);
		memcpy(lk->key, key_now, klen);
		lk->key_len = klen;
	}
	if (PyDict_GET_SIZE(st->held) != 0 && held_exec(st, tid, lk, counts) <= 0)
		return PyErr_Occurred() ? -1 : 0;
	hit = lk->hit;
	tail = PyStructSequence_GET_ITEM(hit, FAST_F_RES_TAIL);
	error = PyStructSequence_GET_ITEM(hit, FAST_F_ERROR);
	cj = comm_of(st, ((const struct event_header *)r)->comm);
	if (cj == NULL)
		return -1;
	pj = path_of(st, r + MAP_MIN_LEN, plen);
	if (pj == NULL)
		return -1;
	cut = path_cut_of(st, id_flags);
	ks = PyTuple_GET_ITEM(kernel_status_json,
			      pc_status < (uint32_t)PyTuple_GET_SIZE(kernel_status_json) ? pc_status : 0);
	origin_name = PyTuple_GET_ITEM(st->origins, origin < (uint32_t)PyTuple_GET_SIZE(st->origins) ? origin : 0);
	args[0].u = ld_u64(r + offsetof(struct event_header, time_ns));
	args[1].u = pid;
	args[2].u = tid;
	args[3].s = PyBytes_AS_STRING(cj);
	args[3].len = PyBytes_GET_SIZE(cj);
	args[4].u = start;
	args[5].u = ld_u64(r + offsetof(struct map_event, len));
	args[6].u = ld_u64(r + offsetof(struct map_event, pgoff));
	args[7].u = ld_u32(r + offsetof(struct map_event, prot));
	args[8].u = ld_u32(r + offsetof(struct map_event, flags));
	args[9].s = PyBytes_AS_STRING(origin_name);
	args[9].len = PyBytes_GET_SIZE(origin_name);
	args[10].s = nlink ? "false" : "true";
	args[10].len = nlink ? 5 : 4;
	args[11].s = PyBytes_AS_STRING(pj);
	args[11].len = PyBytes_GET_SIZE(pj);
	args[12].s = PyBytes_AS_STRING(cut);
	args[12].len = PyBytes_GET_SIZE(cut);
	args[13].s = PyBytes_AS_STRING(tail);
	args[13].len = PyBytes_GET_SIZE(tail);
	args[14].s = PyBytes_AS_STRING(ks);
	args[14].len = PyBytes_GET_SIZE(ks);
	if (emit(st, format_line(&templates[T_MMAP], args)) < 0)
		return -1;
	counts[T_N]++;
	if (error == Py_None)
		counts[T_N + 1]++;
	else if (count_missing(st, error) < 0)
		return -1;
	return add_live(st, pid, start, lk->id_obj) < 0 ? -1 : 1;
}

/*
 * An EXEC record: held in tables.held (tid -> HeldExec) until its
 * executable's mapping completes it, as the Python exec join does; the pid
 * leaves live.  1: held; 0: left to Python (a record whose filename runs past
 * its end, or a tid that holds an exec already: that one must be written out
 * first, with a resolution only Python makes); -1: error set.
 */
static int exec_record(struct run_state *st, PyObject *raw, const char *r, Py_ssize_t len)
{
	const struct event_header *h = (const struct event_header *)r;
	uint32_t pid = ld_u32(r + offsetof(struct event_header, pid));
	uint32_t tid = ld_u32(r + offsetof(struct event_header, tid));
	uint16_t flen = ld_u16(r + offsetof(struct exec_event, filename_len));
	uint16_t plen = ld_u16(r + offsetof(struct exec_event, path_len));
	const char *names = r + offsetof(struct exec_event, names);
	PyObject *t, *cj, *fj, *pj, *prefix, *key, *held = NULL;
	struct arg args[8];
	int rc = -1;

	if ((Py_ssize_t)offsetof(struct exec_event, names) + flen + plen > len)
		return 0;
	t = PyLong_FromUnsignedLong(tid);
	if (t == NULL)
		return -1;
	rc = PyDict_Contains(st->held, t);
	if (rc != 0) {
		Py_DECREF(t);
		return rc < 0 ? -1 : 0;
	}
	cj = comm_of(st, h->comm);		/* borrowed from st */
	fj = cj ? filename_of(st, names, flen) : NULL;
	pj = fj ? path_of(st, names + flen, plen) : NULL;	/* borrowed from st */
	if (pj == NULL) {
		Py_XDECREF(fj);
		Py_DECREF(t);
		return -1;
	}
	args[0].u = ld_u64(r + offsetof(struct event_header, time_ns));
	args[1].u = pid;
	args[2].u = tid;
	args[3].s = PyBytes_AS_STRING(cj);
	args[3].len = PyBytes_GET_SIZE(cj);
	args[4].u = ld_u32(r + offsetof(struct exec_event, old_tid));
	args[5].s = PyBytes_AS_STRING(fj);
	args[5].len = PyBytes_GET_SIZE(fj);
	args[6].s = PyBytes_AS_STRING(pj);
	args[6].len = PyBytes_GET_SIZE(pj);
	args[7].s = PyBytes_AS_STRING(path_cut_of(st, ld_u32(r + offsetof(struct exec_event, id_flags))));
	args[7].len = PyBytes_GET_SIZE(path_cut_of(st, ld_u32(r + offsetof(struct exec_event, id_flags))));
	prefix = format_line(&templates[T_EXEC_PREFIX], args);
	Py_DECREF(fj);
	key = prefix ? PyBytes_FromStringAndSize(r + offsetof(struct exec_event, file), KEY_LEN) : NULL;
	if (key != NULL && (held = PyStructSequence_New(HeldExec)) != NULL) {
		Py_INCREF(raw);
		Py_INCREF(st->step);
		PyStructSequence_SET_ITEM(held, HELD_F_RECORD, raw);
		PyStructSequence_SET_ITEM(held, HELD_F_STEP, st->step);
		PyStructSequence_SET_ITEM(held, HELD_F_KEY, key);
		PyStructSequence_SET_ITEM(held, HELD_F_PREFIX, prefix);
		key = prefix = NULL;	/* held owns them */
	}
	rc = held ? PyDict_SetItem(st->held, t, held) : -1;
	Py_XDECREF(held);
	Py_XDECREF(key);
	Py_XDECREF(prefix);
	Py_DECREF(t);
	if (rc < 0 || forget_pid(st, pid) < 0)
		return -1;
	return 1;
}

PyDoc_STRVAR(run_doc,
"run(raws, start, tables) -> RunCounts\n\n"
"Record raws[start:] (raw ring records, bytes) for as long as each is one of:\n"
"  * a MAP record (struct map_event) whose answer key (the struct file_id\n"
"    bytes before nlink, then for a kernel-final bid.status that status byte\n"
"    and the kernel's build-id: events.py answer_key) is in tables.fast\n"
"    (key -> FastEntry); its own path and kernel status (KERNEL_STATUS_JSON)\n"
"    is written (tables.path_json, tables.path_cut_json by id_flags).  When its tid is in tables.held\n"
"    (tid -> HeldExec: execs waiting for their executable's mapping) with the\n"
"    same key, the exec's line is written first (EXEC_LINE: prefix, res_tail)\n"
"    and the tid leaves held; a different key is left to Python;\n"
"  * a FORK, EXIT or COMM record (struct task_event);\n"
"  * an EXEC record (struct exec_event) from a tid that holds none: it is\n"
"    held, tables.held[tid] = HeldExec((record, tables.step, key, EXEC_PREFIX\n"
"    line)), and its pid leaves tables.live.\n"
"Each becomes one line (records.py's templates, see configure()) appended to\n"
"the list tables.lines.  The other attributes of tables: comm_json,\n"
"filename_json and path_json, memo.Memo of raw comm (16 bytes) / raw exec filename / raw path -> JSON\n"
"bytes (entries read here, hits counted but not made recent, fill() called\n"
"on a miss); origins: tuple of bytes indexed by map_event.origin (index 0 for an\n"
"unknown one); missing: dict reason -> count, incremented for each mapping\n"
"without a build-id; live: dict pid -> set of (vm_start, key), added to (at\n"
"most 4096 per pid), a pid removed on EXIT and EXEC; step: int.\n"
"Returns a RunCounts: the index of the first record not handled (len(raws)\n"
"when all were) and the counts of what was handled.\n"
"Raises RuntimeError before configure(); TypeError or ValueError for tables\n"
"of the wrong shape; what a memo's fill() raises.");

static PyObject *run(PyObject *self, PyObject *args)
{
	PyObject *raws, *tables, *out;
	Py_ssize_t i, n;
	struct run_state st = {0};
	struct last_key lk = {0};
	long counts[T_N + 2] = {0};	/* per template index, then mmap, resolved */
	int rc = 1;

	if (!PyArg_ParseTuple(args, "O!nO", &PyList_Type, &raws, &i, &tables))
		return NULL;
	if (templates[T_MMAP].owner == NULL) {
		PyErr_SetString(PyExc_RuntimeError, "_fastpath.configure() was not called");
		return NULL;
	}
	if (load_state(&st, tables) < 0) {
		release_state(&st);
		return NULL;
	}
	n = PyList_GET_SIZE(raws);
	if (i < 0)
		i = 0;
	for (; i < n; i++) {
		PyObject *raw = PyList_GET_ITEM(raws, i);
		const char *r;
		Py_ssize_t len;
		uint32_t type;

		if (!PyBytes_Check(raw))
			break;
		r = PyBytes_AS_STRING(raw);
		len = PyBytes_GET_SIZE(raw);
		if (len < (Py_ssize_t)sizeof(struct event_header))
			break;
		type = ld_u32(r);
		if (type == BUILDIDD_EV_MAP && len >= (Py_ssize_t)MAP_MIN_LEN)
			rc = map_record(&st, r, len, &lk, counts);
		else if (type >= BUILDIDD_EV_FORK && type <= BUILDIDD_EV_COMM && len >= (Py_ssize_t)TASK_LEN)
			rc = task_record(&st, r, type, counts);
		else if (type == BUILDIDD_EV_EXEC && len >= (Py_ssize_t)offsetof(struct exec_event, names))
			rc = exec_record(&st, raw, r, len);
		else
			rc = 0;
		if (rc <= 0)
			break;
	}
	Py_XDECREF(lk.key_obj);
	Py_XDECREF(lk.id_obj);
	Py_XDECREF(lk.hit);
	release_state(&st);
	if (rc < 0)
		return NULL;
	out = PyStructSequence_New(RunCounts);
	if (out == NULL)
		return NULL;
	{
		long v[] = {counts[T_N], counts[T_N + 1], counts[T_FORK], counts[T_EXIT], counts[T_COMM],
			    counts[T_EXEC]};
		PyObject *x = PyLong_FromSsize_t(i);

		if (x == NULL) {
			Py_DECREF(out);
			return NULL;
		}
		PyStructSequence_SET_ITEM(out, 0, x);
		for (int k = 0; k < 6; k++) {
			if ((x = PyLong_FromLong(v[k])) == NULL) {
				Py_DECREF(out);
				return NULL;
			}
			PyStructSequence_SET_ITEM(out, k + 1, x);
		}
	}
	return out;
}

static PyMethodDef methods[] = {
	{"read_ring", read_ring, METH_VARARGS, read_ring_doc},
	{"sort_by_time", sort_by_time, METH_O, sort_by_time_doc},
	{"quiet_wait", quiet_wait, METH_VARARGS, quiet_wait_doc},
	{"configure", configure, METH_VARARGS, configure_doc},
	{"run", run, METH_VARARGS, run_doc},
	{NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
	PyModuleDef_HEAD_INIT, "buildidd.capture._fastpath",
	"The recorder's per-event hot path: BPF ring-buffer reads and session-log lines (see _fastpath.c).",
	-1, methods,
};

static int add_type(PyObject *m, PyTypeObject **type, PyStructSequence_Desc *desc)
{
	const char *dot = strrchr(desc->name, '.');

	*type = PyStructSequence_NewType(desc);
	if (*type == NULL)
		return -1;
	return PyModule_AddObjectRef(m, dot ? dot + 1 : desc->name, (PyObject *)*type);
}

PyMODINIT_FUNC PyInit__fastpath(void)
{
	PyObject *m;
	struct { PyObject **s; const char *name; } names[] = {
		{&s_fast, "fast"}, {&s_held, "held"}, {&s_live, "live"}, {&s_comm_json, "comm_json"},
		{&s_filename_json, "filename_json"}, {&s_path_json, "path_json"}, {&s_path_cut_json, "path_cut_json"},
		{&s_origins, "origins"}, {&s_missing, "missing"},
		{&s_lines, "lines"}, {&s_step, "step"}, {&s_entries, "entries"}, {&s_fill, "fill"},
		{&s_hits, "hits"},
	};

	for (size_t k = 0; k < sizeof(names) / sizeof(names[0]); k++)
		if ((*names[k].s = PyUnicode_InternFromString(names[k].name)) == NULL)
			return NULL;
	m = PyModule_Create(&module);
	if (m == NULL)
		return NULL;
	if (add_type(m, &HeldExec, &held_exec_desc) < 0 || add_type(m, &FastEntry, &fast_entry_desc) < 0 ||
	    add_type(m, &RunCounts, &run_counts_desc) < 0) {
		Py_DECREF(m);
		return NULL;
	}
	return m;
}

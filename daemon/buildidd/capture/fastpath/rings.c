/* SPDX-License-Identifier: GPL-2.0 */
/* The fast path's ring-buffer reads, quiet wait and ordering by time (see _fastpath.c). */
#include "fastpath.h"

/* ---- ring buffers ------------------------------------------------------ */

FP_INTERNAL int ring_layout_check(const Py_buffer *cons, const Py_buffer *data, Py_ssize_t page, uint64_t mask)
{
	if (cons->len < 8 || page < 8 || (mask & (mask + 1)) != 0 ||
	    (unsigned long long)data->len < (unsigned long long)page + 2 * (mask + 1)) {
		PyErr_SetString(PyExc_ValueError, "ring buffer mappings smaller than their layout");
		return -1;
	}
	return 0;
}

FP_INTERNAL int walk_ring(const Py_buffer *cons, const Py_buffer *data, Py_ssize_t page, uint64_t mask,
			  struct timed **recs, Py_ssize_t *n, Py_ssize_t *cap, uint64_t *begin, uint64_t *end)
{
	const uint64_t *prod_pos = (const uint64_t *)data->buf;
	const char *area = (const char *)data->buf + page;
	uint64_t c = __atomic_load_n((const uint64_t *)cons->buf, __ATOMIC_RELAXED);
	uint64_t p = __atomic_load_n(prod_pos, __ATOMIC_ACQUIRE);
	int rc = 0;

	*begin = c;
	while (c < p) {
		const char *rec = area + (c & mask);
		uint32_t len = __atomic_load_n((const uint32_t *)rec, __ATOMIC_ACQUIRE), size;

		if (len & RINGBUF_BUSY_BIT)
			break;
		size = len & ~(RINGBUF_BUSY_BIT | RINGBUF_DISCARD_BIT);
		if (size > mask + 1 - RINGBUF_HDR_SZ) {
			PyErr_Format(PyExc_ValueError, "ring record of %u bytes in a %llu-byte ring", size,
				     (unsigned long long)(mask + 1));
			rc = -1;
			break;
		}
		if (!(len & RINGBUF_DISCARD_BIT)) {
			if (*n == *cap) {
				Py_ssize_t grow = *cap ? *cap * 2 : 1024;
				struct timed *m = PyMem_Realloc(*recs, sizeof(**recs) * (size_t)grow);

				if (m == NULL) {
					PyErr_NoMemory();
					rc = -1;
					break;
				}
				*recs = m;
				*cap = grow;
			}
			(*recs)[*n].p = rec + RINGBUF_HDR_SZ;
			(*recs)[*n].len = size;
			(*recs)[*n].ring = 0;
			(*recs)[*n].time_ns = record_time_at(rec + RINGBUF_HDR_SZ, size);
			(*n)++;
		}
		c += (size + RINGBUF_HDR_SZ + 7) & ~7ULL;
	}
	*end = c;
	return rc;
}

FP_INTERNAL const char read_ring_doc[] =
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
"Raises ValueError when a buffer is smaller than the layout needs, or at a\n"
"record larger than the ring (the records before it are appended and consumed);\n"
"MemoryError (then nothing is consumed).  The walk is take()'s (walk_ring).";

FP_INTERNAL PyObject *read_ring(PyObject *self, PyObject *args)
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
	if (ring_layout_check(&cons, &data, page, mask) < 0)
		goto out;
	{
		uint64_t start, end;
		struct timed *recs = NULL;
		Py_ssize_t nrecs = 0, cap = 0;
		PyObject *et, *ev, *tb;

		walk_ring(&cons, &data, page, mask, &recs, &nrecs, &cap, &start, &end);
		PyErr_Fetch(&et, &ev, &tb);	/* a bad record: those before it still come, then it raises */
		for (; n < nrecs; n++) {
			PyObject *b = PyBytes_FromStringAndSize(recs[n].p, recs[n].len);

			if (b == NULL || PyList_Append(out, b) < 0) {
				Py_XDECREF(b);
				break;
			}
			Py_DECREF(b);
		}
		PyMem_Free(recs);
		if (n == nrecs) {	/* every record walked is in out: consumed */
			consumed = end - start;
			__atomic_store_n((uint64_t *)cons.buf, end, __ATOMIC_RELEASE);
			PyErr_Restore(et, ev, tb);
		} else {		/* out of memory: nothing consumed, that error raised */
			Py_XDECREF(et);
			Py_XDECREF(ev);
			Py_XDECREF(tb);
		}
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

FP_INTERNAL const char quiet_wait_doc[] =
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
"a signal handler raises.";

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

FP_INTERNAL PyObject *quiet_wait(PyObject *self, PyObject *args)
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

/*
 * Stable natural merge sort: the records come as one ascending run per ring,
 * so this takes log2(rings) linear passes.  Equal times keep list order.
 * Returns v or tmp, whichever holds the result; NULL when out of memory.
 */
FP_INTERNAL struct timed *merge_runs(struct timed *v, struct timed *tmp, Py_ssize_t n)
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

FP_INTERNAL const char sort_by_time_doc[] =
"sort_by_time(records) -> None\n\n"
"Sort a list of raw records (bytes) in place by event_header.time_ns (ns since\n"
"boot), stably: records of equal times keep their order.  Raises TypeError for an\n"
"item that is not bytes.";

FP_INTERNAL PyObject *sort_by_time(PyObject *self, PyObject *arg)
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
		v[i].time_ns = record_time_at(PyBytes_AS_STRING(o), PyBytes_GET_SIZE(o));
		v[i].p = o;
	}
	sorted = merge_runs(v, v + n, n);
	if (sorted == NULL) {
		PyMem_Free(v);
		return PyErr_NoMemory();
	}
	/* Same objects, permuted: the list's references carry over unchanged. */
	for (Py_ssize_t i = 0; i < n; i++)
		PyList_SET_ITEM(arg, i, (PyObject *)sorted[i].p);
	PyMem_Free(v);
	Py_RETURN_NONE;
}

/* SPDX-License-Identifier: GPL-2.0 */
/*
 * A step's records read in place: the Batch type (see _fastpath.c).
 *
 * take() walks every ring from its consumer position to its producer
 * position, as read_ring() does, but copies nothing: it notes where each
 * record lies in the ring's mapping and orders them by time.  run() then
 * records them from ring memory, and only a record that Python must see
 * becomes a bytes object (batch[i]).  The kernel does not reuse the space of a
 * record before consumer_pos passes it, so a record stays valid until a
 * consumer position past it is stored.  So that a long step does not hold a
 * ring's space while the kernel needs it, the space of the records already
 * recorded is given back during the step (batch_release_to(), from run()
 * every RELEASE_STRIDE records): each ring's consumer position moves to the
 * lowest position a record still to be recorded holds in it.  The merge may
 * order one ring's records otherwise than the ring (their times need not
 * rise within a ring), so that position is not simply the last record's end:
 * take() notes, every RELEASE_STRIDE records from the end, the lowest
 * position per ring of the records from there on (the checkpoints).
 * release() stores the final positions, past the whole batch.
 */
#include "fastpath.h"

struct ring_view {
	Py_buffer cons;		/* the consumer page (writable) */
	Py_buffer data;		/* the producer page, then the data area mapped twice */
	const char *area;	/* the data area (data.buf + page) */
	uint64_t start;		/* consumer_pos when taken */
	uint64_t mask;		/* the data area's size - 1 */
	uint64_t stored;	/* the consumer_pos stored last (start at first) */
	uint64_t end;		/* consumer_pos once the batch is released */
	int held;		/* the buffers are held */
};

typedef struct {
	PyObject_HEAD
	struct ring_view *rings;
	Py_ssize_t nrings;
	struct timed *recs;	/* the records, in time order */
	Py_ssize_t n;
	/* Checkpoint q, per ring k: the lowest position in ring k of a record from index
	 * q * RELEASE_STRIDE on (the ring's end when none): low[q * nrings + k].  NULL
	 * when the batch has fewer than RELEASE_STRIDE records. */
	uint64_t *low;
	Py_ssize_t released_q;	/* the last checkpoint stored (0: none) */
	double fill;		/* the largest share of a ring the batch takes */
	int released;
} BatchObject;

FP_INTERNAL PyTypeObject *Batch;

/* Store the consumer positions and let go of the ring mappings (idempotent). */
static void batch_release_rings(BatchObject *b)
{
	for (Py_ssize_t k = 0; k < b->nrings; k++) {
		struct ring_view *v = &b->rings[k];

		if (!v->held)
			continue;
		if (!b->released && v->end != v->stored)
			__atomic_store_n((uint64_t *)v->cons.buf, v->end, __ATOMIC_RELEASE);
		PyBuffer_Release(&v->data);
		PyBuffer_Release(&v->cons);
		v->held = 0;
	}
	b->released = 1;
	b->n = 0;
}

static void batch_dealloc(BatchObject *b)
{
	PyTypeObject *tp = Py_TYPE(b);

	batch_release_rings(b);
	PyMem_Free(b->low);
	PyMem_Free(b->recs);
	PyMem_Free(b->rings);
	tp->tp_free((PyObject *)b);
	Py_DECREF(tp);		/* a heap type: its instances hold it */
}

/* The position in its ring of record j (its 8-byte header): within a ring size of the start. */
static inline uint64_t record_pos(const BatchObject *b, Py_ssize_t j)
{
	const struct ring_view *v = &b->rings[b->recs[j].ring];
	uint64_t off = (uint64_t)((const char *)b->recs[j].p - RINGBUF_HDR_SZ - v->area);

	return v->start + ((off - v->start) & v->mask);
}

/* The checkpoints (b->low), from the last record to the first: 0, or -1 with MemoryError set. */
static int batch_checkpoints(BatchObject *b)
{
	Py_ssize_t nq = b->n / RELEASE_STRIDE + 1;
	uint64_t *low = PyMem_Malloc(sizeof(*low) * (size_t)(nq * b->nrings)), *cur;

	if (low == NULL) {
		PyErr_NoMemory();
		return -1;
	}
	cur = low + (nq - 1) * b->nrings;	/* the last checkpoint's row, the running minimum */
	for (Py_ssize_t k = 0; k < b->nrings; k++)
		cur[k] = b->rings[k].end;
	for (Py_ssize_t j = b->n - 1; j >= 0; j--) {
		uint64_t pos = record_pos(b, j);
		uint32_t r = b->recs[j].ring;
		uint64_t *row = low + (j / RELEASE_STRIDE) * b->nrings;

		if (row != cur) {	/* j is the last record of checkpoint j / STRIDE's span */
			memcpy(row, cur, sizeof(*low) * (size_t)b->nrings);
			cur = row;
		}
		if (pos < cur[r])
			cur[r] = pos;
	}
	b->low = low;
	return 0;
}

FP_INTERNAL void batch_release_to(PyObject *obj, Py_ssize_t i)
{
	BatchObject *b = (BatchObject *)obj;
	Py_ssize_t q;

	if (b->released || b->low == NULL || i <= 0)
		return;
	q = (i < b->n ? i : b->n) / RELEASE_STRIDE;
	if (q <= b->released_q)
		return;
	for (Py_ssize_t k = 0; k < b->nrings; k++) {
		struct ring_view *v = &b->rings[k];
		uint64_t pos = b->low[q * b->nrings + k];

		if (pos > v->stored) {
			__atomic_store_n((uint64_t *)v->cons.buf, pos, __ATOMIC_RELEASE);
			v->stored = pos;
		}
	}
	b->released_q = q;
}

FP_INTERNAL const char take_doc[] =
"take(rings) -> Batch\n\n"
"Every complete record now in the BPF ring buffers, in place and ordered by\n"
"event_header.time_ns (stably: records of equal times keep their ring's order), as\n"
"read_ring() and sort_by_time() would give them but without a copy.\n"
"rings: a tuple of (cons, data, page, mask) per ring, read_ring()'s arguments.\n"
"The Batch is a sequence: len(batch), batch[i] (a copy of record i, bytes);\n"
"run() records from it in place; batch.fill is the largest share (0..1) of a\n"
"ring it holds.  batch.release() stores each ring's consumer_pos past the\n"
"batch (release semantics) and lets go of the mappings (a ring must not be\n"
"closed before); batch.release_to(i), which run() calls as it goes, gives\n"
"back earlier the space that only records before i held.\n"
"Raises ValueError for a buffer smaller than its layout or a record larger\n"
"than its ring (then nothing is taken).";

FP_INTERNAL PyObject *take(PyObject *self, PyObject *arg)
{
	BatchObject *b;
	Py_ssize_t cap = 0;

	if (!PyTuple_Check(arg)) {
		PyErr_SetString(PyExc_TypeError, "take() needs a tuple of (cons, data, page, mask)");
		return NULL;
	}
	b = PyObject_New(BatchObject, Batch);
	if (b == NULL)
		return NULL;
	b->nrings = 0;
	b->recs = NULL;
	b->low = NULL;
	b->released_q = 0;
	b->n = 0;
	b->fill = 0.0;
	b->released = 0;
	b->rings = PyMem_Calloc((size_t)PyTuple_GET_SIZE(arg) + 1, sizeof(*b->rings));
	if (b->rings == NULL) {
		Py_DECREF(b);
		return PyErr_NoMemory();
	}
	for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(arg); k++) {
		struct ring_view *v = &b->rings[k];
		PyObject *cons_obj, *data_obj;
		Py_ssize_t page;
		unsigned long long mask;
		uint64_t start;
		Py_ssize_t first;

		if (!PyArg_ParseTuple(PyTuple_GET_ITEM(arg, k), "OOnK", &cons_obj, &data_obj, &page, &mask))
			goto fail;
		if (PyObject_GetBuffer(cons_obj, &v->cons, PyBUF_WRITABLE) < 0)
			goto fail;
		if (PyObject_GetBuffer(data_obj, &v->data, PyBUF_SIMPLE) < 0) {
			PyBuffer_Release(&v->cons);
			goto fail;
		}
		v->held = 1;
		b->nrings = k + 1;
		if (ring_layout_check(&v->cons, &v->data, page, mask) < 0)
			goto fail;
		first = b->n;
		if (walk_ring(&v->cons, &v->data, page, mask, &b->recs, &b->n, &cap, &start, &v->end) < 0)
			goto fail;
		for (Py_ssize_t j = first; j < b->n; j++)
			b->recs[j].ring = (uint32_t)k;
		v->area = (const char *)v->data.buf + page;
		v->start = v->stored = start;
		v->mask = mask;
		if ((double)(v->end - start) / (double)(mask + 1) > b->fill)
			b->fill = (double)(v->end - start) / (double)(mask + 1);
	}
	if (b->n > 1) {
		struct timed *tmp = PyMem_Malloc(sizeof(*tmp) * (size_t)b->n), *sorted;

		if (tmp == NULL) {
			PyErr_NoMemory();
			goto fail;
		}
		sorted = merge_runs(b->recs, tmp, b->n);
		if (sorted == NULL) {
			PyMem_Free(tmp);
			PyErr_NoMemory();
			goto fail;
		}
		if (sorted == tmp) {
			PyMem_Free(b->recs);
			b->recs = tmp;
		} else {
			PyMem_Free(tmp);
		}
	}
	if (b->n >= RELEASE_STRIDE && batch_checkpoints(b) < 0)
		goto fail;
	return (PyObject *)b;
fail:
	/* Nothing was recorded: the consumer positions stay where they were. */
	b->released = 1;
	Py_DECREF(b);
	return NULL;
}

/* Record i of a batch in place: 0, or -1 (IndexError set). */
FP_INTERNAL int batch_record(PyObject *obj, Py_ssize_t i, const char **r, Py_ssize_t *len)
{
	BatchObject *b = (BatchObject *)obj;

	if (i < 0 || i >= b->n) {
		PyErr_SetString(PyExc_IndexError, "batch index out of range");
		return -1;
	}
	*r = b->recs[i].p;
	*len = b->recs[i].len;
	return 0;
}

FP_INTERNAL Py_ssize_t batch_len(PyObject *obj)
{
	return ((BatchObject *)obj)->n;
}

static PyObject *batch_item(PyObject *obj, Py_ssize_t i)
{
	const char *r;
	Py_ssize_t len;

	if (batch_record(obj, i, &r, &len) < 0)
		return NULL;
	return PyBytes_FromStringAndSize(r, len);
}

static PyObject *batch_release(PyObject *obj, PyObject *unused)
{
	batch_release_rings((BatchObject *)obj);
	Py_RETURN_NONE;
}

static PyObject *batch_release_to_m(PyObject *obj, PyObject *arg)
{
	Py_ssize_t i = PyLong_AsSsize_t(arg);

	if (i == -1 && PyErr_Occurred())
		return NULL;
	batch_release_to(obj, i);
	Py_RETURN_NONE;
}

static PyObject *batch_get_fill(PyObject *obj, void *closure)
{
	return PyFloat_FromDouble(((BatchObject *)obj)->fill);
}

static PyMethodDef batch_methods[] = {
	{"release", batch_release, METH_NOARGS,
	 "release() -> None\n\nStore each ring's consumer_pos past the batch and let go of the mappings; "
	 "the batch is then empty (idempotent)."},
	{"release_to", batch_release_to_m, METH_O,
	 "release_to(i) -> None\n\nGive back to the kernel the space that only records before index i "
	 "held, to the last checkpoint (every 1024 records) at or below i: each ring's consumer_pos moves "
	 "to the lowest position of a record from that checkpoint on.  The batch still holds its records "
	 "(run() calls this as it goes; batch[j] for j below the checkpoint may read reused space)."},
	{NULL, NULL, 0, NULL},
};

static PyGetSetDef batch_getset[] = {
	{"fill", batch_get_fill, NULL, "the largest share (0..1) of one ring that the batch holds", NULL},
	{NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot batch_slots[] = {
	{Py_tp_dealloc, batch_dealloc},
	{Py_tp_methods, batch_methods},
	{Py_tp_getset, batch_getset},
	{Py_sq_length, batch_len},
	{Py_sq_item, batch_item},
	{Py_tp_doc, (void *)"The records of the rings at one moment, in place and in time order (see take())."},
	{0, NULL},
};

FP_INTERNAL PyType_Spec batch_spec = {
	"buildidd.capture._fastpath.Batch", sizeof(BatchObject), 0, Py_TPFLAGS_DEFAULT, batch_slots,
};

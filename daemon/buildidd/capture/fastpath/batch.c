/* SPDX-License-Identifier: GPL-2.0 */
/*
 * A step's records read in place: the Batch type (see _fastpath.c).
 *
 * take() walks every ring from its consumer position to its producer
 * position, as read_ring() does, but copies nothing: it notes where each
 * record lies in the ring's mapping and orders them by time.  run() then
 * records them from ring memory, and only a record that Python must see
 * becomes a bytes object (batch[i]).  The kernel does not reuse the space of a
 * record before consumer_pos passes it, so the records stay valid until
 * release() stores the new consumer positions (the rings' space is given back
 * at the end of the step instead of at its start).
 */
#include "fastpath.h"

struct ring_view {
	Py_buffer cons;		/* the consumer page (writable) */
	Py_buffer data;		/* the producer page, then the data area mapped twice */
	uint64_t end;		/* consumer_pos once the batch is released */
	int held;		/* the buffers are held */
};

typedef struct {
	PyObject_HEAD
	struct ring_view *rings;
	Py_ssize_t nrings;
	struct timed *recs;	/* the records, in time order */
	Py_ssize_t n;
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
		if (!b->released)
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
	PyMem_Free(b->recs);
	PyMem_Free(b->rings);
	tp->tp_free((PyObject *)b);
	Py_DECREF(tp);		/* a heap type: its instances hold it */
}

/* event_header.time_ns of a record in place (of a short one: the bytes present of 16..24). */
static uint64_t time_in_place(const unsigned char *s, uint32_t len)
{
	uint64_t t = 0;

	if (len >= 24)
		return ld_u64((const char *)s + 16);
	for (int i = (int)len - 1; i >= 16; i--)
		t = (t << 8) | s[i];
	return t;
}

/*
 * Note every complete record of ring v from consumer_pos to producer_pos
 * into *recs (grown as needed); v->end becomes the position after the last.
 * 0, or -1 with an error set.
 */
static int walk_ring(struct ring_view *v, Py_ssize_t page, uint64_t mask, struct timed **recs, Py_ssize_t *n,
		     Py_ssize_t *cap, uint64_t *taken)
{
	const uint64_t *prod_pos = (const uint64_t *)v->data.buf;
	const char *area = (const char *)v->data.buf + page;
	uint64_t c = __atomic_load_n((const uint64_t *)v->cons.buf, __ATOMIC_RELAXED), start = c;
	uint64_t p = __atomic_load_n(prod_pos, __ATOMIC_ACQUIRE);

	while (c < p) {
		const char *rec = area + (c & mask);
		uint32_t len = __atomic_load_n((const uint32_t *)rec, __ATOMIC_ACQUIRE), size;

		if (len & RINGBUF_BUSY_BIT)
			break;
		size = len & ~(RINGBUF_BUSY_BIT | RINGBUF_DISCARD_BIT);
		if (size > mask + 1 - RINGBUF_HDR_SZ) {
			PyErr_Format(PyExc_ValueError, "ring record of %u bytes in a %llu-byte ring", size,
				     (unsigned long long)(mask + 1));
			return -1;
		}
		if (!(len & RINGBUF_DISCARD_BIT)) {
			if (*n == *cap) {
				Py_ssize_t grow = *cap ? *cap * 2 : 1024;
				struct timed *m = PyMem_Realloc(*recs, sizeof(**recs) * (size_t)grow);

				if (m == NULL) {
					PyErr_NoMemory();
					return -1;
				}
				*recs = m;
				*cap = grow;
			}
			(*recs)[*n].p = rec + RINGBUF_HDR_SZ;
			(*recs)[*n].len = size;
			(*recs)[*n].time_ns = time_in_place((const unsigned char *)rec + RINGBUF_HDR_SZ, size);
			(*n)++;
		}
		c += (size + RINGBUF_HDR_SZ + 7) & ~7ULL;
	}
	v->end = c;
	*taken = c - start;
	return 0;
}

FP_INTERNAL const char take_doc[] =
"take(rings) -> Batch\n\n"
"Every complete record now in the BPF ring buffers, in place and ordered by\n"
"event_header.time_ns (stably: one ring's records keep their order), as\n"
"read_ring() and sort_by_time() would give them but without a copy.\n"
"rings: a tuple of (cons, data, page, mask) per ring, read_ring()'s arguments.\n"
"The Batch is a sequence: len(batch), batch[i] (a copy of record i, bytes);\n"
"run() records from it in place; batch.fill is the largest share (0..1) of a\n"
"ring it holds.  batch.release() stores each ring's consumer_pos past the\n"
"batch (release semantics) and lets go of the mappings; until then the\n"
"kernel keeps the records' space (a ring must not be closed before).\n"
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
		uint64_t taken;

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
		if (v->cons.len < 8 || page < 8 || (mask & (mask + 1)) != 0 ||
		    (unsigned long long)v->data.len < (unsigned long long)page + 2 * (mask + 1)) {
			PyErr_SetString(PyExc_ValueError, "ring buffer mappings smaller than their layout");
			goto fail;
		}
		v->end = __atomic_load_n((const uint64_t *)v->cons.buf, __ATOMIC_RELAXED);
		if (walk_ring(v, page, mask, &b->recs, &b->n, &cap, &taken) < 0)
			goto fail;
		if ((double)taken / (double)(mask + 1) > b->fill)
			b->fill = (double)taken / (double)(mask + 1);
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

static PyObject *batch_get_fill(PyObject *obj, void *closure)
{
	return PyFloat_FromDouble(((BatchObject *)obj)->fill);
}

static PyMethodDef batch_methods[] = {
	{"release", batch_release, METH_NOARGS,
	 "release() -> None\n\nStore each ring's consumer_pos past the batch and let go of the mappings; "
	 "the batch is then empty (idempotent)."},
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

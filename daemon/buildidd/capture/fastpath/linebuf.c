/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The pending session-log lines of a step: the LineBuffer type (see _fastpath.c).
 *
 * One buffer that run() formats lines into and the writer writes with one
 * write(): no object per line, and the memory is kept from step to step
 * (it grows by doubling; clear() keeps it unless it grew past
 * LINEBUF_KEEP_MAX).  A bytearray frees its memory whenever it is emptied and
 * grows by an eighth, which copied each byte several times per step.
 */
#include "fastpath.h"

/* clear() gives back memory above this (a burst's buffer is not kept for ever). */
#define LINEBUF_KEEP_MAX (1 << 20)
#define LINEBUF_MIN (64 << 10)

FP_INTERNAL PyTypeObject *LineBuffer;

static PyObject *linebuf_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
	struct linebuf *b;

	if (!_PyArg_NoPositional("LineBuffer", args) || !_PyArg_NoKeywords("LineBuffer", kwds))
		return NULL;
	b = (struct linebuf *)type->tp_alloc(type, 0);
	if (b == NULL)
		return NULL;
	b->buf = NULL;
	b->len = b->cap = 0;
	b->lines = 0;
	b->exports = 0;
	return (PyObject *)b;
}

static void linebuf_dealloc(struct linebuf *b)
{
	PyTypeObject *tp = Py_TYPE(b);

	PyMem_Free(b->buf);
	tp->tp_free((PyObject *)b);
	Py_DECREF(tp);
}

FP_INTERNAL int linebuf_reserve(struct linebuf *b, Py_ssize_t more)
{
	Py_ssize_t want = b->len + more, cap;
	char *m;

	if (b->exports > 0) {
		PyErr_SetString(PyExc_BufferError, "LineBuffer: cannot change while exported");
		return -1;
	}
	if (want <= b->cap)
		return 0;
	cap = b->cap ? b->cap : LINEBUF_MIN;
	while (cap < want)
		cap *= 2;
	m = PyMem_Realloc(b->buf, (size_t)cap);
	if (m == NULL) {
		PyErr_NoMemory();
		return -1;
	}
	b->buf = m;
	b->cap = cap;
	return 0;
}

static PyObject *linebuf_append(struct linebuf *b, PyObject *arg)
{
	Py_buffer v;

	if (PyObject_GetBuffer(arg, &v, PyBUF_SIMPLE) < 0)
		return NULL;
	if (linebuf_reserve(b, v.len + 1) < 0) {
		PyBuffer_Release(&v);
		return NULL;
	}
	memcpy(b->buf + b->len, v.buf, (size_t)v.len);
	b->len += v.len;
	b->buf[b->len++] = '\n';
	b->lines++;
	PyBuffer_Release(&v);
	Py_RETURN_NONE;
}

static PyObject *linebuf_clear(struct linebuf *b, PyObject *unused)
{
	if (b->exports > 0) {
		PyErr_SetString(PyExc_BufferError, "LineBuffer: cannot change while exported");
		return NULL;
	}
	b->len = 0;
	b->lines = 0;
	if (b->cap > LINEBUF_KEEP_MAX) {
		PyMem_Free(b->buf);
		b->buf = NULL;
		b->cap = 0;
	}
	Py_RETURN_NONE;
}

static PyObject *linebuf_drop_front(struct linebuf *b, PyObject *arg)
{
	Py_ssize_t n = PyLong_AsSsize_t(arg), dropped = 0;

	if (n == -1 && PyErr_Occurred())
		return NULL;
	if (b->exports > 0) {
		PyErr_SetString(PyExc_BufferError, "LineBuffer: cannot change while exported");
		return NULL;
	}
	if (n < 0 || n > b->len || (n > 0 && b->buf[n - 1] != '\n')) {
		PyErr_SetString(PyExc_ValueError, "drop_front(): not the end of a line");
		return NULL;
	}
	for (Py_ssize_t i = 0; i < n; i++)
		dropped += b->buf[i] == '\n';
	memmove(b->buf, b->buf + n, (size_t)(b->len - n));
	b->len -= n;
	b->lines -= dropped;
	return PyLong_FromSsize_t(dropped);
}

static int linebuf_getbuffer(struct linebuf *b, Py_buffer *view, int flags)
{
	if (PyBuffer_FillInfo(view, (PyObject *)b, b->buf ? b->buf : "", b->len, 1, flags) < 0)
		return -1;
	b->exports++;
	return 0;
}

static void linebuf_releasebuffer(struct linebuf *b, Py_buffer *view)
{
	b->exports--;
}

static Py_ssize_t linebuf_length(struct linebuf *b)
{
	return b->len;
}

static PyObject *linebuf_get_lines(struct linebuf *b, void *closure)
{
	return PyLong_FromSsize_t(b->lines);
}

static PyMethodDef linebuf_methods[] = {
	{"append", (PyCFunction)linebuf_append, METH_O,
	 "append(line) -> None\n\nAdd one line (bytes-like, without its newline) and a newline."},
	{"clear", (PyCFunction)linebuf_clear, METH_NOARGS,
	 "clear() -> None\n\nNo line left; the memory is kept for the next step (up to 1 MiB).\n"
	 "Raises BufferError while a view of it exists."},
	{"drop_front", (PyCFunction)linebuf_drop_front, METH_O,
	 "drop_front(nbytes) -> int\n\nDrop the first nbytes (whole lines: byte nbytes - 1 is a newline); "
	 "returns the lines dropped.\nRaises ValueError when nbytes does not end a line."},
	{NULL, NULL, 0, NULL},
};

static PyGetSetDef linebuf_getset[] = {
	{"lines", (getter)linebuf_get_lines, NULL, "lines held (each ends in a newline)", NULL},
	{NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot linebuf_slots[] = {
	{Py_tp_new, linebuf_new},
	{Py_tp_dealloc, linebuf_dealloc},
	{Py_tp_methods, linebuf_methods},
	{Py_tp_getset, linebuf_getset},
	{Py_sq_length, linebuf_length},
	{Py_bf_getbuffer, linebuf_getbuffer},
	{Py_bf_releasebuffer, linebuf_releasebuffer},
	{Py_tp_doc, (void *)"LineBuffer(): session-log lines, each ending in a newline, in one buffer.\n\n"
		    "len() is its bytes, .lines its lines; it exports a read-only buffer (os.write, "
		    "memoryview, bytes()).  run() formats lines into it."},
	{0, NULL},
};

FP_INTERNAL PyType_Spec linebuf_spec = {
	"buildidd.capture._fastpath.LineBuffer", sizeof(struct linebuf), 0, Py_TPFLAGS_DEFAULT, linebuf_slots,
};

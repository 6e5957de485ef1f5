/* SPDX-License-Identifier: GPL-2.0 */
/* The fast path's session-log lines, formatted from records.py's templates (see _fastpath.c). */
#include "fastpath.h"

/* ---- line templates ---------------------------------------------------- */

static const char *const tmpl_convs[T_N] = {"ddddsdddddssssss", "dddsdd", "dddsd", "ddds", "ss", "ddddsdsss"};
static const char *const tmpl_names[T_N] = {"MMAP_LINE", "FORK_LINE", "EXIT_LINE", "COMM_LINE", "EXEC_LINE",
					    "EXEC_PREFIX"};
FP_INTERNAL struct tmpl templates[T_N];
/* records.py KERNEL_STATUS_JSON: what follows a mapping's fields, by enum pagecache_status (owned). */
FP_INTERNAL PyObject *kernel_status_json;

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

FP_INTERNAL const char configure_doc[] =
"configure(mmap_line, fork_line, exit_line, comm_line, exec_line, exec_prefix, kernel_status_json) -> None\n\n"
"Give the line templates of records.py (MMAP_LINE, FORK_LINE, EXIT_LINE,\n"
"COMM_LINE, EXEC_LINE, EXEC_PREFIX): bytes with %d (unsigned decimal) and %s (bytes)\n"
"conversions, and KERNEL_STATUS_JSON (a tuple of bytes indexed by map_event.bid.status).\n"
"Raises ValueError when a template's conversions are not the ones run() fills.";

FP_INTERNAL PyObject *configure(PyObject *self, PyObject *args)
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

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
 *
 * The parts: fastpath/rings.c (ring reads, the quiet wait, ordering by time),
 * fastpath/batch.c (a step's records read in place: take() and Batch),
 * fastpath/linebuf.c (the pending lines: LineBuffer),
 * fastpath/templates.c (records.py's templates and line formatting),
 * fastpath/records.c (run()), fastpath/fastpath.h (what they share); this
 * file holds the named types and the module.
 */
#include "fastpath/fastpath.h"

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

FP_INTERNAL PyTypeObject *HeldExec, *FastEntry, *RunCounts;

/* Attribute names read from run()'s tables object and from a Memo. */
FP_INTERNAL PyObject *s_fast, *s_held, *s_live, *s_comm_json, *s_filename_json, *s_path_json, *s_origins,
	*s_missing, *s_out, *s_step, *s_entries, *s_fill, *s_hits, *s_path_cut_json, *s_execs, *s_live_entries,
	*s_live_max_entries;

static PyMethodDef methods[] = {
	{"read_ring", read_ring, METH_VARARGS, read_ring_doc},
	{"sort_by_time", sort_by_time, METH_O, sort_by_time_doc},
	{"quiet_wait", quiet_wait, METH_VARARGS, quiet_wait_doc},
	{"configure", configure, METH_VARARGS, configure_doc},
	{"run", run, METH_VARARGS, run_doc},
	{"take", take, METH_O, take_doc},
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
		{&s_live_entries, "live_entries"}, {&s_live_max_entries, "live_max_entries"},
		{&s_origins, "origins"}, {&s_missing, "missing"},
		{&s_out, "out"}, {&s_step, "step"}, {&s_entries, "entries"}, {&s_fill, "fill"},
		{&s_hits, "hits"}, {&s_execs, "execs"},
	};

	for (size_t k = 0; k < sizeof(names) / sizeof(names[0]); k++)
		if ((*names[k].s = PyUnicode_InternFromString(names[k].name)) == NULL)
			return NULL;
	m = PyModule_Create(&module);
	if (m == NULL)
		return NULL;
	if (add_type(m, &HeldExec, &held_exec_desc) < 0 || add_type(m, &FastEntry, &fast_entry_desc) < 0 ||
	    add_type(m, &RunCounts, &run_counts_desc) < 0 ||
	    (Batch = (PyTypeObject *)PyType_FromSpec(&batch_spec)) == NULL ||
	    PyModule_AddObjectRef(m, "Batch", (PyObject *)Batch) < 0 ||
	    (LineBuffer = (PyTypeObject *)PyType_FromSpec(&linebuf_spec)) == NULL ||
	    PyModule_AddObjectRef(m, "LineBuffer", (PyObject *)LineBuffer) < 0) {
		Py_DECREF(m);
		return NULL;
	}
	return m;
}

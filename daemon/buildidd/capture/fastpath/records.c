/* SPDX-License-Identifier: GPL-2.0 */
/* The fast path's run(): ring records to session-log lines (see _fastpath.c). */
#include "fastpath.h"

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
	PyObject *fast, *held, *live, *origins, *missing, *out, *step, *execs;
	struct memo_ref comm, filename, path;
	PyObject *path_cut;	/* owned: tables.path_cut_json, 2 bytes: read whole / cut */
	char last_comm[BUILDIDD_COMM_LEN];
	PyObject *last_comm_json;	/* owned: the JSON of last_comm */
	PyObject *last_path;	/* owned: raw bytes of the previous mapping's path */
	PyObject *last_path_json;	/* owned: its JSON */
	/* The last (pid, vm_start, identity key object) added to live: a mapping made again at the
	 * same place (a storm of mmap/munmap) needs no set lookup. */
	uint32_t live_pid;
	uint64_t live_start;
	PyObject *live_key;	/* borrowed: held by last_key.id_obj while it is the same */
	/* tables.live_entries (mappings in live, all pids), written back when run() returns, and
	 * tables.live_max_entries (no mapping is added beyond it) */
	Py_ssize_t live_entries, live_max;
	PyObject *tables;	/* borrowed: run()'s argument */
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

/* tables.NAME as a Py_ssize_t into *v: 0, or -1 with an error set. */
static int get_ssize_of(PyObject *tables, PyObject *name, Py_ssize_t *v)
{
	PyObject *o = get_attr_of(tables, name, &PyLong_Type);

	if (o == NULL)
		return -1;
	*v = PyLong_AsSsize_t(o);
	Py_DECREF(o);
	return *v == -1 && PyErr_Occurred() ? -1 : 0;
}

static int load_state(struct run_state *st, PyObject *tables)
{
	st->tables = tables;
	if (get_ssize_of(tables, s_live_entries, &st->live_entries) < 0 ||
	    get_ssize_of(tables, s_live_max_entries, &st->live_max) < 0)
		return -1;
	if ((st->fast = get_attr_of(tables, s_fast, &PyDict_Type)) == NULL ||
	    (st->held = get_attr_of(tables, s_held, &PyDict_Type)) == NULL ||
	    (st->live = get_attr_of(tables, s_live, &PyDict_Type)) == NULL ||
	    (st->origins = get_attr_of(tables, s_origins, &PyTuple_Type)) == NULL ||
	    (st->missing = get_attr_of(tables, s_missing, &PyDict_Type)) == NULL ||
	    (st->out = get_attr_of(tables, s_out, LineBuffer)) == NULL ||
	    (st->step = get_attr_of(tables, s_step, &PyLong_Type)) == NULL ||
	    (st->execs = get_attr_of(tables, s_execs, &PyList_Type)) == NULL ||
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
	if (st->live != NULL) {		/* loaded: the count goes back (a pending error is kept) */
		PyObject *exc_type, *exc, *tb, *n;

		PyErr_Fetch(&exc_type, &exc, &tb);
		n = PyLong_FromSsize_t(st->live_entries);
		if (n == NULL || PyObject_SetAttr(st->tables, s_live_entries, n) < 0)
			PyErr_WriteUnraisable(st->tables);
		Py_XDECREF(n);
		PyErr_Restore(exc_type, exc, tb);
	}
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
	Py_CLEAR(st->out);
	Py_CLEAR(st->step);
	Py_CLEAR(st->execs);
}

/*
 * memo(key) for a Memo's entries: a hit is counted (not made the most recent:
 * a call of move_to_end per lookup is a visible share of the fast path's time
 * per event, and an entry evicted in its turn is only computed again); a miss
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


/* The pid's live mappings are gone (exit, exec): live.pop(pid, None).  0, or -1 with an error set. */
static int forget_pid(struct run_state *st, uint32_t pid)
{
	PyObject *k = PyLong_FromUnsignedLong(pid), *pl;
	int r;

	st->live_key = NULL;

	if (k == NULL)
		return -1;
	pl = PyDict_GetItemWithError(st->live, k);
	if (pl == NULL) {
		Py_DECREF(k);
		return PyErr_Occurred() ? -1 : 0;
	}
	if (PyAnySet_Check(pl))
		st->live_entries -= PySet_GET_SIZE(pl);
	r = PyDict_DelItem(st->live, k);
	Py_DECREF(k);
	return r;
}

/*
 * An exec the kernel completed (an EXEC record, or an EXEC_MAIN/EXEC_INTERP mapping), told to the
 * exec pins (resolve.execpins.ExecPins.recorded): tables.execs.append((pid, uid, file.dev (kernel
 * dev_t), file.ino, time_ns)), at most EXECS_MAX a step (capture/tables.py: the rest are not told).
 * 0, or -1 with an error set.
 */
#define EXECS_MAX 65536
static int note_exec(struct run_state *st, const char *r, const char *file)
{
	PyObject *t;
	int rc;

	if (PyList_GET_SIZE(st->execs) >= EXECS_MAX)
		return 0;
	t = Py_BuildValue("(IIIKK)", ld_u32(r + offsetof(struct event_header, pid)),
			  ld_u32(r + offsetof(struct event_header, uid)), ld_u32(file + offsetof(struct file_id, dev)),
			  (unsigned long long)ld_u64(file + offsetof(struct file_id, ino)),
			  (unsigned long long)ld_u64(r + offsetof(struct event_header, time_ns)));
	if (t == NULL)
		return -1;
	rc = PyList_Append(st->execs, t);
	Py_DECREF(t);
	return rc;
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
	if (append_line((struct linebuf *)st->out, &templates[which], args) < 0)
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
	if (append_line((struct linebuf *)st->out, &templates[T_EXEC], args) < 0 || PyDict_DelItem(st->held, t) < 0) {
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

/* live[pid].add((start, key)), at most LIVE_MAX per process and tables.live_max_entries in all.  0, or -1 with an error set. */
static int add_live(struct run_state *st, uint32_t pid, uint64_t start, PyObject *key)
{
	PyObject *pid_obj, *pl, *item;

	if (st->live_entries >= st->live_max)
		goto added;		/* full: no set is made for a new pid either */
	if ((pid_obj = PyLong_FromUnsignedLong(pid)) == NULL)
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
	if (PySet_GET_SIZE(pl) < LIVE_MAX && st->live_entries < st->live_max) {
		Py_ssize_t had = PySet_GET_SIZE(pl);

		item = Py_BuildValue("(KO)", (unsigned long long)start, key);
		if (item == NULL || PySet_Add(pl, item) < 0) {
			Py_XDECREF(item);
			return -1;
		}
		Py_DECREF(item);
		st->live_entries += PySet_GET_SIZE(pl) - had;
	}
added:
	st->live_pid = pid;
	st->live_start = start;
	st->live_key = key;
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
	struct arg args[16];
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
		st->live_key = NULL;	/* its address may come back as another key's */
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
	args[3].u = ld_u32(r + offsetof(struct event_header, uid));
	args[4].s = PyBytes_AS_STRING(cj);
	args[4].len = PyBytes_GET_SIZE(cj);
	args[5].u = start;
	args[6].u = ld_u64(r + offsetof(struct map_event, len));
	args[7].u = ld_u64(r + offsetof(struct map_event, pgoff));
	args[8].u = ld_u32(r + offsetof(struct map_event, prot));
	args[9].u = ld_u32(r + offsetof(struct map_event, flags));
	args[10].s = PyBytes_AS_STRING(origin_name);
	args[10].len = PyBytes_GET_SIZE(origin_name);
	args[11].s = nlink ? "false" : "true";
	args[11].len = nlink ? 5 : 4;
	args[12].s = PyBytes_AS_STRING(pj);
	args[12].len = PyBytes_GET_SIZE(pj);
	args[13].s = PyBytes_AS_STRING(cut);
	args[13].len = PyBytes_GET_SIZE(cut);
	args[14].s = PyBytes_AS_STRING(tail);
	args[14].len = PyBytes_GET_SIZE(tail);
	args[15].s = PyBytes_AS_STRING(ks);
	args[15].len = PyBytes_GET_SIZE(ks);
	if (append_line((struct linebuf *)st->out, &templates[T_MMAP], args) < 0)
		return -1;
	counts[T_N]++;
	if (error == Py_None)
		counts[T_N + 1]++;
	else if (count_missing(st, error) < 0)
		return -1;
	if ((origin == BUILDIDD_ORIGIN_EXEC_MAIN || origin == BUILDIDD_ORIGIN_EXEC_INTERP) && note_exec(st, r, file) < 0)
		return -1;
	if (st->live_key == lk->id_obj && st->live_pid == pid && st->live_start == start)
		return 1;		/* added already */
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
	struct arg args[9];
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
	args[3].u = ld_u32(r + offsetof(struct event_header, uid));
	args[4].s = PyBytes_AS_STRING(cj);
	args[4].len = PyBytes_GET_SIZE(cj);
	args[5].u = ld_u32(r + offsetof(struct exec_event, old_tid));
	args[6].s = PyBytes_AS_STRING(fj);
	args[6].len = PyBytes_GET_SIZE(fj);
	args[7].s = PyBytes_AS_STRING(pj);
	args[7].len = PyBytes_GET_SIZE(pj);
	args[8].s = PyBytes_AS_STRING(path_cut_of(st, ld_u32(r + offsetof(struct exec_event, id_flags))));
	args[8].len = PyBytes_GET_SIZE(path_cut_of(st, ld_u32(r + offsetof(struct exec_event, id_flags))));
	prefix = format_line(&templates[T_EXEC_PREFIX], args);
	Py_DECREF(fj);
	key = prefix ? PyBytes_FromStringAndSize(r + offsetof(struct exec_event, file), KEY_LEN) : NULL;
	if (raw != NULL)
		Py_INCREF(raw);
	else if (key != NULL)
		raw = PyBytes_FromStringAndSize(r, len);	/* a record in ring memory: held as a copy */
	if (key != NULL && raw != NULL && (held = PyStructSequence_New(HeldExec)) != NULL) {
		Py_INCREF(st->step);
		PyStructSequence_SET_ITEM(held, HELD_F_RECORD, raw);
		PyStructSequence_SET_ITEM(held, HELD_F_STEP, st->step);
		PyStructSequence_SET_ITEM(held, HELD_F_KEY, key);
		PyStructSequence_SET_ITEM(held, HELD_F_PREFIX, prefix);
		key = prefix = raw = NULL;	/* held owns them */
	}
	Py_XDECREF(raw);
	rc = held ? PyDict_SetItem(st->held, t, held) : -1;
	Py_XDECREF(held);
	Py_XDECREF(key);
	Py_XDECREF(prefix);
	Py_DECREF(t);
	if (rc < 0 || forget_pid(st, pid) < 0 || note_exec(st, r, r + offsetof(struct exec_event, file)) < 0)
		return -1;
	return 1;
}

FP_INTERNAL const char run_doc[] =
"run(raws, start, tables) -> RunCounts\n\n"
"Record raws[start:] (raw ring records: a list of bytes, or a Batch from\n"
"take(), read in place) for as long as each is one of:\n"
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
"Each becomes one line (records.py's templates, see configure()) and a\n"
"newline, appended to the LineBuffer tables.out.  The other attributes of tables: comm_json,\n"
"filename_json and path_json, memo.Memo of raw comm (16 bytes) / raw exec filename / raw path -> JSON\n"
"bytes (entries read here, hits counted but not made recent, fill() called\n"
"on a miss); origins: tuple of bytes indexed by map_event.origin (index 0 for an\n"
"unknown one); missing: dict reason -> count, incremented for each mapping\n"
"without a build-id; live: dict pid -> set of (vm_start, key), added to (at\n"
"most 4096 per pid), a pid removed on EXIT and EXEC; step: int; execs: list, appended\n"
"(pid, uid, file.dev as the kernel's dev_t, file.ino, time_ns) for each EXEC record and\n"
"EXEC_MAIN/EXEC_INTERP mapping handled (at most 65536 in the list: the exec pins' confirmations).\n"
"A Batch's space before the records still to be recorded is given back to\n"
"the kernel as run() goes (every 1024 records: Batch.release_to).\n"
"Returns a RunCounts: the index of the first record not handled (len(raws)\n"
"when all were) and the counts of what was handled.\n"
"Raises RuntimeError before configure(); TypeError or ValueError for tables\n"
"of the wrong shape; what a memo's fill() raises.";

FP_INTERNAL PyObject *run(PyObject *self, PyObject *args)
{
	PyObject *raws, *tables, *out;
	Py_ssize_t i, n;
	struct run_state st = {0};
	struct last_key lk = {0};
	long counts[T_N + 2] = {0};	/* per template index, then mmap, resolved */
	int rc = 1, in_place;

	if (!PyArg_ParseTuple(args, "OnO", &raws, &i, &tables))
		return NULL;
	in_place = Py_IS_TYPE(raws, Batch);
	if (!in_place && !PyList_Check(raws)) {
		PyErr_SetString(PyExc_TypeError, "run(): raws must be a list of bytes or a Batch");
		return NULL;
	}
	if (templates[T_MMAP].owner == NULL) {
		PyErr_SetString(PyExc_RuntimeError, "_fastpath.configure() was not called");
		return NULL;
	}
	if (load_state(&st, tables) < 0) {
		release_state(&st);
		return NULL;
	}
	n = in_place ? batch_len(raws) : PyList_GET_SIZE(raws);
	if (i < 0)
		i = 0;
	for (; i < n; i++) {
		PyObject *raw = NULL;
		const char *r;
		Py_ssize_t len;
		uint32_t type;

		if (in_place) {
			if ((i & (RELEASE_STRIDE - 1)) == 0)	/* the kernel gets the space of those done */
				batch_release_to(raws, i);
			if (batch_record(raws, i, &r, &len) < 0) {
				rc = -1;
				break;
			}
		} else {
			raw = PyList_GET_ITEM(raws, i);
			if (!PyBytes_Check(raw))
				break;
			r = PyBytes_AS_STRING(raw);
			len = PyBytes_GET_SIZE(raw);
		}
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
	if (in_place)
		batch_release_to(raws, i);	/* Python copies the record at i (batch[i]) */
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

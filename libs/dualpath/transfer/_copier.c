/* dualpath.transfer._copier: one same-node batch as one shared list of memory copies.
 *
 * See dualpath/transfer/shm.py for how the shm transport uses it. ``Job(entries, ...)`` reads
 * a batch's ``TransferEntry`` objects once, with the GIL held: every entry is checked against
 * the extents of its local and remote mapping and cut into pieces of at most ``chunk`` bytes
 * (a strided entry into one piece per stride first). ``copy()`` then claims pieces one at a
 * time from a shared counter and copies them with ``memmove``, and any number of threads may
 * call it on the same job at once: the event loop copies its share while a copy thread
 * copies the rest, each piece copied exactly once, and neither waits for the other to wake
 * up to start. ``wait()`` spins, without the GIL, until every piece has landed.
 *
 * What makes it cheaper than a copy per entry from Python: one pass over the entries in C
 * instead of a Python loop with a foreign call per piece, and the GIL released once per call
 * instead of once per piece (two threads copying small pieces otherwise hand it back and
 * forth). The job holds the regions' buffers (a mapping with a buffer held cannot be closed)
 * until ``release()``, which first stops every claim and waits for the pieces being copied:
 * after it, no thread touches the regions, whatever is left uncopied.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <limits.h>
#include <time.h>

typedef struct {
    char *dst;
    const char *src;
    size_t len;
} Piece;

typedef struct {
    PyObject_HEAD
    Piece *pieces;
    Py_ssize_t count;
    long long total;
    Py_ssize_t next;      /* the next piece to claim (atomic) */
    Py_ssize_t inflight;  /* copy() calls between a claim and its piece landing (atomic) */
    long long landed;     /* bytes copied so far (atomic) */
    Py_buffer *views;     /* the local region's and the remote regions' buffers, held until release() */
    int n_views, cap_views;
    PyObject *ids;        /* the remote region ids the batch names (their extents point at them) */
} Job;

static PyObject *s_local_offset, *s_remote_region, *s_remote_offset, *s_length, *s_count, *s_local_stride, *s_remote_stride;

static int
get_ll(PyObject *obj, PyObject *name, long long *out)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return -1;
    *out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* Raised for an entry the job refuses; the caller names the error (check_entries). */
static PyObject *BadEntry;

static int
bad_entry(Py_ssize_t index, const char *why)
{
    PyErr_Format(BadEntry, "entry %zd: %s", index, why);
    return -1;
}

typedef struct {
    PyObject *id;   /* the region id (``ids`` holds a reference) */
    char *base;
    long long size;
} Extent;

/* Stop every claim from now on and wait (without the GIL when it has to) until no piece is
 * being copied; then let go of the buffers: nothing can touch them after this. */
static void
release_views(Job *self)
{
    __atomic_fetch_add(&self->next, self->count + 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&self->inflight, __ATOMIC_ACQUIRE) != 0) {
        Py_BEGIN_ALLOW_THREADS
        while (__atomic_load_n(&self->inflight, __ATOMIC_ACQUIRE) != 0)
            sched_yield();
        Py_END_ALLOW_THREADS
    }
    for (int i = 0; i < self->n_views; i++)
        PyBuffer_Release(&self->views[i]);
    self->n_views = 0;
    Py_CLEAR(self->ids);
}

static void
Job_dealloc(Job *self)
{
    release_views(self);
    PyMem_Free(self->views);
    PyMem_Free(self->pieces);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Hold a writable buffer of ``obj`` (until release()); its bytes, at most ``limit`` of them. */
static int
hold(Job *self, PyObject *obj, long long limit, Extent *out)
{
    if (self->n_views == self->cap_views) {
        int cap = self->cap_views ? 2 * self->cap_views : 4;
        Py_buffer *grown = PyMem_Realloc(self->views, sizeof(Py_buffer) * (size_t)cap);
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        self->views = grown;
        self->cap_views = cap;
    }
    Py_buffer *view = &self->views[self->n_views];
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    self->n_views++;
    out->base = view->buf;
    out->size = view->len < limit ? view->len : limit;
    return 0;
}

/* Job(entries, local, resolve, to_local, chunk)
 *
 * ``local`` is the local region's writable buffer; ``resolve(region_id)`` is called once per
 * remote region the batch names and returns ``(buffer, size)``: the region's writable buffer
 * and how many of its bytes entries may reach (its descriptor's size). It may raise (an
 * unknown region). An entry the job refuses raises ``BadEntry`` (the caller names the error
 * as every transport does, ``check_entries``). */
static int
Job_init(Job *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"entries", "local", "resolve", "to_local", "chunk", NULL};
    PyObject *entries, *local_obj, *resolve;
    long long chunk;
    int to_local;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOpL", kwlist, &entries, &local_obj, &resolve, &to_local, &chunk))
        return -1;
    if (chunk < 1) {
        PyErr_SetString(PyExc_ValueError, "chunk must be >= 1");
        return -1;
    }
    release_views(self);
    PyMem_Free(self->pieces);
    self->pieces = NULL;
    self->count = 0;
    self->total = 0;
    self->next = 0;
    self->landed = 0;
    PyObject *seq = PySequence_Fast(entries, "entries must be a sequence");
    if (seq == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Extent local, *extents = NULL; /* the remote regions seen so far (a batch names very few) */
    int n_extents = 0, cap_extents = 0;
    long long (*spec)[6] = PyMem_Malloc(sizeof(*spec) * (size_t)(n ? n : 1));
    int *where = PyMem_Malloc(sizeof(int) * (size_t)(n ? n : 1));
    Piece *pieces = NULL;
    self->ids = PyList_New(0);
    if (self->ids == NULL || spec == NULL || where == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    if (hold(self, local_obj, LLONG_MAX, &local) < 0)
        goto fail;
    Py_ssize_t count = 0;
    long long total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *e = items[i];
        long long *s = spec[i]; /* local_offset, remote_offset, length, count, local_stride, remote_stride */
        if (get_ll(e, s_local_offset, &s[0]) || get_ll(e, s_remote_offset, &s[1]) || get_ll(e, s_length, &s[2]) ||
            get_ll(e, s_count, &s[3]) || get_ll(e, s_local_stride, &s[4]) || get_ll(e, s_remote_stride, &s[5]))
            goto fail;
        long long length = s[2], cnt = s[3];
        if (length < 0 || cnt < 1) {
            bad_entry(i, "negative length or count below 1");
            goto fail;
        }
        if (cnt > 1 && (s[4] < length || s[5] < length)) {
            bad_entry(i, "strides below the length");
            goto fail;
        }
        PyObject *rid = PyObject_GetAttr(e, s_remote_region);
        if (rid == NULL)
            goto fail;
        int k;
        for (k = 0; k < n_extents; k++) {
            if (extents[k].id == rid)
                break;
            int eq = PyObject_RichCompareBool(extents[k].id, rid, Py_EQ);
            if (eq < 0) {
                Py_DECREF(rid);
                goto fail;
            }
            if (eq)
                break;
        }
        if (k == n_extents && n_extents == cap_extents) {
            int cap = cap_extents ? 2 * cap_extents : 4;
            Extent *grown = PyMem_Realloc(extents, sizeof(Extent) * (size_t)cap);
            if (grown == NULL) {
                PyErr_NoMemory();
                Py_DECREF(rid);
                goto fail;
            }
            extents = grown;
            cap_extents = cap;
        }
        if (k == n_extents) {
            PyObject *got = PyList_Append(self->ids, rid) == 0 ? PyObject_CallOneArg(resolve, rid) : NULL;
            PyObject *buf;
            long long limit;
            if (got == NULL || !PyArg_ParseTuple(got, "OL", &buf, &limit) || hold(self, buf, limit, &extents[k]) < 0) {
                Py_XDECREF(got);
                Py_DECREF(rid);
                goto fail;
            }
            Py_DECREF(got);
            extents[k].id = rid; /* alive while ``ids`` holds it */
            n_extents++;
        }
        Py_DECREF(rid);
        /* one past the last byte touched, in 128 bits: no overflow for any 64-bit fields */
        __int128 end_l = (__int128)s[0] + (__int128)(cnt - 1) * (cnt > 1 ? s[4] : 0) + length;
        __int128 end_r = (__int128)s[1] + (__int128)(cnt - 1) * (cnt > 1 ? s[5] : 0) + length;
        if (s[0] < 0 || end_l > local.size) {
            bad_entry(i, "outside the local region");
            goto fail;
        }
        if (s[1] < 0 || end_r > extents[k].size) {
            bad_entry(i, "outside its remote region");
            goto fail;
        }
        where[i] = k;
        if (length > 0) {
            count += cnt * ((length + chunk - 1) / chunk);
            total += cnt * length;
        }
    }
    pieces = PyMem_Malloc(sizeof(Piece) * (size_t)(count ? count : 1));
    if (pieces == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    Py_ssize_t p = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long *s = spec[i];
        if (s[2] == 0)
            continue;
        for (long long j = 0; j < s[3]; j++) {
            char *l = local.base + s[0] + j * s[4];
            char *r = extents[where[i]].base + s[1] + j * s[5];
            for (long long off = 0; off < s[2]; off += chunk) {
                size_t len = (size_t)(s[2] - off < chunk ? s[2] - off : chunk);
                pieces[p].dst = to_local ? l + off : r + off;
                pieces[p].src = to_local ? r + off : l + off;
                pieces[p].len = len;
                p++;
            }
        }
    }
    Py_DECREF(seq);
    PyMem_Free(spec);
    PyMem_Free(where);
    PyMem_Free(extents);
    self->pieces = pieces;
    self->count = count;
    self->total = total;
    return 0;
fail:
    Py_DECREF(seq);
    PyMem_Free(spec);
    PyMem_Free(where);
    PyMem_Free(extents);
    PyMem_Free(pieces);
    release_views(self);
    return -1;
}

/* Claim and copy pieces until none is left or ``budget`` bytes (< 0: no limit) were copied
 * by this call; return the bytes this call copied. */
static long long
copy_pieces(Job *self, long long budget)
{
    long long mine = 0;
    while (budget < 0 || mine < budget) {
        /* in flight before the claim, so release() sees every claim that may still copy */
        __atomic_fetch_add(&self->inflight, 1, __ATOMIC_SEQ_CST);
        Py_ssize_t i = __atomic_fetch_add(&self->next, 1, __ATOMIC_SEQ_CST);
        if (i >= self->count) {
            __atomic_fetch_sub(&self->inflight, 1, __ATOMIC_RELEASE);
            break;
        }
        Piece *pc = &self->pieces[i];
        memmove(pc->dst, pc->src, pc->len);
        __atomic_fetch_add(&self->landed, (long long)pc->len, __ATOMIC_RELEASE);
        __atomic_fetch_sub(&self->inflight, 1, __ATOMIC_RELEASE);
        mine += (long long)pc->len;
    }
    return mine;
}

static PyObject *
Job_copy(Job *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"budget", "release_gil", NULL};
    long long budget = -1;
    int release = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|Lp", kwlist, &budget, &release))
        return NULL;
    long long mine;
    if (release) {
        Py_BEGIN_ALLOW_THREADS
        mine = copy_pieces(self, budget);
        Py_END_ALLOW_THREADS
    } else {
        mine = copy_pieces(self, budget);
    }
    return PyLong_FromLongLong(mine);
}

static int
job_done(Job *self)
{
    return __atomic_load_n(&self->landed, __ATOMIC_ACQUIRE) == self->total;
}

static double
now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* wait(timeout_s) -> bool: spin without the GIL until every piece has landed (True) or
 * ``timeout_s`` passed (False). Only worth it when the pieces left are already being copied. */
static PyObject *
Job_wait(Job *self, PyObject *arg)
{
    double timeout = PyFloat_AsDouble(arg);
    if (timeout == -1.0 && PyErr_Occurred())
        return NULL;
    if (job_done(self))
        Py_RETURN_TRUE;
    int done;
    Py_BEGIN_ALLOW_THREADS
    double until = now_s() + timeout;
    unsigned spins = 0;
    while (!(done = job_done(self))) {
        if ((++spins & 63) == 0) {
            if (now_s() >= until)
                break;
            sched_yield();
        }
    }
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(done);
}

static PyObject *
Job_release(Job *self, PyObject *Py_UNUSED(ignored))
{
    release_views(self);
    Py_RETURN_NONE;
}

static PyObject *
Job_get_done(Job *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(job_done(self));
}

static PyObject *
Job_get_claimed(Job *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(__atomic_load_n(&self->next, __ATOMIC_RELAXED) >= self->count);
}

static PyObject *
Job_get_total(Job *self, void *closure)
{
    (void)closure;
    return PyLong_FromLongLong(self->total);
}

static PyObject *
Job_get_pieces(Job *self, void *closure)
{
    (void)closure;
    return PyLong_FromSsize_t(self->count);
}

static PyMethodDef Job_methods[] = {
    {"copy", (PyCFunction)(void (*)(void))Job_copy, METH_VARARGS | METH_KEYWORDS,
     "copy(budget=-1, release_gil=True) -> int: claim and copy pieces until none is left or budget bytes were copied; the bytes copied"},
    {"wait", (PyCFunction)Job_wait, METH_O, "wait(timeout_s) -> bool: spin without the GIL until every piece has landed"},
    {"release", (PyCFunction)Job_release, METH_NOARGS, "let go of the regions' buffers (once done: nothing may copy after it)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Job_getset[] = {
    {"done", (getter)Job_get_done, NULL, "every piece has landed", NULL},
    {"claimed", (getter)Job_get_claimed, NULL, "every piece is taken (being copied or landed)", NULL},
    {"total", (getter)Job_get_total, NULL, "bytes the batch moves", NULL},
    {"pieces", (getter)Job_get_pieces, NULL, "pieces the batch was cut into", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject JobType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dualpath.transfer._copier.Job",
    .tp_basicsize = sizeof(Job),
    .tp_dealloc = (destructor)Job_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One batch of same-node copies, shared by the threads that copy it (module docstring).",
    .tp_methods = Job_methods,
    .tp_getset = Job_getset,
    .tp_init = (initproc)Job_init,
    .tp_new = PyType_GenericNew,
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_copier", "A same-node batch as one shared list of memory copies.", -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__copier(void)
{
    if (PyType_Ready(&JobType) < 0)
        return NULL;
#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL
    INTERN(s_local_offset, "local_offset");
    INTERN(s_remote_region, "remote_region");
    INTERN(s_remote_offset, "remote_offset");
    INTERN(s_length, "length");
    INTERN(s_count, "count");
    INTERN(s_local_stride, "local_stride");
    INTERN(s_remote_stride, "remote_stride");
#undef INTERN
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL)
        return NULL;
    BadEntry = PyErr_NewException("dualpath.transfer._copier.BadEntry", PyExc_ValueError, NULL);
    if (BadEntry == NULL || PyModule_AddObjectRef(m, "BadEntry", BadEntry) < 0 || PyModule_AddObjectRef(m, "Job", (PyObject *)&JobType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

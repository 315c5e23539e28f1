/* dualpath.sim._hugepages: CPython's small-object arenas on transparent huge pages.
 *
 * See dualpath/sim/hugepages.py for why and what it measured. CPython's allocator (pymalloc)
 * takes its memory in arenas of 1 MiB through PyObject_SetArenaAllocator's hook; this
 * module reserves address space once (no memory committed: MAP_NORESERVE), asks the
 * kernel for 2 MiB pages there (madvise MADV_HUGEPAGE), and hands out consecutive 1 MiB
 * arenas from it. An arena pymalloc frees goes on a free list and is handed out again; it
 * is not returned to the system (a process's peak memory is unchanged by that). Requests of
 * any other size (the interpreter's frame stacks use the same hook) and arenas beyond the
 * reservation go to the allocator that was installed before, and so does the release of
 * anything this module did not hand out (arenas allocated before install()).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <sys/mman.h>

#define ARENA_BYTES ((size_t)1 << 20) /* pymalloc's ARENA_SIZE since CPython 3.10 */
#define HUGE_BYTES ((size_t)2 << 20)

static char *region_start, *region_next, *region_end;
static void *free_arenas; /* freed arenas, linked through their first word */
static PyObjectArenaAllocator previous;
static unsigned long long served, reused, passed_on;

static void *
arena_alloc(void *ctx, size_t size)
{
    (void)ctx;
    if (size == ARENA_BYTES) {
        if (free_arenas != NULL) {
            void *p = free_arenas;
            free_arenas = *(void **)p;
            reused++;
            return p;
        }
        if ((size_t)(region_end - region_next) >= size) {
            void *p = region_next;
            region_next += size;
            served++;
            return p;
        }
    }
    passed_on++;
    return previous.alloc(previous.ctx, size);
}

static void
arena_free(void *ctx, void *p, size_t size)
{
    (void)ctx;
    if ((char *)p >= region_start && (char *)p < region_end) {
        *(void **)p = free_arenas;
        free_arenas = p;
        return;
    }
    previous.free(previous.ctx, p, size);
}

static PyObject *
install(PyObject *self, PyObject *arg)
{
    (void)self;
    if (region_start != NULL)
        return PyUnicode_FromString("");
    unsigned long long reserve = PyLong_AsUnsignedLongLong(arg);
    if (reserve == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    reserve &= ~(unsigned long long)(HUGE_BYTES - 1);
    if (reserve == 0) {
        PyErr_SetString(PyExc_ValueError, "reserve at least 2 MiB");
        return NULL;
    }
#if !defined(MADV_HUGEPAGE) || !defined(MAP_NORESERVE)
    return PyUnicode_FromString("this platform has no transparent huge pages (MADV_HUGEPAGE)");
#else
    char *m = mmap(NULL, reserve + HUGE_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED)
        return PyUnicode_FromFormat("mmap of %llu bytes failed", reserve);
    char *start = (char *)(((uintptr_t)m + HUGE_BYTES - 1) & ~(uintptr_t)(HUGE_BYTES - 1));
    if (madvise(start, reserve, MADV_HUGEPAGE) != 0) {
        munmap(m, reserve + HUGE_BYTES);
        return PyUnicode_FromString("madvise(MADV_HUGEPAGE) refused (no transparent huge pages in this kernel)");
    }
    region_start = region_next = start;
    region_end = start + reserve;
    PyObjectArenaAllocator mine = {NULL, arena_alloc, arena_free};
    PyObject_GetArenaAllocator(&previous);
    PyObject_SetArenaAllocator(&mine);
    return PyUnicode_FromString("");
#endif
}

static PyObject *
stats(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return Py_BuildValue(
        "{s:K,s:K,s:K,s:K}", "arenas_served", served, "arenas_reused", reused, "passed_on", passed_on, "reserved_bytes",
        (unsigned long long)(region_end - region_start));
}

static PyMethodDef methods[] = {
    {"install", install, METH_O,
     "install(reserve_bytes) -> '' or why not: pymalloc's arenas from a huge-page region of that much address space"},
    {"stats", stats, METH_NOARGS, "stats() -> dict: arenas served, reused, requests passed on, bytes reserved"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "dualpath.sim._hugepages", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC
PyInit__hugepages(void)
{
    return PyModule_Create(&module);
}

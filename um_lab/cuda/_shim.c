/*
 * GIL-free segment source for torch.cuda.MemPool.
 *
 * PyTorch calls a MemPool's allocator while holding its allocator mutex. A Python (ctypes)
 * callback would then take the GIL, and a thread holding the GIL that frees a tensor waits for that
 * mutex: a lock-order deadlock. These callbacks never touch Python: they call the CUDA runtime
 * through function pointers that Python resolved beforehand (so nothing here needs CUDA headers,
 * and the same build serves CUDA 12 and 13), keep their own registry under their own mutex, apply
 * the per-type advice to each new segment, and refuse any request that would push live managed
 * bytes past the safety cap before CUDA is called.
 *
 * One allocation entry point per data type (the signature carries no pool), one free for all.
 * A type may be switched to plain device memory (cudaMalloc, no advice): its segments are counted
 * under the same cap and registry, marked as device memory (a copy engine reading managed memory
 * serialises with the kernels beside it on the H200; reading device memory does not).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define N_TAGS 5
#define MAX_ADVICE 8
#define ATTACH_GLOBAL 1u /* cudaMemAttachGlobal */

typedef struct { int type; int id; } mem_location; /* layout of cudaMemLocation */
typedef int (*malloc_managed_fn)(void **ptr, size_t size, unsigned int flags);
typedef int (*free_fn)(void *ptr);
typedef int (*advise_fn)(const void *ptr, size_t count, int advice, mem_location location);
typedef int (*get_last_error_fn)(void);
typedef int (*malloc_device_fn)(void **ptr, size_t size);

typedef struct { int advice; mem_location location; } advice_entry;
typedef struct { uintptr_t ptr; size_t size; int tag; int device; } segment;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static malloc_managed_fn g_malloc = NULL;
static free_fn g_free = NULL;
static advise_fn g_advise = NULL;
static get_last_error_fn g_get_last_error = NULL;
static malloc_device_fn g_malloc_device = NULL;
static int g_device_tag[N_TAGS]; /* 1: this type's new segments are plain device memory */
static unsigned long long g_live_device = 0;
static unsigned long long g_cap = 0;
static int g_allow_over = 0;
static unsigned long long g_live[N_TAGS];
static unsigned long long g_live_total = 0, g_reserved = 0, g_peak = 0;
static unsigned long long g_malloc_calls = 0, g_free_calls = 0, g_refused = 0, g_malloc_errors = 0;
static unsigned long long g_free_errors = 0, g_unknown_frees = 0, g_advise_errors = 0;
static int g_last_error = 0, g_last_advise_error = 0;
static unsigned long long g_last_refused_size = 0, g_last_refused_live = 0, g_last_refused_cap = 0;
static int g_last_refused_tag = -1;
static unsigned long long g_last_refused_thread = 0;
static advice_entry g_advice[N_TAGS][MAX_ADVICE];
static int g_n_advice[N_TAGS];
static segment *g_segs = NULL;
static size_t g_n_segs = 0, g_cap_segs = 0;

/* A failed runtime call leaves a sticky "last error" that torch's next launch check would report
 * against an unrelated kernel: consume it here, where it happened. */
static void clear_last_error(void) {
    if (g_get_last_error) g_get_last_error();
}

static int registry_add(uintptr_t ptr, size_t size, int tag, int device) {
    if (g_n_segs == g_cap_segs) {
        size_t n = g_cap_segs ? 2 * g_cap_segs : 256;
        segment *grown = (segment *)realloc(g_segs, n * sizeof(segment));
        if (!grown) return -1;
        g_segs = grown;
        g_cap_segs = n;
    }
    g_segs[g_n_segs].ptr = ptr;
    g_segs[g_n_segs].size = size;
    g_segs[g_n_segs].tag = tag;
    g_segs[g_n_segs].device = device;
    g_n_segs++;
    return 0;
}

static void *alloc_tagged(size_t size, int tag) {
    void *ptr = NULL;
    advice_entry advice[MAX_ADVICE];
    int n_advice, err, device;

    pthread_mutex_lock(&g_lock);
    unsigned long long in_use = g_live_total + g_reserved;
    if (!g_malloc || (!g_allow_over && in_use + size > g_cap)) {
        g_refused++;
        g_last_refused_size = size;
        g_last_refused_live = in_use;
        g_last_refused_cap = g_cap;
        g_last_refused_tag = tag;
        g_last_refused_thread = (unsigned long long)pthread_self();
        pthread_mutex_unlock(&g_lock);
        return NULL; /* torch turns this into an OutOfMemoryError; Python names the refusal */
    }
    g_reserved += size; /* concurrent requests cannot both squeeze under the cap */
    device = g_device_tag[tag] && g_malloc_device;
    n_advice = device ? 0 : g_n_advice[tag];
    memcpy(advice, g_advice[tag], sizeof(advice_entry) * (size_t)n_advice);
    pthread_mutex_unlock(&g_lock);

    err = device ? g_malloc_device(&ptr, size) : g_malloc(&ptr, size, ATTACH_GLOBAL);
    if (err == 0 && ptr && g_advise) {
        for (int i = 0; i < n_advice; i++) {
            int e = g_advise(ptr, size, advice[i].advice, advice[i].location);
            if (e) {
                clear_last_error();
                pthread_mutex_lock(&g_lock);
                g_advise_errors++;
                g_last_advise_error = e;
                pthread_mutex_unlock(&g_lock);
            }
        }
    }

    pthread_mutex_lock(&g_lock);
    g_reserved -= size;
    g_malloc_calls++;
    if (err != 0 || !ptr || registry_add((uintptr_t)ptr, size, tag, device) != 0) {
        if (err != 0) clear_last_error();
        g_malloc_errors++;
        g_last_error = err ? err : -1;
        pthread_mutex_unlock(&g_lock);
        if (err == 0 && ptr) g_free(ptr);
        return NULL;
    }
    g_live[tag] += size;
    g_live_total += size;
    if (device) g_live_device += size;
    if (g_live_total > g_peak) g_peak = g_live_total;
    pthread_mutex_unlock(&g_lock);
    return ptr;
}

static void shim_free(void *ptr, size_t size, int device, void *stream) {
    (void)size; (void)device; (void)stream;
    if (!ptr) return;
    int found = 0;
    pthread_mutex_lock(&g_lock);
    for (size_t i = 0; i < g_n_segs; i++) {
        if (g_segs[i].ptr == (uintptr_t)ptr) {
            g_live[g_segs[i].tag] -= g_segs[i].size;
            g_live_total -= g_segs[i].size;
            if (g_segs[i].device) g_live_device -= g_segs[i].size;
            g_segs[i] = g_segs[--g_n_segs];
            found = 1;
            break;
        }
    }
    if (!found) g_unknown_frees++;
    pthread_mutex_unlock(&g_lock);
    if (!found) return; /* never hand CUDA a pointer this shim did not allocate */
    int err = g_free(ptr);
    if (err) clear_last_error();
    pthread_mutex_lock(&g_lock);
    g_free_calls++;
    if (err) { g_free_errors++; g_last_error = err; }
    pthread_mutex_unlock(&g_lock);
}

#define DEFINE_ALLOC(TAG) \
    static void *shim_alloc_##TAG(size_t size, int device, void *stream) { \
        (void)device; (void)stream; return alloc_tagged(size, TAG); }
DEFINE_ALLOC(0)
DEFINE_ALLOC(1)
DEFINE_ALLOC(2)
DEFINE_ALLOC(3)
DEFINE_ALLOC(4)
static void *(*const k_allocs[N_TAGS])(size_t, int, void *) = {
    shim_alloc_0, shim_alloc_1, shim_alloc_2, shim_alloc_3, shim_alloc_4};

/* ---- Python surface (control only; never on the allocation path) ---- */

static PyObject *py_configure(PyObject *self, PyObject *args) {
    unsigned long long m, f, a, e = 0, d = 0;
    if (!PyArg_ParseTuple(args, "KKK|KK", &m, &f, &a, &e, &d)) return NULL;
    pthread_mutex_lock(&g_lock);
    g_malloc = (malloc_managed_fn)(uintptr_t)m;
    g_free = (free_fn)(uintptr_t)f;
    g_advise = (advise_fn)(uintptr_t)a;
    g_get_last_error = (get_last_error_fn)(uintptr_t)e;
    g_malloc_device = (malloc_device_fn)(uintptr_t)d;
    pthread_mutex_unlock(&g_lock);
    Py_RETURN_NONE;
}

static PyObject *py_set_device_memory(PyObject *self, PyObject *args) {
    int tag, on;
    if (!PyArg_ParseTuple(args, "ip", &tag, &on)) return NULL;
    if (tag < 0 || tag >= N_TAGS) return PyErr_Format(PyExc_ValueError, "tag %d out of range", tag);
    pthread_mutex_lock(&g_lock);
    int missing = on && !g_malloc_device;
    if (!missing) g_device_tag[tag] = on;
    pthread_mutex_unlock(&g_lock);
    if (missing) return PyErr_Format(PyExc_ValueError, "no device-memory allocator configured (configure's 5th address)");
    Py_RETURN_NONE;
}

static PyObject *py_set_cap(PyObject *self, PyObject *args) {
    unsigned long long cap;
    int allow;
    if (!PyArg_ParseTuple(args, "Kp", &cap, &allow)) return NULL;
    pthread_mutex_lock(&g_lock);
    g_cap = cap;
    g_allow_over = allow;
    pthread_mutex_unlock(&g_lock);
    Py_RETURN_NONE;
}

static PyObject *py_set_advice(PyObject *self, PyObject *args) {
    int tag;
    PyObject *seq;
    if (!PyArg_ParseTuple(args, "iO", &tag, &seq)) return NULL;
    if (tag < 0 || tag >= N_TAGS) return PyErr_Format(PyExc_ValueError, "tag %d out of range", tag);
    PyObject *fast = PySequence_Fast(seq, "advice must be a sequence of (advice, location_type, id)");
    if (!fast) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n > MAX_ADVICE) {
        Py_DECREF(fast);
        return PyErr_Format(PyExc_ValueError, "at most %d advice entries per type", MAX_ADVICE);
    }
    advice_entry entries[MAX_ADVICE];
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "iii", &entries[i].advice,
                              &entries[i].location.type, &entries[i].location.id)) {
            Py_DECREF(fast);
            return NULL;
        }
    }
    Py_DECREF(fast);
    pthread_mutex_lock(&g_lock);
    memcpy(g_advice[tag], entries, sizeof(advice_entry) * (size_t)n);
    g_n_advice[tag] = (int)n;
    pthread_mutex_unlock(&g_lock);
    Py_RETURN_NONE;
}

static PyObject *py_addresses(PyObject *self, PyObject *noargs) {
    PyObject *allocs = PyTuple_New(N_TAGS);
    if (!allocs) return NULL;
    for (int i = 0; i < N_TAGS; i++)
        PyTuple_SET_ITEM(allocs, i, PyLong_FromUnsignedLongLong((uintptr_t)k_allocs[i]));
    return Py_BuildValue("(NK)", allocs, (unsigned long long)(uintptr_t)shim_free);
}

static PyObject *py_stats(PyObject *self, PyObject *noargs) {
    /* Copy under the lock, build Python objects after releasing it: building may run the garbage
     * collector, whose finalizers may free segments (and need this lock). */
    unsigned long long live[N_TAGS], live_total, peak, cap, mallocs, frees, refused, merr, ferr, unknown;
    unsigned long long aerr, rsize, rlive, rcap, rthread, reserved, live_device;
    int last_error, last_aerr, rtag, allow;
    size_t nsegs;
    pthread_mutex_lock(&g_lock);
    memcpy(live, g_live, sizeof(live));
    live_total = g_live_total; peak = g_peak; cap = g_cap; mallocs = g_malloc_calls; frees = g_free_calls;
    refused = g_refused; merr = g_malloc_errors; ferr = g_free_errors; unknown = g_unknown_frees;
    aerr = g_advise_errors; last_error = g_last_error; last_aerr = g_last_advise_error;
    rsize = g_last_refused_size; rlive = g_last_refused_live; rcap = g_last_refused_cap;
    rtag = g_last_refused_tag; rthread = g_last_refused_thread; reserved = g_reserved;
    allow = g_allow_over; nsegs = g_n_segs; live_device = g_live_device;
    pthread_mutex_unlock(&g_lock);
    return Py_BuildValue(
        "{s:K,s:(KKKKK),s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:i,s:i,s:(KKKi),s:K,s:K,s:i,s:n,s:K}",
        "live_total", live_total, "live_by_tag", live[0], live[1], live[2], live[3], live[4],
        "peak_total", peak, "cap", cap, "malloc_calls", mallocs, "free_calls", frees,
        "refused", refused, "malloc_errors", merr, "free_errors", ferr,
        "unknown_frees", unknown, "advise_errors", aerr, "last_error", last_error,
        "last_advise_error", last_aerr, "last_refusal", rsize, rlive, rcap, rtag,
        "last_refusal_thread", rthread, "reserved", reserved,
        "allow_oversubscription", allow, "segments", (Py_ssize_t)nsegs, "live_device", live_device);
}

/* The two readings a training step takes (stats() builds a 20-entry dict): refusals so far, live bytes per tag. */
static PyObject *py_refused(PyObject *self, PyObject *noargs) {
    pthread_mutex_lock(&g_lock);
    unsigned long long refused = g_refused;
    pthread_mutex_unlock(&g_lock);
    return PyLong_FromUnsignedLongLong(refused);
}

/* Changes whenever a segment is allocated or freed: whoever caches the segment list re-reads it then. */
static PyObject *py_generation(PyObject *self, PyObject *noargs) {
    pthread_mutex_lock(&g_lock);
    unsigned long long generation = g_malloc_calls + g_free_calls;
    pthread_mutex_unlock(&g_lock);
    return PyLong_FromUnsignedLongLong(generation);
}

static PyObject *py_live_by_tag(PyObject *self, PyObject *noargs) {
    unsigned long long live[N_TAGS];
    pthread_mutex_lock(&g_lock);
    memcpy(live, g_live, sizeof(live));
    pthread_mutex_unlock(&g_lock);
    return Py_BuildValue("(KKKKK)", live[0], live[1], live[2], live[3], live[4]);
}

static PyObject *py_segments(PyObject *self, PyObject *noargs) {
    pthread_mutex_lock(&g_lock);
    size_t n = g_n_segs;
    segment *copy = (segment *)malloc((n ? n : 1) * sizeof(segment));
    if (copy) memcpy(copy, g_segs, n * sizeof(segment));
    pthread_mutex_unlock(&g_lock);
    if (!copy) return PyErr_NoMemory();
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; list && i < n; i++)
        PyList_SET_ITEM(list, (Py_ssize_t)i,
                        Py_BuildValue("(Knii)", (unsigned long long)copy[i].ptr, (Py_ssize_t)copy[i].size,
                                      copy[i].tag, copy[i].device));
    free(copy);
    return list;
}

static PyObject *py_reset_peak(PyObject *self, PyObject *noargs) {
    pthread_mutex_lock(&g_lock);
    g_peak = g_live_total;
    pthread_mutex_unlock(&g_lock);
    Py_RETURN_NONE;
}

/* Call the allocation path directly (tests and probes), with the GIL released as torch would. */
static PyObject *py_alloc(PyObject *self, PyObject *args) {
    int tag;
    unsigned long long size;
    if (!PyArg_ParseTuple(args, "iK", &tag, &size)) return NULL;
    if (tag < 0 || tag >= N_TAGS) return PyErr_Format(PyExc_ValueError, "tag %d out of range", tag);
    void *p;
    Py_BEGIN_ALLOW_THREADS
    p = k_allocs[tag]((size_t)size, 0, NULL);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLongLong((uintptr_t)p);
}

static PyObject *py_free(PyObject *self, PyObject *args) {
    unsigned long long ptr;
    if (!PyArg_ParseTuple(args, "K", &ptr)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    shim_free((void *)(uintptr_t)ptr, 0, 0, NULL);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", py_configure, METH_VARARGS, "configure(malloc_managed, free, advise[, get_last_error[, malloc_device]]): CUDA function addresses."},
    {"set_device_memory", py_set_device_memory, METH_VARARGS, "set_device_memory(tag, on): the type's new segments from cudaMalloc (no advice)."},
    {"set_cap", py_set_cap, METH_VARARGS, "set_cap(cap_bytes, allow_oversubscription)."},
    {"set_advice", py_set_advice, METH_VARARGS, "set_advice(tag, [(advice, location_type, location_id), ...])."},
    {"addresses", py_addresses, METH_NOARGS, "((alloc per tag...), free): C function addresses for torch."},
    {"stats", py_stats, METH_NOARGS, "Counters and live bytes."},
    {"segments", py_segments, METH_NOARGS, "Live segments as [(ptr, size, tag, device)]."},
    {"refused", py_refused, METH_NOARGS, "Requests refused by the cap so far."},
    {"live_by_tag", py_live_by_tag, METH_NOARGS, "Live bytes per tag, as a tuple."},
    {"generation", py_generation, METH_NOARGS, "Allocations plus frees so far: changes with the segment list."},
    {"reset_peak", py_reset_peak, METH_NOARGS, "Set the peak to the current live bytes."},
    {"alloc", py_alloc, METH_VARARGS, "alloc(tag, size) -> ptr or 0 (refused or failed)."},
    {"free", py_free, METH_VARARGS, "free(ptr)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_shim",
                                    "GIL-free managed-memory segment source for torch MemPools.", -1, methods};

PyMODINIT_FUNC PyInit__shim(void) { return PyModule_Create(&module); }

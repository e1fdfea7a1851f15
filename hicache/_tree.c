/* The radix tree's inner walk in C, with the same loop in Python (hicache/fastpath.py).
 *
 * A match spends most of its time stepping from a node to the child its key continues with:
 * a dict lookup by the next page of token bytes, a prefix compare, an access-time stamp. In
 * Python each step is a dozen bytecodes; here it is a few C calls on the same objects. The
 * tree stays made of Python TreeNode objects, read and written through ordinary attribute
 * access; the counting a match does on its path is here too, for the same reason.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* interned attribute names */
static PyObject *s_children, *s_key, *s_last_access, *s_hit_count, *s_device_pages,
    *s_host_pages, *s_io;
static PyObject *one; /* the int 1 */

/* The child of ``node`` whose key ``key[pos:]`` starts with, as a new reference, its key's
 * length in ``*klen``; NULL with no error set when there is none (or it is matched only in
 * part), NULL with an error on failure. */
static PyObject *next_child(PyObject *node, const char *key, Py_ssize_t pos, Py_ssize_t end,
                            Py_ssize_t step, Py_ssize_t *klen) {
    PyObject *children = PyObject_GetAttr(node, s_children);
    if (children == NULL) return NULL;
    if (!PyDict_Check(children)) {
        Py_DECREF(children);
        PyErr_SetString(PyExc_TypeError, "descend: node.children must be a dict");
        return NULL;
    }
    PyObject *page = PyBytes_FromStringAndSize(key + pos, step);
    if (page == NULL) { Py_DECREF(children); return NULL; }
    PyObject *child = PyDict_GetItemWithError(children, page); /* borrowed */
    Py_DECREF(page);
    Py_XINCREF(child);
    Py_DECREF(children);
    if (child == NULL) return NULL;
    PyObject *ckey = PyObject_GetAttr(child, s_key);
    if (ckey == NULL) { Py_DECREF(child); return NULL; }
    *klen = PyBytes_Check(ckey) ? PyBytes_GET_SIZE(ckey) : -1;
    int whole = *klen >= 0 && *klen <= end - pos &&
                memcmp(PyBytes_AS_STRING(ckey), key + pos, *klen) == 0;
    Py_DECREF(ckey);
    if (!whole) { Py_DECREF(child); return NULL; }
    return child;
}

/* descend(node, key, pos, page_bytes, now) -> (path, pos)
 *
 * From ``node``, follow every child that ``key[pos:]`` covers whole: stamp its last_access with
 * ``now`` and append it to ``path``; ``pos`` ends after the last one. Stops before a child that
 * is missing or matched only in part (the caller splits that one). */
static PyObject *descend(PyObject *self, PyObject *args) {
    PyObject *node, *key, *now;
    Py_ssize_t pos, step;
    if (!PyArg_ParseTuple(args, "OSnnO", &node, &key, &pos, &step, &now)) return NULL;
    if (step <= 0 || pos < 0) {
        PyErr_SetString(PyExc_ValueError, "descend: need page_bytes > 0 and pos >= 0");
        return NULL;
    }
    const char *k = PyBytes_AS_STRING(key);
    Py_ssize_t end = PyBytes_GET_SIZE(key);
    PyObject *path = PyList_New(0);
    if (path == NULL) return NULL;
    Py_INCREF(node);
    while (pos <= end - step) {  /* not pos + step <= end: that wraps for a huge pos */
        Py_ssize_t klen;
        PyObject *child = next_child(node, k, pos, end, step, &klen);
        Py_DECREF(node);
        node = child;
        if (child == NULL) break;
        if (PyObject_SetAttr(child, s_last_access, now) < 0 || PyList_Append(path, child) < 0)
            break;
        pos += klen;
    }
    Py_XDECREF(node);
    if (PyErr_Occurred()) { Py_DECREF(path); return NULL; }
    return Py_BuildValue("(Nn)", path, pos);
}

/* Counts one hit on ``node`` and folds its device state into the tally; 0, or -1 with an error. */
static int tally_node(PyObject *node, PyObject *chunks, Py_ssize_t *nbytes, int *unbacked,
                      int *loading, PyObject *io_load) {
    PyObject *hits = PyObject_GetAttr(node, s_hit_count);
    if (hits == NULL) return -1;
    PyObject *more = PyNumber_Add(hits, one);
    Py_DECREF(hits);
    if (more == NULL) return -1;
    int err = PyObject_SetAttr(node, s_hit_count, more);
    Py_DECREF(more);
    if (err < 0) return -1;
    PyObject *pages = PyObject_GetAttr(node, s_device_pages);
    if (pages == NULL) return -1;
    if (pages == Py_None) { Py_DECREF(pages); return 0; }
    if (!PyBytes_Check(pages) || PyList_Append(chunks, pages) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "tally: pages must be bytes");
        Py_DECREF(pages);
        return -1;
    }
    *nbytes += PyBytes_GET_SIZE(pages);
    Py_DECREF(pages);
    PyObject *host = PyObject_GetAttr(node, s_host_pages), *io = PyObject_GetAttr(node, s_io);
    if (host == NULL || io == NULL) { Py_XDECREF(host); Py_XDECREF(io); return -1; }
    *unbacked |= host == Py_None;
    *loading |= io == io_load;
    Py_DECREF(host);
    Py_DECREF(io);
    return 0;
}

/* tally(path, io_load) -> (chunks, slot_bytes, unbacked, loading)
 *
 * A match's bookkeeping over its path: every node's hit_count += 1. Of the device-resident
 * nodes (they come first): their device_pages in order, those bytes' total, whether one has no
 * host copy, whether one's ``io`` is ``io_load`` (a load still writing it). */
static PyObject *tally(PyObject *self, PyObject *args) {
    PyObject *path, *io_load;
    if (!PyArg_ParseTuple(args, "O!O", &PyList_Type, &path, &io_load)) return NULL;
    PyObject *chunks = PyList_New(0);
    if (chunks == NULL) return NULL;
    Py_ssize_t nbytes = 0;
    int unbacked = 0, loading = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(path); i++) {  /* (the list may shrink) */
        PyObject *node = PyList_GET_ITEM(path, i);
        Py_INCREF(node);  /* attribute access may run code that drops the list's reference */
        int err = tally_node(node, chunks, &nbytes, &unbacked, &loading, io_load);
        Py_DECREF(node);
        if (err) {
            Py_DECREF(chunks);
            return NULL;
        }
    }
    return Py_BuildValue("(NnNN)", chunks, nbytes, PyBool_FromLong(unbacked),
                         PyBool_FromLong(loading));
}

/* An AVX2 compare beside the plain one, picked once at import by the CPU (GCC on x86-64 Linux
 * only: elsewhere just the plain one; HICACHE_NO_AVX2=1 forces the plain one). */
#if defined(__x86_64__) && defined(__linux__) && defined(__GLIBC__) && !defined(__clang__) && \
    defined(__GNUC__) && __GNUC__ >= 6
#define HAVE_AVX2_PATH 1
#include <immintrin.h>
#else
#define HAVE_AVX2_PATH 0
#endif
static int cpu_has_avx2 = 0; /* set once at import (HAVE_AVX2_PATH builds only) */

/* The bits in which the ``n * ps`` int64 slots at ``sl`` differ from those of the int64 page
 * ids ``pg`` (page * ps + 0, 1, ... in order), nonzero also for a page id above ``most`` or
 * negative. No early exit: a branch per page stops the vectorizing, and a mismatch costs at most
 * this node's compare. (noinline: inlined beside the AVX2 path, it made that one 15% slower.) */
__attribute__((noinline)) static uint64_t slot_diff(const char *sl, const char *pg,
                                                   Py_ssize_t n, Py_ssize_t ps, uint64_t most) {
    uint64_t bad = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t page;
        memcpy(&page, pg + 8 * i, 8); /* memcpy: the buffers need not be aligned */
        bad |= page < 0 || (uint64_t)page > most;
        uint64_t first = (uint64_t)page * (uint64_t)ps; /* unsigned: wraps, never UB */
        const char *run = sl + 8 * i * ps;
        for (Py_ssize_t j = 0; j < ps; j++) {
            uint64_t slot;
            memcpy(&slot, run + 8 * j, 8);
            bad |= slot ^ (first + (uint64_t)j);
        }
    }
    return bad;
}

#if HAVE_AVX2_PATH
/* slot_diff for a page size that is a multiple of 4, four slots a vector: GCC's own vectorizing
 * of the loop above ran 0.85 us for 3,000 slots (page size 16), more than memcmp of page ids
 * and slots at page size 1 (0.72 us, twice the bytes). */
__attribute__((target("avx2"))) static uint64_t slot_diff_avx2(const char *sl, const char *pg,
                                                               Py_ssize_t n, Py_ssize_t ps,
                                                               uint64_t most) {
    const __m256i four = _mm256_set1_epi64x(4), iota = _mm256_setr_epi64x(0, 1, 2, 3);
    __m256i acc = _mm256_setzero_si256();
    uint64_t bad = 0;
    if (ps % 16 == 0) { /* 16 slots a step, unrolled: no loop overhead per vector */
        const __m256i i1 = _mm256_add_epi64(iota, four), i2 = _mm256_add_epi64(i1, four),
                      i3 = _mm256_add_epi64(i2, four), sixteen = _mm256_set1_epi64x(16);
        __m256i acc1 = _mm256_setzero_si256();
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t page;
            memcpy(&page, pg + 8 * i, 8);
            bad |= page < 0 || (uint64_t)page > most;
            __m256i base = _mm256_set1_epi64x((long long)((uint64_t)page * (uint64_t)ps));
            const char *run = sl + 8 * i * ps;
            for (Py_ssize_t j = 0; j < ps; j += 16, run += 128) {
                __m256i g0 = _mm256_loadu_si256((const __m256i *)(const void *)run);
                __m256i g1 = _mm256_loadu_si256((const __m256i *)(const void *)(run + 32));
                __m256i g2 = _mm256_loadu_si256((const __m256i *)(const void *)(run + 64));
                __m256i g3 = _mm256_loadu_si256((const __m256i *)(const void *)(run + 96));
                acc = _mm256_or_si256(acc, _mm256_xor_si256(g0, _mm256_add_epi64(base, iota)));
                acc1 = _mm256_or_si256(acc1, _mm256_xor_si256(g1, _mm256_add_epi64(base, i1)));
                acc = _mm256_or_si256(acc, _mm256_xor_si256(g2, _mm256_add_epi64(base, i2)));
                acc1 = _mm256_or_si256(acc1, _mm256_xor_si256(g3, _mm256_add_epi64(base, i3)));
                base = _mm256_add_epi64(base, sixteen);
            }
        }
        acc = _mm256_or_si256(acc, acc1);
        return bad | (uint64_t)!_mm256_testz_si256(acc, acc);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t page;
        memcpy(&page, pg + 8 * i, 8);
        bad |= page < 0 || (uint64_t)page > most;
        uint64_t first = (uint64_t)page * (uint64_t)ps;
        __m256i want = _mm256_add_epi64(_mm256_set1_epi64x((long long)first), iota);
        const char *run = sl + 8 * i * ps;
        for (Py_ssize_t j = 0; j < ps; j += 4) {
            __m256i got = _mm256_loadu_si256((const __m256i *)(const void *)(run + 8 * j));
            acc = _mm256_or_si256(acc, _mm256_xor_si256(got, want));
            want = _mm256_add_epi64(want, four);
        }
    }
    return bad | (uint64_t)!_mm256_testz_si256(acc, acc);
}
#endif

/* Whether the ``avail`` int64 slots at ``sl`` begin with exactly the slots of the int64 page
 * ids ``pg`` (``n`` of them): page * ps + 0, 1, ... in order. A negative page id, or one whose
 * last slot would pass 2**63 - 1 (and wrap onto a real slot), never matches (above page size 1;
 * at 1 the slots are the pages, byte for byte). */
static int slots_are_pages(const char *sl, Py_ssize_t avail, const char *pg, Py_ssize_t n,
                           Py_ssize_t ps) {
    if (n > avail / ps) return 0; /* no n * ps: it may wrap */
    if (ps == 1) return memcmp(sl, pg, (size_t)n * 8) == 0;
    uint64_t most = ((uint64_t)INT64_MAX - (uint64_t)(ps - 1)) / (uint64_t)ps;
#if HAVE_AVX2_PATH
    if (cpu_has_avx2 && ps % 4 == 0) return slot_diff_avx2(sl, pg, n, ps, most) == 0;
#endif
    return slot_diff(sl, pg, n, ps, most) == 0;
}

/* own_nodes(path, i, pos, slots, page_size) -> (i, pos)
 *
 * From ``path[i]`` on, pass every node whose device pages the int64 ``slots`` from slot ``pos``
 * on are (the caller handed the tree's own pages back); stop at the first that has no device
 * pages or whose slots differ. ``pos`` advances by each passed node's slots. Nothing is built:
 * an insert's proof that the caller's slots are the tree's, in place, in one call. */
static PyObject *own_nodes(PyObject *self, PyObject *args) {
    PyObject *path;
    Py_ssize_t i, pos, ps;
    Py_buffer s;
    if (!PyArg_ParseTuple(args, "O!nny*n", &PyList_Type, &path, &i, &pos, &s, &ps)) return NULL;
    if (ps < 1 || i < 0 || pos < 0) {
        PyBuffer_Release(&s);
        PyErr_SetString(PyExc_ValueError, "own_nodes: need page_size >= 1, i >= 0, pos >= 0");
        return NULL;
    }
    Py_ssize_t avail = s.len / 8;
    int err = 0;
    while (i < PyList_GET_SIZE(path) && pos <= avail) {  /* (the list may shrink) */
        PyObject *node = PyList_GET_ITEM(path, i);
        Py_INCREF(node);  /* attribute access may run code that drops the list's reference */
        PyObject *pages = PyObject_GetAttr(node, s_device_pages);
        Py_DECREF(node);
        if (pages == NULL) { err = 1; break; }
        if (pages != Py_None && (!PyBytes_Check(pages) || PyBytes_GET_SIZE(pages) % 8)) {
            Py_DECREF(pages);
            PyErr_SetString(PyExc_TypeError, "own_nodes: device_pages must be int64 bytes");
            err = 1;
            break;
        }
        Py_ssize_t n = pages == Py_None ? 0 : PyBytes_GET_SIZE(pages) / 8;
        int same = pages != Py_None &&
                   slots_are_pages((const char *)s.buf + 8 * pos, avail - pos,
                                   PyBytes_AS_STRING(pages), n, ps);
        Py_DECREF(pages);
        if (!same) break;
        pos += n * ps;  /* <= avail: slots_are_pages checked n <= (avail - pos) / ps */
        i++;
    }
    PyBuffer_Release(&s);
    if (err) return NULL;
    return Py_BuildValue("(nn)", i, pos);
}

static PyMethodDef methods[] = {
    {"tally", tally, METH_VARARGS, "Count a match's hits; its device chunks and their state."},
    {"own_nodes", own_nodes, METH_VARARGS, "Pass the path's nodes whose pages the slots are."},
    {"descend", descend, METH_VARARGS, "Follow the children a key covers whole; (path, pos)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tree", NULL, -1, methods};

PyMODINIT_FUNC PyInit__tree(void) {
    s_children = PyUnicode_InternFromString("children");
    s_key = PyUnicode_InternFromString("key");
    s_last_access = PyUnicode_InternFromString("last_access");
    s_hit_count = PyUnicode_InternFromString("hit_count");
    s_device_pages = PyUnicode_InternFromString("device_pages");
    s_host_pages = PyUnicode_InternFromString("host_pages");
    s_io = PyUnicode_InternFromString("io");
    one = PyLong_FromLong(1);
#if HAVE_AVX2_PATH
    __builtin_cpu_init();
    cpu_has_avx2 = __builtin_cpu_supports("avx2") && !getenv("HICACHE_NO_AVX2");
#endif
    if (!s_children || !s_key || !s_last_access || !s_hit_count || !s_device_pages ||
        !s_host_pages || !s_io || !one)
        return NULL;
    return PyModule_Create(&module);
}

/* Hot-path checks of the core in C, with a numpy fallback in Python (hicache/fastpath.py).
 *
 * numpy costs several microseconds per call on small arrays; validating a caller's slots took
 * about ten such calls per insert. These functions do each check in one pass instead.
 * They only read, except whole_pages, which marks pages while scanning (to find repeats) and
 * then sets every page it accepted to ``claim`` (or restores them all when it refuses).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MARK 0x7f /* a state code no page ever has: "seen in this call" */
#define MAX_SLOT_BYTES ((Py_ssize_t)1 << 40) /* the most page_slots will build (1 TiB) */

/* The data of ``b``, 8-byte aligned: the buffer itself, or an aligned copy in ``*tmp`` (which
 * the caller frees with PyMem_Free). NULL, with MemoryError set, when the copy fails. Typed
 * reads of a misaligned buffer (a memoryview slice) would be undefined behaviour. */
static const void *aligned(const Py_buffer *b, void **tmp) {
    *tmp = NULL;
    if (((uintptr_t)b->buf & 7) == 0) return b->buf;
    *tmp = PyMem_Malloc(b->len ? (size_t)b->len : 1);
    if (*tmp == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    memcpy(*tmp, b->buf, (size_t)b->len);
    return *tmp;
}

/* min_int32(buffer) -> int: the smallest int32 in the buffer, or 0 when it has none below 0 */
static PyObject *min_int32(PyObject *self, PyObject *args) {
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "y*", &b)) return NULL;
    if (b.len % 4) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "min_int32: not whole int32 values");
        return NULL;
    }
    void *tmp;
    const int32_t *v = aligned(&b, &tmp);
    if (v == NULL) {
        PyBuffer_Release(&b);
        return NULL;
    }
    Py_ssize_t n = b.len / 4;
    int32_t any = 0, lo = 0;
    for (Py_ssize_t i = 0; i < n; i++)  /* OR of sign bits: vectorizes with plain SSE2 */
        any |= v[i];
    if (any < 0)  /* some id is negative (rare): find the smallest for the error message */
        for (Py_ssize_t i = 0; i < n; i++)
            if (v[i] < lo) lo = v[i];
    PyMem_Free(tmp);
    PyBuffer_Release(&b);
    return PyLong_FromLong(lo);
}

/* whole_pages(state, slots, page_size, num_pages, expected, claim[, stack, top, free])
 *     -> bytes | int
 *
 * ``slots`` (int64 bytes) must be whole pages in order, except that the last run may be a
 * partial page (its first slots). Every page must be in [0, num_pages), have state ``expected``
 * and appear once. Then all of them get state ``claim``. Returns the page ids as int64 bytes, or
 * an error code (and changes nothing):
 * 1 slot out of range, 2 not page-shaped, 3 wrong state, 4 repeated page.
 *
 * With ``stack`` (a writable int64 buffer, the allocator's free stack) a partial last page is
 * freed instead of claimed: it gets state ``free``, is written at ``stack[top]`` (the caller
 * then counts one more free page) and is left out of the returned ids. ``top`` outside the
 * stack is a ValueError before anything changes.
 */
static PyObject *whole_pages(PyObject *self, PyObject *args) {
    Py_buffer st, raw, stk = {0};
    Py_ssize_t ps, num_pages, top = 0;
    int expected, claim, free_state = 0;
    PyObject *stack = Py_None;
    if (!PyArg_ParseTuple(args, "w*y*nnii|Oni", &st, &raw, &ps, &num_pages, &expected, &claim,
                          &stack, &top, &free_state))
        return NULL;
    PyObject *out = NULL;
    void *tmp = NULL;
    if (stack != Py_None && PyObject_GetBuffer(stack, &stk, PyBUF_WRITABLE) < 0) goto release;
    if (ps < 1 || num_pages < 0 || raw.len % 8) {
        PyErr_SetString(PyExc_ValueError,
                        "whole_pages: need page_size >= 1, num_pages >= 0 and int64 slots");
        goto release;
    }
    if (stk.buf != NULL) { /* an int64 stack of its own, apart from the states */
        const char *a = stk.buf, *b = st.buf;
        if ((uintptr_t)stk.buf % 8 || stk.itemsize != 8 || top < 0 || top >= stk.len / 8 ||
            free_state < -128 || free_state > 127 || (a < b + st.len && b < a + stk.len)) {
            PyErr_SetString(PyExc_ValueError,
                            "whole_pages: need an aligned int64 stack apart from the states, top "
                            "inside it and an int8 free state");
            goto release;
        }
    }
    int8_t *state = (int8_t *)st.buf;
    const int64_t *s = aligned(&raw, &tmp);
    if (s == NULL) goto release;
    Py_ssize_t n = raw.len / 8, count = n / ps + (n % ps != 0), done = 0; /* no overflow */
    /* a partial last page to free is kept apart (``last``), not in the returned ids */
    Py_ssize_t kept = count - (stk.buf != NULL && n % ps);
    int64_t last = -1;
    int err = 0;
    out = PyBytes_FromStringAndSize(NULL, kept * 8);
    if (out == NULL) goto release;
    int64_t *pages = (int64_t *)PyBytes_AS_STRING(out); /* (the empty singleton: never written) */
    for (Py_ssize_t i = 0; i < count && !err; i++) {
        int64_t first = s[i * ps];
        if (first < 0 || first / ps >= num_pages || first / ps >= st.len) { err = 1; break; }
        if (first % ps) { err = 2; break; }
        Py_ssize_t len = n - i * ps < ps ? n - i * ps : ps; /* i * ps < n: no overflow */
        uint64_t diff = 0; /* no branch per slot: an early exit ran 12% slower at page size 16 */
        for (Py_ssize_t j = 1; j < len; j++)  /* unsigned: wraps, never UB, at any page size */
            diff |= (uint64_t)s[i * ps + j] ^ ((uint64_t)first + (uint64_t)j);
        if (diff) { err = 2; break; }
        int64_t p = first / ps;
        if (state[p] != expected) { err = state[p] == MARK ? 4 : 3; break; }
        state[p] = MARK;
        if (i < kept) pages[i] = p;
        else last = p;
        done = i + 1;
    }
    for (Py_ssize_t i = 0; i < done; i++)
        state[i < kept ? pages[i] : last] = (int8_t)(err ? expected : claim);
    if (err) {
        Py_DECREF(out);
        out = PyLong_FromLong(err);
    } else if (kept < count) { /* the partial last page: freed, not returned */
        state[last] = (int8_t)free_state;
        ((int64_t *)stk.buf)[top] = last;
    }
release:
    PyMem_Free(tmp);
    if (stk.buf != NULL) PyBuffer_Release(&stk);
    PyBuffer_Release(&st);
    PyBuffer_Release(&raw);
    return out;
}

/* common_bytes(a, b, offset) -> int: how many leading bytes of a and b[offset:] are equal */
static PyObject *common_bytes(PyObject *self, PyObject *args) {
    Py_buffer a, b;
    Py_ssize_t offset;
    if (!PyArg_ParseTuple(args, "y*y*n", &a, &b, &offset)) return NULL;
    Py_ssize_t n = 0, limit = 0;
    if (offset >= 0 && offset <= b.len)  /* (offset beyond b: nothing in common) */
        limit = b.len - offset < a.len ? b.len - offset : a.len;
    const unsigned char *x = (const unsigned char *)a.buf;
    const unsigned char *y = (const unsigned char *)b.buf + (limit ? offset : 0);
    while (n + 8 <= limit && memcmp(x + n, y + n, 8) == 0) n += 8;  /* (no aligned loads) */
    while (n < limit && x[n] == y[n]) n++;
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return PyLong_FromSsize_t(n);
}

/* page_slots(pages, page_size) -> bytearray: the slots of int64 page ids, page by page
 * (page * page_size + offset). A bytearray: callers wrap it in a writable tensor. */
static PyObject *page_slots(PyObject *self, PyObject *args) {
    Py_buffer b;
    Py_ssize_t ps;
    if (!PyArg_ParseTuple(args, "y*n", &b, &ps)) return NULL;
    PyObject *out = NULL;
    void *tmp = NULL;
    if (ps < 1 || b.len % 8) {
        PyErr_SetString(PyExc_ValueError, "page_slots: need page_size >= 1 and int64 pages");
        goto release;
    }
    Py_ssize_t n = b.len / 8;
    if (n && ps > MAX_SLOT_BYTES / 8 / n) {  /* n * ps * 8 must not wrap */
        PyErr_SetString(PyExc_ValueError, "page_slots: too many slots");
        goto release;
    }
    const int64_t *pages = aligned(&b, &tmp);
    if (pages == NULL) goto release;
    for (Py_ssize_t i = 0; i < n; i++)  /* page * ps + offset must fit int64 */
        if (pages[i] < 0 || pages[i] > (INT64_MAX - ps) / ps) {
            PyErr_SetString(PyExc_ValueError, "page_slots: a page id outside [0, 2**63 / page_size)");
            goto release;
        }
    out = PyByteArray_FromStringAndSize(NULL, n * ps * 8);
    if (out == NULL) goto release;
    int64_t *dst = (int64_t *)PyByteArray_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++)
        for (Py_ssize_t j = 0; j < ps; j++) *dst++ = pages[i] * ps + j;
release:
    PyMem_Free(tmp);
    PyBuffer_Release(&b);
    return out;
}

/* slot_pages(slots, page_size) -> bytes: for each run of page_size int64 slots, the page id it
 * is (a whole page: page * page_size + 0, 1, ... in order), or -1 when it is not one. A trailing
 * partial run is left out. Compared with a node's page ids, this proves a caller's slots are the
 * tree's own without expanding the node. */
static PyObject *slot_pages(PyObject *self, PyObject *args) {
    Py_buffer b;
    Py_ssize_t ps;
    if (!PyArg_ParseTuple(args, "y*n", &b, &ps)) return NULL;
    PyObject *out = NULL;
    void *tmp = NULL;
    if (ps < 1) {
        PyErr_SetString(PyExc_ValueError, "slot_pages: need page_size >= 1");
        goto release;
    }
    Py_ssize_t n = b.len / 8 / ps;
    const int64_t *s = aligned(&b, &tmp);
    if (s == NULL) goto release;
    out = PyBytes_FromStringAndSize(NULL, n * 8);
    if (out == NULL) goto release;
    int64_t *dst = (int64_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++, s += ps) {
        int64_t page = s[0] >= 0 && s[0] % ps == 0 ? s[0] / ps : -1;
        for (Py_ssize_t j = 1; j < ps && page >= 0; j++)  /* unsigned: s[0] + j never wraps UB */
            if ((uint64_t)s[j] != (uint64_t)s[0] + (uint64_t)j) page = -1;
        dst[i] = page;
    }
release:
    PyMem_Free(tmp);
    PyBuffer_Release(&b);
    return out;
}

/* store_release(buffer, index, value) and load_acquire(buffer, index) -> int: one aligned
 * int64 word of a writable buffer, with release / acquire ordering (the layer progress table:
 * KV written before the store is visible to a reader that has seen the stored value). */
/* 0 when word ``i`` lies inside ``b`` and ``b`` is 8-byte aligned; else -1 with IndexError or
 * ValueError set and ``b`` released. No (i + 1) * 8: it wraps for a huge i. */
static int check_word(Py_buffer *b, Py_ssize_t i) {
    if (i < 0 || i >= b->len / 8) {
        PyBuffer_Release(b);
        PyErr_SetString(PyExc_IndexError, "word outside the buffer");
        return -1;
    }
    if ((uintptr_t)b->buf % 8) {
        PyBuffer_Release(b);
        PyErr_SetString(PyExc_ValueError, "the buffer is not 8-byte aligned");
        return -1;
    }
    return 0;
}

static PyObject *store_release(PyObject *self, PyObject *args) {
    Py_buffer b;
    Py_ssize_t i;
    long long v;
    if (!PyArg_ParseTuple(args, "w*nL", &b, &i, &v)) return NULL;
    if (check_word(&b, i) < 0) return NULL;
    __atomic_store_n((int64_t *)b.buf + i, (int64_t)v, __ATOMIC_RELEASE);
    PyBuffer_Release(&b);
    Py_RETURN_NONE;
}

static PyObject *load_acquire(PyObject *self, PyObject *args) {
    Py_buffer b;
    Py_ssize_t i;
    if (!PyArg_ParseTuple(args, "y*n", &b, &i)) return NULL;
    if (check_word(&b, i) < 0) return NULL;
    int64_t v = __atomic_load_n((const int64_t *)b.buf + i, __ATOMIC_ACQUIRE);
    PyBuffer_Release(&b);
    return PyLong_FromLongLong(v);
}

/* pack_shared(buffers) -> (bytes, shared): int32 sequences concatenated, each without the
 * leading tokens it shares with the previous one; shared[i] counts those tokens. */
static PyObject *pack_shared(PyObject *self, PyObject *args) {
    PyObject *list;
    if (!PyArg_ParseTuple(args, "O!", &PyList_Type, &list)) return NULL;
    Py_ssize_t k = PyList_GET_SIZE(list), total = 0;
    Py_buffer *bufs = PyMem_Calloc(k ? k : 1, sizeof(Py_buffer));
    Py_ssize_t *shared = PyMem_Calloc(k ? k : 1, sizeof(Py_ssize_t));
    PyObject *out = NULL, *counts = NULL, *result = NULL;
    Py_ssize_t got = 0;
    if (bufs == NULL || shared == NULL) { PyErr_NoMemory(); goto done; }
    for (; got < k; got++) {
        if (PyObject_GetBuffer(PyList_GET_ITEM(list, got), &bufs[got], PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        if (bufs[got].len % 4) { PyErr_SetString(PyExc_ValueError, "not int32 data"); got++; goto done; }
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        Py_ssize_t n = 0;
        if (i) {
            const char *a = bufs[i - 1].buf, *b = bufs[i].buf;
            Py_ssize_t bytes = bufs[i].len < bufs[i - 1].len ? bufs[i].len : bufs[i - 1].len;
            Py_ssize_t at = 0;  /* whole 8-byte words first, then the tokens of the last one */
            while (at + 8 <= bytes && memcmp(a + at, b + at, 8) == 0) at += 8;
            n = at / 4;
            while (n < bytes / 4 && memcmp(a + 4 * n, b + 4 * n, 4) == 0) n++;
        }
        shared[i] = n;
        total += bufs[i].len - 4 * n;
    }
    out = PyBytes_FromStringAndSize(NULL, total);
    counts = PyList_New(k);
    if (out == NULL || counts == NULL) goto done;
    char *dst = PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < k; i++) {
        Py_ssize_t skip = 4 * shared[i];
        memcpy(dst, (const char *)bufs[i].buf + skip, bufs[i].len - skip);
        dst += bufs[i].len - skip;
        PyList_SET_ITEM(counts, i, PyLong_FromSsize_t(shared[i]));
    }
    result = PyTuple_Pack(2, out, counts);
done:
    for (Py_ssize_t i = 0; i < got && bufs; i++)
        if (bufs[i].obj) PyBuffer_Release(&bufs[i]);
    PyMem_Free(bufs);
    PyMem_Free(shared);
    Py_XDECREF(out);
    Py_XDECREF(counts);
    return result;
}

/* unpack_shared(frame, lengths, shared) -> list[bytes]: the inverse of pack_shared. The caller
 * has checked that the lists are consistent with each other and with the frame's size. */
static PyObject *unpack_shared(PyObject *self, PyObject *args) {
    Py_buffer f;
    PyObject *lengths, *shared;
    if (!PyArg_ParseTuple(args, "y*O!O!", &f, &PyList_Type, &lengths, &PyList_Type, &shared))
        return NULL;
    Py_ssize_t k = PyList_GET_SIZE(lengths), pos = 0;
    PyObject *out = NULL, *prev = NULL;
    if (PyList_GET_SIZE(shared) != k) {
        PyErr_SetString(PyExc_ValueError, "lengths and shared do not match the frame");
        goto fail;
    }
    out = PyList_New(k);
    if (out == NULL) goto fail;
    for (Py_ssize_t i = 0; i < k; i++) {
        Py_ssize_t n = PyLong_AsSsize_t(PyList_GET_ITEM(lengths, i));
        Py_ssize_t s = PyLong_AsSsize_t(PyList_GET_ITEM(shared, i));
        if (PyErr_Occurred()) goto fail;
        /* in tokens first, so that 4 * n cannot wrap; then in bytes */
        if (n < 0 || s < 0 || s > n || n - s > (f.len - pos) / 4) {
            PyErr_SetString(PyExc_ValueError, "lengths and shared do not match the frame");
            goto fail;
        }
        n *= 4;
        s *= 4;
        if (s && (prev == NULL || s > PyBytes_GET_SIZE(prev))) {
            PyErr_SetString(PyExc_ValueError, "lengths and shared do not match the frame");
            goto fail;
        }
        PyObject *key = PyBytes_FromStringAndSize(NULL, n);
        if (key == NULL) goto fail;
        if (s) memcpy(PyBytes_AS_STRING(key), PyBytes_AS_STRING(prev), s);
        memcpy(PyBytes_AS_STRING(key) + s, (const char *)f.buf + pos, n - s);
        pos += n - s;
        PyList_SET_ITEM(out, i, key);  /* the list owns it; prev borrows */
        prev = key;
    }
    PyBuffer_Release(&f);
    return out;
fail:
    PyBuffer_Release(&f);
    Py_XDECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"common_bytes", common_bytes, METH_VARARGS, "Length of the common prefix of a, b[offset:]."},
    {"min_int32", min_int32, METH_VARARGS, "Smallest int32 of a buffer (0 if none is negative)."},
    {"store_release", store_release, METH_VARARGS, "Store an int64 word with release order."},
    {"load_acquire", load_acquire, METH_VARARGS, "Load an int64 word with acquire order."},
    {"pack_shared", pack_shared, METH_VARARGS, "Concatenate int32 sequences minus shared prefixes."},
    {"unpack_shared", unpack_shared, METH_VARARGS, "Rebuild the sequences pack_shared packed."},
    {"page_slots", page_slots, METH_VARARGS, "The int64 slots of int64 page ids."},
    {"slot_pages", slot_pages, METH_VARARGS, "Page id of each whole-page run of slots, or -1."},
    {"whole_pages", whole_pages, METH_VARARGS, "Validate page-shaped slots; page ids or code."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fast", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fast(void) { return PyModule_Create(&module); }

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

/* min_int32(buffer) -> int: the smallest int32 in the buffer, or 0 when it has none below 0 */
static PyObject *min_int32(PyObject *self, PyObject *args) {
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "y*", &b)) return NULL;
    const int32_t *v = (const int32_t *)b.buf;
    Py_ssize_t n = b.len / 4;
    int32_t lo = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (v[i] < lo) lo = v[i];
    PyBuffer_Release(&b);
    return PyLong_FromLong(lo);
}

/* whole_pages(state, slots, page_size, num_pages, expected, claim) -> bytes | int
 *
 * ``slots`` (int64 bytes) must be whole pages in order, except that the last run may be a
 * partial page (its first slots). Every page must be in [0, num_pages), have state ``expected``
 * and appear once. Then all of them get state ``claim``. Returns the page ids as int64 bytes, or
 * an error code (and changes nothing):
 * 1 slot out of range, 2 not page-shaped, 3 wrong state, 4 repeated page.
 */
static PyObject *whole_pages(PyObject *self, PyObject *args) {
    Py_buffer st, raw;
    Py_ssize_t ps, num_pages;
    int expected, claim;
    if (!PyArg_ParseTuple(args, "w*y*nnii", &st, &raw, &ps, &num_pages, &expected, &claim))
        return NULL;
    int8_t *state = (int8_t *)st.buf;
    const int64_t *s = (const int64_t *)raw.buf;
    Py_ssize_t n = raw.len / 8, count = (n + ps - 1) / ps, done = 0;
    int err = 0;
    PyObject *out = PyBytes_FromStringAndSize(NULL, count * 8);
    if (out == NULL) goto release;
    int64_t *pages = (int64_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < count && !err; i++) {
        int64_t first = s[i * ps];
        if (first < 0 || first / ps >= num_pages || first / ps >= st.len) { err = 1; break; }
        if (first % ps) { err = 2; break; }
        Py_ssize_t len = (i + 1) * ps <= n ? ps : n - i * ps;
        for (Py_ssize_t j = 1; j < len; j++)
            if (s[i * ps + j] != first + j) { err = 2; break; }
        if (err) break;
        int64_t p = first / ps;
        if (state[p] != expected) { err = state[p] == MARK ? 4 : 3; break; }
        state[p] = MARK;
        pages[i] = p;
        done = i + 1;
    }
    for (Py_ssize_t i = 0; i < done; i++) state[pages[i]] = (int8_t)(err ? expected : claim);
    if (err) {
        Py_DECREF(out);
        out = PyLong_FromLong(err);
    }
release:
    PyBuffer_Release(&st);
    PyBuffer_Release(&raw);
    return out;
}

/* common_bytes(a, b, offset) -> int: how many leading bytes of a and b[offset:] are equal */
static PyObject *common_bytes(PyObject *self, PyObject *args) {
    Py_buffer a, b;
    Py_ssize_t offset;
    if (!PyArg_ParseTuple(args, "y*y*n", &a, &b, &offset)) return NULL;
    Py_ssize_t n = 0, limit = b.len - offset < a.len ? b.len - offset : a.len;
    const unsigned char *x = (const unsigned char *)a.buf;
    const unsigned char *y = (const unsigned char *)b.buf + (offset > 0 ? offset : 0);
    if (offset < 0 || limit < 0) limit = 0;
    while (n + 8 <= limit && *(const uint64_t *)(x + n) == *(const uint64_t *)(y + n)) n += 8;
    while (n < limit && x[n] == y[n]) n++;
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return PyLong_FromSsize_t(n);
}

/* page_ids(chunks, page_size) -> bytes: the page id (int64) of every page-aligned run of
 * ``page_size`` slots in each int64 chunk, concatenated. The tree's slot chunks are whole pages
 * in order, so this is every page_size-th slot divided by page_size. */
static PyObject *page_ids(PyObject *self, PyObject *args) {
    PyObject *list;
    Py_ssize_t ps;
    if (!PyArg_ParseTuple(args, "O!n", &PyList_Type, &list, &ps)) return NULL;
    if (ps < 1) { PyErr_SetString(PyExc_ValueError, "page_size < 1"); return NULL; }
    Py_ssize_t count = 0, k = PyList_GET_SIZE(list);
    for (Py_ssize_t c = 0; c < k; c++) {
        PyObject *b = PyList_GET_ITEM(list, c);
        if (!PyBytes_Check(b)) { PyErr_SetString(PyExc_TypeError, "chunks are bytes"); return NULL; }
        count += PyBytes_GET_SIZE(b) / 8 / ps;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, count * 8);
    if (out == NULL) return NULL;
    int64_t *dst = (int64_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t c = 0; c < k; c++) {
        PyObject *b = PyList_GET_ITEM(list, c);
        const int64_t *s = (const int64_t *)PyBytes_AS_STRING(b);
        Py_ssize_t n = PyBytes_GET_SIZE(b) / 8 / ps;
        for (Py_ssize_t i = 0; i < n; i++) *dst++ = s[i * ps] / ps;
    }
    return out;
}

/* store_release(buffer, index, value) and load_acquire(buffer, index) -> int: one aligned
 * int64 word of a writable buffer, with release / acquire ordering (the layer progress table:
 * KV written before the store is visible to a reader that has seen the stored value). */
static PyObject *store_release(PyObject *self, PyObject *args) {
    Py_buffer b;
    Py_ssize_t i;
    long long v;
    if (!PyArg_ParseTuple(args, "w*nL", &b, &i, &v)) return NULL;
    if (i < 0 || (i + 1) * 8 > b.len) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_IndexError, "word outside the buffer");
        return NULL;
    }
    __atomic_store_n((int64_t *)b.buf + i, (int64_t)v, __ATOMIC_RELEASE);
    PyBuffer_Release(&b);
    Py_RETURN_NONE;
}

static PyObject *load_acquire(PyObject *self, PyObject *args) {
    Py_buffer b;
    Py_ssize_t i;
    if (!PyArg_ParseTuple(args, "y*n", &b, &i)) return NULL;
    if (i < 0 || (i + 1) * 8 > b.len) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_IndexError, "word outside the buffer");
        return NULL;
    }
    int64_t v = __atomic_load_n((const int64_t *)b.buf + i, __ATOMIC_ACQUIRE);
    PyBuffer_Release(&b);
    return PyLong_FromLongLong(v);
}

static PyMethodDef methods[] = {
    {"common_bytes", common_bytes, METH_VARARGS, "Length of the common prefix of a, b[offset:]."},
    {"min_int32", min_int32, METH_VARARGS, "Smallest int32 of a buffer (0 if none is negative)."},
    {"store_release", store_release, METH_VARARGS, "Store an int64 word with release order."},
    {"load_acquire", load_acquire, METH_VARARGS, "Load an int64 word with acquire order."},
    {"page_ids", page_ids, METH_VARARGS, "Page ids of whole-page int64 slot chunks."},
    {"whole_pages", whole_pages, METH_VARARGS, "Validate page-shaped slots; page ids or code."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fast", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fast(void) { return PyModule_Create(&module); }

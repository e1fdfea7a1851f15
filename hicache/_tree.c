/* The radix tree's inner walk in C, with the same loop in Python (hicache/fastpath.py).
 *
 * A match spends most of its time stepping from a node to the child its key continues with:
 * a dict lookup by the next page of token bytes, a prefix compare, an access-time stamp. In
 * Python each step is a dozen bytecodes; here it is a few C calls on the same objects. The
 * tree stays made of Python TreeNode objects: this only reads ``children`` and ``key`` and
 * writes ``last_access``, through ordinary attribute access.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

static PyObject *s_children, *s_key, *s_last_access; /* interned attribute names */

/* The child of ``node`` whose key ``key[pos:]`` starts with, as a new reference; NULL with no
 * error set when there is none (or it is matched only in part), NULL with an error on failure. */
static PyObject *next_child(PyObject *node, const char *key, Py_ssize_t pos, Py_ssize_t end,
                            Py_ssize_t step) {
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
    int whole = PyBytes_Check(ckey) &&
                PyBytes_GET_SIZE(ckey) <= end - pos &&
                memcmp(PyBytes_AS_STRING(ckey), key + pos, PyBytes_GET_SIZE(ckey)) == 0;
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
    while (pos + step <= end) {
        PyObject *child = next_child(node, k, pos, end, step);
        Py_DECREF(node);
        node = child;
        if (child == NULL) break;
        if (PyObject_SetAttr(child, s_last_access, now) < 0 || PyList_Append(path, child) < 0)
            break;
        PyObject *ckey = PyObject_GetAttr(child, s_key);
        if (ckey == NULL) break;
        pos += PyBytes_GET_SIZE(ckey);
        Py_DECREF(ckey);
    }
    Py_XDECREF(node);
    if (PyErr_Occurred()) { Py_DECREF(path); return NULL; }
    PyObject *out = Py_BuildValue("(Nn)", path, pos);
    return out;
}

static PyMethodDef methods[] = {
    {"descend", descend, METH_VARARGS, "Follow the children a key covers whole; (path, pos)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tree", NULL, -1, methods};

PyMODINIT_FUNC PyInit__tree(void) {
    s_children = PyUnicode_InternFromString("children");
    s_key = PyUnicode_InternFromString("key");
    s_last_access = PyUnicode_InternFromString("last_access");
    if (!s_children || !s_key || !s_last_access) return NULL;
    return PyModule_Create(&module);
}

/* Page copies between CPU KV pools, in C without the GIL, split across threads.
 *
 * A page of one (kv, layer) is ``tokens`` chunks of ``chunk`` bytes; consecutive chunks are
 * ``tok_stride`` bytes apart (equal to ``chunk`` in layer-first pools, where a page is one
 * block, and num_layers * chunk in page_first, where layers interleave). Copying page
 * src_pages[i] to dst_pages[i] is then one memcpy per page or one per token.
 *
 * A single thread reaches about half of what torch's own (multithreaded) copy does on two
 * cores, so large copies are cut into contiguous ranges of pages, one per thread.
 * The caller (hicache/fastpath.py) has checked every page index and stride against the
 * tensors the addresses come from; this module trusts them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define MAX_THREADS 16

typedef struct {
    const char *src;                 /* base address of the source view */
    char *dst;                       /* base address of the destination view */
    Py_ssize_t s_page, d_page;       /* bytes between pages */
    Py_ssize_t s_tok, d_tok;         /* bytes between a page's tokens */
    Py_ssize_t tokens, chunk;        /* tokens per page, bytes per token */
    const int64_t *si, *di;          /* page ids */
    Py_ssize_t begin, end;           /* this task's range of i */
} Task;

static void *run_task(void *arg) {
    const Task *t = (const Task *)arg;
    int block = t->s_tok == t->chunk && t->d_tok == t->chunk;
    size_t page_bytes = (size_t)(t->tokens * t->chunk);
    for (Py_ssize_t i = t->begin; i < t->end; i++) {
        const char *s = t->src + t->si[i] * t->s_page;
        char *d = t->dst + t->di[i] * t->d_page;
        if (block) {
            memcpy(d, s, page_bytes);
            continue;
        }
        for (Py_ssize_t k = 0; k < t->tokens; k++)
            memcpy(d + k * t->d_tok, s + k * t->s_tok, (size_t)t->chunk);
    }
    return NULL;
}

/* copy_pages(src, dst, s_page, d_page, s_tok, d_tok, tokens, chunk, src_pages, dst_pages,
 *            threads) -> None */
static PyObject *copy_pages(PyObject *self, PyObject *args) {
    unsigned long long src, dst;
    Py_ssize_t s_page, d_page, s_tok, d_tok, tokens, chunk, threads;
    Py_buffer si, di;
    if (!PyArg_ParseTuple(args, "KKnnnnnny*y*n", &src, &dst, &s_page, &d_page, &s_tok, &d_tok,
                          &tokens, &chunk, &si, &di, &threads))
        return NULL;
    Py_ssize_t n = si.len / 8 < di.len / 8 ? si.len / 8 : di.len / 8;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > n) threads = n > 0 ? n : 1;
    Task tasks[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (Py_ssize_t k = 0; k < threads; k++) {
        Task t = {(const char *)src, (char *)dst, s_page, d_page, s_tok, d_tok, tokens, chunk,
                  (const int64_t *)si.buf, (const int64_t *)di.buf,
                  n * k / threads, n * (k + 1) / threads};
        tasks[k] = t;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 1; k < threads; k++)  /* a thread that fails to start: done inline */
        started[k] = pthread_create(&ids[k], NULL, run_task, &tasks[k]) == 0;
    run_task(&tasks[0]);
    for (Py_ssize_t k = 1; k < threads; k++) {
        if (started[k])
            pthread_join(ids[k], NULL);
        else
            run_task(&tasks[k]);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&si);
    PyBuffer_Release(&di);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_pages", copy_pages, METH_VARARGS, "memcpy indexed pages between strided buffers."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_copy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__copy(void) { return PyModule_Create(&module); }

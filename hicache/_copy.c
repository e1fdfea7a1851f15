/* Page copies between CPU KV pools, in C without the GIL, split across threads.
 *
 * One call copies the same page lists for several (kv, layer) views of identical strides: a
 * backup is one call for all layers, so threads start once.
 * A page of one (kv, layer) is ``tokens`` chunks of ``chunk`` bytes; consecutive chunks are
 * ``tok_stride`` bytes apart (equal to ``chunk`` in layer-first pools, where a page is one
 * block, and num_layers * chunk in page_first, where layers interleave). Copying page
 * src_pages[i] to dst_pages[i] is then one memcpy per page or one per token.
 *
 * A single thread reaches about half of what torch's own (multithreaded) copy does on two
 * cores, so large copies are cut into contiguous ranges of pages, one per thread.
 * The caller (hicache/cpu_copy.py) checks every page index and layer against the tensors the
 * addresses come from; this module checks what its arguments alone can tell (check_args).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#define MAX_THREADS 16

typedef struct {
    const int64_t *bases;            /* (src, dst) base address of each of ``pairs`` views */
    Py_ssize_t pairs;                /* (kv, layer) views sharing strides and page lists */
    Py_ssize_t s_page, d_page;       /* bytes between pages */
    Py_ssize_t s_tok, d_tok;         /* bytes between a page's tokens */
    Py_ssize_t tokens, chunk;        /* tokens per page, bytes per token */
    const int64_t *si, *di;          /* page ids */
    Py_ssize_t n;                    /* pages per view */
    Py_ssize_t begin, end;           /* this task's range of work items (view * n + page) */
    int stream;                      /* non-temporal stores (large copies) */
} Task;

/* memcpy with non-temporal stores: a large copy then writes memory without first reading every
 * destination line into the cache (what plain memcpy of a whole buffer does too). Falls back to
 * memcpy where alignment or the architecture does not allow it. */
static void copy_chunk(char *d, const char *s, size_t n, int stream) {
#if defined(__x86_64__)
    if (stream && !(((uintptr_t)d | (uintptr_t)s | n) & 15)) {
        __m128i *dv = (__m128i *)d;
        const __m128i *sv = (const __m128i *)s;
        size_t k = 0, words = n / 16;
        for (; k + 4 <= words; k += 4) {
            __m128i a = _mm_load_si128(sv + k), b = _mm_load_si128(sv + k + 1);
            __m128i c = _mm_load_si128(sv + k + 2), e = _mm_load_si128(sv + k + 3);
            _mm_stream_si128(dv + k, a);
            _mm_stream_si128(dv + k + 1, b);
            _mm_stream_si128(dv + k + 2, c);
            _mm_stream_si128(dv + k + 3, e);
        }
        for (; k < words; k++) _mm_stream_si128(dv + k, _mm_load_si128(sv + k));
        return;
    }
#endif
    (void)stream;
    memcpy(d, s, n);
}

/* Pages [begin, end) of one view; pages that are whole blocks, back to back on both sides,
 * merge into one copy. */
static void copy_range(const Task *t, const char *src, char *dst, Py_ssize_t begin,
                       Py_ssize_t end) {
    int block = t->s_tok == t->chunk && t->d_tok == t->chunk;
    size_t page_bytes = (size_t)(t->tokens * t->chunk);
    int merge = block && t->s_page == (Py_ssize_t)page_bytes && t->d_page == (Py_ssize_t)page_bytes;
    for (Py_ssize_t i = begin; i < end; i++) {
        const char *s = src + t->si[i] * t->s_page;
        char *d = dst + t->di[i] * t->d_page;
        if (block) {
            Py_ssize_t run = 1;
            while (merge && i + run < end && t->si[i + run] == t->si[i] + run &&
                   t->di[i + run] == t->di[i] + run)
                run++;
            copy_chunk(d, s, page_bytes * (size_t)run, t->stream);
            i += run - 1;
            continue;
        }
        for (Py_ssize_t k = 0; k < t->tokens; k++)
            copy_chunk(d + k * t->d_tok, s + k * t->s_tok, (size_t)t->chunk, t->stream);
    }
}

/* View by view: on layer-first sides, consecutive pages merge into one copy. */
static void run_views(const Task *t) {
    for (Py_ssize_t item = t->begin; item < t->end;) {
        Py_ssize_t view = item / t->n, page = item % t->n;
        Py_ssize_t stop = (view + 1) * t->n < t->end ? t->n : t->end - view * t->n;
        copy_range(t, (const char *)(intptr_t)t->bases[2 * view],
                   (char *)(intptr_t)t->bases[2 * view + 1], page, stop);
        item = view * t->n + stop;
    }
}

/* Page by page, every view of a page in turn: page_first interleaves layers inside a page, so
 * its side is then read or written front to back instead of once per layer. */
static void run_pages(const Task *t) {
    for (Py_ssize_t item = t->begin; item < t->end; item++) {
        Py_ssize_t view = item % t->pairs, page = item / t->pairs;
        copy_range(t, (const char *)(intptr_t)t->bases[2 * view],
                   (char *)(intptr_t)t->bases[2 * view + 1], page, page + 1);
    }
}

static void *run_task(void *arg) {
    const Task *t = (const Task *)arg;
    if (t->s_tok != t->chunk || t->d_tok != t->chunk)
        run_pages(t);
    else
        run_views(t);
#if defined(__x86_64__)
    if (t->stream) _mm_sfence(); /* streamed stores are visible before the copy is reported */
#endif
    return NULL;
}

/* What can be checked here: the shapes of the arguments, and page ids >= 0. Addresses and the
 * upper bounds of page ids are checked by the caller against the tensors (cpu_copy.py). */
static int check_args(Py_buffer *bases, Py_buffer *si, Py_buffer *di, Py_ssize_t s_page,
                      Py_ssize_t d_page, Py_ssize_t s_tok, Py_ssize_t d_tok, Py_ssize_t tokens,
                      Py_ssize_t chunk) {
    if (((uintptr_t)bases->buf | (uintptr_t)si->buf | (uintptr_t)di->buf) & 7) {
        PyErr_SetString(PyExc_ValueError, "copy_pages: int64 arrays must be 8-byte aligned");
        return -1;
    }
    if (bases->len % 16 || si->len % 8 || si->len != di->len) {
        PyErr_SetString(PyExc_ValueError,
                        "copy_pages: bases are (src, dst) int64 pairs; as many src as dst pages");
        return -1;
    }
    if (s_page < 0 || d_page < 0 || s_tok < 0 || d_tok < 0 || tokens < 1 || chunk < 0) {
        PyErr_SetString(PyExc_ValueError, "copy_pages: strides and sizes must be >= 0");
        return -1;
    }
    const int64_t *a = (const int64_t *)si->buf, *b = (const int64_t *)di->buf;
    for (Py_ssize_t i = 0; i < si->len / 8; i++)
        if (a[i] < 0 || b[i] < 0) {
            PyErr_SetString(PyExc_IndexError, "copy_pages: a negative page id");
            return -1;
        }
    return 0;
}

/* copy_pages(bases, s_page, d_page, s_tok, d_tok, tokens, chunk, src_pages, dst_pages,
 *            threads, stream) -> None
 * ``bases``: int64 (src, dst) address pairs, one per view; every view copies the same pages. */
static PyObject *copy_pages(PyObject *self, PyObject *args) {
    Py_ssize_t s_page, d_page, s_tok, d_tok, tokens, chunk, threads;
    int stream;
    Py_buffer bases, si, di;
    if (!PyArg_ParseTuple(args, "y*nnnnnny*y*np", &bases, &s_page, &d_page, &s_tok, &d_tok,
                          &tokens, &chunk, &si, &di, &threads, &stream))
        return NULL;
    if (check_args(&bases, &si, &di, s_page, d_page, s_tok, d_tok, tokens, chunk) < 0) {
        PyBuffer_Release(&bases);
        PyBuffer_Release(&si);
        PyBuffer_Release(&di);
        return NULL;
    }
    Py_ssize_t n = si.len / 8;
    Py_ssize_t pairs = bases.len / 16, items = pairs * n;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > items) threads = items > 0 ? items : 1;
    Task tasks[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (Py_ssize_t k = 0; k < threads; k++) {
        Task t = {(const int64_t *)bases.buf, pairs, s_page, d_page, s_tok, d_tok, tokens, chunk,
                  (const int64_t *)si.buf, (const int64_t *)di.buf, n,
                  items * k / threads, items * (k + 1) / threads, stream};
        tasks[k] = t;
    }
    if (n > 0) {
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
    }
    PyBuffer_Release(&bases);
    PyBuffer_Release(&si);
    PyBuffer_Release(&di);
    Py_RETURN_NONE;
}

/* page_sums(bases, page_stride, tok_stride, tokens, chunk, pages, table, out) -> None
 * The checksum of each page: every view's ``tokens`` chunks of ``chunk`` bytes (a multiple of
 * 8) read as little-endian uint64 words w_i in view, token, word order, and
 * ``mix(sum_i w_i * table[i])`` mod 2**64 (``table``: odd multipliers, one per word of a page;
 * mix: splitmix64's finalizer). Linear, so numpy computes the same (hicache/page_sums.py); an
 * odd multiplier makes any change of one word change the sum. */
static PyObject *page_sums(PyObject *self, PyObject *args) {
    Py_ssize_t s_page, s_tok, tokens, chunk;
    Py_buffer bases, pages, table, out;
    if (!PyArg_ParseTuple(args, "y*nnnny*y*w*", &bases, &s_page, &s_tok, &tokens, &chunk, &pages,
                          &table, &out))
        return NULL;
    Py_ssize_t views = bases.len / 8, n = pages.len / 8, words = chunk / 8;
    int bad = (((uintptr_t)bases.buf | (uintptr_t)pages.buf | (uintptr_t)table.buf |
                (uintptr_t)out.buf) & 7) || bases.len % 8 || pages.len % 8 || chunk % 8 ||
              s_page < 0 || s_tok < 0 || tokens < 1 || out.len != pages.len ||
              table.len != views * tokens * words * 8;
    const int64_t *pg = (const int64_t *)pages.buf;
    for (Py_ssize_t i = 0; !bad && i < n; i++) bad = pg[i] < 0;
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "page_sums: misaligned, negative or mis-sized arguments");
    } else {
        const int64_t *b = (const int64_t *)bases.buf;
        const uint64_t *k = (const uint64_t *)table.buf;
        uint64_t *o = (uint64_t *)out.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t h0 = 0, h1 = 0;
            const uint64_t *kk = k;
            for (Py_ssize_t v = 0; v < views; v++) {
                const char *page = (const char *)(intptr_t)b[v] + pg[i] * s_page;
                for (Py_ssize_t t = 0; t < tokens; t++, kk += words) {
                    const uint64_t *w = (const uint64_t *)(page + t * s_tok);
                    Py_ssize_t j = 0;
                    for (; j + 2 <= words; j += 2) {  /* two chains: two multiplies in flight */
                        uint64_t a, c;
                        memcpy(&a, w + j, 8);
                        memcpy(&c, w + j + 1, 8);
                        h0 += a * kk[j];
                        h1 += c * kk[j + 1];
                    }
                    if (j < words) {
                        uint64_t a;
                        memcpy(&a, w + j, 8);
                        h0 += a * kk[j];
                    }
                }
            }
            uint64_t x = h0 + h1;
            x ^= x >> 30;
            x *= 0xBF58476D1CE4E5B9ULL;
            x ^= x >> 27;
            x *= 0x94D049BB133111EBULL;
            x ^= x >> 31;
            o[i] = x;
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&bases);
    PyBuffer_Release(&pages);
    PyBuffer_Release(&table);
    PyBuffer_Release(&out);
    if (bad) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_pages", copy_pages, METH_VARARGS, "memcpy indexed pages between strided buffers."},
    {"page_sums", page_sums, METH_VARARGS, "a checksum per indexed page of strided buffers."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_copy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__copy(void) { return PyModule_Create(&module); }

/* A step's sampled windows drawn on the CPU, on the step's threads (kernels/sampling.py:
   draw_windows wraps it; verifier_service/sampled_rounds.py: own_tokens calls it).

A window is a session's rows of one step (its head row, then a row per draft). Its own tokens are
the draws sample() makes from process_logits' rows with the pick stream's u at each row's position
(kernels/rng.py: uniform_at): in exact mode the verdict is the drafts' agreement with them, and a
plain round's token is its one row's draw (DESIGN §2). A window's rows are drawn in order and only
up to the first draft they reject (its draw then is the token emitted; no verdict reads a row
after it), so a window of k drafts accepting a of them draws a + 1 rows, not k + 1. Windows are
work items of the step's thread pool, each drawn whole by one thread, so a token does not depend
on the threads or on the other windows; the arithmetic is _sampling_core.h's (the same code
_sampling_rows.c's process runs), the u's its Philox (kernels/rng.py's words).

draw_windows(logits, type, vocab, count, windows, drafts, params, out, threads)
  logits [R, vocab] of `type` (0 float32, 1 bfloat16, 2 float64); windows [count, 10] int64: first
  row, rows, the offset of its drafts in `drafts` (int64), how many (< rows: the rows past them
  have no draft to check), top_k (0: off), width, candidates, the seed's key words k0 and k1, the
  position its first row decides; params [count, 3] float64: temperature, top_p, min_p; out [R]
  int64: each drawn row's token (rows not drawn keep their value). */
#include "_cpu_rows.h"
#include "../_sampling_core.h"

enum { W_FIRST, W_ROWS, W_DRAFTS_AT, W_NUM_DRAFTS, W_TOP_K, W_WIDTH, W_CANDIDATES, W_K0, W_K1, W_POSITION, W_FIELDS };

struct draws_call {
    const char *logits;
    int type;
    Py_ssize_t vocab, count, most_candidates, most_width;
    const int64_t *windows, *drafts;
    const double *params;
    int64_t *out;
    Py_ssize_t *claim;  /* items: the windows */
    int failed;  /* a thread could not allocate its scratch (set, never cleared, by any thread) */
};

static void draw_window(const struct draws_call *c, Py_ssize_t w, const struct row_scratch *b, int64_t *ids,
                        double *probs) {
    const int64_t *at = c->windows + w * W_FIELDS;
    const double *params = c->params + w * 3;
    struct process_call row = {.logits = c->logits, .type = c->type, .vocab = c->vocab, .top_k = at[W_TOP_K], .width = at[W_WIDTH],
                               .candidates = at[W_CANDIDATES], .temperature = params[0], .top_p = params[1],
                               .min_p = params[2]};
    const int64_t *drafts = c->drafts + at[W_DRAFTS_AT];
    for (Py_ssize_t j = 0; j < at[W_ROWS]; j++) {
        const Py_ssize_t r = at[W_FIRST] + j;
        process_row(&row, r, b, ids, probs);
        const double u = pick_uniform((uint32_t)at[W_K0], (uint32_t)at[W_K1], (uint64_t)(at[W_POSITION] + j));
        c->out[r] = pick(ids, probs, row.width, u);
        if (at[W_NUM_DRAFTS] >= 0 && (j >= at[W_NUM_DRAFTS] || c->out[r] != drafts[j]))
            return;  /* the bonus, or the first rejection */
    }
}

/* A thread's share of the windows (row_kernel: the pool's scratch unused; each thread its own). */
static void draw_some(const void *call, float *unused) {
    (void)unused;
    struct draws_call *c = (struct draws_call *)call;
    Py_ssize_t w = __atomic_fetch_add(c->claim, 1, __ATOMIC_RELAXED);
    if (w >= c->count) return;  /* (a helper that joined late: nothing left, nothing allocated) */
    struct row_scratch b;
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)c->most_width);
    double *probs = malloc(sizeof(double) * (size_t)c->most_width);
    if (!scratch_alloc(&b, c->vocab, c->most_candidates) || !ids || !probs) {
        __atomic_store_n(&c->failed, 1, __ATOMIC_RELAXED);
    } else {
        for (; w < c->count; w = __atomic_fetch_add(c->claim, 1, __ATOMIC_RELAXED)) draw_window(c, w, &b, ids, probs);
    }
    scratch_free(&b);
    free(ids);
    free(probs);
}

KERNEL PyObject *draw_windows(PyObject *self, PyObject *args) {
    unsigned long long logits, windows, drafts, params, out;
    Py_ssize_t claim = 0;
    struct draws_call c = {.claim = &claim};
    int threads;
    if (!PyArg_ParseTuple(args, "KinnKKKKi", &logits, &c.type, &c.vocab, &c.count, &windows, &drafts, &params, &out,
                          &threads))
        return NULL;
    if (c.type < 0 || c.type > 2 || c.vocab < 1 || c.count < 0 || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "draw_windows: bad type, vocabulary, count or threads");
        return NULL;
    }
    c.logits = (const char *)(uintptr_t)logits;
    c.windows = (const int64_t *)(uintptr_t)windows, c.drafts = (const int64_t *)(uintptr_t)drafts;
    c.params = (const double *)(uintptr_t)params, c.out = (int64_t *)(uintptr_t)out;
    c.most_candidates = c.most_width = 1;
    for (Py_ssize_t w = 0; w < c.count; w++) {  /* the kernels index with these unchecked */
        const int64_t *at = c.windows + w * W_FIELDS;
        const double *p = c.params + w * 3;
        if (at[W_FIRST] < 0 || at[W_ROWS] < 1 || at[W_NUM_DRAFTS] < -1 || at[W_NUM_DRAFTS] >= at[W_ROWS] ||
            at[W_DRAFTS_AT] < 0 || at[W_WIDTH] < 1 || at[W_CANDIDATES] < at[W_WIDTH] ||
            at[W_CANDIDATES] > c.vocab || at[W_TOP_K] < 0 || !(p[0] > 0.0) || at[W_POSITION] < 0) {
            PyErr_Format(PyExc_ValueError, "draw_windows: window %zd's rows, drafts, sizes, temperature or "
                         "position are out of range", w);
            return NULL;
        }
        if (at[W_CANDIDATES] > c.most_candidates) c.most_candidates = at[W_CANDIDATES];
        if (at[W_WIDTH] > c.most_width) c.most_width = at[W_WIDTH];
    }
    if (c.count == 0) Py_RETURN_NONE;
    pool_parallel(draw_some, &c, &claim, threads < c.count ? threads : (int)c.count);
    if (c.failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

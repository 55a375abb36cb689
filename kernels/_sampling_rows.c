/* The processed target distribution of logit rows on the CPU, natively (kernels/sampling.py's
   process_logits is the definition; this computes the same law in one pass a row, where torch
   spends a dozen small ops on it).

   process(logits, type, rows, vocab, temperature, top_k, top_p, min_p, width, candidates,
           token_ids, probs)
   logits [rows, vocab] of `type` (0 float32, 1 bfloat16, 2 float64); candidates = max(width,
   top_k) (top_k 0: off); token_ids [rows, width] int64 and probs [rows, width] float64 out.
   Per row, in float64: scaled = logit / temperature; the softmax's normaliser over the whole
   row; the `candidates` largest scaled values (ties: the lower id first) selected (a heap), then sorted;
   their softmax probabilities; top_k, top_p (the mass before a token below top_p), min_p
   (against the most likely), the cap to `width`, each followed by a renormalisation; the kept
   tokens by ascending id, then padding (id -1, prob 0). The arithmetic is the definition's, in
   another summation order (the normaliser, the renormalisations): probabilities agree to
   rounding, never in which tokens are kept except at a boundary met to the last bit.

   draw(logits, type, vocab, rows, count, temperature, top_k, top_p, min_p, width, candidates, u, out)
   rows [count] int64: logit rows to draw from; u [count] float64; out int64, indexed by row:
   out[rows[i]] = the token sample() draws with u[i] from row rows[i]'s processed distribution
   (the above): its kept tokens by ascending id, the first whose running sum of probabilities
   exceeds u, else the last with a positive probability — sample()'s arithmetic (a float64 sum
   from the left, as torch.cumsum's), so the same token as process() then sample(). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_machine_clones.h"

typedef struct {
    double value;
    int64_t id;
} entry;

/* a ranks before b: the larger value, then the lower id (a strict total order: ids differ) */
static inline int before(const entry *a, const entry *b) {
    return a->value > b->value || (a->value == b->value && a->id < b->id);
}

static inline void swap(entry *a, entry *b) {
    const entry t = *a;
    *a = *b;
    *b = t;
}

/* heap[0, size): the root ranks last. sift_down restores that from position i. */
static void sift_down(entry *heap, Py_ssize_t size, Py_ssize_t i) {
    for (;;) {
        Py_ssize_t last = i;
        const Py_ssize_t left = 2 * i + 1, right = left + 1;
        if (left < size && before(&heap[last], &heap[left])) last = left;
        if (right < size && before(&heap[last], &heap[right])) last = right;
        if (last == i) return;
        swap(&heap[i], &heap[last]);
        i = last;
    }
}

/* The n entries of values[0, len) that rank first, into best[0, n) (in no order): one pass with a
   heap of the n best so far, whose root (the worst of them) a newcomer must beat. */
static void select_first(const double *values, Py_ssize_t len, Py_ssize_t n, entry *best) {
    for (Py_ssize_t v = 0; v < n; v++) {
        best[v].value = values[v];
        best[v].id = v;
    }
    for (Py_ssize_t i = n / 2 - 1; i >= 0; i--) sift_down(best, n, i);
    for (Py_ssize_t v = n; v < len; v++) {
        const entry e = {values[v], v};
        if (before(&e, &best[0])) {
            best[0] = e;
            sift_down(best, n, 0);
        }
    }
}

/* exp(d) for d in [-708, 0], to about an ulp, in code a compiler can vectorise (no call): 2^k
   times a degree-13 Taylor polynomial of the remainder (|r| <= ln2 / 2: its error below 1e-17). */
static inline __attribute__((always_inline)) double exp_nonpositive(double d) {
    const double shifter = 0x1.8p52;  /* adding it rounds to an integer held in the low bits */
    const double kd = d * 1.4426950408889634074 + shifter, k = kd - shifter;
    const double r = (d - k * 6.93147180369123816490e-01) - k * 1.90821492927058770002e-10;
    double p = 1.0 / 6227020800.0;
    p = p * r + 1.0 / 479001600.0;
    p = p * r + 1.0 / 39916800.0;
    p = p * r + 1.0 / 3628800.0;
    p = p * r + 1.0 / 362880.0;
    p = p * r + 1.0 / 40320.0;
    p = p * r + 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    uint64_t bits, k_bits;
    memcpy(&k_bits, &kd, sizeof k_bits);
    bits = (k_bits - 0x4338000000000000ULL + 1023ULL) << 52;  /* 2^k */
    double scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#define LANES 8
/* The softmax's normaliser of a row: sum of exp(value - top), in LANES running sums added in
   lane order. A term below exp(-708) is dropped: the sum is at least 1 (the top's own term), so
   such a term would not change it. */
MACHINE_CLONES
static double normaliser(const double *values, Py_ssize_t vocab, double top) {
    double lanes[LANES] = {0.0};
    Py_ssize_t v = 0;
    for (; v + LANES <= vocab; v += LANES)
        for (int j = 0; j < LANES; j++) {  /* (selects, not branches: the loop vectorises) */
            const double d = values[v + j] - top, e = exp_nonpositive(d < -708.0 ? -708.0 : d);
            lanes[j] += d < -708.0 ? 0.0 : e;
        }
    for (; v < vocab; v++) {
        const double d = values[v] - top, e = exp_nonpositive(d < -708.0 ? -708.0 : d);
        lanes[v % LANES] += d < -708.0 ? 0.0 : e;
    }
    double total = 0.0;
    for (int j = 0; j < LANES; j++) total += lanes[j];
    return total;
}

/* probs[i] / (the sum of the kept ones), 0 where not kept */
static void renormalise(double *probs, const char *keep, Py_ssize_t n) {
    double total = 0.0;
    for (Py_ssize_t i = 0; i < n; i++) total += keep[i] ? probs[i] : 0.0;
    for (Py_ssize_t i = 0; i < n; i++) probs[i] = keep[i] ? probs[i] / total : 0.0;
}

static inline double load(const void *row, Py_ssize_t v, int type) {
    if (type == 0) return (double)((const float *)row)[v];
    if (type == 1) {
        const uint32_t bits = (uint32_t)((const uint16_t *)row)[v] << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        return (double)f;
    }
    return ((const double *)row)[v];
}

struct process_call {
    const char *logits;
    int type;
    Py_ssize_t rows, vocab, top_k, width, candidates;
    double temperature, top_p, min_p;
    int64_t *token_ids;
    double *probs;
};

/* The scratch of a call's rows, one allocation: scaled [vocab]; entries, probs, keep [candidates]. */
struct row_scratch {
    double *scaled, *probs;
    entry *entries;
    char *keep;
};

static int scratch_alloc(struct row_scratch *b, Py_ssize_t vocab, Py_ssize_t candidates) {
    b->scaled = malloc(sizeof(double) * (size_t)vocab);
    b->entries = malloc(sizeof(entry) * (size_t)candidates);
    b->probs = malloc(sizeof(double) * (size_t)candidates);
    b->keep = malloc((size_t)candidates);
    return b->scaled && b->entries && b->probs && b->keep;
}

static void scratch_free(struct row_scratch *b) {
    free(b->scaled);
    free(b->entries);
    free(b->probs);
    free(b->keep);
}

/* Row r of the call's logits, processed into ids [width] and out [width]. */
static void process_row(const struct process_call *c, Py_ssize_t r, const struct row_scratch *b, int64_t *ids,
                        double *out) {
    const size_t item = c->type == 0 ? 4 : c->type == 1 ? 2 : 8;
    const Py_ssize_t n = c->candidates;
    double *scaled = b->scaled, *probs = b->probs;
    entry *entries = b->entries;
    char *keep = b->keep;
    const void *row = c->logits + (size_t)r * (size_t)c->vocab * item;
    double top = -INFINITY;
    for (Py_ssize_t v = 0; v < c->vocab; v++) {
        scaled[v] = load(row, v, c->type) / c->temperature;
        if (scaled[v] > top) top = scaled[v];
    }
    const double total = normaliser(scaled, c->vocab, top);
    select_first(scaled, c->vocab, n, entries);
    for (Py_ssize_t size = n - 1; size > 0; size--) {  /* heapsort: the worst to the end, in turn */
        swap(&entries[0], &entries[size]);
        sift_down(entries, size, 0);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        probs[i] = exp(entries[i].value - top) / total;
        keep[i] = 1;
    }
    if (c->top_k) {
        for (Py_ssize_t i = 0; i < n; i++) keep[i] &= i < c->top_k;
        renormalise(probs, keep, n);
    }
    if (c->top_p < 1.0) {
        double mass = 0.0;
        for (Py_ssize_t i = 0; i < n; i++) {
            mass += probs[i];
            keep[i] &= mass - probs[i] < c->top_p;  /* (as cumsum - probs: the same rounding) */
        }
        renormalise(probs, keep, n);
    }
    if (c->min_p > 0.0) {
        const double least = c->min_p * probs[0];
        for (Py_ssize_t i = 0; i < n; i++) keep[i] &= probs[i] >= least;
        renormalise(probs, keep, n);
    }
    for (Py_ssize_t i = c->width; i < n; i++) keep[i] = 0;
    renormalise(probs, keep, n);
    Py_ssize_t kept = 0;
    for (Py_ssize_t i = 0; i < c->width; i++)
        if (keep[i]) {
            entries[kept].id = entries[i].id;
            entries[kept].value = probs[i];  /* (the entry now carries its probability) */
            kept++;
        }
    for (Py_ssize_t i = 1; i < kept; i++) {  /* by ascending id (an insertion sort: a few dozen) */
        const entry e = entries[i];
        Py_ssize_t j = i;
        for (; j > 0 && entries[j - 1].id > e.id; j--) entries[j] = entries[j - 1];
        entries[j] = e;
    }
    for (Py_ssize_t i = 0; i < c->width; i++) {
        ids[i] = i < kept ? entries[i].id : -1;
        out[i] = i < kept ? entries[i].value : 0.0;
    }
}

static void process_rows(const struct process_call *c, const struct row_scratch *b) {
    for (Py_ssize_t r = 0; r < c->rows; r++)
        process_row(c, r, b, c->token_ids + r * c->width, c->probs + r * c->width);
}

/* sample()'s inverse-CDF pick from a processed row (ids, probs [width]) with u */
static int64_t pick(const int64_t *ids, const double *probs, Py_ssize_t width, double u) {
    double cdf = 0.0;
    Py_ssize_t below = 0, last = 0;  /* entries whose running sum is <= u; the last positive one */
    for (Py_ssize_t i = 0; i < width; i++) {
        cdf += probs[i];
        below += cdf <= u;
        if (probs[i] > 0.0) last = i;
    }
    return ids[below < last ? below : last];
}

static PyObject *process(PyObject *self, PyObject *args) {
    unsigned long long logits, token_ids, probs;
    struct process_call c;
    if (!PyArg_ParseTuple(args, "Kinndnddnn" "KK", &logits, &c.type, &c.rows, &c.vocab, &c.temperature, &c.top_k,
                          &c.top_p, &c.min_p, &c.width, &c.candidates, &token_ids, &probs))
        return NULL;
    if (c.type < 0 || c.type > 2 || c.vocab < 1 || c.width < 1 || c.candidates < c.width || c.candidates > c.vocab ||
        c.top_k < 0 || !(c.temperature > 0.0)) {
        PyErr_SetString(PyExc_ValueError, "process: bad type, sizes or temperature");
        return NULL;
    }
    c.logits = (const char *)(uintptr_t)logits;
    c.token_ids = (int64_t *)(uintptr_t)token_ids;
    c.probs = (double *)(uintptr_t)probs;
    struct row_scratch b;
    if (!scratch_alloc(&b, c.vocab, c.candidates)) {
        scratch_free(&b);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    process_rows(&c, &b);
    Py_END_ALLOW_THREADS
    scratch_free(&b);
    Py_RETURN_NONE;
}

static PyObject *draw(PyObject *self, PyObject *args) {
    unsigned long long logits, rows, u, out;
    Py_ssize_t count;
    struct process_call c;
    if (!PyArg_ParseTuple(args, "KinKndnddnn" "KK", &logits, &c.type, &c.vocab, &rows, &count, &c.temperature,
                          &c.top_k, &c.top_p, &c.min_p, &c.width, &c.candidates, &u, &out))
        return NULL;
    if (c.type < 0 || c.type > 2 || c.vocab < 1 || c.width < 1 || c.candidates < c.width || c.candidates > c.vocab ||
        c.top_k < 0 || !(c.temperature > 0.0) || count < 0) {
        PyErr_SetString(PyExc_ValueError, "draw: bad type, sizes or temperature");
        return NULL;
    }
    c.logits = (const char *)(uintptr_t)logits;
    c.rows = count;
    const int64_t *row_of = (const int64_t *)(uintptr_t)rows;
    const double *u_of = (const double *)(uintptr_t)u;
    int64_t *token_of = (int64_t *)(uintptr_t)out;
    struct row_scratch b;
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)c.width);
    double *probs = malloc(sizeof(double) * (size_t)c.width);
    if (!scratch_alloc(&b, c.vocab, c.candidates) || !ids || !probs) {
        scratch_free(&b);
        free(ids);
        free(probs);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        process_row(&c, row_of[i], &b, ids, probs);
        token_of[row_of[i]] = pick(ids, probs, c.width, u_of[i]);
    }
    Py_END_ALLOW_THREADS
    scratch_free(&b);
    free(ids);
    free(probs);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"process", process, METH_VARARGS, "The processed distribution of logit rows (see kernels/sampling.py)."},
    {"draw", draw, METH_VARARGS, "Tokens drawn from processed logit rows (see kernels/sampling.py)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sampling_rows", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__sampling_rows(void) { return PyModule_Create(&module); }

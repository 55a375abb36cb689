/* The sampled rows' arithmetic on the CPU, shared by the native modules that process or draw
   them (kernels/_sampling_rows.c: process; kernels/fused/_cpu_draws.c: a step's draws): every
   function static, so each module compiles the same code (both without contraction: setup.py).
   kernels/sampling.py's process_logits and sample are the definition (see _sampling_rows.c). */
#ifndef TANDEM_SAMPLING_CORE_H
#define TANDEM_SAMPLING_CORE_H
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

/* scaled[v] = logit v / temperature (the definition's division, each value), and the largest of
   them (a NaN never: as `>` keeps the top), in LANES running maxima — the largest value whatever
   the order (a zero's sign aside, which no use of it sees: exp(±0) = 1). Loops apart, so that
   each vectorises. */
MACHINE_CLONES
static double scale_row(const void *row, int type, Py_ssize_t vocab, double temperature, double *scaled) {
    if (type == 0) {
        const float *x = row;
        for (Py_ssize_t v = 0; v < vocab; v++) scaled[v] = (double)x[v] / temperature;
    } else if (type == 1) {
        const uint16_t *h = row;
        for (Py_ssize_t v = 0; v < vocab; v++) {
            const uint32_t bits = (uint32_t)h[v] << 16;
            float f;
            memcpy(&f, &bits, sizeof f);
            scaled[v] = (double)f / temperature;
        }
    } else {
        const double *x = row;
        for (Py_ssize_t v = 0; v < vocab; v++) scaled[v] = x[v] / temperature;
    }
    double lanes[LANES], top = -INFINITY;
    for (int j = 0; j < LANES; j++) lanes[j] = -INFINITY;
    Py_ssize_t v = 0;
    for (; v + LANES <= vocab; v += LANES)
        for (int j = 0; j < LANES; j++) lanes[j] = scaled[v + j] > lanes[j] ? scaled[v + j] : lanes[j];
    for (; v < vocab; v++) lanes[v % LANES] = scaled[v] > lanes[v % LANES] ? scaled[v] : lanes[v % LANES];
    for (int j = 0; j < LANES; j++) top = lanes[j] > top ? lanes[j] : top;
    return top;
}

/* probs[i] / (the sum of the kept ones), 0 where not kept */
static void renormalise(double *probs, const char *keep, Py_ssize_t n) {
    double total = 0.0;
    for (Py_ssize_t i = 0; i < n; i++) total += keep[i] ? probs[i] : 0.0;
    for (Py_ssize_t i = 0; i < n; i++) probs[i] = keep[i] ? probs[i] / total : 0.0;
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
    const double top = scale_row(row, c->type, c->vocab, c->temperature, scaled);
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

/* sample()'s inverse-CDF pick from a processed row (ids, probs [width]) with u */
static inline int64_t pick(const int64_t *ids, const double *probs, Py_ssize_t width, double u) {
    double cdf = 0.0;
    Py_ssize_t below = 0, last = 0;  /* entries whose running sum is <= u; the last positive one */
    for (Py_ssize_t i = 0; i < width; i++) {
        cdf += probs[i];
        below += cdf <= u;
        if (probs[i] > 0.0) last = i;
    }
    return ids[below < last ? below : last];
}


/* The pick stream's u at `position` under a seed's key words (kernels/rng.py: uniform_at(seed,
   position), word 0 of Philox4x32-10 with counter (position's low word, its high word | the pick
   stream's tag 0, 0, 0)): (word + 0.5) / 2^32, exact in a double. */
static inline double pick_uniform(uint32_t k0, uint32_t k1, uint64_t position) {
    uint32_t c0 = (uint32_t)position, c1 = (uint32_t)(position >> 32), c2 = 0, c3 = 0;
    for (int round = 0; round < 10; round++) {
        if (round) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const uint64_t p0 = (uint64_t)0xD2511F53u * c0, p1 = (uint64_t)0xCD9E8D57u * c2;
        c0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
        c1 = (uint32_t)p1;
        c2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c3 = (uint32_t)p0;
    }
    return ((double)c0 + 0.5) / 4294967296.0;
}

#endif

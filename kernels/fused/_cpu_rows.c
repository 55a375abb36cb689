/* Row-invariant CPU kernels for the decode/verify step (kernels/fused/cpu_rows.py wraps them).

Each row (attention) or route (experts) is computed by the same loop whatever else is in the
call: nothing is shared between rows, and every sum runs in a fixed order (eight lanes, then a
fixed tree), so a row's bits are its one-row step's in any window or batch (DESIGN §11). One
call replaces the torch reference's per-row loop of small ops, whose dispatch dominated a CPU
step.

Arguments are raw addresses and sizes: the Python wrapper checks devices, dtypes, shapes and
contiguity before calling. Element types: 0 = float32, 1 = bfloat16. */

#include "_cpu_rows.h"

#define LANES 8

/* The sum of a[j] * b[j], j < n, as every kernel here takes it: eight lanes (lane j % 8), then
   ((0+4) + (1+5)) + ((2+6) + (3+7)). GCC's vector type keeps the lanes explicit on any target. */
typedef float lanes __attribute__((vector_size(4 * LANES)));
typedef int32_t lane_bits __attribute__((vector_size(4 * LANES)));  /* a comparison's lanes (-1 where true) */

HELPER lanes load_lanes(const float *p) {
    lanes v;
    memcpy(&v, p, sizeof v);
    return v;
}

HELPER float lanes_total(lanes a) { return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])); }

/* out[i] = sum_j x[j] * w[i * stride + j] for i < count, each in lanes_total's order; four rows
   at a time (independent sums, so the core overlaps them: one row's chain is latency-bound). */
HELPER void dots(const float *restrict x, const float *restrict w, Py_ssize_t stride, Py_ssize_t n,
                 Py_ssize_t count, float *restrict out) {
    Py_ssize_t i = 0;
    for (; i + 4 <= count; i += 4) {
        const float *w0 = w + i * stride, *w1 = w0 + stride, *w2 = w1 + stride, *w3 = w2 + stride;
        lanes a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        Py_ssize_t j = 0;
        for (; j + LANES <= n; j += LANES) {
            const lanes xv = load_lanes(x + j);
            a0 += xv * load_lanes(w0 + j);
            a1 += xv * load_lanes(w1 + j);
            a2 += xv * load_lanes(w2 + j);
            a3 += xv * load_lanes(w3 + j);
        }
        for (; j < n; j++) {
            a0[j % LANES] += x[j] * w0[j];
            a1[j % LANES] += x[j] * w1[j];
            a2[j % LANES] += x[j] * w2[j];
            a3[j % LANES] += x[j] * w3[j];
        }
        out[i] = lanes_total(a0);
        out[i + 1] = lanes_total(a1);
        out[i + 2] = lanes_total(a2);
        out[i + 3] = lanes_total(a3);
    }
    for (; i < count; i++) {
        const float *w0 = w + i * stride;
        lanes a0 = {0};
        Py_ssize_t j = 0;
        for (; j + LANES <= n; j += LANES) a0 += load_lanes(x + j) * load_lanes(w0 + j);
        for (; j < n; j++) a0[j % LANES] += x[j] * w0[j];
        out[i] = lanes_total(a0);
    }
}

/* dots for two inputs at once: out0[i] = sum_j x0[j] * w[i * stride + j], out1 likewise from x1 —
   each sum in exactly dots' order (its own lanes, the same tail and total), so an output's bits do
   not depend on whether it was paired; the weights are loaded once for both (the products are
   bound by loads, not by multiply-adds, when one input meets four weight rows). */
HELPER void dots2(const float *restrict x0, const float *restrict x1, const float *restrict w, Py_ssize_t stride,
                  Py_ssize_t n, Py_ssize_t count, float *restrict out0, float *restrict out1) {
    Py_ssize_t i = 0;
    for (; i + 4 <= count; i += 4) {
        const float *w0 = w + i * stride, *w1 = w0 + stride, *w2 = w1 + stride, *w3 = w2 + stride;
        lanes a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
        Py_ssize_t j = 0;
        for (; j + LANES <= n; j += LANES) {
            const lanes xa = load_lanes(x0 + j), xb = load_lanes(x1 + j);
            lanes wv = load_lanes(w0 + j);
            a0 += xa * wv;
            b0 += xb * wv;
            wv = load_lanes(w1 + j);
            a1 += xa * wv;
            b1 += xb * wv;
            wv = load_lanes(w2 + j);
            a2 += xa * wv;
            b2 += xb * wv;
            wv = load_lanes(w3 + j);
            a3 += xa * wv;
            b3 += xb * wv;
        }
        for (; j < n; j++) {
            a0[j % LANES] += x0[j] * w0[j];
            a1[j % LANES] += x0[j] * w1[j];
            a2[j % LANES] += x0[j] * w2[j];
            a3[j % LANES] += x0[j] * w3[j];
            b0[j % LANES] += x1[j] * w0[j];
            b1[j % LANES] += x1[j] * w1[j];
            b2[j % LANES] += x1[j] * w2[j];
            b3[j % LANES] += x1[j] * w3[j];
        }
        out0[i] = lanes_total(a0), out0[i + 1] = lanes_total(a1), out0[i + 2] = lanes_total(a2), out0[i + 3] = lanes_total(a3);
        out1[i] = lanes_total(b0), out1[i + 1] = lanes_total(b1), out1[i + 2] = lanes_total(b2), out1[i + 3] = lanes_total(b3);
    }
    if (i < count) {
        dots(x0, w + i * stride, stride, n, count - i, out0 + i);
        dots(x1, w + i * stride, stride, n, count - i, out1 + i);
    }
}

/* Weights in the paired layout (PAIRED, _cpu_rows.h): the products over their values in exactly
   dots' and dots2's order, the values converted in registers (half the bytes read). */
typedef uint32_t pair_bits __attribute__((vector_size(4 * LANES)));
typedef uint16_t half_bits __attribute__((vector_size(2 * LANES)));

/* The chunk of 16 paired values at p: its values 0..7 into *first, 8..15 into *second. */
HELPER void paired_chunk(const uint16_t *p, lanes *first, lanes *second) {
    pair_bits v;
    memcpy(&v, p, sizeof v);
    const pair_bits low = v << 16, high = v & 0xffff0000u;
    memcpy(first, &low, sizeof low);
    memcpy(second, &high, sizeof high);
}

/* Values a .. a + 7 of a paired row whose chunks end at n16 (a % 8 == 0, a + 8 <= the row's length). */
HELPER lanes paired_eight(const uint16_t *row, Py_ssize_t a, Py_ssize_t n16) {
    lanes first, second;
    if (a < n16) {  /* (then a + 8 <= n16: both are multiples of 8, n16 of 16) */
        paired_chunk(row + (a & ~(Py_ssize_t)15), &first, &second);
        return (a & 15) ? second : first;
    }
    half_bits h;
    memcpy(&h, row + a, sizeof h);
    const pair_bits v = __builtin_convertvector(h, pair_bits) << 16;
    memcpy(&first, &v, sizeof v);
    return first;
}

/* Value a of a paired row whose chunks end at n16. */
HELPER float paired_at(const uint16_t *row, Py_ssize_t a, Py_ssize_t n16) {
    if (a >= n16) return bf16_to_f32(row[a]);
    const Py_ssize_t k = a & 15;
    return bf16_to_f32(row[a - k + (k < 8 ? 2 * k : 2 * (k - 8) + 1)]);
}

/* Columns first .. first + n - 1 of a paired row (chunks ending at n16) into dst as float32. */
HELPER void unpack_paired(float *restrict dst, const uint16_t *restrict row, Py_ssize_t first, Py_ssize_t n,
                          Py_ssize_t n16) {
    Py_ssize_t j = 0;
    if (!(first & 15))
        for (; j + 2 * LANES <= n && first + j + 2 * LANES <= n16; j += 2 * LANES) {
            lanes low, high;
            paired_chunk(row + first + j, &low, &high);
            memcpy(dst + j, &low, sizeof low);
            memcpy(dst + j + LANES, &high, sizeof high);
        }
    if (!(first & 7))
        for (; j + LANES <= n; j += LANES) {
            const lanes v = paired_eight(row, first + j, n16);
            memcpy(dst + j, &v, sizeof v);
        }
    for (; j < n; j++) dst[j] = paired_at(row, first + j, n16);
}

/* out_m[r] = the sum over j < n of x_m[j] * (paired row r at w + r * stride)[first + j], for `rows`
   (1..4) weight rows and `inputs` (1 or 2) input rows, each sum in dots' order: a lane's terms in j
   order (a chunk's two sets of lanes are consecutive 8-steps), the same tail and total. first % 8
   == 0. Called with constant rows and inputs, so its loops unroll into registers. */
HELPER void paired_group(const float *x0, const float *x1, const uint16_t *w, Py_ssize_t stride, Py_ssize_t first,
                         Py_ssize_t n, Py_ssize_t n16, int rows, int inputs, float *out0, float *out1) {
    lanes a[4] = {{0}}, b[4] = {{0}};
    Py_ssize_t j = 0;
    if (!(first & 15))
        for (; j + 2 * LANES <= n && first + j + 2 * LANES <= n16; j += 2 * LANES) {
            const lanes xa = load_lanes(x0 + j), xa2 = load_lanes(x0 + j + LANES);
            const lanes xb = inputs > 1 ? load_lanes(x1 + j) : xa, xb2 = inputs > 1 ? load_lanes(x1 + j + LANES) : xa2;
            for (int r = 0; r < rows; r++) {
                lanes low, high;
                paired_chunk(w + r * stride + first + j, &low, &high);
                a[r] += xa * low;
                if (inputs > 1) b[r] += xb * low;
                a[r] += xa2 * high;
                if (inputs > 1) b[r] += xb2 * high;
            }
        }
    for (; j + LANES <= n; j += LANES) {
        const lanes xa = load_lanes(x0 + j), xb = inputs > 1 ? load_lanes(x1 + j) : xa;
        for (int r = 0; r < rows; r++) {
            const lanes wv = paired_eight(w + r * stride, first + j, n16);
            a[r] += xa * wv;
            if (inputs > 1) b[r] += xb * wv;
        }
    }
    for (; j < n; j++)
        for (int r = 0; r < rows; r++) {
            const float wv = paired_at(w + r * stride, first + j, n16);
            a[r][j % LANES] += x0[j] * wv;
            if (inputs > 1) b[r][j % LANES] += x1[j] * wv;
        }
    for (int r = 0; r < rows; r++) {
        out0[r] = lanes_total(a[r]);
        if (inputs > 1) out1[r] = lanes_total(b[r]);
    }
}

/* dots (x1 NULL) or dots2 over `count` paired weight rows, columns first .. first + n - 1. wide (a
   machine with AVX-512, _cpu_wide.c): two weight rows a register where the columns are whole chunks
   (the same sums). */
HELPER void paired_dots(const float *x0, const float *x1, const uint16_t *w, Py_ssize_t stride, Py_ssize_t first,
                        Py_ssize_t n, Py_ssize_t n16, Py_ssize_t count, float *out0, float *out1, int wide) {
#if WIDE_PRODUCTS
    if (wide && !(first & 15) && !(n & 15) && first + n <= n16) {
        wide_paired_dots(x0, x1, w, stride, first, n, count, out0, x1 ? out1 : out0);
        return;
    }
#else
    (void)wide;
#endif
    Py_ssize_t i = 0;
    if (x1) {
        for (; i + 4 <= count; i += 4)
            paired_group(x0, x1, w + i * stride, stride, first, n, n16, 4, 2, out0 + i, out1 + i);
        for (; i < count; i++) paired_group(x0, x1, w + i * stride, stride, first, n, n16, 1, 2, out0 + i, out1 + i);
    } else {
        for (; i + 4 <= count; i += 4) paired_group(x0, x0, w + i * stride, stride, first, n, n16, 4, 1, out0 + i, out0 + i);
        for (; i < count; i++) paired_group(x0, x0, w + i * stride, stride, first, n, n16, 1, 1, out0 + i, out0 + i);
    }
}

/* paired_dots for an expert's routes order[first .. last), two a pass: route r's input row at
   x + r * n, its outputs from out + r * out_stride; `count` paired weight rows at w, n columns each. */
HELPER void routes_by_twos(const Py_ssize_t *order, Py_ssize_t first, Py_ssize_t last, const float *x, Py_ssize_t n,
                           const uint16_t *w, Py_ssize_t count, float *out, Py_ssize_t out_stride, int wide) {
    for (Py_ssize_t i = first; i < last; i += 2) {
        const Py_ssize_t r0 = order[i], r1 = order[i + 1 < last ? i + 1 : i];
        paired_dots(x + r0 * n, i + 1 < last ? x + r1 * n : NULL, w, n, 0, n, n & ~(Py_ssize_t)15, count,
                    out + r0 * out_stride, out + r1 * out_stride, wide);
    }
}

/* `count` rows of n values, `stride` apart, of `type` at p (offset i elements), as float32:
   the rows themselves for float32 (no copy), else converted into buf (count * n floats). */
HELPER const float *rows_f32(const void *p, Py_ssize_t i, Py_ssize_t stride, Py_ssize_t n, Py_ssize_t count,
                                    int type, float *buf) {
    if (type == F32) return (const float *)p + i;
    for (Py_ssize_t r = 0; r < count; r++) load_row(buf + r * n, p, i + r * stride, n, type);
    return buf;
}

/* rows_f32 for weights: also of PAIRED rows (n values each, chunked over the whole row), converted. */
HELPER const float *weight_rows(const void *p, Py_ssize_t i, Py_ssize_t stride, Py_ssize_t n, Py_ssize_t count,
                                int wtype, float *buf) {
    if (wtype != PAIRED) return rows_f32(p, i, stride, n, count, wtype, buf);
    for (Py_ssize_t r = 0; r < count; r++)
        unpack_paired(buf + r * n, (const uint16_t *)p + i + r * stride, 0, n, n & ~(Py_ssize_t)15);
    return buf;
}

/* Each entry point fills its call's struct, then runs its kernel on a scratch buffer of `floats`
   floats with the GIL released. */
typedef void (*row_kernel)(const void *call, float *buf);

static PyObject *run_released(row_kernel kernel, const void *call, size_t floats) {
    float *buf = malloc(sizeof(float) * floats);
    if (!buf) return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS
    kernel(call, buf);
    Py_END_ALLOW_THREADS
    free(buf);
    Py_RETURN_NONE;
}

/* exp(d) for float32 d <= 0, in code a compiler vectorises (no call): 2^k times a degree-7
   Taylor polynomial of the remainder r (|r| <= ln2 / 2: relative error below 1e-8, under float32's
   half ulp); d below -87 (exp < 1.7e-38, float32's smallest normal) gives 0. */
HELPER float exp_nonpositive(float d) {
    const float clamped = d < -87.0f ? -87.0f : d;
    const float shifter = 0x1.8p23f;  /* adding it rounds to an integer held in the low bits */
    const float kf = clamped * 1.44269504088896341f + shifter, k = kf - shifter;
    const float r = (clamped - k * 0.693145751953125f) - k * 1.42860682030941723e-6f;  /* ln 2, split */
    float poly = 1.0f / 5040.0f;
    poly = poly * r + 1.0f / 720.0f;
    poly = poly * r + 1.0f / 120.0f;
    poly = poly * r + 1.0f / 24.0f;
    poly = poly * r + 1.0f / 6.0f;
    poly = poly * r + 0.5f;
    poly = poly * r + 1.0f;
    poly = poly * r + 1.0f;
    uint32_t k_bits, bits;
    memcpy(&k_bits, &kf, 4);
    bits = (k_bits - 0x4B400000u + 127u) << 23;  /* 2^k (k >= -126: a normal) */
    float two_k;
    memcpy(&two_k, &bits, 4);
    return d < -87.0f ? 0.0f : poly * two_k;
}

/* attention(q, keys, values, tables, positions, slots, out, num_rows, num_heads, num_kv, head_dim,
             block_size, max_blocks, type)
   q [T, Hq, D] and the cache [blocks, block_size, Hkv, D] of `type`; tables [slots, max_blocks]
   int32; positions, slots [T] int64; out [T, Hq, D] float32. Row t attends to positions
   0..positions[t] of its slot's blocks (float32 softmax, scale 1/sqrt(D)), block by block in
   position order. A row's query heads that share a KV head are taken together (each key and
   value row read once for the group); every head's sums stay its own, in a fixed order. */
#define HEADS_TOGETHER 4  /* query heads whose value sums stay in registers at once */

/* The softmax of one head's scores [n] in place: scaled, exp(x - max) with exp_nonpositive, summed
   in LANES running sums (lane j % LANES, then lanes_total), each divided by the sum. */
HELPER void softmax_row(float *scores, Py_ssize_t n, float scale) {
    /* the max, lane by lane (a bit select where x > m: the same rule as the tail's) */
    lanes tops = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    Py_ssize_t j = 0;
    for (; j + LANES <= n; j += LANES) {
        const lanes x = load_lanes(scores + j) * scale;
        memcpy(scores + j, &x, sizeof x);
        const lane_bits greater = x > tops;
        tops = (lanes)(((lane_bits)x & greater) | ((lane_bits)tops & ~greater));
    }
    float top = -INFINITY;
    for (; j < n; j++) {
        scores[j] *= scale;
        top = scores[j] > top ? scores[j] : top;
    }
    for (int l = 0; l < LANES; l++) top = tops[l] > top ? tops[l] : top;
    for (j = 0; j < n; j++) scores[j] = exp_nonpositive(scores[j] - top);
    lanes sums = {0};
    for (j = 0; j + LANES <= n; j += LANES) sums += load_lanes(scores + j);
    for (; j < n; j++) sums[j % LANES] += scores[j];
    const float total = lanes_total(sums);
    for (j = 0; j < n; j++) scores[j] /= total;
}

/* acc_i[d] += sum over the block's rows j of p_i[j] * v[j][d], for `heads` heads (<= HEADS_TOGETHER),
   j in order; the sums of a LANES-wide column chunk stay in registers through the block. */
HELPER void weigh_values(const float *v, Py_ssize_t stride, Py_ssize_t count, Py_ssize_t d_size,
                         const float *const *p, float *const *acc, int heads) {
    Py_ssize_t d = 0;
    for (; d + LANES <= d_size; d += LANES) {
        lanes a0 = load_lanes(acc[0] + d), a1 = {0}, a2 = {0}, a3 = {0};
        if (heads > 1) a1 = load_lanes(acc[1] + d);
        if (heads > 2) a2 = load_lanes(acc[2] + d);
        if (heads > 3) a3 = load_lanes(acc[3] + d);
        for (Py_ssize_t j = 0; j < count; j++) {
            const lanes vv = load_lanes(v + j * stride + d);
            a0 += vv * p[0][j];
            if (heads > 1) a1 += vv * p[1][j];
            if (heads > 2) a2 += vv * p[2][j];
            if (heads > 3) a3 += vv * p[3][j];
        }
        memcpy(acc[0] + d, &a0, sizeof a0);
        if (heads > 1) memcpy(acc[1] + d, &a1, sizeof a1);
        if (heads > 2) memcpy(acc[2] + d, &a2, sizeof a2);
        if (heads > 3) memcpy(acc[3] + d, &a3, sizeof a3);
    }
    for (; d < d_size; d++)
        for (int i = 0; i < heads; i++)
            for (Py_ssize_t j = 0; j < count; j++) acc[i][d] += p[i][j] * v[j * stride + d];
}

MACHINE_CLONES
KERNEL void attention_rows(const void *call, float *buf) {
    const struct attention_call *c = call;
    const Py_ssize_t head_dim = c->head_dim, block_size = c->block_size;
    const Py_ssize_t group = c->num_heads / c->num_kv, row_stride = c->num_kv * head_dim;  /* a position's, in a block */
    const Py_ssize_t k_stride = c->type == F32 ? row_stride : head_dim;  /* rows_f32's rows */
    const float scale = 1.0f / sqrtf((float)head_dim);
    /* per head of a group: scores [L], its query and output rows [D]; a block's keys or values as
       float32 [bs, D] */
    float *scores = buf, *queries = scores + group * c->max_length, *accs = queries + group * head_dim;
    float *block_rows = accs + group * head_dim;
    Py_ssize_t own = 0;
    for (Py_ssize_t item = next_item(c->claim, &own); item < c->num_rows * c->num_kv; item = next_item(c->claim, &own)) {
        const Py_ssize_t t = item / c->num_kv, h = item % c->num_kv;
        const Py_ssize_t length = c->positions[t] + 1;
        const int32_t *table = c->tables + c->slots[t] * c->max_blocks;
        {
            const Py_ssize_t first_head = h * group;
            load_row(queries, c->q, (t * c->num_heads + first_head) * head_dim, group * head_dim, c->type);
            for (Py_ssize_t start = 0; start < length; start += block_size) {
                const Py_ssize_t count = length - start < block_size ? length - start : block_size;
                const Py_ssize_t at = (Py_ssize_t)table[start / block_size] * block_size * row_stride + h * head_dim;
                const float *k = rows_f32(c->keys, at, row_stride, head_dim, count, c->type, block_rows);
                Py_ssize_t i = 0;
                for (; i + 2 <= group; i += 2)
                    dots2(queries + i * head_dim, queries + (i + 1) * head_dim, k, k_stride, head_dim, count,
                          scores + i * c->max_length + start, scores + (i + 1) * c->max_length + start);
                if (i < group) dots(queries + i * head_dim, k, k_stride, head_dim, count, scores + i * c->max_length + start);
            }
            for (Py_ssize_t i = 0; i < group; i++) softmax_row(scores + i * c->max_length, length, scale);
            for (Py_ssize_t d = 0; d < group * head_dim; d++) accs[d] = 0.0f;
            for (Py_ssize_t start = 0; start < length; start += block_size) {
                const Py_ssize_t count = length - start < block_size ? length - start : block_size;
                const Py_ssize_t at = (Py_ssize_t)table[start / block_size] * block_size * row_stride + h * head_dim;
                const float *v = rows_f32(c->values, at, row_stride, head_dim, count, c->type, block_rows);
                for (Py_ssize_t i = 0; i < group; i += HEADS_TOGETHER) {
                    const int heads = group - i < HEADS_TOGETHER ? (int)(group - i) : HEADS_TOGETHER;
                    const float *p[HEADS_TOGETHER];
                    float *acc[HEADS_TOGETHER];
                    for (int g = 0; g < heads; g++) {
                        p[g] = scores + (i + g) * c->max_length + start;
                        acc[g] = accs + (i + g) * head_dim;
                    }
                    weigh_values(v, k_stride, count, head_dim, p, acc, heads);
                }
            }
            memcpy(c->out + (t * c->num_heads + first_head) * head_dim, accs, sizeof(float) * (size_t)(group * head_dim));
        }
    }
}

static PyObject *attention(PyObject *self, PyObject *args) {
    unsigned long long q, keys, values, tables, positions, slots, out;
    struct attention_call c = {.claim = NULL};
    if (!PyArg_ParseTuple(args, "KKKKKKKnnnnnni", &q, &keys, &values, &tables, &positions, &slots, &out, &c.num_rows,
                          &c.num_heads, &c.num_kv, &c.head_dim, &c.block_size, &c.max_blocks, &c.type))
        return NULL;
    c.q = (const void *)(uintptr_t)q;
    c.keys = (const void *)(uintptr_t)keys;
    c.values = (const void *)(uintptr_t)values;
    c.tables = (const int32_t *)(uintptr_t)tables;
    c.positions = (const int64_t *)(uintptr_t)positions;
    c.slots = (const int64_t *)(uintptr_t)slots;
    c.out = (float *)(uintptr_t)out;
    c.max_length = 0;
    for (Py_ssize_t t = 0; t < c.num_rows; t++)
        if (c.positions[t] + 1 > c.max_length) c.max_length = c.positions[t] + 1;
    return run_released(attention_rows, &c, attention_scratch(&c));
}

/* experts(x, ids, gate_up, down, out, num_tokens, top_k, num_experts, hidden, inter, type, wtype)
   x [T, H] of `type`, gate_up [E, 2I, H] (gate rows, then up rows), down [E, H, I] of `wtype`
   (`type`, or PAIRED under float32 rows); ids [T, k]
   int64 (-1: dropped, output zeros); out [T*k, H] float32, route r = t*k + rank:
   down_e · (silu(gate_e · x_t) * (up_e · x_t)), with the torch reference's roundings to `type`
   (the products' outputs and the activation). An expert's routes are taken together, a block
   of its weight rows at a time (read once for all of them); each route's sums are its own. */

MACHINE_CLONES
KERNEL void expert_routes(const void *call, float *buf) {
    const struct experts_call *c = call;
    const Py_ssize_t hidden = c->hidden, inter = c->inter, num_routes = c->num_tokens * c->top_k;
    const int64_t *ids = c->ids;
    float *inputs = buf, *gate_up_out = inputs + num_routes * hidden, *acts = gate_up_out + num_routes * 2 * inter;
    float *weights = acts + num_routes * inter;
    Py_ssize_t *order = (Py_ssize_t *)(buf + experts_floats(c)), *starts = order + num_routes + 1;
#if WIDE_PRODUCTS
    const int wide = c->wtype == PAIRED && wide_machine();
#else
    const int wide = 0;
#endif
    /* counting sort of the routes by expert (stable) */
    for (Py_ssize_t e = 0; e <= c->num_experts + 1; e++) starts[e] = 0;
    for (Py_ssize_t r = 0; r < num_routes; r++)
        if (ids[r] >= 0) starts[ids[r] + 1]++;
    for (Py_ssize_t e = 0; e < c->num_experts; e++) starts[e + 1] += starts[e];
    for (Py_ssize_t r = 0; r < num_routes; r++) {
        if (ids[r] < 0) continue;
        order[starts[ids[r]]++] = r;
        load_row(inputs + r * hidden, c->x, (r / c->top_k) * hidden, hidden, c->type);
    }
    for (Py_ssize_t e = c->num_experts; e > 0; e--) starts[e] = starts[e - 1];
    starts[0] = 0;
    Py_ssize_t own = 0;
    for (Py_ssize_t e = next_item(c->claim, &own); e <= c->num_experts; e = next_item(c->claim, &own)) {
        if (e == c->num_experts) {  /* the dropped routes' outputs: zeros */
            for (Py_ssize_t r = 0; r < num_routes; r++)
                if (ids[r] < 0) memset(c->out + r * hidden, 0, sizeof(float) * (size_t)hidden);
            continue;
        }
        const Py_ssize_t first = starts[e], last = starts[e + 1];
        if (first == last) continue;
        for (Py_ssize_t n = 0; n < 2 * inter; n += ROW_BLOCK) {
            const Py_ssize_t count = 2 * inter - n < ROW_BLOCK ? 2 * inter - n : ROW_BLOCK;
            const Py_ssize_t at = (e * 2 * inter + n) * hidden;
            /* (8-lane, more routes: the block converted once, below; wide: two routes a pass) */
            if (c->wtype == PAIRED && (last - first <= 2 || (wide && !(hidden & 15)))) {
                routes_by_twos(order, first, last, inputs, hidden, (const uint16_t *)c->gate_up + at, count,
                               gate_up_out + n, 2 * inter, wide);
                continue;
            }
            const float *w = weight_rows(c->gate_up, at, hidden, hidden, count, c->wtype, weights);
            Py_ssize_t i = first;
            for (; i + 2 <= last; i += 2)
                dots2(inputs + order[i] * hidden, inputs + order[i + 1] * hidden, w, hidden, hidden, count,
                      gate_up_out + order[i] * 2 * inter + n, gate_up_out + order[i + 1] * 2 * inter + n);
            if (i < last)
                dots(inputs + order[i] * hidden, w, hidden, hidden, count, gate_up_out + order[i] * 2 * inter + n);
        }
        for (Py_ssize_t i = first; i < last; i++) {
            const float *g = gate_up_out + order[i] * 2 * inter, *u = g + inter;
            float *a = acts + order[i] * inter;
            for (Py_ssize_t j = 0; j < inter; j++) {
                float gv = g[j], uv = u[j];
                if (c->type == BF16) gv = round_bf16(gv), uv = round_bf16(uv);
                a[j] = gv / (1.0f + expf(-gv)) * uv;
                if (c->type == BF16) a[j] = round_bf16(a[j]);
            }
        }
        for (Py_ssize_t n = 0; n < hidden; n += ROW_BLOCK) {
            const Py_ssize_t count = hidden - n < ROW_BLOCK ? hidden - n : ROW_BLOCK;
            const Py_ssize_t at = (e * hidden + n) * inter;
            Py_ssize_t i = first;
            if (c->wtype == PAIRED && (last - first <= 2 || (wide && !(inter & 15)))) {
                routes_by_twos(order, first, last, acts, inter, (const uint16_t *)c->down + at, count, c->out + n,
                               hidden, wide);
                i = last;
            }
            const float *w = i < last ? weight_rows(c->down, at, inter, inter, count, c->wtype, weights) : NULL;
            for (; i + 2 <= last; i += 2)
                dots2(acts + order[i] * inter, acts + order[i + 1] * inter, w, inter, inter, count,
                      c->out + order[i] * hidden + n, c->out + order[i + 1] * hidden + n);
            if (i < last) dots(acts + order[i] * inter, w, inter, inter, count, c->out + order[i] * hidden + n);
            if (c->type == BF16)
                for (i = first; i < last; i++) {
                    float *o = c->out + order[i] * hidden + n;
                    for (Py_ssize_t j = 0; j < count; j++) o[j] = round_bf16(o[j]);
                }
        }
    }
}

static PyObject *experts(PyObject *self, PyObject *args) {
    unsigned long long x, ids, gate_up, down, out;
    struct experts_call c = {.claim = NULL};
    if (!PyArg_ParseTuple(args, "KKKKKnnnnnii", &x, &ids, &gate_up, &down, &out, &c.num_tokens, &c.top_k,
                          &c.num_experts, &c.hidden, &c.inter, &c.type, &c.wtype))
        return NULL;
    if (!weights_read(c.type, c.wtype)) return NULL;
    c.x = (const void *)(uintptr_t)x;
    c.ids = (const int64_t *)(uintptr_t)ids;
    c.gate_up = (const void *)(uintptr_t)gate_up;
    c.down = (const void *)(uintptr_t)down;
    c.out = (float *)(uintptr_t)out;
    return run_released(expert_routes, &c, experts_scratch(&c));
}

/* partials(x, weight, out, num_rows, num_out, num_in, x_stride, weight_stride, splits, step, type, wtype):
   x of `type`, weight of `wtype` (`type`, or PAIRED under float32 rows); out [M, splits, N] float32, partial s = x[:, s*step : (s+1)*step] @ weight[:, same]^T (empty past
   K: zeros), each sum in lanes_total's order — linear_partials' split-K products, and with one
   split rowwise_linear's. A block of weight rows at a time, for every row of x (the weight read
   once for all of them); on a machine with AVX-512 two or more rows through the wide kernel
   (_cpu_wide.c: the same sums, two rows a register) where a split's columns are whole eights
   (paired weights: whole chunks), and one row over paired weights two weight rows a register.
   Optional last argument `narrow`: never the wide kernels. */

MACHINE_CLONES
KERNEL void partial_rows(const void *call, float *buf) {
    const struct products_call *c = call;
    const Py_ssize_t splits = c->splits, step = c->step;
    const Py_ssize_t num_in = c->num_in;
    float *inputs = buf, *weights = inputs + c->num_rows * num_in;
    for (Py_ssize_t m = 0; m < c->num_rows; m++) load_row(inputs + m * num_in, c->x, m * c->x_stride, num_in, c->type);
    /* the wide kernel's input pairs (_cpu_wide.c): pair p's eight columns j at pairs + (p * eights + j / 8) * 16 */
    const Py_ssize_t eights = (num_in + 7) / 8;
    float *pairs = weights + ROW_BLOCK * num_in;
#if WIDE_PRODUCTS
    const int wide_ok = !c->narrow && c->wtype != BF16 && wide_machine();
#else
    const int wide_ok = 0;
#endif
    const int wide = wide_ok && c->num_rows >= WIDE_MIN_ROWS;  /* (fewer rows: paired_dots' wide way) */
    if (wide)
        for (Py_ssize_t m = 0; m < c->num_rows + c->num_rows % 2; m++)
            for (Py_ssize_t j = 0; j < 8 * eights; j++)
                pairs[(m / 2 * eights + j / 8) * 16 + m % 2 * 8 + j % 8] =
                    m < c->num_rows && j < num_in ? inputs[m * num_in + j] : 0.0f;
    const Py_ssize_t chunks = (c->num_out + PRODUCT_CHUNK - 1) / PRODUCT_CHUNK;
    Py_ssize_t own = 0;
    for (Py_ssize_t item = next_item(c->claim, &own); item < splits * chunks; item = next_item(c->claim, &own)) {
        const Py_ssize_t sp = item / chunks, chunk_end = (item % chunks + 1) * PRODUCT_CHUNK;
        const Py_ssize_t first = sp * step < num_in ? sp * step : num_in;
        const Py_ssize_t width = (first + step < num_in ? first + step : num_in) - first;
        /* (paired weights: whole chunks only; the 8-lane kernels take the rest, in the same order) */
        const int wide_here = wide && !(first & 7) && !(width & 7) &&
                              (c->wtype != PAIRED || (!(first & 15) && !(width & 15) && first + width <= (num_in & ~(Py_ssize_t)15)));
        for (Py_ssize_t n = (item % chunks) * PRODUCT_CHUNK; n < c->num_out && n < chunk_end; n += ROW_BLOCK) {
            const Py_ssize_t count = c->num_out - n < ROW_BLOCK ? c->num_out - n : ROW_BLOCK;
#if WIDE_PRODUCTS
            if (wide_here) {
                const Py_ssize_t element = c->wtype == PAIRED ? 2 : 4;
                wide_products(pairs, eights, c->num_rows, (const char *)c->weight + n * c->weight_stride * element,
                              c->weight_stride, first, width, c->wtype == PAIRED, count, c->out + sp * c->num_out + n,
                              splits * c->num_out);
                continue;
            }
#endif
            const float *w;
            Py_ssize_t stride;
            if (c->wtype == PAIRED) {
                const uint16_t *rows = (const uint16_t *)c->weight + n * c->weight_stride;
                const Py_ssize_t n16 = num_in & ~(Py_ssize_t)15;
                if (c->num_rows <= 2 && !(first & 7)) {  /* (more rows: the block converted once, below) */
                    paired_dots(inputs + first, c->num_rows == 2 ? inputs + num_in + first : NULL, rows,
                                c->weight_stride, first, width, n16, count, c->out + sp * c->num_out + n,
                                c->out + (splits + sp) * c->num_out + n, wide_ok);
                    continue;
                }
                for (Py_ssize_t r = 0; r < count; r++)
                    unpack_paired(weights + r * width, rows + r * c->weight_stride, first, width, n16);
                w = weights;
                stride = width;
            } else if (c->wtype == F32) {
                w = (const float *)c->weight + n * c->weight_stride + first;
                stride = c->weight_stride;
            } else {
                for (Py_ssize_t r = 0; r < count; r++)
                    load_row(weights + r * width, c->weight, (n + r) * c->weight_stride + first, width, c->wtype);
                w = weights;
                stride = width;
            }
            Py_ssize_t m = 0;
            for (; m + 2 <= c->num_rows; m += 2)
                dots2(inputs + m * num_in + first, inputs + (m + 1) * num_in + first, w, stride, width, count,
                      c->out + (m * splits + sp) * c->num_out + n, c->out + ((m + 1) * splits + sp) * c->num_out + n);
            if (m < c->num_rows)
                dots(inputs + m * num_in + first, w, stride, width, count, c->out + (m * splits + sp) * c->num_out + n);
        }
    }
}

static PyObject *partials(PyObject *self, PyObject *args) {
    unsigned long long x, weight, out;
    struct products_call c = {.claim = NULL};
    if (!PyArg_ParseTuple(args, "KKKnnnnnnnii|p", &x, &weight, &out, &c.num_rows, &c.num_out, &c.num_in, &c.x_stride,
                          &c.weight_stride, &c.splits, &c.step, &c.type, &c.wtype, &c.narrow))
        return NULL;
    if (!weights_read(c.type, c.wtype)) return NULL;
    c.x = (const void *)(uintptr_t)x;
    c.weight = (const void *)(uintptr_t)weight;
    c.out = (float *)(uintptr_t)out;
    return run_released(partial_rows, &c, partials_scratch(&c));
}

/* The rows' RMS norm as add_rmsnorm_reference takes it: y = float32 h, y * rsqrt(mean(y^2) + eps),
   then weight * y in the dtype (centred: y * (1 + weight) in float32, rounded once). */
HELPER void rms_norm(const float *h, const void *weight, Py_ssize_t n, float eps, int centred, int type,
                     float *w_row, float *out) {
    lanes acc = {0};
    Py_ssize_t j = 0;
    for (; j + LANES <= n; j += LANES) {
        const lanes v = load_lanes(h + j);
        acc += v * v;
    }
    for (; j < n; j++) acc[j % LANES] += h[j] * h[j];
    const float scale = 1.0f / sqrtf(lanes_total(acc) / (float)n + eps);
    load_row(w_row, weight, 0, n, type);
    for (j = 0; j < n; j++) {
        float y = h[j] * scale;
        if (centred) {
            y = y * (1.0f + w_row[j]);
            out[j] = type == BF16 ? round_bf16(y) : y;
        } else {
            if (type == BF16) y = round_bf16(y);
            out[j] = type == BF16 ? round_bf16(w_row[j] * y) : w_row[j] * y;
        }
    }
}

/* add_norm(x, kind, residual, weight, normed, new_residual, route_weights, num_rows, hidden, terms, eps,
            centred, type): new_residual = residual + x' (x' alone without a residual), normed = its
   RMS norm, where x' is by kind: 0 x [T, H] of `type`; 1 split-K partials [T, terms, H] float32
   summed in split order; 2 routes' outputs [T*terms, H] float32 weighted by route_weights
   [T, terms] float32 and summed in rank order — each rounded to `type` before the add, as the
   references round them. */

MACHINE_CLONES
KERNEL void add_norm_rows(const void *call, float *buf) {
    const struct norm_call *c = call;
    const Py_ssize_t n = c->hidden;
    float *h = buf, *r = h + n, *w_row = r + n, *out = w_row + n;
    for (Py_ssize_t t = 0; t < c->num_rows; t++) {
        if (c->kind == 0) {
            load_row(h, c->x, t * n, n, c->type);
        } else {
            const float *x = (const float *)c->x;
            for (Py_ssize_t j = 0; j < n; j++) h[j] = 0.0f;
            for (Py_ssize_t k = 0; k < c->terms; k++) {
                const float *term = x + (t * c->terms + k) * n;
                if (c->kind == 1) {
                    for (Py_ssize_t j = 0; j < n; j++) h[j] = k ? h[j] + term[j] : term[j];
                } else {
                    const float w = c->route_weights[t * c->terms + k];
                    for (Py_ssize_t j = 0; j < n; j++) h[j] = k ? h[j] + term[j] * w : term[j] * w;
                }
            }
            if (c->type == BF16)
                for (Py_ssize_t j = 0; j < n; j++) h[j] = round_bf16(h[j]);
        }
        if (c->residual) {
            load_row(r, c->residual, t * n, n, c->type);
            for (Py_ssize_t j = 0; j < n; j++) h[j] = c->type == BF16 ? round_bf16(r[j] + h[j]) : r[j] + h[j];
        }
        rms_norm(h, c->weight, n, c->eps, c->centred, c->type, w_row, out);
        store_row(c->normed, t * n, out, n, c->type);
        if (c->new_residual) store_row(c->new_residual, t * n, h, n, c->type);
    }
}

static PyObject *add_norm(PyObject *self, PyObject *args) {
    unsigned long long x, residual, weight, normed, new_residual, route_weights;
    struct norm_call c;
    if (!PyArg_ParseTuple(args, "KiKKKKKnnnfii", &x, &c.kind, &residual, &weight, &normed, &new_residual,
                          &route_weights, &c.num_rows, &c.hidden, &c.terms, &c.eps, &c.centred, &c.type))
        return NULL;
    c.x = (const void *)(uintptr_t)x;
    c.residual = (const void *)(uintptr_t)residual;
    c.weight = (const void *)(uintptr_t)weight;
    c.normed = (void *)(uintptr_t)normed;
    c.new_residual = (void *)(uintptr_t)new_residual;
    c.route_weights = (const float *)(uintptr_t)route_weights;
    return run_released(add_norm_rows, &c, norm_scratch(&c));
}

/* qk_rope(qkv, qkv_stride, q_out, keys, values, tables, positions, slots, q_norm, k_norm, cos, sin,
           num_rows, num_heads, num_kv, head_dim, q_head_stride, rot, block_size, max_blocks, eps,
           centred, type): per row, q's and k's heads RMS-normed (rms_norm) and their first `rot`
   dims rotated (x*c + rotate_half(x)*s, each product and the sum rounded to `type`; c, s the
   float32 tables' row at the position, rounded to `type`); q to q_out [T, Hq, D], k and v (as
   they are) to the cache at (slot, position). qkv's columns: query head h at h * q_head_stride,
   then the key heads, then the value heads (D each). */

MACHINE_CLONES
KERNEL void qk_rope_rows(const void *call, float *buf) {
    const struct rope_call *c = call;
    const Py_ssize_t d = c->head_dim, half = c->rot / 2;
    float *x = buf, *normed = x + d, *w_row = normed + d, *out = w_row + d;
    for (Py_ssize_t t = 0; t < c->num_rows; t++) {
        const Py_ssize_t p = c->positions[t];
        const Py_ssize_t kv_row = ((Py_ssize_t)c->tables[c->slots[t] * c->max_blocks + p / c->block_size] * c->block_size
                                   + p % c->block_size) * c->num_kv * d;
        const float *cos = c->cos + p * c->rot, *sin = c->sin + p * c->rot;
        for (Py_ssize_t head = 0; head < c->num_heads + 2 * c->num_kv; head++) {
            const int is_q = head < c->num_heads, is_k = !is_q && head < c->num_heads + c->num_kv;
            const Py_ssize_t column = is_q ? head * c->q_head_stride : c->num_heads * c->q_head_stride + (head - c->num_heads) * d;
            load_row(x, c->qkv, t * c->qkv_stride + column, d, c->type);
            if (!is_q && !is_k) {
                store_row(c->values, kv_row + (head - c->num_heads - c->num_kv) * d, x, d, c->type);
                continue;
            }
            rms_norm(x, is_q ? c->q_norm : c->k_norm, d, c->eps, c->centred, c->type, w_row, normed);
            for (Py_ssize_t j = 0; j < d; j++) {
                if (j >= c->rot) {
                    out[j] = normed[j];
                    continue;
                }
                float cv = cos[j], sv = sin[j];
                const float partner = j < half ? -normed[j + half] : normed[j - half];
                if (c->type == BF16) {
                    cv = round_bf16(cv), sv = round_bf16(sv);
                    out[j] = round_bf16(round_bf16(normed[j] * cv) + round_bf16(partner * sv));
                } else {
                    out[j] = normed[j] * cv + partner * sv;
                }
            }
            if (is_q)
                store_row(c->q_out, (t * c->num_heads + head) * d, out, d, c->type);
            else
                store_row(c->keys, kv_row + (head - c->num_heads) * d, out, d, c->type);
        }
    }
}

static PyObject *qk_rope(PyObject *self, PyObject *args) {
    unsigned long long qkv, q_out, keys, values, tables, positions, slots, q_norm, k_norm, cos, sin;
    struct rope_call c;
    if (!PyArg_ParseTuple(args, "KnKKKKKKKKKKnnnnnnnnfii", &qkv, &c.qkv_stride, &q_out, &keys, &values, &tables,
                          &positions, &slots, &q_norm, &k_norm, &cos, &sin, &c.num_rows, &c.num_heads, &c.num_kv,
                          &c.head_dim, &c.q_head_stride, &c.rot, &c.block_size, &c.max_blocks, &c.eps, &c.centred,
                          &c.type))
        return NULL;
    c.qkv = (const void *)(uintptr_t)qkv;
    c.q_out = (void *)(uintptr_t)q_out;
    c.keys = (void *)(uintptr_t)keys;
    c.values = (void *)(uintptr_t)values;
    c.tables = (const int32_t *)(uintptr_t)tables;
    c.positions = (const int64_t *)(uintptr_t)positions;
    c.slots = (const int64_t *)(uintptr_t)slots;
    c.q_norm = (const void *)(uintptr_t)q_norm;
    c.k_norm = (const void *)(uintptr_t)k_norm;
    c.cos = (const float *)(uintptr_t)cos;
    c.sin = (const float *)(uintptr_t)sin;
    return run_released(qk_rope_rows, &c, rope_scratch(&c));
}

/* route(partials, live, ids, weights, num_rows, splits, num_experts, top_k, normalize, round_bf16, has_live):
   the router's plain top-k, row by row: logits = the split-K partials [T, S, E] float32 added in split
   order, rounded to bfloat16 when the model's dtype is; p = softmax (float32: exp(x - max) with libm's
   expf, summed in expert order, divided by the sum); the k largest p, ties to the lower id; weights
   [T, k] float32 = those p, divided by max(their sum in rank order, 2^-14) when normalize; ids [T, k]
   int64 (-1 on a row whose live [T] int64 entry is 0). */

MACHINE_CLONES
KERNEL void route_rows(const void *call, float *buf) {
    const struct route_call *c = call;
    const Py_ssize_t E = c->num_experts, k = c->top_k;
    float *probs = buf;
    unsigned char *taken = (unsigned char *)(buf + E);
    for (Py_ssize_t t = 0; t < c->num_rows; t++) {
        const float *p = c->partials + t * c->splits * E;
        float top = -INFINITY;
        for (Py_ssize_t e = 0; e < E; e++) {
            float x = p[e];
            for (Py_ssize_t s = 1; s < c->splits; s++) x += p[s * E + e];
            if (c->round) x = round_bf16(x);
            probs[e] = x;
            if (x > top) top = x;
        }
        float total = 0.0f;
        for (Py_ssize_t e = 0; e < E; e++) {
            probs[e] = expf(probs[e] - top);
            total += probs[e];
        }
        for (Py_ssize_t e = 0; e < E; e++) {
            probs[e] /= total;
            taken[e] = 0;
        }
        int64_t *ids = c->ids + t * k;
        float *w = c->weights + t * k;
        float chosen = 0.0f;
        for (Py_ssize_t r = 0; r < k; r++) {
            Py_ssize_t best = -1;
            for (Py_ssize_t e = 0; e < E; e++)  /* strictly greater: the lower id keeps a tie */
                if (!taken[e] && (best < 0 || probs[e] > probs[best])) best = e;
            taken[best] = 1;
            ids[r] = best;
            w[r] = probs[best];
            chosen += probs[best];
        }
        if (c->normalize) {
            const float floor = 6.103515625e-05f;  /* 2^-14 */
            const float denominator = chosen > floor ? chosen : floor;
            for (Py_ssize_t r = 0; r < k; r++) w[r] /= denominator;
        }
        if (c->has_live && c->live[t] == 0)
            for (Py_ssize_t r = 0; r < k; r++) ids[r] = -1;
    }
}

static PyObject *route(PyObject *self, PyObject *args) {
    unsigned long long partials, live, ids, weights;
    struct route_call c;
    if (!PyArg_ParseTuple(args, "KKKKnnnniii", &partials, &live, &ids, &weights, &c.num_rows, &c.splits,
                          &c.num_experts, &c.top_k, &c.normalize, &c.round, &c.has_live))
        return NULL;
    c.partials = (const float *)(uintptr_t)partials;
    c.live = (const int64_t *)(uintptr_t)live;
    c.ids = (int64_t *)(uintptr_t)ids;
    c.weights = (float *)(uintptr_t)weights;
    return run_released(route_rows, &c, route_scratch(&c));
}

/* argmax(logits, out, num_rows, width): out [T] int64 = the index of each float32 row's first largest
   value, a NaN counting as larger than any number (torch.argmax's rule). Comparisons only: exact. */
KERNEL void argmax_rows(const float *logits, int64_t *out, Py_ssize_t num_rows, Py_ssize_t width) {
    for (Py_ssize_t t = 0; t < num_rows; t++) {
        const float *row = logits + t * width;
        Py_ssize_t best = 0;
        for (Py_ssize_t j = 0; j < width; j++) {
            if (isnan(row[j])) {
                best = j;
                break;
            }
            if (row[j] > row[best]) best = j;
        }
        out[t] = best;
    }
}

static PyObject *argmax(PyObject *self, PyObject *args) {
    unsigned long long logits, out;
    Py_ssize_t num_rows, width;
    if (!PyArg_ParseTuple(args, "KKnn", &logits, &out, &num_rows, &width)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    argmax_rows((const float *)(uintptr_t)logits, (int64_t *)(uintptr_t)out, num_rows, width);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *wide_products_here(PyObject *self, PyObject *args) {
#if WIDE_PRODUCTS
    return PyBool_FromLong(wide_machine());
#else
    Py_RETURN_FALSE;
#endif
}

static PyObject *set_wide_here(PyObject *self, PyObject *args) {
    int allowed;
    if (!PyArg_ParseTuple(args, "p", &allowed)) return NULL;
#if WIDE_PRODUCTS
    set_wide(allowed);
#endif
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"attention", attention, METH_VARARGS, "Paged decode attention, row by row (see kernels/fused/cpu_rows.py)."},
    {"experts", experts, METH_VARARGS, "Routed experts' outputs, route by route (see kernels/fused/cpu_rows.py)."},
    {"partials", partials, METH_VARARGS, "Split-K partial products, row by row (see kernels/fused/cpu_rows.py)."},
    {"add_norm", add_norm, METH_VARARGS, "Residual add and RMS norm, row by row (see kernels/fused/cpu_rows.py)."},
    {"qk_rope", qk_rope, METH_VARARGS, "q/k norms, RoPE and the KV write, row by row (see kernels/fused/cpu_rows.py)."},
    {"route", route, METH_VARARGS, "The router's plain top-k, row by row (see kernels/fused/cpu_rows.py)."},
    {"wide_products", wide_products_here, METH_NOARGS, "Whether products take the wide kernels here."},
    {"set_wide", set_wide_here, METH_VARARGS, "Allow (or forbid) the wide kernels, for every call from now on."},
    {"argmax", argmax, METH_VARARGS, "Greedy ids of float32 rows (see kernels/fused/cpu_rows.py)."},
    {"step_plan", step_plan, METH_VARARGS, "A qwen3_moe step's plan (see kernels/fused/cpu_step.py)."},
    {"step_run", step_run, METH_VARARGS, "A qwen3_moe step as one call (see kernels/fused/cpu_step.py)."},
    {"draw_windows", draw_windows, METH_VARARGS, "A step's sampled windows drawn (see kernels/sampling.py)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_rows", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__cpu_rows(void) { return PyModule_Create(&module); }

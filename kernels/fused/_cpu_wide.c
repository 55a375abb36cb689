/* The products of several input rows on a machine with AVX-512 (x86-64-v4): wide lanes, the same bits.

A product's sum takes lanes_total's order (_cpu_rows.c: eight lanes, lane l summing the columns
j = l mod 8 in column order, then ((0+4) + (1+5)) + ((2+6) + (3+7))). Here two input rows share a
16-lane register — row a's eight lanes, then row b's — and each weight row's eight values go to
both halves, so one multiply and one add serve two sums, each still in that order and rounded the
same way (a product rounded, then added: setup.py builds these kernels without contraction, so
no clone or compiler fuses some of them and not others). So a row's product has the same bits
whether one row or eight share the call (DESIGN §11), and the inputs, paired two by two once a
call, are read from L1 while each weight value is read once for up to eight rows: with eight rows
the 8-lane kernels are bound by their multiply-adds, not by the weights' bytes (docs/PERFORMANCE.md).

One or two input rows (a request's own decode step; an expert's routes, two at a time) take the
other way round: two paired weight rows side by side in a register (row i's eight lanes, then row
i + 1's) and the input's eight values in both halves — again a multiply and an add a term, in each
sum's 8-lane order: the same bits. `set_wide(0)` turns both ways off (the tests compare them with the
8-lane kernels). */

#include "_cpu_rows.h"

#if WIDE_PRODUCTS

#define WIDE static inline __attribute__((always_inline, target("arch=x86-64-v4")))

typedef float eight __attribute__((vector_size(32)));
typedef uint32_t eight_bits __attribute__((vector_size(32)));
typedef float wide __attribute__((vector_size(64)));  /* [row a's eight lanes | row b's] */
typedef uint32_t wide_bits __attribute__((vector_size(64)));

#define BOTH_HALVES 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7

WIDE wide wide_at(const float *p) {
    wide v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Eight float32 weights at p in both halves. */
WIDE wide eight_twice(const float *p) {
    eight h;
    memcpy(&h, p, sizeof h);
    return __builtin_shufflevector(h, h, BOTH_HALVES);
}

/* Two paired weight rows' chunks at p and q (_cpu_rows.h: PAIRED): values 0..7 of p's in the low half of
   *first and of q's in its high half, values 8..15 likewise in *second. */
WIDE void chunks_side_by_side(const uint16_t *p, const uint16_t *q, wide *first, wide *second) {
    eight_bits a, b;
    memcpy(&a, p, sizeof a);
    memcpy(&b, q, sizeof b);
    const wide_bits v = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const wide_bits low = v << 16, high = v & 0xffff0000u;
    memcpy(first, &low, sizeof low);
    memcpy(second, &high, sizeof high);
}

/* A paired chunk at p in both halves: its values 0..7 in each half of *first, 8..15 of *second. */
WIDE void chunk_twice(const uint16_t *p, wide *first, wide *second) { chunks_side_by_side(p, p, first, second); }


/* lanes_total of each half, in its order (a sum is commutative bit for bit: a + b == b + a). */
WIDE void halves_total(wide a, float *low, float *high) {
    const wide t = a + __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    const wide u = t + __builtin_shufflevector(t, t, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    const wide z = u + __builtin_shufflevector(u, u, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    *low = z[0];
    *high = z[8];
}

/* `rows` (1..4) weight rows at w, `stride` elements apart, columns first .. first + width - 1, against
   `pairs` (1..4) input pairs at pairs_at (pair p's eight columns c at pairs_at + (p * pair_stride + c) * 16);
   sums of input row m (of `num_rows` from the first pair's first) to out + m * out_stride + (the weight
   row). Called with constant rows and pairs: its loops unroll into registers (16 sums at most). */
WIDE void wide_group(const float *pairs_at, Py_ssize_t pair_stride, int pairs, const void *w, Py_ssize_t stride,
                     Py_ssize_t first, Py_ssize_t width, int paired, int rows, Py_ssize_t num_rows, float *out,
                     Py_ssize_t out_stride) {
    wide acc[4][4] = {{{0}}};
    const float *x = pairs_at + first / 8 * 16;
    if (paired) {
        const uint16_t *wp = (const uint16_t *)w + first;
        for (Py_ssize_t j = 0; j < width; j += 16) {
            wide low[4], high[4];
            for (int r = 0; r < rows; r++) chunk_twice(wp + r * stride + j, &low[r], &high[r]);
            for (int p = 0; p < pairs; p++) {
                const wide xa = wide_at(x + (p * pair_stride + j / 8) * 16), xb = wide_at(x + (p * pair_stride + j / 8 + 1) * 16);
                for (int r = 0; r < rows; r++) {
                    acc[p][r] += xa * low[r];
                    acc[p][r] += xb * high[r];
                }
            }
        }
    } else {
        const float *wf = (const float *)w + first;
        for (Py_ssize_t j = 0; j < width; j += 8) {
            wide wv[4];
            for (int r = 0; r < rows; r++) wv[r] = eight_twice(wf + r * stride + j);
            for (int p = 0; p < pairs; p++) {
                const wide xv = wide_at(x + (p * pair_stride + j / 8) * 16);
                for (int r = 0; r < rows; r++) acc[p][r] += xv * wv[r];
            }
        }
    }
    for (int p = 0; p < pairs; p++)
        for (int r = 0; r < rows; r++) {
            float low, high;
            halves_total(acc[p][r], &low, &high);
            out[2 * p * out_stride + r] = low;
            if (2 * p + 1 < num_rows) out[(2 * p + 1) * out_stride + r] = high;
        }
}

#define GROUP(PAIRS, ROWS) \
    wide_group(pairs_at, pair_stride, PAIRS, w, stride, first, width, paired, ROWS, left, out, out_stride)

/* One pass of up to four pairs over `count` weight rows (constant pair counts: unrolled). */
WIDE void pass(const float *pairs_at, Py_ssize_t pair_stride, int num_pairs, const void *w_rows, Py_ssize_t stride,
               Py_ssize_t first, Py_ssize_t width, int paired, Py_ssize_t count, Py_ssize_t left, float *out_rows,
               Py_ssize_t out_stride) {
    const Py_ssize_t element = paired ? 2 : 4;
    for (Py_ssize_t i = 0; i < count;) {
        const void *w = (const char *)w_rows + i * stride * element;
        float *out = out_rows + i;
        const int four = count - i >= 4;
        switch (num_pairs * 2 + four) {
            case 2: GROUP(1, 1); break;
            case 3: GROUP(1, 4); break;
            case 4: GROUP(2, 1); break;
            case 5: GROUP(2, 4); break;
            case 6: GROUP(3, 1); break;
            case 7: GROUP(3, 4); break;
            case 8: GROUP(4, 1); break;
            default: GROUP(4, 4); break;
        }
        i += four ? 4 : 1;
    }
}

__attribute__((target("arch=x86-64-v4"))) KERNEL void wide_products(const float *pairs_at, Py_ssize_t pair_stride,
                                                                     Py_ssize_t num_rows, const void *w,
                                                                     Py_ssize_t stride, Py_ssize_t first,
                                                                     Py_ssize_t width, int paired, Py_ssize_t count,
                                                                     float *out, Py_ssize_t out_stride) {
    for (Py_ssize_t m = 0; m < num_rows; m += 8) {
        const Py_ssize_t left = num_rows - m < 8 ? num_rows - m : 8;
        pass(pairs_at + m / 2 * pair_stride * 16, pair_stride, (int)((left + 1) / 2), w, stride, first, width, paired,
             count, left, out + m * out_stride, out_stride);
    }
}

/* `pairs` (1..8) pairs of weight rows at w (rows 2i and 2i + 1 of the group, `stride` apart; with
   `single`, the group's last pair is one row, read twice, whose high half is dropped) against `inputs`
   (1 or 2) input rows, columns first .. first + n - 1 (whole chunks): each weight row's eight lanes a
   half of a register, the input's eight in both halves. Constant pairs and inputs: unrolled. */
WIDE void side_by_side_group(const float *x0, const float *x1, const uint16_t *w, Py_ssize_t stride,
                             Py_ssize_t first, Py_ssize_t n, int pairs, int inputs, int single, float *out0,
                             float *out1) {
    wide a[8] = {{0}}, b[8] = {{0}};
    for (Py_ssize_t j = 0; j < n; j += 16) {
        const wide xa = eight_twice(x0 + j), xa2 = eight_twice(x0 + j + 8);
        const wide xb = inputs > 1 ? eight_twice(x1 + j) : xa, xb2 = inputs > 1 ? eight_twice(x1 + j + 8) : xa2;
        for (int i = 0; i < pairs; i++) {
            const uint16_t *row = w + 2 * i * stride + first + j;
            wide low, high;
            chunks_side_by_side(row, single && i == pairs - 1 ? row : row + stride, &low, &high);
            a[i] += xa * low;
            if (inputs > 1) b[i] += xb * low;
            a[i] += xa2 * high;
            if (inputs > 1) b[i] += xb2 * high;
        }
    }
    for (int i = 0; i < pairs; i++) {
        const int both = !(single && i == pairs - 1);
        float low, high;
        halves_total(a[i], &low, &high);
        out0[2 * i] = low;
        if (both) out0[2 * i + 1] = high;
        if (inputs > 1) {
            halves_total(b[i], &low, &high);
            out1[2 * i] = low;
            if (both) out1[2 * i + 1] = high;
        }
    }
}

#define SIDE(PAIRS, INPUTS, SINGLE) \
    side_by_side_group(x0, x1, w + i * stride, stride, first, n, PAIRS, INPUTS, SINGLE, out0 + i, out1 + i)

__attribute__((target("arch=x86-64-v4"))) KERNEL void wide_paired_dots(const float *x0, const float *x1,
                                                                        const uint16_t *w, Py_ssize_t stride,
                                                                        Py_ssize_t first, Py_ssize_t n,
                                                                        Py_ssize_t count, float *out0, float *out1) {
    Py_ssize_t i = 0;
    if (x1 == NULL) {
        for (; i + 16 <= count; i += 16) SIDE(8, 1, 0);
        for (; i + 2 <= count; i += 2) SIDE(1, 1, 0);
        if (i < count) SIDE(1, 1, 1);
    } else {
        for (; i + 8 <= count; i += 8) SIDE(4, 2, 0);
        for (; i + 2 <= count; i += 2) SIDE(1, 2, 0);
        if (i < count) SIDE(1, 2, 1);
    }
}

static int wide_allowed = 1;  /* (set_wide: the tests' comparison of the two ways) */

KERNEL int wide_machine(void) { return wide_allowed && __builtin_cpu_supports("x86-64-v4"); }

KERNEL void set_wide(int allowed) { wide_allowed = allowed; }

#endif

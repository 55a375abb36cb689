/* What the CPU's native row kernels (_cpu_rows.c) and the step that chains them (_cpu_step.c)
share: element types, the conversions every kernel inlines, each kernel's call and the scratch
it needs. Every float computation of a row lives in the kernels (compiled per machine, one
clone a process), so the step adds no arithmetic of its own: its rows keep the kernels' bits. */
#ifndef TANDEM_CPU_ROWS_H
#define TANDEM_CPU_ROWS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../_machine_clones.h"

/* Element types. PAIRED is a weights-only type beside float32 activations: bfloat16 values (a
   bfloat16 checkpoint's weights, exact in float32) in the paired layout — a row's first n16 = n / 16
   * 16 values in chunks of 16 with a chunk's values j and j + 8 side by side, the rest in order
   (kernels/fused/paired.py: pair_bf16) — so that one 32-byte load splits into a chunk's two sets
   of eight lanes by a shift and a mask. Half the bytes of float32, the same values: the same bits. */
enum { F32 = 0, BF16 = 1, PAIRED = 2 };

/* Whether the kernels read weights of `wtype` under rows of `type` (else a ValueError is set). */
static inline int weights_read(int type, int wtype) {
    if (wtype == type || (wtype == PAIRED && type == F32)) return 1;
    PyErr_Format(PyExc_ValueError, "weights of type %d under rows of type %d", wtype, type);
    return 0;
}
/* The loops are compiled twice (MACHINE_CLONES: AVX2 + FMA and the baseline, one per process). */
/* (the helpers inline into each clone, so they are compiled for its machine too) */
#define HELPER static inline __attribute__((always_inline))
/* The row kernels: called by their entry points (_cpu_rows.c) and by the step (_cpu_step.c). */
#define KERNEL __attribute__((visibility("hidden")))

HELPER float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Round to bfloat16 (to nearest, ties to even) and back, as torch's .to(torch.bfloat16). */
HELPER float round_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7f800000u) == 0x7f800000u) {  /* inf or nan: keep (quiet a nan) */
        if (bits & 0x007fffffu) bits |= 0x00400000u;
        bits &= 0xffff0000u;
    } else {
        bits += 0x7fffu + ((bits >> 16) & 1u);
        bits &= 0xffff0000u;
    }
    memcpy(&f, &bits, 4);
    return f;
}

/* n values of type `type` at p (offset i elements) into dst as float32. */
HELPER void load_row(float *dst, const void *p, Py_ssize_t i, Py_ssize_t n, int type) {
    if (type == F32) {
        memcpy(dst, (const float *)p + i, (size_t)n * 4);
    } else {
        const uint16_t *h = (const uint16_t *)p + i;
        for (Py_ssize_t j = 0; j < n; j++) dst[j] = bf16_to_f32(h[j]);
    }
}

/* n floats from src into p (offset i elements) as `type` (rounded to nearest even for bfloat16). */
HELPER void store_row(void *p, Py_ssize_t i, const float *src, Py_ssize_t n, int type) {
    if (type == F32) {
        memcpy((float *)p + i, src, (size_t)n * 4);
    } else {
        uint16_t *h = (uint16_t *)p + i;
        for (Py_ssize_t j = 0; j < n; j++) {
            const float r = round_bf16(src[j]);
            uint32_t bits;
            memcpy(&bits, &r, 4);
            h[j] = (uint16_t)(bits >> 16);
        }
    }
}

#define ROW_BLOCK 16  /* weight rows read together (the products and the experts) */
#define PRODUCT_CHUNK (4 * ROW_BLOCK)  /* a product's columns in one work item */

/* Work items (the step's threads, _cpu_step.c): the kernels whose call has a `claim` counter split
   their work into items (a product's column chunks, attention's (row, KV head) pairs, the experts),
   each computed whole by one thread with the same loops as alone, so which thread takes an item
   never changes a bit. `claim` NULL: the caller's thread takes every item, in order. */
HELPER Py_ssize_t next_item(Py_ssize_t *claim, Py_ssize_t *own) {
    return claim ? __atomic_fetch_add(claim, 1, __ATOMIC_RELAXED) : (*own)++;
}

/* Each kernel's call (the fields its entry point's comment in _cpu_rows.c describes). */
struct attention_call {
    const void *q, *keys, *values;
    const int32_t *tables;
    const int64_t *positions, *slots;
    float *out;
    Py_ssize_t num_rows, num_heads, num_kv, head_dim, block_size, max_blocks, max_length;
    Py_ssize_t *claim;  /* items: (row, KV head) */
    int type;
};

struct experts_call {
    const void *x, *gate_up, *down;
    const int64_t *ids;
    float *out;
    Py_ssize_t num_tokens, top_k, num_experts, hidden, inter;
    Py_ssize_t *claim;  /* items: the experts, then one for the dropped routes */
    int type, wtype;  /* the rows' type; the weights' (`type`, or PAIRED under float32 rows) */
};

struct products_call {
    const void *x, *weight;
    float *out;
    Py_ssize_t num_rows, num_out, num_in, x_stride, weight_stride, splits, step;
    Py_ssize_t *claim;  /* items: (split, PRODUCT_CHUNK columns) */
    int type, wtype;  /* the rows' type; the weights' (`type`, or PAIRED under float32 rows) */
    int narrow;  /* never the wide kernel (the tests' comparison of the two) */
};

struct norm_call {
    const void *x, *residual, *weight;
    const float *route_weights;
    void *normed, *new_residual;
    Py_ssize_t num_rows, hidden, terms;
    float eps;
    int kind, centred, type;
};

struct rope_call {
    const void *qkv, *q_norm, *k_norm;
    void *q_out, *keys, *values;
    const int32_t *tables;
    const int64_t *positions, *slots;
    const float *cos, *sin;
    Py_ssize_t num_rows, qkv_stride, num_heads, num_kv, head_dim, q_head_stride, rot, block_size, max_blocks;
    float eps;
    int centred, type;
};

struct route_call {
    const float *partials;
    const int64_t *live;
    int64_t *ids;
    float *weights;
    Py_ssize_t num_rows, splits, num_experts, top_k;
    int normalize, round, has_live;
};

typedef void (*row_kernel)(const void *call, float *buf);

KERNEL void attention_rows(const void *call, float *buf);
KERNEL void expert_routes(const void *call, float *buf);
KERNEL void partial_rows(const void *call, float *buf);
KERNEL void add_norm_rows(const void *call, float *buf);
KERNEL void argmax_rows(const float *logits, int64_t *out, Py_ssize_t num_rows, Py_ssize_t width);
KERNEL void qk_rope_rows(const void *call, float *buf);
KERNEL void route_rows(const void *call, float *buf);

/* Scratch floats each kernel's buf needs. */
HELPER size_t attention_scratch(const struct attention_call *c) {  /* a KV head's query group, then a block */
    const Py_ssize_t group = c->num_kv ? c->num_heads / c->num_kv : 1;
    return (size_t)(group * (c->max_length + 2 * c->head_dim) + c->block_size * c->head_dim);
}

/* the experts' buf: per route its input row [H], gate/up [2I], activation [I]; a block of weight
   rows (these experts_floats floats, an even count); then the routes by expert: order
   [routes + 1] and starts [E + 2] (Py_ssize_t: 2 floats each). */
HELPER size_t experts_floats(const struct experts_call *c) {
    const Py_ssize_t routes = c->num_tokens * c->top_k, width = c->hidden > c->inter ? c->hidden : c->inter;
    const size_t floats = (size_t)(routes * (c->hidden + 3 * c->inter) + ROW_BLOCK * width);
    return floats + floats % 2;  /* (the index arrays after it stay 8-byte aligned) */
}

HELPER size_t experts_scratch(const struct experts_call *c) {
    return experts_floats(c) + 2 * (size_t)(c->num_tokens * c->top_k + 1 + c->num_experts + 2);
}

/* the products' buf: the input rows [M, K], a block of weight rows [ROW_BLOCK, K], the input rows two by
   two for the wide kernel (_cpu_wide.c) [M / 2 rounded up, K / 8 rounded up, 16] */
HELPER size_t partials_scratch(const struct products_call *c) {
    return (size_t)((c->num_rows + ROW_BLOCK) * c->num_in + (c->num_rows + 1) / 2 * 16 * ((c->num_in + 7) / 8));
}
HELPER size_t norm_scratch(const struct norm_call *c) { return (size_t)(4 * c->hidden); }
HELPER size_t rope_scratch(const struct rope_call *c) { return (size_t)(4 * c->head_dim); }
HELPER size_t route_scratch(const struct route_call *c) { return (size_t)(2 * c->num_experts + 1); }

/* The wide products (_cpu_wide.c): on x86-64 with GCC, taken where the machine has AVX-512
   (x86-64-v4): two input rows a register for calls of at least WIDE_MIN_ROWS rows, two weight rows
   a register for one or two input rows over paired weights (`wide_paired_dots`). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && defined(__GLIBC__)
#define WIDE_PRODUCTS 1
#else
#define WIDE_PRODUCTS 0
#endif
#define WIDE_MIN_ROWS 2
#if WIDE_PRODUCTS
KERNEL int wide_machine(void);
KERNEL void set_wide(int allowed);
KERNEL void wide_paired_dots(const float *x0, const float *x1, const uint16_t *w, Py_ssize_t stride, Py_ssize_t first,
                             Py_ssize_t n, Py_ssize_t count, float *out0, float *out1);
KERNEL void wide_products(const float *pairs_at, Py_ssize_t pair_stride, Py_ssize_t num_rows, const void *w,
                          Py_ssize_t stride, Py_ssize_t first, Py_ssize_t width, int paired, Py_ssize_t count,
                          float *out, Py_ssize_t out_stride);
#endif

/* The step's entry points (_cpu_step.c), in the module's method table (_cpu_rows.c). */
KERNEL PyObject *step_plan(PyObject *self, PyObject *args);
KERNEL PyObject *step_run(PyObject *self, PyObject *args);
/* The step's thread pool for a call outside a step (_cpu_step.c), and a step's draws (_cpu_draws.c). */
KERNEL void pool_parallel(row_kernel kernel, const void *call, Py_ssize_t *claim, int threads);
KERNEL PyObject *draw_windows(PyObject *self, PyObject *args);

#endif

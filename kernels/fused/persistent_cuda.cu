// A layer chain of one-row products in one persistent CUDA kernel: issue 39's second probe
// (DESIGN §11). kernels/fused/persistent_cuda.py compiles it with NVRTC and states the chain.
//
// Per layer, five stages: qkv [Q, H] -> o [H, Q] -> router [E, H] -> the routed experts'
// gate/up [E, 2I, H] with SiLU -> their down [E, H, I] combined by route weight. A stage's
// input is the stage before's output (RMS-normed, unit weights, where the chain says so).
//
// Shape of the kernel (the design the Triton probe could not express):
// - one block a multiprocessor, resident for the whole chain; 8 consumer warps and 1 producer
//   warp. The producer walks the block's weight tiles in the order the consumers use them and
//   streams each into a ring of shared-memory slots with bulk copies (cp.async.bulk, completion
//   on an mbarrier), so weights never wait for data: while the consumers wait at a stage
//   boundary, the next stages' weights keep arriving. Only the experts' tiles wait, for the
//   block's own routes.
// - stage boundaries are counters in global memory: a block adds 1 to its stage's counter once
//   its outputs are written; a stage starts when its input stage's counter reaches the grid.
// - every sum in a fixed order that depends on neither the number of rows nor the grid: a row's
//   bits are its one-row chain's (row invariance, DESIGN §11).
//
// Buffers are plain bf16 bit patterns (unsigned short); NVRTC needs no headers.

#define RMAX 8        // rows a launch takes at most
#define CONSUMERS 256 // 8 warps
#define SLOT_BYTES 32768
#define MAX_SLOTS 8
#define MAX_ROUTES (RMAX * 8)
#define TOP_K 8
#define NUM_EXPERTS 128
#define DOWN_ROWS 16  // output rows of a down tile
#define GU_PAIRS 4    // gate/up row pairs of a gate/up tile
#define STAGES 5
#define NEG_INF __int_as_float(0xff800000)

typedef unsigned short bf16_t;
typedef unsigned long long u64;

struct Chain {
    const u64* qkv;      // [layers] pointers to [Q, H]
    const u64* o;        // [layers] pointers to [H, Q]
    const u64* router;   // [layers] pointers to [E, H]
    const u64* gate_up;  // [layers] pointers to [E, 2I, H]
    const u64* down;     // [layers] pointers to [E, H, I]
    const bf16_t* x;     // [R, H] the chain's input
    bf16_t* qkv_out;     // [R, Q]
    bf16_t* o_out;       // [R, H]
    bf16_t* logits;      // [R, E]
    bf16_t* act;         // [R * TOP_K, I] a route's SiLU(gate) * up
    bf16_t* out;         // [R, H] the combine (before its norm)
    unsigned* counters;  // [layers * STAGES + 1], zero between launches
    int layers, rows, H, Q, I, slots;
};

__device__ __forceinline__ float bf(unsigned bits16) { return __uint_as_float(bits16 << 16); }
__device__ __forceinline__ unsigned short to_bf(float f) {  // round to nearest even
    unsigned u = __float_as_uint(f);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
__device__ __forceinline__ float round_bf(float f) { return bf(to_bf(f)); }

__device__ __forceinline__ unsigned smem(const void* p) {
    unsigned a;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void mbar_init(u64* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect(u64* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(u64* bar, unsigned parity) {
    unsigned done = 0;
    while (!done) {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(smem(bar)), "r"(parity) : "memory");
    }
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, u64* bar, u64 policy) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
                 :: "r"(smem(dst)), "l"(src), "r"(bytes), "r"(smem(bar)), "l"(policy) : "memory");
}
__device__ __forceinline__ u64 evict_first() {
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, 256;" ::: "memory"); }
__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ uint4 load_cg(const void* p) {  // past L1: written by other blocks
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// A stage's end: this block's outputs are written (by every consumer) before the count.
__device__ __forceinline__ void arrive_stage(unsigned* counter) {
    consumers_sync();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(counter, 1u);
    }
}
__device__ __forceinline__ void wait_stage(const unsigned* counter) {
    if (threadIdx.x == 0) {
        while (load_acquire(counter) < gridDim.x) { }
        __threadfence();
    }
    consumers_sync();
}

// The shared state of a block: the ring's barriers and the layer's routes.
struct Shared {
    u64 full[MAX_SLOTS];
    u64 empty[MAX_SLOTS];
    u64 routes_ready;
    float red[2][DOWN_ROWS * RMAX];   // a tile's per-(row, segment) sums, by tile parity
    int route_expert[MAX_ROUTES];     // [r * TOP_K + rank]
    float route_weight[MAX_ROUTES];
    int experts[MAX_ROUTES];          // the distinct experts the rows route to, ascending
    signed char route_of[RMAX][MAX_ROUTES];  // [r][expert index] -> r * TOP_K + rank, or -1
    int num_experts;
};

// Stage input into xbuf: `rows` rows of `width` bf16 from global, RMS-normed (unit weights,
// eps 1e-6) and rounded to bf16 where `norm`. Warp r does row r, in one fixed order.
__device__ void load_input(bf16_t* xbuf, const bf16_t* src, int rows, int width, bool norm) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (warp >= rows) return;
    const int chunks = width / 8, per_lane = chunks / 32;  // width: a multiple of 256, at most 4096
    uint4 v[16];
    float ss = 0.f;
#pragma unroll
    for (int q = 0; q < 16; q++) {
        if (q < per_lane) {
            v[q] = load_cg(src + (size_t)warp * width + (size_t)(lane + 32 * q) * 8);
            unsigned w[4] = {v[q].x, v[q].y, v[q].z, v[q].w};
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float lo = bf(w[e] & 0xFFFFu), hi = bf(w[e] >> 16);
                ss += lo * lo;
                ss += hi * hi;
            }
        }
    }
    float scale = 1.f;
    if (norm) {
#pragma unroll
        for (int m = 16; m; m >>= 1) ss += __shfl_xor_sync(0xFFFFFFFFu, ss, m);
        scale = rsqrtf(ss / (float)width + 1e-6f);
    }
#pragma unroll
    for (int q = 0; q < 16; q++) {
        if (q < per_lane) {
            uint4 o = v[q];
            if (norm) {
                unsigned w[4] = {v[q].x, v[q].y, v[q].z, v[q].w};
#pragma unroll
                for (int e = 0; e < 4; e++)
                    w[e] = (unsigned)to_bf(bf(w[e] & 0xFFFFu) * scale) | ((unsigned)to_bf(bf(w[e] >> 16) * scale) << 16);
                o = make_uint4(w[0], w[1], w[2], w[3]);
            }
            *(uint4*)(xbuf + (size_t)warp * width + (size_t)(lane + 32 * q) * 8) = o;
        }
    }
}

// One tile's dot products: `num_rows` weight rows of `width` in shared memory, against the x
// rows at xbuf + x_offset[r] (skipped where -1). A row splits into `segments` (8 warps share
// the tile's rows); each (row, segment, r) sum goes to red[(row * segments + segment) * RMAX + r].
__device__ __forceinline__ void tile_dot(const bf16_t* w, int num_rows, int width, const bf16_t* xbuf, const int* x_offset,
                         int rows, float* red) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int segments = num_rows >= 8 ? 1 : 8 / num_rows;
    const int items = num_rows * segments, per_segment = width / 8 / segments;
    for (int item = warp; item < items; item += 8) {
        const int row = item / segments, segment = item % segments;
        const uint4* wrow = (const uint4*)(w + (size_t)row * width) + segment * per_segment;
        float acc[RMAX];
#pragma unroll
        for (int r = 0; r < RMAX; r++) acc[r] = 0.f;
        for (int c = lane; c < per_segment; c += 32) {
            const uint4 wv = wrow[c];
            const unsigned ww[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
            for (int r = 0; r < RMAX; r++) {
                if (r < rows && x_offset[r] >= 0) {
                    const uint4 xv = ((const uint4*)(xbuf + x_offset[r]))[segment * per_segment + c];
                    const unsigned xx[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        acc[r] = fmaf(bf(ww[e] & 0xFFFFu), bf(xx[e] & 0xFFFFu), acc[r]);
                        acc[r] = fmaf(bf(ww[e] >> 16), bf(xx[e] >> 16), acc[r]);
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < RMAX; r++) {
            if (r < rows) {
                float a = acc[r];
#pragma unroll
                for (int m = 16; m; m >>= 1) a += __shfl_xor_sync(0xFFFFFFFFu, a, m);
                if (lane == 0) red[item * RMAX + r] = a;
            }
        }
    }
}

// The sum of a row's segments, in segment order.
__device__ __forceinline__ float row_sum(const float* red, int row, int segments, int r) {
    float s = 0.f;
    for (int g = 0; g < segments; g++) s += red[(row * segments + g) * RMAX + r];
    return s;
}

// Each row's top-k of the router's logits (softmax over the k, ties to the lower expert), then
// the distinct experts in ascending order. Every block computes the same table.
__device__ void make_routes(Shared& sh, const bf16_t* logits, int rows) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (warp < rows) {
        float v[4];
#pragma unroll
        for (int q = 0; q < 4; q++) {
            unsigned short bits;
            asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(bits) : "l"(logits + warp * NUM_EXPERTS + lane + 32 * q));
            v[q] = bf(bits);
        }
        float top[TOP_K];
        int ids[TOP_K];
        for (int k = 0; k < TOP_K; k++) {
            float best = NEG_INF;
            int id = NUM_EXPERTS;
#pragma unroll
            for (int q = 0; q < 4; q++) {
                if (v[q] > best) { best = v[q]; id = lane + 32 * q; }
            }
#pragma unroll
            for (int m = 16; m; m >>= 1) {
                const float ob = __shfl_xor_sync(0xFFFFFFFFu, best, m);
                const int oi = __shfl_xor_sync(0xFFFFFFFFu, id, m);
                if (ob > best || (ob == best && oi < id)) { best = ob; id = oi; }
            }
            top[k] = best;
            ids[k] = id;
            #pragma unroll
            for (int q = 0; q < 4; q++)
                if (id == lane + 32 * q) v[q] = NEG_INF;
        }
        if (lane == 0) {
            float total = 0.f, e[TOP_K];
            for (int k = 0; k < TOP_K; k++) { e[k] = __expf(top[k] - top[0]); total += e[k]; }
            for (int k = 0; k < TOP_K; k++) {
                sh.route_expert[warp * TOP_K + k] = ids[k];
                sh.route_weight[warp * TOP_K + k] = e[k] / total;
            }
        }
    }
    consumers_sync();
    if (threadIdx.x == 0) {
        unsigned used[NUM_EXPERTS / 32] = {0, 0, 0, 0};
        for (int p = 0; p < rows * TOP_K; p++) used[sh.route_expert[p] >> 5] |= 1u << (sh.route_expert[p] & 31);
        int n = 0;
        for (int e = 0; e < NUM_EXPERTS; e++)
            if (used[e >> 5] >> (e & 31) & 1u) sh.experts[n++] = e;
        sh.num_experts = n;
        for (int r = 0; r < rows; r++)
            for (int u = 0; u < n; u++) {
                sh.route_of[r][u] = -1;
                for (int k = 0; k < TOP_K; k++)
                    if (sh.route_expert[r * TOP_K + k] == sh.experts[u]) sh.route_of[r][u] = (signed char)(r * TOP_K + k);
            }
    }
    consumers_sync();
}

extern "C" __global__ void __launch_bounds__(CONSUMERS + 32, 1)
layer_chain(const u64* qkv, const u64* o, const u64* router, const u64* gate_up, const u64* down, const bf16_t* x,
            bf16_t* qkv_out, bf16_t* o_out, bf16_t* logits, bf16_t* act, bf16_t* out, unsigned* counters,
            int layers, int rows, int hidden, int q_width, int inter, int slots) {
    const Chain c = {qkv, o, router, gate_up, down, x, qkv_out, o_out, logits, act, out, counters,
                     layers, rows, hidden, q_width, inter, slots};
    extern __shared__ __align__(128) unsigned char dynamic_smem[];
    __shared__ Shared sh;
    unsigned char* ring = dynamic_smem;                                  // [slots][SLOT_BYTES]
    bf16_t* xbuf = (bf16_t*)(dynamic_smem + (size_t)c.slots * SLOT_BYTES);  // stage input rows
    const int G = gridDim.x, b = blockIdx.x, R = c.rows, H = c.H, Q = c.Q, I = c.I;
    const int gu_tiles_per_expert = I / GU_PAIRS, down_chunks = H / DOWN_ROWS;

    if (threadIdx.x == 0) {
        for (int s = 0; s < c.slots; s++) { mbar_init(&sh.full[s], 1); mbar_init(&sh.empty[s], 1); }
        mbar_init(&sh.routes_ready, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (threadIdx.x >= CONSUMERS) {  // the producer warp: one lane streams the block's tiles
        if (threadIdx.x != CONSUMERS) return;
        const u64 policy = evict_first();
        unsigned n = 0;  // tiles issued
        auto slot_for = [&](unsigned bytes) -> int {
            const int s = n % c.slots;
            const unsigned use = n / c.slots;
            if (use > 0) mbar_wait(&sh.empty[s], (use - 1) & 1);
            mbar_expect(&sh.full[s], bytes);
            n++;
            return s;
        };
        for (int L = 0; L < c.layers; L++) {
            const bf16_t* dense[3] = {(const bf16_t*)c.qkv[L], (const bf16_t*)c.o[L], (const bf16_t*)c.router[L]};
            const int out_rows[3] = {Q, H, NUM_EXPERTS}, widths[3] = {H, Q, H};
            for (int st = 0; st < 3; st++) {
                const int tile_rows = st == 2 ? 1 : SLOT_BYTES / (2 * widths[st]);
                const unsigned bytes = tile_rows * widths[st] * 2;
                for (int t = b; t < out_rows[st] / tile_rows; t += G) {
                    const int s = slot_for(bytes);
                    bulk_load(ring + (size_t)s * SLOT_BYTES, dense[st] + (size_t)t * tile_rows * widths[st], bytes,
                              &sh.full[s], policy);
                }
            }
            mbar_wait(&sh.routes_ready, L & 1);
            const int ne = sh.num_experts;
            const bf16_t* gu = (const bf16_t*)c.gate_up[L];
            for (int t = b; t < ne * gu_tiles_per_expert; t += G) {
                const int e = sh.experts[t / gu_tiles_per_expert], j = (t % gu_tiles_per_expert) * GU_PAIRS;
                const unsigned half = GU_PAIRS * H * 2;
                const int s = slot_for(2 * half);
                unsigned char* dst = ring + (size_t)s * SLOT_BYTES;
                bulk_load(dst, gu + ((size_t)e * 2 * I + j) * H, half, &sh.full[s], policy);
                bulk_load(dst + half, gu + ((size_t)e * 2 * I + I + j) * H, half, &sh.full[s], policy);
            }
            const bf16_t* dn = (const bf16_t*)c.down[L];
            for (int chunk = b; chunk < down_chunks; chunk += G)
                for (int u = 0; u < ne; u++) {
                    const unsigned bytes = DOWN_ROWS * I * 2;
                    const int s = slot_for(bytes);
                    bulk_load(ring + (size_t)s * SLOT_BYTES, dn + ((size_t)sh.experts[u] * H + chunk * DOWN_ROWS) * I,
                              bytes, &sh.full[s], policy);
                }
        }
        return;
    }

    // The consumers.
    const int tid = threadIdx.x;
    unsigned n = 0;  // tiles consumed
    int x_offset[RMAX];
    auto take = [&](int& s, unsigned& parity_buf) {
        s = n % c.slots;
        mbar_wait(&sh.full[s], (n / c.slots) & 1);
        parity_buf = n & 1;
        n++;
    };
    auto give_back = [&](int s) {
        consumers_sync();
        if (tid == 0) mbar_arrive(&sh.empty[s]);
    };
    for (int L = 0; L < c.layers; L++) {
        unsigned* cnt = c.counters + L * STAGES;
        // qkv
        if (L > 0) wait_stage(cnt - STAGES + 4);
        load_input(xbuf, L > 0 ? c.out : c.x, R, H, L > 0);
        consumers_sync();
#pragma unroll
        for (int r = 0; r < RMAX; r++) x_offset[r] = r * H;
        const bf16_t* dense_out[3] = {c.qkv_out, c.o_out, c.logits};
        const int out_rows[3] = {Q, H, NUM_EXPERTS}, widths[3] = {H, Q, H};
        for (int st = 0; st < 3; st++) {
            if (st > 0) {
                wait_stage(cnt + st - 1);
                load_input(xbuf, st == 1 ? c.qkv_out : c.o_out, R, widths[st], st == 2);
                consumers_sync();
#pragma unroll
                for (int r = 0; r < RMAX; r++) x_offset[r] = r * widths[st];
            }
            const int tile_rows = st == 2 ? 1 : SLOT_BYTES / (2 * widths[st]);
            const int segments = tile_rows >= 8 ? 1 : 8 / tile_rows;
            for (int t = b; t < out_rows[st] / tile_rows; t += G) {
                int s;
                unsigned p;
                take(s, p);
                tile_dot((const bf16_t*)(ring + (size_t)s * SLOT_BYTES), tile_rows, widths[st], xbuf, x_offset, R,
                         sh.red[p]);
                give_back(s);
                if (tid < tile_rows * R) {
                    const int i = tid / R, r = tid % R;
                    ((bf16_t*)dense_out[st])[(size_t)r * out_rows[st] + t * tile_rows + i] =
                        to_bf(row_sum(sh.red[p], i, segments, r));
                }
            }
            arrive_stage(cnt + st);
        }
        // gate/up: the router's input (still in xbuf) against each distinct expert's rows
        wait_stage(cnt + 2);
        make_routes(sh, c.logits, R);
        if (tid == 0) mbar_arrive(&sh.routes_ready);
        const int ne = sh.num_experts;
        for (int t = b; t < ne * gu_tiles_per_expert; t += G) {
            const int u = t / gu_tiles_per_expert, j = (t % gu_tiles_per_expert) * GU_PAIRS;
            int offsets[RMAX];
#pragma unroll
            for (int r = 0; r < RMAX; r++) offsets[r] = r < R && sh.route_of[r][u] >= 0 ? r * H : -1;
            int s;
            unsigned p;
            take(s, p);
            tile_dot((const bf16_t*)(ring + (size_t)s * SLOT_BYTES), 2 * GU_PAIRS, H, xbuf, offsets, R, sh.red[p]);
            give_back(s);
            if (tid < GU_PAIRS * R) {
                const int i = tid / R, r = tid % R, route = sh.route_of[r][u];
                if (route >= 0) {
                    const float g = round_bf(sh.red[p][i * RMAX + r]), up = round_bf(sh.red[p][(i + GU_PAIRS) * RMAX + r]);
                    c.act[(size_t)route * I + j + i] = to_bf(round_bf(g / (1.f + __expf(-g))) * up);
                }
            }
        }
        arrive_stage(cnt + 3);
        // down: every route's activations into xbuf, then each output chunk over the experts in order
        wait_stage(cnt + 3);
        for (int q = tid; q < R * TOP_K * I / 8; q += CONSUMERS)
            ((uint4*)xbuf)[q] = load_cg((const uint4*)c.act + q);
        consumers_sync();
        for (int chunk = b; chunk < down_chunks; chunk += G) {
            float acc = 0.f;  // thread (i, r): output row chunk * DOWN_ROWS + i of row r
            for (int u = 0; u < ne; u++) {
                int offsets[RMAX];
#pragma unroll
                for (int r = 0; r < RMAX; r++) offsets[r] = r < R && sh.route_of[r][u] >= 0 ? sh.route_of[r][u] * I : -1;
                int s;
                unsigned p;
                take(s, p);
                tile_dot((const bf16_t*)(ring + (size_t)s * SLOT_BYTES), DOWN_ROWS, I, xbuf, offsets, R, sh.red[p]);
                give_back(s);
                if (tid < DOWN_ROWS * R) {
                    const int i = tid / R, r = tid % R, route = sh.route_of[r][u];
                    if (route >= 0) acc += sh.route_weight[route] * round_bf(sh.red[p][i * RMAX + r]);
                }
            }
            if (tid < DOWN_ROWS * R) {
                const int i = tid / R, r = tid % R;
                c.out[(size_t)r * H + chunk * DOWN_ROWS + i] = to_bf(acc);
            }
        }
        arrive_stage(cnt + 4);
    }
    // The last block out sets every counter back to zero for the next launch.
    if (tid == 0) {
        unsigned* done = c.counters + c.layers * STAGES;
        if (atomicAdd(done, 1u) == (unsigned)G - 1) {
            for (int k = 0; k < c.layers * STAGES; k++) c.counters[k] = 0;
            __threadfence();
            *done = 0;
        }
    }
}

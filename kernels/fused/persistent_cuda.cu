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
#define PAD 8          // elements after each row in shared memory (bank groups for ldmatrix)
#define KT_MAX 2048    // columns of a tile at most
#define SLOT_BYTES (8 * (KT_MAX + PAD) * 2)  // 8 rows of KT_MAX, or 16 of at most KT_MAX / 2 - PAD
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

// A stage's end: this block's outputs are written (by every consumer) before the count: the
// barrier orders them before thread 0, whose release fence orders them before its add.
__device__ __forceinline__ void arrive_stage(unsigned* counter) {
    consumers_sync();
    if (threadIdx.x == 0) {
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
        asm volatile("red.relaxed.gpu.global.add.u32 [%0], 1;" :: "l"(counter) : "memory");
    }
}
// A stage's start: thread 0 acquires the count; the barrier passes that on to the consumers.
__device__ __forceinline__ void wait_stage(const unsigned* counter) {
    if (threadIdx.x == 0)
        while (load_acquire(counter) < gridDim.x) { }
    consumers_sync();
}

extern __shared__ __align__(128) unsigned char dynamic_smem[];  // the ring, then the stage input rows

// The shared state of a block: the ring's barriers and the layer's routes.
struct Shared {
    u64 full[MAX_SLOTS];
    u64 empty[MAX_SLOTS];
    u64 routes_ready;
    float red[2][8 * 2 * 8 * 8];      // a group's sums [warp slot][nb][r][n], by group parity
    int route_expert[MAX_ROUTES];     // [r * TOP_K + rank]
    float route_weight[MAX_ROUTES];
    int experts[MAX_ROUTES];          // the distinct experts the rows route to, ascending
    signed char route_of[RMAX][MAX_ROUTES];  // [r][expert index] -> r * TOP_K + rank, or -1
    int num_experts;
    int expert_count[NUM_EXPERTS / 32];  // distinct experts among each warp's 32
    unsigned char place_of[NUM_EXPERTS];  // an expert's index among the distinct ones
};

// Stage input into xbuf (rows width + PAD apart): `rows` rows of `width` bf16 from global,
// RMS-normed (unit weights, eps 1e-6) and rounded to bf16 where `norm`. Warp r does row r, in one
// fixed order.
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
            *(uint4*)(xbuf + (size_t)warp * (width + PAD) + (size_t)(lane + 32 * q) * 8) = o;
        }
    }
}

__device__ __forceinline__ void ldmatrix_x2(unsigned& r0, unsigned& r1, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];" : "=r"(r0), "=r"(r1) : "r"(smem(p)));
}
__device__ __forceinline__ void mma_bf16(float* c, unsigned a0, unsigned a2, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
}

// A tile in shared memory: `blocks` groups of 8 weight rows, `width` columns, rows `stride`
// elements apart (padded by PAD so that the 8 rows of an ldmatrix fall in 8 bank groups). The x
// rows: xbuf + x[r] (r < RMAX; -1: a row that takes no part), `width` columns each, plus `col`.
// acc: this thread's running sums, kept across a group's K tiles.
//
// Tensor cores (mma m16n8k16, float32 sums): the x rows are A's rows 0-7 (rows 8-15 zero), 8
// weight rows are B's columns; warp w takes the K steps w, w + 8, ... C[r][n] depends on x row r
// and weight row n alone, so a row's bits are its own.
__device__ __forceinline__ void tile_mma(const bf16_t* w, int blocks, int width, int stride, const bf16_t* xbuf,
                                         const int* x, int col, float (*acc)[4]) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int r = lane & 7, half = (lane >> 3) & 1;  // the row (x or weight) whose address this lane gives
    int address_row = 0;
    bool live = false;  // this lane's A fragments belong to x row lane / 4
#pragma unroll
    for (int q = 0; q < RMAX; q++) {
        if (q == r && x[q] >= 0) address_row = x[q];
        if (q == (lane >> 2)) live = x[q] >= 0;
    }
    const bf16_t* xr = xbuf + address_row + col;  // (a row not taking part reads row 0: zeroed below)
    for (int step = warp; step < width / 16; step += 8) {
        const int k = step * 16 + half * 8;
        unsigned a0, a2;
        ldmatrix_x2(a0, a2, xr + k);
        if (!live) { a0 = 0u; a2 = 0u; }
#pragma unroll
        for (int nb = 0; nb < 2; nb++) {
            if (nb < blocks) {
                unsigned b0, b1;
                ldmatrix_x2(b0, b1, w + (size_t)(nb * 8 + r) * stride + k);
                mma_bf16(acc[nb], a0, a2, b0, b1);
            }
        }
    }
}

// The same products on CUDA cores: warp w does weight rows w and w + 8; a lane's sums over its
// columns for x row r in acc[nb][r], kept across a group's K tiles (tile_sums adds the lanes).
__device__ __forceinline__ void tile_fma(const bf16_t* w, int blocks, int width, int stride, const bf16_t* xbuf,
                                         const int* x, int col, float (*acc)[RMAX]) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int nb = 0; nb < 2; nb++) {
        if (nb < blocks) {
            const uint4* wrow = (const uint4*)(w + (size_t)(nb * 8 + warp) * stride);
            for (int c = lane; c < width / 8; c += 32) {
                const uint4 wv = wrow[c];
                const unsigned ww[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
                for (int r = 0; r < RMAX; r++) {
                    if (x[r] >= 0) {
                        const uint4 xv = ((const uint4*)(xbuf + x[r] + col))[c];
                        const unsigned xx[4] = {xv.x, xv.y, xv.z, xv.w};
                        float part = 0.f;
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            part = fmaf(bf(ww[e] & 0xFFFFu), bf(xx[e] & 0xFFFFu), part);
                            part = fmaf(bf(ww[e] >> 16), bf(xx[e] >> 16), part);
                        }
                        acc[nb][r] += part;
                    }
                }
            }
        }
    }
}

// A group's sums into red[warp slot][nb][r][n] (mma: every warp's partial; fma: each weight
// row's whole sum, in slot 0).
__device__ __forceinline__ void tile_sums(bool use_mma, int blocks, float (*acc_mma)[4], float (*acc_fma)[RMAX],
                                          float* red) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (use_mma) {
        const int r = lane >> 2, n = 2 * (lane & 3);
#pragma unroll
        for (int nb = 0; nb < 2; nb++) {
            if (nb < blocks) {
                red[((warp * 2 + nb) * 8 + r) * 8 + n] = acc_mma[nb][0];
                red[((warp * 2 + nb) * 8 + r) * 8 + n + 1] = acc_mma[nb][1];
            }
        }
    } else {
#pragma unroll
        for (int nb = 0; nb < 2; nb++) {
            if (nb < blocks) {
#pragma unroll
                for (int r = 0; r < RMAX; r++) {
                    float a = acc_fma[nb][r];
#pragma unroll
                    for (int m = 16; m; m >>= 1) a += __shfl_xor_sync(0xFFFFFFFFu, a, m);
                    if (lane == 0) red[((0 * 2 + nb) * 8 + r) * 8 + warp] = a;
                }
            }
        }
    }
}

// Weight row i (of the tile's 8 * blocks), x row r: the sum of the warp slots in slot order.
__device__ __forceinline__ float tile_result(const float* red, bool use_mma, int i, int r) {
    float s = 0.f;
    const int slots = use_mma ? 8 : 1;
    for (int w = 0; w < slots; w++) s += red[((w * 2 + i / 8) * 8 + r) * 8 + i % 8];
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
    // The distinct experts, ascending: thread e (< 128) asks whether a route takes expert e; a
    // warp's ballot and the counts of the warps before give its place. Then each route's place.
    const int tid = threadIdx.x;
    bool used = false;
    if (tid < NUM_EXPERTS)
        for (int p = 0; p < rows * TOP_K; p++) used |= sh.route_expert[p] == tid;
    const unsigned ballot = __ballot_sync(0xFFFFFFFFu, used);
    if (tid < NUM_EXPERTS && lane == 0) sh.expert_count[warp] = __popc(ballot);
    for (int p = tid; p < RMAX * MAX_ROUTES; p += CONSUMERS) (&sh.route_of[0][0])[p] = -1;
    consumers_sync();
    if (used) {
        int place = __popc(ballot & ((1u << lane) - 1u));
        for (int w = 0; w < warp; w++) place += sh.expert_count[w];
        sh.experts[place] = tid;
        sh.place_of[tid] = place;
    }
    if (tid == 0) sh.num_experts = sh.expert_count[0] + sh.expert_count[1] + sh.expert_count[2] + sh.expert_count[3];
    consumers_sync();
    if (tid < rows * TOP_K) sh.route_of[tid / TOP_K][sh.place_of[sh.route_expert[tid]]] = (signed char)tid;
    consumers_sync();
}


// The chain, its products on tensor cores (use_mma) or CUDA cores. mode: bit 0, the weights streamed
// and every tile taken but no products (outputs zero); bit 1, while the producer waits for a
// layer's routes, its share of the next layer's qkv and o tiles prefetched into L2.
template <bool use_mma>
__device__ __forceinline__ void chain_body(const Chain& c, int mode) {
    __shared__ Shared sh;
    unsigned char* ring = dynamic_smem;                                     // [slots][SLOT_BYTES]
    bf16_t* xbuf = (bf16_t*)(dynamic_smem + (size_t)c.slots * SLOT_BYTES);  // stage input rows, padded
    const int G = gridDim.x, b = blockIdx.x, R = c.rows, H = c.H, Q = c.Q, I = c.I;
    const int gu_groups_per_expert = I / GU_PAIRS, down_chunks = H / DOWN_ROWS;
    const int out_rows[3] = {Q, H, NUM_EXPERTS}, widths[3] = {H, Q, H};

    if (threadIdx.x == 0) {
        for (int s = 0; s < c.slots; s++) { mbar_init(&sh.full[s], 1); mbar_init(&sh.empty[s], 1); }
        mbar_init(&sh.routes_ready, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (threadIdx.x >= CONSUMERS) {  // the producer warp: one lane streams the block's tiles, row by row
        if (threadIdx.x != CONSUMERS) return;
        const u64 policy = evict_first();
        unsigned n = 0;  // tiles issued
        // a tile of `num_rows` rows of `kt` columns into the next slot: rows `stride` apart from
        // `first`, from row `split` on from `second`
        auto issue = [&](int num_rows, int kt, const bf16_t* first, const bf16_t* second, int split, size_t stride) {
            const int s = n % c.slots;
            const unsigned use = n / c.slots;
            if (use > 0) mbar_wait(&sh.empty[s], (use - 1) & 1);
            mbar_expect(&sh.full[s], num_rows * kt * 2);
            unsigned char* dst = ring + (size_t)s * SLOT_BYTES;
            for (int i = 0; i < num_rows; i++) {
                const bf16_t* row = i < split ? first + i * stride : second + (i - split) * stride;
                bulk_load(dst + (size_t)i * (kt + PAD) * 2, row, kt * 2, &sh.full[s], policy);
            }
            n++;
        };
        for (int L = 0; L < c.layers; L++) {
            const bf16_t* dense[3] = {(const bf16_t*)c.qkv[L], (const bf16_t*)c.o[L], (const bf16_t*)c.router[L]};
            for (int st = 0; st < 3; st++) {
                const int K = widths[st], kt = K < KT_MAX ? K : KT_MAX;
                for (int g = b; g < out_rows[st] / 8; g += G)
                    for (int t = 0; t < K / kt; t++)
                        issue(8, kt, dense[st] + (size_t)g * 8 * K + t * kt, nullptr, 8, K);
            }
            if ((mode & 2) && L + 1 < c.layers) {  // the next layer's qkv and o tiles into L2 meanwhile
                const bf16_t* next[2] = {(const bf16_t*)c.qkv[L + 1], (const bf16_t*)c.o[L + 1]};
                for (int st = 0; st < 2; st++)
                    for (int g = b; g < out_rows[st] / 8; g += G)
                        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;"
                                     :: "l"(next[st] + (size_t)g * 8 * widths[st]), "r"(8 * widths[st] * 2) : "memory");
            }
            mbar_wait(&sh.routes_ready, L & 1);
            const int ne = sh.num_experts, kt = H < KT_MAX ? H : KT_MAX;
            const bf16_t* gu = (const bf16_t*)c.gate_up[L];
            for (int g = b; g < ne * gu_groups_per_expert; g += G) {
                const int e = sh.experts[g / gu_groups_per_expert], j = (g % gu_groups_per_expert) * GU_PAIRS;
                for (int t = 0; t < H / kt; t++)
                    issue(8, kt, gu + ((size_t)e * 2 * I + j) * H + t * kt, gu + ((size_t)e * 2 * I + I + j) * H + t * kt,
                          GU_PAIRS, H);
            }
            const bf16_t* dn = (const bf16_t*)c.down[L];
            for (int chunk = b; chunk < down_chunks; chunk += G)
                for (int u = 0; u < ne; u++) {
                    const int e = sh.experts[u];
                    issue(DOWN_ROWS, I, dn + ((size_t)e * H + chunk * DOWN_ROWS) * I, nullptr, DOWN_ROWS, I);
                }
        }
        return;
    }

    // The consumers: per group of tiles (one group: the K tiles of the same output rows), the
    // products into this thread's sums, the sums into red after the last, then the epilogue.
    const int tid = threadIdx.x;
    unsigned n = 0, groups_done = 0;
    int xr[RMAX];  // the x rows' offsets in xbuf (-1: not taking part)
    float am[2][4], af[2][RMAX];
    // One group: `tiles` K tiles of `num_rows` rows (8 or 16) and `kt` columns against the x rows
    // xr (tile t from column t * kt). Returns red holding the group's sums (valid until the next group's).
    auto run_group = [&](int num_rows, int kt, int tiles) -> const float* {
        const int blocks = num_rows / 8;
        float* red = sh.red[groups_done & 1];
#pragma unroll
        for (int nb = 0; nb < 2; nb++) {
#pragma unroll
            for (int v = 0; v < 4; v++) am[nb][v] = 0.f;
#pragma unroll
            for (int r = 0; r < RMAX; r++) af[nb][r] = 0.f;
        }
        for (int t = 0; t < tiles; t++) {
            const int s = n % c.slots;
            mbar_wait(&sh.full[s], (n / c.slots) & 1);
            n++;
            const bf16_t* w = (const bf16_t*)(ring + (size_t)s * SLOT_BYTES);
            if (!(mode & 1)) {
                if (use_mma) tile_mma(w, blocks, kt, kt + PAD, xbuf, xr, t * kt, am);
                else tile_fma(w, blocks, kt, kt + PAD, xbuf, xr, t * kt, af);
                if (t == tiles - 1) tile_sums(use_mma, blocks, am, af, red);
            }
            consumers_sync();
            if (tid == 0) mbar_arrive(&sh.empty[s]);
        }
        groups_done++;
        return red;
    };
    auto result = [&](const float* red, int i, int r) -> float {
        return mode & 1 ? 0.f : tile_result(red, use_mma, i, r);
    };
    for (int L = 0; L < c.layers; L++) {
        unsigned* cnt = c.counters + L * STAGES;
        const bf16_t* dense_in[3] = {L > 0 ? c.out : c.x, c.qkv_out, c.o_out};
        bf16_t* dense_out[3] = {c.qkv_out, c.o_out, c.logits};
        for (int st = 0; st < 3; st++) {  // qkv, o, router
            const int K = widths[st], N = out_rows[st], kt = K < KT_MAX ? K : KT_MAX;
            if (st > 0 || L > 0) wait_stage(st > 0 ? cnt + st - 1 : cnt - STAGES + 4);
            load_input(xbuf, dense_in[st], R, K, st == 2 || (st == 0 && L > 0));
            consumers_sync();
#pragma unroll
            for (int r = 0; r < RMAX; r++) xr[r] = r < R ? r * (K + PAD) : -1;
            for (int g = b; g < N / 8; g += G) {
                const float* red = run_group(8, kt, K / kt);
                if (tid < 8 * R) {
                    const int i = tid / R, r = tid % R;
                    dense_out[st][(size_t)r * N + g * 8 + i] = to_bf(result(red, i, r));
                }
            }
            arrive_stage(cnt + st);
        }
        // gate/up: the router's input (still in xbuf) against each distinct expert's rows
        wait_stage(cnt + 2);
        make_routes(sh, c.logits, R);
        if (tid == 0) mbar_arrive(&sh.routes_ready);
        const int ne = sh.num_experts, kt = H < KT_MAX ? H : KT_MAX;
        for (int g = b; g < ne * gu_groups_per_expert; g += G) {
            const int u = g / gu_groups_per_expert, j = (g % gu_groups_per_expert) * GU_PAIRS;
#pragma unroll
            for (int r = 0; r < RMAX; r++) xr[r] = r < R && sh.route_of[r][u] >= 0 ? r * (H + PAD) : -1;
            const float* red = run_group(8, kt, H / kt);
            if (tid < GU_PAIRS * R) {
                const int i = tid / R, r = tid % R, route = sh.route_of[r][u];
                if (route >= 0) {
                    const float gate = round_bf(result(red, i, r)), up = round_bf(result(red, i + GU_PAIRS, r));
                    c.act[(size_t)route * I + j + i] = to_bf(round_bf(gate / (1.f + __expf(-gate))) * up);
                }
            }
        }
        arrive_stage(cnt + 3);
        // down: every route's activations into xbuf, then each output chunk over the experts in order
        wait_stage(cnt + 3);
        for (int q = tid; q < R * TOP_K * I / 8; q += CONSUMERS) {
            const int route = q / (I / 8), col = q % (I / 8);
            *(uint4*)(xbuf + (size_t)route * (I + PAD) + col * 8) = load_cg((const uint4*)c.act + q);
        }
        consumers_sync();
        for (int chunk = b; chunk < down_chunks; chunk += G) {
            float acc = 0.f;  // thread (i, r): output row chunk * DOWN_ROWS + i of row r
            for (int u = 0; u < ne; u++) {
#pragma unroll
                for (int r = 0; r < RMAX; r++)
                    xr[r] = r < R && sh.route_of[r][u] >= 0 ? sh.route_of[r][u] * (I + PAD) : -1;
                const float* red = run_group(DOWN_ROWS, I, 1);
                if (tid < DOWN_ROWS * R) {
                    const int i = tid / R, r = tid % R, route = sh.route_of[r][u];
                    if (route >= 0) acc += sh.route_weight[route] * round_bf(result(red, i, r));
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

#define CHAIN_PARAMS                                                                                             \
    const u64 *qkv, const u64 *o, const u64 *router, const u64 *gate_up, const u64 *down, const bf16_t *x,         \
        bf16_t *qkv_out, bf16_t *o_out, bf16_t *logits, bf16_t *act, bf16_t *out, unsigned *counters, int layers, \
        int rows, int hidden, int q_width, int inter, int slots, int mode
#define CHAIN_ARGS                                                                                          \
    {qkv, o, router, gate_up, down, x, qkv_out, o_out, logits, act, out, counters, layers, rows, hidden, \
     q_width, inter, slots}

extern "C" __global__ void __launch_bounds__(CONSUMERS + 32, 1) layer_chain_mma(CHAIN_PARAMS) {
    chain_body<true>(Chain CHAIN_ARGS, mode);
}
extern "C" __global__ void __launch_bounds__(CONSUMERS + 32, 1) layer_chain_fma(CHAIN_PARAMS) {
    chain_body<false>(Chain CHAIN_ARGS, mode);
}

// Streaming alone: each block reads its `per_block` bytes in tiles of `copies` bulk copies of
// `copy_bytes`, through the same ring (`slots` slots) and barriers; the consumers take each tile
// and give it back. What the ring can stream, with nothing else in the way.
extern "C" __global__ void __launch_bounds__(CONSUMERS + 32, 1)
stream_ring(const unsigned char* src, unsigned per_block, int copy_bytes, int copies, int slots,
            unsigned* sink) {
    __shared__ u64 full[MAX_SLOTS], empty[MAX_SLOTS];
    if (threadIdx.x == 0) {
        for (int s = 0; s < slots; s++) { mbar_init(&full[s], 1); mbar_init(&empty[s], 1); }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const unsigned long long tile = (unsigned long long)copy_bytes * copies;
    const unsigned tiles = (unsigned)(per_block / tile);  // (per_block: a multiple of tile)
    const unsigned char* base = src + (unsigned long long)blockIdx.x * per_block;
    if (threadIdx.x >= CONSUMERS) {
        if (threadIdx.x != CONSUMERS) return;
        const u64 policy = evict_first();
        for (unsigned t = 0; t < tiles; t++) {
            const int s = t % slots;
            if (t >= (unsigned)slots) mbar_wait(&empty[s], (t / slots - 1) & 1);
            mbar_expect(&full[s], (unsigned)tile);
            for (int k = 0; k < copies; k++)
                bulk_load(dynamic_smem + (size_t)s * SLOT_BYTES + (size_t)k * (copy_bytes + PAD * 2),
                          base + t * tile + (unsigned long long)k * copy_bytes, copy_bytes, &full[s], policy);
        }
        return;
    }
    unsigned seen = 0;
    for (unsigned t = 0; t < tiles; t++) {
        const int s = t % slots;
        mbar_wait(&full[s], (t / slots) & 1);
        seen += dynamic_smem[(size_t)s * SLOT_BYTES + threadIdx.x];
        consumers_sync();
        if (threadIdx.x == 0) mbar_arrive(&empty[s]);
    }
    if (threadIdx.x == 0) sink[blockIdx.x] = seen;
}

// Stage boundaries alone: `stages` stages, each waits for the one before (its counter), reads the
// word the next block wrote in it (the data's round trip), writes its own and counts itself in —
// the chain's barrier with nothing to compute. counters: [stages + 1] zero; words: [stages, grid].
extern "C" __global__ void __launch_bounds__(CONSUMERS, 1) barrier_chain(unsigned* counters, unsigned* words, int stages) {
    const int G = gridDim.x, b = blockIdx.x;
    unsigned carried = b;
    for (int s = 0; s < stages; s++) {
        if (s > 0) {
            wait_stage(counters + s - 1);
            unsigned v;
            asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(words + (size_t)(s - 1) * G + (b + 1) % G));
            carried += v;
        }
        if (threadIdx.x == 0) words[(size_t)s * G + b] = carried;
        arrive_stage(counters + s);
    }
    if (threadIdx.x == 0 && atomicAdd(counters + stages, 1u) == (unsigned)G - 1) {
        for (int s = 0; s < stages; s++) counters[s] = 0;
        __threadfence();
        counters[stages] = 0;
    }
}

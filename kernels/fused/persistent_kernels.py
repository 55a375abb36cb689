"""Triton kernels of kernels.fused.persistent (imported only when a kernel runs)."""

import triton
import triton.language as tl

from kernels.fused.fp8_kernels import tile_dot

# A stage's entry in the chain's table: int64 fields at these offsets (kernels.fused.persistent.FIELDS
# names them alike and builds the table): the weight, output and input (addresses), the weight's
# outputs and inputs, its K splits and columns per split, the input's splits, the stage's kind
# (DENSE, GATE_UP, DOWN); an experts stage's router partials (address), their splits, the experts
# and the routes a row; FP8 weights' block scales (address; 0: full precision) and their block-row
# and expert strides.
F_WEIGHT = tl.constexpr(0)
F_OUT = tl.constexpr(1)
F_IN = tl.constexpr(2)
F_NUM_OUT = tl.constexpr(3)
F_NUM_IN = tl.constexpr(4)
F_SPLITS = tl.constexpr(5)
F_K_PER_SPLIT = tl.constexpr(6)
F_IN_SPLITS = tl.constexpr(7)
F_KIND = tl.constexpr(8)
F_ROUTES = tl.constexpr(9)
F_ROUTE_SPLITS = tl.constexpr(10)
F_EXPERTS = tl.constexpr(11)
F_TOP_K = tl.constexpr(12)
F_SCALES = tl.constexpr(13)
F_SCALE_ROW_STRIDE = tl.constexpr(14)
F_SCALE_EXPERT_STRIDE = tl.constexpr(15)
FIELDS = tl.constexpr(16)
DENSE = tl.constexpr(0)
GATE_UP = tl.constexpr(1)
DOWN = tl.constexpr(2)


@triton.jit
def grid_barrier(counter_ptr, target):
    """Every program waits here until `target` arrivals were counted (the counter only grows: the
    n-th barrier of a launch waits for n × programs, so it never needs resetting between stages).
    The CTA barrier before the arrival orders this program's stores before it (the release makes
    them visible GPU-wide); the acquire before leaving orders the next stage's loads after the
    other programs' stores."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    arrived = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while arrived < target:
        arrived = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def prefetch_l2(ptrs):
    """One L2 prefetch per pointer (a cache line each): the weights a program reads next start
    streaming from HBM before the data they multiply exists."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def prefetch_rows(w_ptr, cols, num_out, num_in, k_start, k_stop, BLOCK_K: tl.constexpr, LINE: tl.constexpr):
    """Prefetch the lines of weight rows `cols` (of num_out) over columns [k_start, k_stop)."""
    lines = tl.arange(0, BLOCK_K // LINE) * LINE
    for k0 in range(k_start, k_stop, BLOCK_K):
        prefetch_l2(w_ptr + tl.minimum(cols, num_out - 1)[:, None] * num_in
                    + tl.minimum(k0 + lines, num_in - 1)[None, :])


@triton.jit
def row_routes(route_ptr, route_splits, M, row, num_experts, top_k, DTYPE: tl.constexpr, BLOCK_E: tl.constexpr,
               K_PAD: tl.constexpr):
    """(expert ids [K_PAD], weights [K_PAD]) of one row, as kernels.fused.router.route makes them:
    the router's split-K partials added in split order and rounded to DTYPE, softmax in float32,
    top k by rank (ties to the lower id), weights normalised over the k. Every program that needs
    a row's routes computes them (a few reductions over E logits): no stage, no barrier for them."""
    e = tl.arange(0, BLOCK_E)
    ok = e < num_experts
    x = tl.load(route_ptr + row * num_experts + e, mask=ok, other=0.0, cache_modifier=".cg")
    for s in range(1, route_splits):
        x += tl.load(route_ptr + (s * M + row) * num_experts + e, mask=ok, other=0.0, cache_modifier=".cg")
    x = tl.where(ok, x.to(DTYPE).to(tl.float32), float("-inf"))
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    remaining = tl.where(ok, p, float("-inf"))
    ranks = tl.arange(0, K_PAD)
    picked = tl.zeros((K_PAD,), tl.int32)
    chosen = tl.zeros((K_PAD,), tl.float32)
    for rank in range(top_k):
        best = tl.argmax(remaining, axis=0, tie_break_left=True)
        prob = tl.sum(tl.where(e == best, p, 0.0), axis=0)
        picked = tl.where(ranks == rank, best.to(tl.int32), picked)
        chosen = tl.where(ranks == rank, prob, chosen)
        remaining = tl.where(e == best, float("-inf"), remaining)
    chosen = chosen / tl.maximum(tl.sum(chosen, axis=0), 6.103515625e-05)  # kernels.routing.WEIGHT_FLOOR, 2**-14
    return picked, chosen


@triton.jit
def pick(values, ranks, rank):
    """values[rank] of a [K_PAD] vector, as a scalar."""
    return tl.sum(tl.where(ranks == rank, values, 0), axis=0)


@triton.jit
def weight_pointer(entry, DTYPE: tl.constexpr, FP8: tl.constexpr):
    """A stage's weight: float8 e4m3 values (FP8) or the activations' dtype."""
    if FP8:
        return tl.load(entry + F_WEIGHT).to(tl.pointer_type(tl.float8e4nv))
    else:
        return tl.load(entry + F_WEIGHT).to(tl.pointer_type(DTYPE))


@triton.jit
def io_of(entry):
    """A stage's (output, input, the weight's outputs, its inputs): the buffers float32."""
    return (tl.load(entry + F_OUT).to(tl.pointer_type(tl.float32)), tl.load(entry + F_IN).to(tl.pointer_type(tl.float32)),
            tl.load(entry + F_NUM_OUT).to(tl.int32), tl.load(entry + F_NUM_IN).to(tl.int32))


@triton.jit
def routes_of(entry):
    """An experts stage's routing: (router partials, their splits, experts, routes a row)."""
    return (tl.load(entry + F_ROUTES).to(tl.pointer_type(tl.float32)), tl.load(entry + F_ROUTE_SPLITS).to(tl.int32),
            tl.load(entry + F_EXPERTS).to(tl.int32), tl.load(entry + F_TOP_K).to(tl.int32))


@triton.jit
def scales_of(entry):
    """A stage's FP8 block scales: (address, block-row stride, expert stride)."""
    return (tl.load(entry + F_SCALES).to(tl.pointer_type(tl.float32)),
            tl.load(entry + F_SCALE_ROW_STRIDE).to(tl.int32), tl.load(entry + F_SCALE_EXPERT_STRIDE))


@triton.jit
def dense_stage(entry, pid, num_programs, M, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                DTYPE: tl.constexpr, IEEE: tl.constexpr, MAX_IN_SPLITS: tl.constexpr, FP8: tl.constexpr,
                SBN: tl.constexpr, SBK: tl.constexpr, SUB: tl.constexpr, EXACT: tl.constexpr, ASM: tl.constexpr):
    """out [splits, M, num_out] = split-K partials of (Σ in's partials, rounded to DTYPE) @ w^T; items
    (column block, split) round-robin; each K loop is linear_kernel's (same tiles, order, product;
    FP8: the same way to read the weights, fp8_kernels.tile_dot)."""
    w_ptr = weight_pointer(entry, DTYPE, FP8)
    s_ptr, stride_sn, _ = scales_of(entry)
    out_ptr, in_ptr, num_out, num_in = io_of(entry)
    splits = tl.load(entry + F_SPLITS).to(tl.int32)
    k_per_split = tl.load(entry + F_K_PER_SPLIT).to(tl.int32)
    in_splits = tl.load(entry + F_IN_SPLITS).to(tl.int32)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    ns = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    for item in range(pid, tl.cdiv(num_out, BLOCK_N) * splits, num_programs):
        split = item % splits
        cols = (item // splits) * BLOCK_N + ns
        col_ok = cols < num_out
        k_start = split * k_per_split
        k_stop = tl.minimum(num_in, k_start + k_per_split)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_stop, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < num_in
            x_ok = row_ok[:, None] & k_ok[None, :]
            # (the other programs' partials: read through L2, never a stale L1 line)
            xs = tl.load(in_ptr + rows[:, None] * num_in + kk[None, :], mask=x_ok, other=0.0, cache_modifier=".cg")
            # (unrolled, masked past in_splits: a loop nested in the K loop would keep the
            # compiler from pipelining the weight loads)
            for j in tl.static_range(1, MAX_IN_SPLITS):
                xs += tl.load(in_ptr + j * M * num_in + rows[:, None] * num_in + kk[None, :],
                              mask=x_ok & (j < in_splits), other=0.0, cache_modifier=".cg")
            w = tl.load(w_ptr + cols[:, None] * num_in + kk[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tile_dot(xs.to(DTYPE), w, acc, s_ptr, (cols // SBN) * stride_sn, col_ok, k0, num_in, IEEE, FP8, SBK,
                           BLOCK_N, BLOCK_K, SUB, EXACT, ASM)
        tl.store(out_ptr + split * M * num_out + rows[:, None] * num_out + cols[None, :], acc,
                 mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def gate_up_stage(entry, pid, num_programs, M, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  DTYPE: tl.constexpr, IEEE: tl.constexpr, MAX_IN_SPLITS: tl.constexpr, BLOCK_E: tl.constexpr,
                  K_PAD: tl.constexpr, FP8: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr, SUB: tl.constexpr,
                  EXACT: tl.constexpr, ASM: tl.constexpr):
    """out [M·k, inter] = silu(x @ gate_e^T) · (x @ up_e^T), rounded to DTYPE, for route (row, rank)
    with expert e = the row's rank-th pick; w [E, 2·inter, H] (gate rows, then up rows); items
    (route, column block) round-robin, one route a tile (its row in the tile's first)."""
    w_ptr = weight_pointer(entry, DTYPE, FP8)
    s_ptr, stride_sn, stride_se = scales_of(entry)
    out_ptr, in_ptr, inter, hidden = io_of(entry)
    in_splits = tl.load(entry + F_IN_SPLITS).to(tl.int32)
    route_ptr, route_splits, num_experts, top_k = routes_of(entry)
    rows = tl.arange(0, BLOCK_M)
    first = rows == 0
    ns = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    ranks = tl.arange(0, K_PAD)
    num_blocks = tl.cdiv(inter, BLOCK_N)
    for item in range(pid, M * top_k * num_blocks, num_programs):
        route = item // num_blocks
        row = route // top_k
        picked, _ = row_routes(route_ptr, route_splits, M, row, num_experts, top_k, DTYPE, BLOCK_E, K_PAD)
        expert = pick(picked, ranks, route % top_k)
        cols = (item % num_blocks) * BLOCK_N + ns
        col_ok = cols < inter
        gate_rows = expert.to(tl.int64) * 2 * inter + cols
        s_base = s_ptr + expert.to(tl.int64) * stride_se
        s_gate = (cols // SBN) * stride_sn
        s_up = ((cols + inter) // SBN) * stride_sn
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < hidden
            x_ok = first[:, None] & k_ok[None, :]
            xs = tl.load(in_ptr + row * hidden + kk[None, :] + 0 * rows[:, None], mask=x_ok, other=0.0,
                         cache_modifier=".cg")
            for j in tl.static_range(1, MAX_IN_SPLITS):
                xs += tl.load(in_ptr + (j * M + row) * hidden + kk[None, :] + 0 * rows[:, None],
                              mask=x_ok & (j < in_splits), other=0.0, cache_modifier=".cg")
            x = xs.to(DTYPE)
            w_ok = col_ok[:, None] & k_ok[None, :]
            wg = tl.load(w_ptr + gate_rows[:, None] * hidden + kk[None, :], mask=w_ok, other=0.0)
            wu = tl.load(w_ptr + (gate_rows + inter)[:, None] * hidden + kk[None, :], mask=w_ok, other=0.0)
            gate = tile_dot(x, wg, gate, s_base, s_gate, col_ok, k0, hidden, IEEE, FP8, SBK, BLOCK_N, BLOCK_K,
                            SUB, EXACT, ASM)
            up = tile_dot(x, wu, up, s_base, s_up, col_ok, k0, hidden, IEEE, FP8, SBK, BLOCK_N, BLOCK_K,
                          SUB, EXACT, ASM)
        act = (gate / (1.0 + tl.exp(-gate)) * up).to(DTYPE).to(tl.float32)  # (gate_up_kernel's SiLU)
        tl.store(out_ptr + route * inter + cols[None, :] + 0 * rows[:, None], act, mask=first[:, None] & col_ok[None, :])


@triton.jit
def down_stage(entry, pid, num_programs, M, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               DTYPE: tl.constexpr, IEEE: tl.constexpr, BLOCK_E: tl.constexpr, K_PAD: tl.constexpr,
               FP8: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr, SUB: tl.constexpr, EXACT: tl.constexpr,
               ASM: tl.constexpr):
    """out [1, M, H] = Σ_rank weight · (act_route @ down_e^T) in float32, rank order (the combine),
    for each row; w [E, H, inter]; items: column blocks round-robin."""
    w_ptr = weight_pointer(entry, DTYPE, FP8)
    s_ptr, stride_sn, stride_se = scales_of(entry)
    out_ptr, act_ptr, hidden, inter = io_of(entry)  # act [M·k, inter]
    route_ptr, route_splits, num_experts, top_k = routes_of(entry)
    rows = tl.arange(0, BLOCK_M)
    first = rows == 0
    ns = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    ranks = tl.arange(0, K_PAD)
    for item in range(pid, tl.cdiv(hidden, BLOCK_N), num_programs):
        cols = item * BLOCK_N + ns
        col_ok = cols < hidden
        for row in range(M):
            picked, chosen = row_routes(route_ptr, route_splits, M, row, num_experts, top_k, DTYPE, BLOCK_E, K_PAD)
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for rank in range(top_k):
                expert = pick(picked, ranks, rank)
                w_rows = expert.to(tl.int64) * hidden + cols
                s_base = s_ptr + expert.to(tl.int64) * stride_se
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for k0 in range(0, inter, BLOCK_K):
                    kk = k0 + ks
                    k_ok = kk < inter
                    a = tl.load(act_ptr + (row * top_k + rank) * inter + kk[None, :] + 0 * rows[:, None],
                                mask=first[:, None] & k_ok[None, :], other=0.0, cache_modifier=".cg")
                    w = tl.load(w_ptr + w_rows[:, None] * inter + kk[None, :], mask=col_ok[:, None] & k_ok[None, :],
                                other=0.0)
                    acc = tile_dot(a.to(DTYPE), w, acc, s_base, (cols // SBN) * stride_sn, col_ok, k0, inter, IEEE,
                                   FP8, SBK, BLOCK_N, BLOCK_K, SUB, EXACT, ASM)
                total += pick(chosen, ranks, rank) * acc
            tl.store(out_ptr + row * hidden + cols[None, :] + 0 * rows[:, None], total,
                     mask=first[:, None] & col_ok[None, :])


@triton.jit
def prefetch_share(entry, pid, num_programs, M, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr,
                   LINE: tl.constexpr, BLOCK_E: tl.constexpr, K_PAD: tl.constexpr, HAS_FP8: tl.constexpr):
    """Prefetch into L2 every weight line of a stage that this program will multiply: a dense
    stage's always; a down stage's once its routes are known (the router's stage has passed:
    called from the gate/up stage); a gate/up stage's never (its routes are not known yet).
    (Block scales are not prefetched: a tile's are a few bytes.)"""
    if HAS_FP8:
        if tl.load(entry + F_SCALES) != 0:  # a line holds twice the elements of one byte
            prefetch_typed(entry, pid, num_programs, M, BLOCK_N, BLOCK_K, DTYPE, 2 * LINE, BLOCK_E, K_PAD, True)
        else:
            prefetch_typed(entry, pid, num_programs, M, BLOCK_N, BLOCK_K, DTYPE, LINE, BLOCK_E, K_PAD, False)
    else:
        prefetch_typed(entry, pid, num_programs, M, BLOCK_N, BLOCK_K, DTYPE, LINE, BLOCK_E, K_PAD, False)


@triton.jit
def prefetch_typed(entry, pid, num_programs, M, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr,
                   LINE: tl.constexpr, BLOCK_E: tl.constexpr, K_PAD: tl.constexpr, FP8: tl.constexpr):
    kind = tl.load(entry + F_KIND).to(tl.int32)
    w_ptr = weight_pointer(entry, DTYPE, FP8)
    num_out = tl.load(entry + F_NUM_OUT).to(tl.int32)
    num_in = tl.load(entry + F_NUM_IN).to(tl.int32)
    ns = tl.arange(0, BLOCK_N)
    if kind == DENSE:
        splits = tl.load(entry + F_SPLITS).to(tl.int32)
        k_per_split = tl.load(entry + F_K_PER_SPLIT).to(tl.int32)
        for item in range(pid, tl.cdiv(num_out, BLOCK_N) * splits, num_programs):
            k_start = (item % splits) * k_per_split
            prefetch_rows(w_ptr, (item // splits) * BLOCK_N + ns, num_out, num_in, k_start,
                          tl.minimum(num_in, k_start + k_per_split), BLOCK_K, LINE)
    elif kind == DOWN:
        route_ptr, route_splits, num_experts, top_k = routes_of(entry)
        ranks = tl.arange(0, K_PAD)
        for item in range(pid, tl.cdiv(num_out, BLOCK_N), num_programs):
            for row in range(M):
                picked, _ = row_routes(route_ptr, route_splits, M, row, num_experts, top_k, DTYPE, BLOCK_E, K_PAD)
                for rank in range(top_k):
                    expert = pick(picked, ranks, rank)
                    prefetch_rows(w_ptr + expert.to(tl.int64) * num_out * num_in, item * BLOCK_N + ns, num_out,
                                  num_in, 0, num_in, BLOCK_K, LINE)


@triton.jit
def run_stage(entry, pid, num_programs, M, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              DTYPE: tl.constexpr, IEEE: tl.constexpr, MAX_IN_SPLITS: tl.constexpr, BLOCK_E: tl.constexpr,
              K_PAD: tl.constexpr, FP8: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr, SUB: tl.constexpr,
              DENSE_EXACT: tl.constexpr, EXPERT_EXACT: tl.constexpr, ASM: tl.constexpr, EXPERTS: tl.constexpr):
    """This program's share of one stage, by its kind (EXPERTS: the experts' stages compiled in)."""
    kind = tl.load(entry + F_KIND).to(tl.int32)
    if kind == DENSE or not EXPERTS:
        dense_stage(entry, pid, num_programs, M, BLOCK_M, BLOCK_N, BLOCK_K, DTYPE, IEEE, MAX_IN_SPLITS, FP8, SBN, SBK,
                    SUB, DENSE_EXACT, ASM and DENSE_EXACT)
    elif kind == GATE_UP:
        gate_up_stage(entry, pid, num_programs, M, BLOCK_M, BLOCK_N, BLOCK_K, DTYPE, IEEE, MAX_IN_SPLITS, BLOCK_E,
                      K_PAD, FP8, SBN, SBK, SUB, EXPERT_EXACT, ASM and EXPERT_EXACT)
    else:
        down_stage(entry, pid, num_programs, M, BLOCK_M, BLOCK_N, BLOCK_K, DTYPE, IEEE, BLOCK_E, K_PAD, FP8, SBN, SBK,
                   SUB, EXPERT_EXACT, ASM and EXPERT_EXACT)


@triton.jit
def chain_kernel(
    table_ptr, counter_ptr, chain_length, M,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr,
    IEEE: tl.constexpr, PREFETCH: tl.constexpr, LINE: tl.constexpr, MAX_IN_SPLITS: tl.constexpr,
    BLOCK_E: tl.constexpr, K_PAD: tl.constexpr, HAS_FP8: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr,
    SUB: tl.constexpr, DENSE_EXACT: tl.constexpr, EXPERT_EXACT: tl.constexpr, ASM: tl.constexpr,
):
    """Every stage of a chain in one launch: the programs stay resident, take each stage's items
    round-robin and meet at a grid barrier between stages. PREFETCH: 0 none; 1 the next stage's
    share of weights prefetched into L2 before the barrier; 2 at the stage's start, so HBM streams
    the next stage's weights while this one runs (prefetch_share: where they are known).
    HAS_FP8: some stages' weights are FP8 (a stage's scales field says which), read the way
    kernels.fused.linear reads them (DENSE_EXACT, EXPERT_EXACT, ASM)."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    for stage in range(chain_length):
        entry = table_ptr + stage * FIELDS
        if PREFETCH == 2:
            if stage + 1 < chain_length:
                prefetch_share(entry + FIELDS, pid, num_programs, M, BLOCK_N, BLOCK_K, DTYPE, LINE, BLOCK_E, K_PAD,
                               HAS_FP8)
        if HAS_FP8:  # (a chain with FP8 weights has FP8 experts: full precision is only dense there, the routers)
            if tl.load(entry + F_SCALES) != 0:
                run_stage(entry, pid, num_programs, M, BLOCK_M, BLOCK_N, BLOCK_K, DTYPE, IEEE, MAX_IN_SPLITS, BLOCK_E,
                          K_PAD, True, SBN, SBK, SUB, DENSE_EXACT, EXPERT_EXACT, ASM, True)
            else:
                run_stage(entry, pid, num_programs, M, BLOCK_M, BLOCK_N, BLOCK_K, DTYPE, IEEE, MAX_IN_SPLITS, BLOCK_E,
                          K_PAD, False, 1, 1, 1, False, False, False, False)
        else:
            run_stage(entry, pid, num_programs, M, BLOCK_M, BLOCK_N, BLOCK_K, DTYPE, IEEE, MAX_IN_SPLITS, BLOCK_E,
                      K_PAD, False, 1, 1, 1, False, False, False, True)
        if PREFETCH == 1:
            if stage + 1 < chain_length:
                prefetch_share(entry + FIELDS, pid, num_programs, M, BLOCK_N, BLOCK_K, DTYPE, LINE, BLOCK_E, K_PAD,
                               HAS_FP8)
        grid_barrier(counter_ptr, (stage + 1) * num_programs)

"""Triton kernels of kernels.fused.moe (imported only when a kernel runs)."""

import triton
import triton.language as tl

from kernels.fused.fp8_kernels import tile_dot


@triton.jit
def _group(ids_ptr, r, R, R_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """(expert, opens, member routes [BLOCK_M], member ok [BLOCK_M]) of route r's group."""
    all_r = tl.arange(0, R_PAD)
    ids = tl.load(ids_ptr + all_r, mask=all_r < R, other=-1)
    expert = tl.load(ids_ptr + r)
    same = (ids == expert) & (all_r < R)
    ordinal = tl.sum(tl.where(same & (all_r < r), 1, 0), axis=0)
    opens = (expert >= 0) & (ordinal % BLOCK_M == 0)
    rank_in_expert = tl.cumsum(same.to(tl.int32), axis=0) - 1
    j = tl.arange(0, BLOCK_M)
    match = same[None, :] & (rank_in_expert[None, :] == ordinal + j[:, None])  # [BLOCK_M, R_PAD]
    members = tl.sum(tl.where(match, all_r[None, :], 0), axis=1)
    member_ok = tl.sum(match.to(tl.int32), axis=1) > 0
    return expert, opens, members, member_ok

@triton.jit
def _tile(ids_ptr, sorted_ptr, tile_len_ptr, g, R, R_PAD: tl.constexpr, BLOCK_M: tl.constexpr, TABLE: tl.constexpr):
    """(expert, opens, member routes [BLOCK_M], member ok [BLOCK_M]) of program g's group:
    from route_table_kernel's table (TABLE), else by comparing route g with every route."""
    if TABLE:
        length = tl.load(tile_len_ptr + g)
        j = tl.arange(0, BLOCK_M)
        member_ok = j < length
        members = tl.load(sorted_ptr + g + j, mask=member_ok, other=0)
        expert = tl.load(ids_ptr + tl.load(sorted_ptr + g))
        return expert, length > 0, members, member_ok
    else:
        return _group(ids_ptr, g, R, R_PAD, BLOCK_M)


@triton.jit
def route_table_kernel(ids_ptr, sorted_ptr, tile_len_ptr, R, R_PAD: tl.constexpr, CHUNK: tl.constexpr,
                       BLOCK_M: tl.constexpr, PDL: tl.constexpr):
    """The routes sorted by expert (stable; routes of no expert first) into sorted_ptr, and at
    the sorted position of every group's first route (every BLOCK_M-th route of an expert) its
    group's length, 0 elsewhere: the groups _group forms, found once per launch instead of by
    every program of the expert kernels. CHUNK routes a program."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    r = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    r_ok = r < R
    e = tl.load(ids_ptr + r, mask=r_ok, other=-1)
    all_r = tl.arange(0, R_PAD)
    all_e = tl.load(ids_ptr + all_r, mask=all_r < R, other=1 << 30)
    same = all_e[None, :] == e[:, None]  # [CHUNK, R_PAD]
    ordinal = tl.sum((same & (all_r[None, :] < r[:, None])).to(tl.int32), axis=1)
    count = tl.sum(same.to(tl.int32), axis=1)
    position = tl.sum((all_e[None, :] < e[:, None]).to(tl.int32), axis=1) + ordinal
    tl.store(sorted_ptr + position, r, mask=r_ok)
    length = tl.where((e >= 0) & (ordinal % BLOCK_M == 0), tl.minimum(count - ordinal, BLOCK_M), 0)
    tl.store(tile_len_ptr + position, length, mask=r_ok)


@triton.jit
def gate_up_kernel(
    x_ptr, ids_ptr, sorted_ptr, tile_len_ptr, w_ptr, act_ptr, R, I, H, s_ptr, stride_se, stride_sn,
    TOP_K: tl.constexpr, R_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr, TABLE: tl.constexpr,
    FP8: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr, SUB: tl.constexpr, EXACT: tl.constexpr,
    ASM: tl.constexpr,
):
    """FP8: float8 weights with one float32 scale per block of SBN rows × SBK columns at s_ptr
    (experts stride_se apart, block rows stride_sn), dequantised tile by tile (fp8_kernels.tile_dot)."""
    if PDL:  # wait for the predecessor kernel before touching anything it may write or read
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    r = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert, opens, members, member_ok = _tile(ids_ptr, sorted_ptr, tile_len_ptr, r, R, R_PAD, BLOCK_M, TABLE)
    if opens:
        tokens = members // TOP_K
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < I
        ks = tl.arange(0, BLOCK_K)
        w_base = w_ptr + expert.to(tl.int64) * (2 * I * H)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        s_base = s_ptr + expert.to(tl.int64) * stride_se
        s_gate = (n // SBN) * stride_sn
        s_up = ((n + I) // SBN) * stride_sn
        for k0 in range(0, H, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < H
            x = tl.load(x_ptr + tokens[:, None] * H + kk[None, :], mask=member_ok[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(w_base + n[:, None] * H + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            wu = tl.load(w_base + (n[:, None] + I) * H + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc_g = tile_dot(x, wg, acc_g, s_base, s_gate, n_ok, k0, H, IEEE, FP8, SBK, BLOCK_N, BLOCK_K, SUB, EXACT, ASM)
            acc_u = tile_dot(x, wu, acc_u, s_base, s_up, n_ok, k0, H, IEEE, FP8, SBK, BLOCK_N, BLOCK_K, SUB, EXACT, ASM)
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(act_ptr + members[:, None] * I + n[None, :], act.to(act_ptr.dtype.element_ty),
                 mask=member_ok[:, None] & n_ok[None, :])

@triton.jit
def down_kernel(
    act_ptr, ids_ptr, sorted_ptr, tile_len_ptr, w_ptr, out_ptr, R, I, H, s_ptr, stride_se, stride_sn,
    R_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr, PDL: tl.constexpr, TABLE: tl.constexpr, PRELOAD: tl.constexpr,
    FP8: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr, SUB: tl.constexpr, EXACT: tl.constexpr,
    ASM: tl.constexpr,
):
    """FP8: as gate_up_kernel's."""
    r = tl.program_id(0)
    pid_n = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < H
    ks = tl.arange(0, BLOCK_K)
    if PRELOAD:  # the routes (from kernels before gate_up) and the first weight tile, before the wait
        expert, opens, members, member_ok = _tile(ids_ptr, sorted_ptr, tile_len_ptr, r, R, R_PAD, BLOCK_M, TABLE)
        w_first = tl.load(w_ptr + tl.maximum(expert, 0).to(tl.int64) * (H * I) + n[:, None] * I + ks[None, :],
                          mask=opens & n_ok[:, None] & (ks < I)[None, :], other=0.0)
    if PDL:  # wait for the predecessor kernel before touching anything it may write or read
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if not PRELOAD:
        expert, opens, members, member_ok = _tile(ids_ptr, sorted_ptr, tile_len_ptr, r, R, R_PAD, BLOCK_M, TABLE)
    if opens:
        w_base = w_ptr + expert.to(tl.int64) * (H * I)
        s_base = s_ptr + expert.to(tl.int64) * stride_se
        s_rows = (n // SBN) * stride_sn
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        k_first = 0
        if PRELOAD:  # the loop's first step on the early tile (same order of sums)
            a = tl.load(act_ptr + members[:, None] * I + ks[None, :], mask=member_ok[:, None] & (ks < I)[None, :],
                        other=0.0)
            acc = tile_dot(a, w_first, acc, s_base, s_rows, n_ok, 0, I, IEEE, FP8, SBK, BLOCK_N, BLOCK_K, SUB, EXACT, ASM)
            k_first = BLOCK_K
        for k0 in range(k_first, I, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < I
            a = tl.load(act_ptr + members[:, None] * I + kk[None, :], mask=member_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_base + n[:, None] * I + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tile_dot(a, w, acc, s_base, s_rows, n_ok, k0, I, IEEE, FP8, SBK, BLOCK_N, BLOCK_K, SUB, EXACT, ASM)
        tl.store(out_ptr + members[:, None] * H + n[None, :], acc, mask=member_ok[:, None] & n_ok[None, :])

@triton.jit
def combine_kernel(
    route_ptr, weights_ptr, res_ptr, norm_ptr, normed_ptr, res_out_ptr, rows_ptr, H, eps,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK: tl.constexpr, HAS_ROWS: tl.constexpr, PDL: tl.constexpr,
    EARLY: tl.constexpr, CENTRED: tl.constexpr,
):
    if PDL and not EARLY:  # wait for the predecessor kernel before touching anything it may write or read
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    # (EARLY: the route weights, the residual and the norm weight come from kernels further back:
    # read before the wait; only the route outputs come from the kernel before.)
    ranks = tl.arange(0, K_PAD)
    route_w = tl.load(weights_ptr + t * TOP_K + ranks, mask=ranks < TOP_K, other=0.0)  # [K_PAD]
    if HAS_ROWS:  # route outputs in another order (grouped by expert): rows_ptr says where
        route_rows = tl.load(rows_ptr + t * TOP_K + ranks, mask=ranks < TOP_K, other=0).to(tl.int64)
    else:
        route_rows = (t * TOP_K + ranks).to(tl.int64)
    res = tl.load(res_ptr + t * H + cols, mask=ok, other=0.0)
    g = tl.load(norm_ptr + cols, mask=ok, other=0.0)
    if PDL and EARLY:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    mixed = tl.zeros((BLOCK,), tl.float32)
    for rank in tl.static_range(TOP_K):
        w = tl.sum(tl.where(ranks == rank, route_w, 0.0), axis=0)
        row = tl.sum(tl.where(ranks == rank, route_rows, 0), axis=0)
        mixed += w * tl.load(route_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32)
    dtype = res.dtype
    h = (mixed.to(dtype).to(tl.float32) + res.to(tl.float32)).to(dtype)
    tl.store(res_out_ptr + t * H + cols, h, mask=ok)
    y = h.to(tl.float32)
    var = tl.sum(y * y, axis=0) / H
    if CENTRED:  # (1 + g) times the float32 normalised row, one rounding
        normed = (y * tl.rsqrt(var + eps) * (1.0 + g.to(tl.float32))).to(dtype)
    else:
        y = (y * tl.rsqrt(var + eps)).to(dtype)
        normed = (g.to(tl.float32) * y.to(tl.float32)).to(dtype)
    tl.store(normed_ptr + t * H + cols, normed, mask=ok)


@triton.jit
def silu_mul_kernel(gate_up_ptr, out_ptr, I, BLOCK: tl.constexpr):
    """out[r] = silu(gate) * up of one row [gate | up] of 2*I columns (float32 math, one rounding)."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < I
    gate = tl.load(gate_up_ptr + r * 2 * I + c, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + r * 2 * I + I + c, mask=ok, other=0.0).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + r * I + c, act.to(out_ptr.dtype.element_ty), mask=ok)

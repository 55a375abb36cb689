"""Triton kernels of kernels.fused.grouped (imported only when a kernel runs).

A program multiplies one tile of up to BLOCK_M routes of one expert (a row of the tile table
kernels.fused.grouped.tile_table builds) by BLOCK_N output columns of that expert's weights,
read as stored (FP8 tiles through fp8_kernels.tile_dot); a program whose tile is empty (the
table's tail) exits at once.
"""

import triton
import triton.language as tl

from kernels.fused.fp8_kernels import tile_dot


@triton.jit
def tile_table_kernel(counts_ptr, expert_ptr, start_ptr, length_ptr, E, G, E_PAD: tl.constexpr,
                      BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr):
    """kernels.fused.grouped.tile_table's entries g of this program's BLOCK_G (one launch where the
    torch ops take a dozen): every program sums the experts' counts [E] itself; a tile's expert is
    the number of experts whose tiles end at or before it, its expert's sums picked by a mask."""
    e = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + e, mask=e < E, other=0).to(tl.int32)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, axis=0)
    route_end = tl.cumsum(counts, axis=0)
    g = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
    expert = tl.sum(((tile_end[None, :] <= g[:, None]) & (e < E)[None, :]).to(tl.int32), axis=1)  # [BLOCK_G]: E past the last
    valid = expert < E
    mine = e[None, :] == tl.minimum(expert, E - 1)[:, None]  # [BLOCK_G, E_PAD]
    first_tile = tl.sum(tl.where(mine, tile_end - tiles, 0), axis=1)
    first_route = tl.sum(tl.where(mine, route_end - counts, 0), axis=1)
    count = tl.sum(tl.where(mine, counts, 0), axis=1)
    within = (g - first_tile) * BLOCK_M
    length = tl.where(valid, tl.minimum(tl.maximum(count - within, 0), BLOCK_M), 0)
    ok = g < G
    tl.store(expert_ptr + g, tl.minimum(expert, E - 1), mask=ok)
    tl.store(start_ptr + g, first_route + within, mask=ok)
    tl.store(length_ptr + g, length, mask=ok)


@triton.jit
def _tile(tile_expert_ptr, tile_start_ptr, g, length, BLOCK_M: tl.constexpr):
    """(expert, sorted route positions [BLOCK_M] int64, which of them are the tile's) of tile g."""
    j = tl.arange(0, BLOCK_M)
    return tl.load(tile_expert_ptr + g), (tl.load(tile_start_ptr + g) + j).to(tl.int64), j < length


@triton.jit
def grouped_gate_up_kernel(
    x_ptr, order_ptr, tile_expert_ptr, tile_start_ptr, tile_len_ptr, w_ptr, act_ptr, I, H,
    s_ptr, stride_se, stride_sn,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr, FP8: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr, SUB: tl.constexpr,
    EXACT: tl.constexpr, ASM: tl.constexpr,
):
    """act[m] = silu(x_t @ gate^T) * (x_t @ up^T) for the sorted routes m of a tile, t = order[m] //
    TOP_K (x [T, H] read in place: no gathered copy of the rows); gate_up [E, 2I, H] (gate rows,
    then up rows); act [R, I] in the sorted order."""
    g = tl.program_id(0)
    length = tl.load(tile_len_ptr + g)
    if length > 0:
        expert, m, m_ok = _tile(tile_expert_ptr, tile_start_ptr, g, length, BLOCK_M)
        tokens = tl.load(order_ptr + m, mask=m_ok, other=0) // TOP_K
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < I
        ks = tl.arange(0, BLOCK_K)
        w_base = w_ptr + expert.to(tl.int64) * (2 * I * H)
        s_base = s_ptr + expert.to(tl.int64) * stride_se
        s_gate = (n // SBN) * stride_sn
        s_up = ((n + I) // SBN) * stride_sn
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < H
            x = tl.load(x_ptr + tokens.to(tl.int64)[:, None] * H + kk[None, :], mask=m_ok[:, None] & k_ok[None, :],
                        other=0.0)
            wg = tl.load(w_base + n[:, None] * H + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            wu = tl.load(w_base + (n[:, None] + I) * H + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc_g = tile_dot(x, wg, acc_g, s_base, s_gate, n_ok, k0, H, IEEE, FP8, SBK, BLOCK_N, BLOCK_K, SUB, EXACT, ASM)
            acc_u = tile_dot(x, wu, acc_u, s_base, s_up, n_ok, k0, H, IEEE, FP8, SBK, BLOCK_N, BLOCK_K, SUB, EXACT, ASM)
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(act_ptr + m[:, None] * I + n[None, :], act.to(act_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def grouped_down_kernel(
    act_ptr, tile_expert_ptr, tile_start_ptr, tile_len_ptr, w_ptr, out_ptr, I, H, s_ptr, stride_se, stride_sn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr,
    SBN: tl.constexpr, SBK: tl.constexpr, SUB: tl.constexpr, EXACT: tl.constexpr, ASM: tl.constexpr,
):
    """out[m] = act[m] @ down^T for the sorted routes m of a tile; down [E, H, I]; out [R, H]."""
    g = tl.program_id(0)
    length = tl.load(tile_len_ptr + g)
    if length > 0:
        expert, m, m_ok = _tile(tile_expert_ptr, tile_start_ptr, g, length, BLOCK_M)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < H
        ks = tl.arange(0, BLOCK_K)
        w_base = w_ptr + expert.to(tl.int64) * (H * I)
        s_base = s_ptr + expert.to(tl.int64) * stride_se
        s_rows = (n // SBN) * stride_sn
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, I, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < I
            a = tl.load(act_ptr + m[:, None] * I + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_base + n[:, None] * I + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tile_dot(a, w, acc, s_base, s_rows, n_ok, k0, I, IEEE, FP8, SBK, BLOCK_N, BLOCK_K, SUB, EXACT, ASM)
        tl.store(out_ptr + m[:, None] * H + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

"""y = x @ W^T for a few rows (decode and verify windows) with a row-independent reduction.

cuBLAS picks its kernel (and split-K) by the number of rows, so a row's bf16 result can
change with the window it sits in. This kernel fixes the tiling by (N, K) alone: each
program owns BLOCK_N output columns for BLOCK_M rows and walks K in one fixed order, so a
row computes bit-identically alone or among others, and every weight byte is read once per
BLOCK_M rows. Larger inputs (prefill) go to cuBLAS.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.fused import cdiv, launch_options, next_power_of_2, use_triton

MAX_FUSED_ROWS = 64  # above this (prefill chunks) cuBLAS is faster than re-reading weights per BLOCK_M rows
BLOCK_M = 16  # tl.dot's smallest M; rows past the input are masked
# The CPU's row-invariant products (rowwise_linear): weights with this many outputs or more run
# in tiles of TILE_ROWS rows (the matmul reads a wide weight once per tile, not once per row).
WIDE_OUTPUTS = 2048
TILE_ROWS = 2
# Prefill's projections (prefill_linear): one tile for every row count, so a prompt's rows are
# the same bits whatever other prompts share its forward (cuBLAS picks its kernel by the row
# count). (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages.)
PREFILL_TILE = (64, 128, 64, 4, 4)
INVARIANT_PREFILL = True  # False: cuBLAS (bench/hybrid_fast.py --sections prefill_sharing measures both)


SMEM_BUDGET = 160 * 1024  # bytes of shared memory the pipelined tiles of a program may take


def pipeline_stages(wanted: int, tile_bytes: int) -> int:
    """At most `wanted` stages whose buffered tiles (stages - 1 of tile_bytes) fit SMEM_BUDGET
    (fp32 tiles are twice bf16's: the H200 refuses 240 KiB)."""
    return max(2, min(wanted, 1 + SMEM_BUDGET // tile_bytes))


# Settings measured for one weight shape (num_out, num_in) on the H200 that beat the rule in
# linear_config (bench/config_sweep.py, the whole captured step; docs/PERFORMANCE.md).
MEASURED: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (12352, 2048): (128, 256, 4, 3),  # Qwen3.5-35B-A3B: a linear layer's in-projection (q|k|v|z|b|a)
    (9216, 2048): (128, 128, 8, 4),  # Qwen3.5-35B-A3B: a gated attention layer's q (with gates) | k | v
}


def linear_config(num_out: int, num_in: int, element_size: int = 2) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for a weight [num_out, num_in] of element_size bytes.

    A function of the weight (shape and dtype) only, never of the row count: that is what keeps
    rows batch-invariant. Small N gets narrow column blocks so enough programs fill the GPU.
    """
    measured = MEASURED.get((num_out, num_in)) if element_size == 2 else None
    if measured is not None:
        return measured
    # Measured on the H200 (docs/PERFORMANCE.md; bench/config_sweep.py times the whole captured
    # step): BK 256, BN 64 and 4 stages from 2,048 outputs (qkv, o_proj; o_proj then takes 4 K
    # splits), 3 stages for the lm_head as measured; BK 128 for narrow outputs (the router: 16 K
    # splits instead of 8, so twice the programs).
    block_k = min(128 if num_out <= 256 else 256, max(16, next_power_of_2(num_in)))
    block_n = 64 if num_out >= 2048 else 32
    stages = pipeline_stages(4 if 2048 <= num_out < 65536 else 3, (BLOCK_M + block_n) * block_k * element_size)
    return block_n, block_k, 4, stages


@functools.cache
def _kernels():
    """Triton is imported on first use, so CPU-only installs never need it."""
    import triton
    import triton.language as tl

    @triton.jit
    def linear_kernel(
        x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, k_per_split, stride_ys,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
        SPLITS: tl.constexpr, PDL: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        split = tl.program_id(2)  # split-K: this program sums K range [split, split + 1) * k_per_split
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        row_ok = rows < M
        col_ok = cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_start = 0
        k_stop = K
        if SPLITS > 1:  # (a compile-time branch: the unsplit loop keeps its simple bounds)
            y_ptr += split * stride_ys
            k_start = split * k_per_split
            k_stop = tl.minimum(K, k_start + k_per_split)
        if PDL:  # everything below reads what earlier kernels wrote
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        for k0 in range(k_start, k_stop, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < K
            x = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + cols[:, None] * stride_wn + kk[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc)
        out = acc.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], out, mask=row_ok[:, None] & col_ok[None, :])

    return linear_kernel


def linear(
    x: Tensor,  # [M, K]
    weight: Tensor,  # [N, K] (nn.Linear layout)
    *,
    out_dtype: torch.dtype | None = None,
    pdl: bool = False,
) -> Tensor:
    """x @ weight^T → [M, N] in out_dtype (default x's dtype); float32 accumulation.

    pdl: launch as a programmatic dependent of the previous kernel (kernels.fused.pdl_supported).
    Measured on the H200 (bench/pdl_chain.py): it helps a GEMV behind a small kernel but slows
    one behind another bandwidth-bound GEMV (the early programs take SM slots), so callers
    leave it off there."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")
    num_rows, num_in = x.shape
    num_out = weight.shape[0]
    out_dtype = out_dtype or x.dtype
    if num_rows > MAX_FUSED_ROWS:
        return F.linear(x, weight).to(out_dtype)
    if not use_triton(x):
        return rowwise_linear(x, weight).to(out_dtype)
    x = x.contiguous()
    if weight.stride(1) != 1:
        raise ValueError("linear: weight rows must be contiguous")
    out = torch.empty((num_rows, num_out), dtype=out_dtype, device=x.device)
    _launch(x, weight, out, 1, pdl)
    return out


def rowwise_linear(x: Tensor, weight: Tensor) -> Tensor:
    """x [M, K] @ weight[N, K]^T → [M, N] by torch ops, each row's bits independent of M and of
    the other rows: every row runs the same fixed-shape product whatever M is, where F.linear
    picks its kernel by M. The CPU's reference of `linear`, so windows and batches run as one
    forward there with their rows' one-row bits. How, by the weight's shape only (so a weight's
    rows always take the same way):
    - narrow weights: one [1, K] × [K, N] product per row, in one batched matmul;
    - wide ones (the lm_head): [TILE_ROWS, K] tiles, zero-padded, one matmul each — a product
      of fixed shape reads the weight once per tile instead of once per row, and its rows'
      bits depend neither on their place in the tile nor on the tile's other row."""
    num_rows, num_in = x.shape
    num_out = weight.shape[0]
    if num_out < WIDE_OUTPUTS or num_rows == 0:
        return torch.bmm(x.unsqueeze(1), weight.t().unsqueeze(0).expand(num_rows, num_in, num_out)).squeeze(1)
    pad = -num_rows % TILE_ROWS
    if pad:
        x = torch.cat([x, x.new_zeros(pad, num_in)])
    tiles = [F.linear(x[row : row + TILE_ROWS], weight) for row in range(0, num_rows + pad, TILE_ROWS)]
    return torch.cat(tiles)[:num_rows]


def prefill_linear(x: Tensor, weight: Tensor) -> Tensor:
    """x @ weight^T [M, N] in x's dtype for prompt rows, each row's bits independent of the other
    rows (PREFILL_TILE for every M); cuBLAS where Triton does not run, or with INVARIANT_PREFILL off."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"prefill_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")
    if not (INVARIANT_PREFILL and use_triton(x)):
        return F.linear(x, weight)
    if weight.stride(1) != 1:
        raise ValueError("prefill_linear: weight rows must be contiguous")
    x = x.contiguous()
    num_rows, num_in = x.shape
    num_out = weight.shape[0]
    out = torch.empty((num_rows, num_out), dtype=x.dtype, device=x.device)
    if num_rows:
        _launch(x, weight, out, 1, False, tile=PREFILL_TILE)
    return out


def split_k(num_out: int, num_in: int) -> int:
    """K splits for linear_partials: enough programs for a narrow weight (a function of its shape)."""
    block_n, block_k, _, _ = linear_config(num_out, num_in)
    splits = 1
    while cdiv(num_out, block_n) * splits * 2 <= 160 and num_in // (splits * 2) >= block_k:
        splits *= 2
    return splits


def linear_partials(
    x: Tensor,  # [M, K]
    weight: Tensor,  # [N, K]
    splits: int,
    *,
    pdl: bool = False,
) -> Tensor:
    """Split-K partial products [M, splits, N] float32: partial s sums K range s·K/splits ...
    (consumers add them in split order, so rows stay invariant). Narrow weights (the router,
    o_proj) get enough programs to fill the GPU this way."""
    num_rows, num_in = x.shape
    if not use_triton(x) or num_rows > MAX_FUSED_ROWS:
        step = _k_per_split(weight.shape[0], num_in, splits)
        product = F.linear if num_rows > MAX_FUSED_ROWS else rowwise_linear
        return torch.stack([product(x[:, s * step : (s + 1) * step].float(), weight[:, s * step : (s + 1) * step].float())
                            for s in range(splits)], dim=1)
    out = torch.empty((num_rows, splits, weight.shape[0]), dtype=torch.float32, device=x.device)
    _launch(x.contiguous(), weight, out, splits, pdl)
    return out


def _launch(x: Tensor, weight: Tensor, out: Tensor, splits: int, pdl: bool,
            tile: tuple[int, int, int, int, int] | None = None) -> None:
    """tile: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for every row count (prefill, no
    K splits); None: BLOCK_M rows and the weight's linear_config."""
    num_rows, num_in = x.shape
    num_out = weight.shape[0]
    if tile is None:
        block_m, (block_n, block_k, warps, stages) = BLOCK_M, linear_config(num_out, num_in, x.element_size())
    else:
        block_m, block_n, block_k, warps, stages = tile
    k_per_split = _k_per_split(num_out, num_in, splits)
    grid = (cdiv(num_out, block_n), cdiv(num_rows, block_m), splits)
    stride_ym = out.stride(0)
    stride_ys = out.stride(1) if splits > 1 else 0
    _kernels()[grid](
        x, weight, out, num_rows, num_out, num_in, x.stride(0), weight.stride(0), stride_ym, k_per_split, stride_ys,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=x.dtype == torch.float32, SPLITS=splits,
        PDL=pdl,
        num_warps=warps, num_stages=stages, **launch_options(pdl),
    )


def _k_per_split(num_out: int, num_in: int, splits: int) -> int:
    block_k = linear_config(num_out, num_in)[1]
    return cdiv(cdiv(num_in, splits), block_k) * block_k

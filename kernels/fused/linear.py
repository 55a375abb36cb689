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

from kernels.fused import cdiv, cpu_rows, launch_options, next_power_of_2, use_triton
from kernels.fused.fp8 import Fp8Weight, dequantize_fast

Weight = Tensor | Fp8Weight  # [N, K]: full precision, or block-scaled FP8 (kernels.fused.fp8)

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


# FP8 weights' tiles, as measured on the H200 with weights read from HBM (bench/fp8_kernels.py,
# docs/PERFORMANCE.md): the projections dequantise each tile in registers (fp8_kernels.dequant_tile),
# FP8_WIDEN times bf16's K tile in column blocks of FP8_BLOCK_N; the experts multiply each tile's
# e4m3 values and scale its partial product (EXPERT_FP8_EXACT: fp8_kernels.scaled_dot, a tile inside
# one block column), EXPERT_FP8_WIDEN times bf16's K tile. FP8_ASM: the e4m3 values made bf16 by
# bit moves (CUDA, bf16 activations) rather than Triton's conversion. A few-row product is bound by
# its latency more than by its bytes, so the ways measured differ by op.
FP8_WIDEN = 2
FP8_BLOCK_N = 32
EXPERT_FP8_WIDEN = 1
LINEAR_FP8_EXACT = False
EXPERT_FP8_EXACT = True
FP8_ASM = True
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
    from kernels.fused.linear_kernels import linear_kernel

    return linear_kernel


def weight_config(weight: Weight, x_dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of a weight: linear_config by its shape and
    element size; FP8 weights take FP8_BLOCK_N columns and FP8_WIDEN times bf16's K tile (the
    same bytes a load), made to fit the block's columns (Fp8Weight.tile_k; inside one with
    LINEAR_FP8_EXACT)."""
    num_out, num_in = weight.shape
    if not isinstance(weight, Fp8Weight):
        return linear_config(num_out, num_in, torch.finfo(x_dtype).bits // 8)
    block_n, block_k, warps, stages = linear_config(num_out, num_in, 2)
    block_n = min(FP8_BLOCK_N, max(16, next_power_of_2(num_out)))
    wanted = min(FP8_WIDEN * block_k, max(16, next_power_of_2(num_in)))
    block_k = weight.tile_k(min(wanted, weight.block[1]) if LINEAR_FP8_EXACT else wanted)
    x_bytes = torch.finfo(x_dtype).bits // 8
    return block_n, block_k, warps, pipeline_stages(stages, (BLOCK_M * x_bytes + block_n) * block_k)


def dense(weight: Weight, dtype: torch.dtype) -> Tensor:
    """The weight in full precision (an FP8 weight dequantised: the references' and prefill's view;
    by one kernel where Triton runs, the same values)."""
    if not isinstance(weight, Fp8Weight):
        return weight
    if use_triton(weight.q) and dtype in (torch.bfloat16, torch.float32):  # (the kernel's tested dtypes)
        return dequantize_fast(weight, dtype)
    return weight.dequantize(dtype)


def _check(name: str, x: Tensor, weight: Weight) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"{name}: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")
    if isinstance(weight, Fp8Weight) and use_triton(x) and not weight.kernel_ready():
        raise ValueError(f"{name}: an FP8 weight in blocks of {list(weight.block)} is not one the kernels read "
                         f"(columns a multiple of 16, rows contiguous)")


def linear(
    x: Tensor,  # [M, K]
    weight: Weight,  # [N, K] (nn.Linear layout), or block-scaled FP8
    *,
    out_dtype: torch.dtype | None = None,
    pdl: bool = False,
) -> Tensor:
    """x @ weight^T → [M, N] in out_dtype (default x's dtype); float32 accumulation.

    pdl: launch as a programmatic dependent of the previous kernel (kernels.fused.pdl_supported).
    Measured on the H200 (bench/pdl_chain.py): it helps a GEMV behind a small kernel but slows
    one behind another bandwidth-bound GEMV (the early programs take SM slots), so callers
    leave it off there."""
    _check("linear", x, weight)
    num_rows, num_in = x.shape
    num_out = weight.shape[0]
    out_dtype = out_dtype or x.dtype
    if num_rows > MAX_FUSED_ROWS:
        return F.linear(x, dense(weight, x.dtype)).to(out_dtype)
    if not use_triton(x):
        return rowwise_linear(x, dense(weight, x.dtype)).to(out_dtype)
    x = x.contiguous()
    if _rows_of(weight).stride(1) != 1:
        raise ValueError("linear: weight rows must be contiguous")
    out = torch.empty((num_rows, num_out), dtype=out_dtype, device=x.device)
    _launch(x, weight, out, 1, pdl)
    return out


def rowwise_linear(x: Tensor, weight: Tensor) -> Tensor:
    """x [M, K] @ weight[N, K]^T → [M, N], each row's bits independent of M and of the other
    rows: the CPU's `linear`, so windows and batches run as one forward there with their rows'
    one-row bits. The native kernel (kernels.fused.cpu_rows: every output by one loop, the
    weight read once for all rows) where it applies, else torch_rowwise_linear."""
    out = cpu_rows.linear(x, weight)
    return torch_rowwise_linear(x, weight) if out is None else out


def torch_rowwise_linear(x: Tensor, weight: Tensor) -> Tensor:
    """rowwise_linear by torch ops: every row runs the same fixed-shape product whatever M is,
    where F.linear picks its kernel by M. How, by the weight's shape only (so a weight's
    rows always take the same way):
    - narrow weights: one [1, K] × [K, N] product per row, in one batched matmul;
    - wide ones (the lm_head): [TILE_ROWS, K] tiles, zero-padded, one matmul each — a product
      of fixed shape reads the weight once per tile instead of once per row, and its rows'
      bits depend neither on their place in the tile nor on the tile's other row.
    Every row starts on a 64-byte boundary (copied to rows of a padded stride): some BLAS builds
    sum a row by its address's alignment (torch 2.13's CPU build on AMD Zen 5: a row's bits
    differed by where it sat in memory)."""
    num_rows, num_in = x.shape
    num_out = weight.shape[0]
    pad = 0 if num_out < WIDE_OUTPUTS else -num_rows % TILE_ROWS
    per_line = 64 // x.element_size()
    rows = x.new_zeros(num_rows + pad, -(-num_in // per_line) * per_line)[:, :num_in]  # [M + pad, K], aligned rows
    rows[:num_rows] = x
    if num_out < WIDE_OUTPUTS or num_rows == 0:
        return torch.bmm(rows.unsqueeze(1), weight.t().unsqueeze(0).expand(num_rows, num_in, num_out)).squeeze(1)
    tiles = [F.linear(rows[row : row + TILE_ROWS], weight) for row in range(0, num_rows + pad, TILE_ROWS)]
    return torch.cat(tiles)[:num_rows]


def prefill_linear(x: Tensor, weight: Weight) -> Tensor:
    """x @ weight^T [M, N] in x's dtype for prompt rows, each row's bits independent of the other
    rows (PREFILL_TILE for every M); cuBLAS where Triton does not run, or with INVARIANT_PREFILL off.
    An FP8 weight is dequantised for the call (prompt rows are compute-bound: the bytes matter less)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"prefill_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")
    weight = dense(weight, x.dtype)
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
    weight: Weight,  # [N, K]
    splits: int,
    *,
    pdl: bool = False,
) -> Tensor:
    """Split-K partial products [M, splits, N] float32: partial s sums K range s·K/splits ...
    (consumers add them in split order, so rows stay invariant). Narrow weights (the router,
    o_proj) get enough programs to fill the GPU this way."""
    _check("linear_partials", x, weight)
    num_rows, num_in = x.shape
    if not use_triton(x) or num_rows > MAX_FUSED_ROWS:
        step = k_per_split(weight, x.dtype, splits)
        if num_rows <= MAX_FUSED_ROWS:
            out = cpu_rows.partials(x, weight, splits, step)
            if out is not None:
                return out
        product = F.linear if num_rows > MAX_FUSED_ROWS else rowwise_linear
        full = dense(weight, x.dtype)
        return torch.stack([product(x[:, s * step : (s + 1) * step].float(), full[:, s * step : (s + 1) * step].float())
                            for s in range(splits)], dim=1)
    out = torch.empty((num_rows, splits, weight.shape[0]), dtype=torch.float32, device=x.device)
    _launch(x.contiguous(), weight, out, splits, pdl)
    return out


def _rows_of(weight: Weight) -> Tensor:
    return weight.q if isinstance(weight, Fp8Weight) else weight


def _launch(x: Tensor, weight: Weight, out: Tensor, splits: int, pdl: bool,
            tile: tuple[int, int, int, int, int] | None = None) -> None:
    """tile: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for every row count (prefill, no
    K splits); None: BLOCK_M rows and the weight's weight_config."""
    num_rows, num_in = x.shape
    num_out = weight.shape[0]
    if tile is None:
        block_m, (block_n, block_k, warps, stages) = BLOCK_M, weight_config(weight, x.dtype)
    else:
        block_m, block_n, block_k, warps, stages = tile
    k_per_split = cdiv(cdiv(num_in, splits), block_k) * block_k
    grid = (cdiv(num_out, block_n), cdiv(num_rows, block_m), splits)
    stride_ym = out.stride(0)
    stride_ys = out.stride(1) if splits > 1 else 0
    fp8 = isinstance(weight, Fp8Weight)
    w = _rows_of(weight)
    scale = weight.scale if fp8 else w
    sbn, sbk = weight.block if fp8 else (1, 1)
    _kernels()[grid](
        x, w, out, scale, num_rows, num_out, num_in, x.stride(0), w.stride(0), stride_ym, k_per_split, stride_ys,
        scale.stride(0) if fp8 else 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=x.dtype == torch.float32, SPLITS=splits,
        PDL=pdl, FP8=fp8, SBN=sbn, SBK=sbk, SUB=min(block_k, sbk), **fp8_way(fp8 and LINEAR_FP8_EXACT, x),
        num_warps=warps, num_stages=stages, **launch_options(pdl),
    )


def fp8_way(exact: bool, x: Tensor) -> dict[str, bool]:
    """The FP8 kernels' way for activations x: EXACT (fp8_kernels.scaled_dot, else dequant_tile)
    and ASM (FP8_ASM where it applies). The bit moves are PTX, so the interpreter (CPU tests)
    converts with Triton's own cast."""
    return dict(EXACT=exact, ASM=exact and FP8_ASM and x.is_cuda and x.dtype == torch.bfloat16)


def k_per_split(weight: Weight, dtype: torch.dtype, splits: int) -> int:
    """K columns per split: whole K tiles of the weight's configuration (as the kernel splits)."""
    block_k = weight_config(weight, dtype)[1]
    return cdiv(cdiv(weight.shape[1], splits), block_k) * block_k

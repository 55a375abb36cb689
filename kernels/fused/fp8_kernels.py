"""Triton code shared by the kernels that read block-scaled FP8 weights (kernels.fused.fp8;
imported only when a kernel runs)."""

import triton
import triton.language as tl


@triton.jit
def dequant_tile(w, s_ptr, s_rows, s_ok, k0, K, SBK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SUB: tl.constexpr):
    """A float8 weight tile w [BLOCK_N, BLOCK_K] (columns k0 ...) in float32 times its block scales:
    s_ptr + s_rows [BLOCK_N] (each row's scale row) + the column's block column. The tile is
    SUB-column pieces, each inside one block column (SUB = min(BLOCK_K, SBK)): a wide tile keeps
    as many bytes in flight per load as a bf16 one though a block is narrower."""
    NSC: tl.constexpr = BLOCK_K // SUB
    j = tl.arange(0, NSC)
    starts = k0 + j * SUB
    s = tl.load(s_ptr + s_rows[:, None] + (starts // SBK)[None, :], mask=s_ok[:, None] & (starts < K)[None, :],
                other=0.0)  # [BLOCK_N, NSC]
    scaled = tl.reshape(w.to(tl.float32), (BLOCK_N, NSC, SUB)) * s[:, :, None]
    return tl.reshape(scaled, (BLOCK_N, BLOCK_K))

"""Triton kernel of kernels.fused.linear (imported only when a kernel runs)."""

import triton
import triton.language as tl

from kernels.fused.fp8_kernels import tile_dot


@triton.jit
def linear_kernel(
    x_ptr, w_ptr, y_ptr, s_ptr, M, N, K, stride_xm, stride_wn, stride_ym, k_per_split, stride_ys, stride_sn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    SPLITS: tl.constexpr, PDL: tl.constexpr, FP8: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr,
    SUB: tl.constexpr, EXACT: tl.constexpr, ASM: tl.constexpr,
):
    """FP8: w is float8 with one float32 scale per block of SBN rows × SBK columns at s_ptr
    (rows stride_sn apart): EXACT, each tile (inside one block column) multiplied as its e4m3
    values and its partial product scaled, else dequantised tile by tile (fp8_kernels.tile_dot)."""
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
        acc = tile_dot(x, w, acc, s_ptr, (cols // SBN) * stride_sn, col_ok, k0, K, IEEE, FP8, SBK, BLOCK_N, BLOCK_K,
                       SUB, EXACT, ASM)
    out = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], out, mask=row_ok[:, None] & col_ok[None, :])

"""RMSNorm fused with the residual add, and q/k norm fused with RoPE and the KV-cache write.

Rounding follows the reference modules (shared.model.layers): the residual sum is rounded
to the model dtype, normalised in float32, rounded, then scaled by the weight; RoPE uses
the rotate-half convention with float32 cos/sin tables.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from kernels.fused import early_reads, launch_options, next_power_of_2, paged_rows, use_triton

NORM_WARPS = 8  # add_rmsnorm's per row (doubled past 4,096 columns; H200: 8 beat 4 by ~1-2% of the step)
QK_ROPE_WARPS = 1  # per (row, head)


def add_rmsnorm_reference(
    x: Tensor,  # [T, H]
    residual: Tensor | None,  # [T, H] or None
    weight: Tensor,  # [H]
    eps: float,
) -> tuple[Tensor, Tensor]:
    """(normed, new_residual): new_residual = x + residual (x when None), normed = rmsnorm(it)."""
    h = x if residual is None else residual + x
    y = h.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(h.dtype), h


def qk_norm_rope_reference(
    qkv: Tensor,  # [T, (Hq + 2*Hkv) * D]
    q_norm: Tensor,  # [D]
    k_norm: Tensor,  # [D]
    cos: Tensor,  # [max_positions, D] float32
    sin: Tensor,  # [max_positions, D] float32
    positions: Tensor,  # [T] int
    num_heads: int,
    num_kv_heads: int,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]): q and k normed per head and rotated."""
    num_rows = qkv.shape[0]
    head_dim = q_norm.shape[0]
    q, k, v = qkv.view(num_rows, num_heads + 2 * num_kv_heads, head_dim).split(
        [num_heads, num_kv_heads, num_kv_heads], dim=1)
    q, _ = add_rmsnorm_reference(q, None, q_norm, eps)
    k, _ = add_rmsnorm_reference(k, None, k_norm, eps)
    c = cos[positions].to(qkv.dtype).unsqueeze(1)
    s = sin[positions].to(qkv.dtype).unsqueeze(1)
    half = head_dim // 2

    def rotate(x: Tensor) -> Tensor:
        return x * c + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * s

    return rotate(q), rotate(k), v.contiguous()


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def add_rmsnorm_kernel(
        x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, H, eps,
        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PARTIALS: tl.constexpr, PDL: tl.constexpr,
        EARLY: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < H
        if EARLY:  # the weight, and the residual (from kernels further back), before the wait
            w = tl.load(w_ptr + cols, mask=ok, other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(res_ptr + row * H + cols, mask=ok, other=0.0)
        if PDL:  # wait for the predecessor kernel before touching anything it may write or read
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if PARTIALS > 0:  # x as split-K partials [T, PARTIALS, H] float32, summed in split order
            acc = tl.zeros((BLOCK,), tl.float32)
            for s in tl.static_range(PARTIALS):
                acc += tl.load(x_ptr + (row * PARTIALS + s) * H + cols, mask=ok, other=0.0)
            h = acc.to(out_ptr.dtype.element_ty)
        else:
            h = tl.load(x_ptr + row * H + cols, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            if not EARLY:
                r = tl.load(res_ptr + row * H + cols, mask=ok, other=0.0)
            h = (h.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
            tl.store(res_out_ptr + row * H + cols, h, mask=ok)
        y = h.to(tl.float32)
        var = tl.sum(y * y, axis=0) / H
        y = (y * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty)
        if not EARLY:
            w = tl.load(w_ptr + cols, mask=ok, other=0.0)
        tl.store(out_ptr + row * H + cols, (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def qk_rope_kernel(
        qkv_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, table_ptr,
        stride_qkv, stride_block, stride_pos, stride_table, eps,
        NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        PDL: tl.constexpr, EARLY: tl.constexpr,
    ):
        if PDL and not EARLY:  # wait for the predecessor kernel before touching anything it may write or read
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        t = tl.program_id(0)
        head = tl.program_id(1)
        d = tl.arange(0, D)
        partner = (d + HALF) % D
        # (EARLY: the position, its cache row, the norm weights and cos/sin come from the host's
        # inputs and the weights: read before the wait; only qkv comes from the kernel before.)
        pos = tl.load(pos_ptr + t)
        slot = tl.load(slot_ptr + t)
        block = tl.load(table_ptr + slot * stride_table + pos // BLOCK_SIZE).to(tl.int64)
        kv_row = block * stride_block + (pos % BLOCK_SIZE) * stride_pos
        is_q = head < NUM_Q
        norm_ptr = tl.where(is_q, qn_ptr, kn_ptr)
        w = tl.load(norm_ptr + d)
        wp = tl.load(norm_ptr + partner)
        c = tl.load(cos_ptr + pos * D + d)
        s = tl.load(sin_ptr + pos * D + d)
        if PDL and EARLY:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        base = qkv_ptr + t * stride_qkv + head * D
        x = tl.load(base + d)
        xp = tl.load(base + partner)
        dtype = x.dtype
        if head < NUM_Q + NUM_KV:
            xf = x.to(tl.float32)
            scale = tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
            y = (w.to(tl.float32) * (xf * scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            yp = (wp.to(tl.float32) * (xp.to(tl.float32) * scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            c = c.to(dtype).to(tl.float32)
            s = s.to(dtype).to(tl.float32)
            rotated = tl.where(d < HALF, -yp, yp)
            out = ((y * c).to(dtype).to(tl.float32) + (rotated * s).to(dtype).to(tl.float32)).to(dtype)
            if head < NUM_Q:
                tl.store(q_out_ptr + (t * NUM_Q + head) * D + d, out)
            else:
                tl.store(k_cache_ptr + kv_row + (head - NUM_Q) * D + d, out)
        else:
            tl.store(v_cache_ptr + kv_row + (head - NUM_Q - NUM_KV) * D + d, x)

    return add_rmsnorm_kernel, qk_rope_kernel


def add_rmsnorm(
    x: Tensor,  # [T, H], or split-K partials [T, splits, H] float32 (summed, rounded to residual's dtype)
    residual: Tensor | None,  # [T, H]
    weight: Tensor,  # [H]
    eps: float,
    *,
    pdl: bool = False,  # launch as a programmatic dependent (kernels.fused.pdl_supported)
) -> tuple[Tensor, Tensor]:
    """(normed, new_residual) with new_residual = residual + x (x itself when residual is None)."""
    partials = x.shape[1] if x.dim() == 3 else 0
    if partials and residual is None:
        raise ValueError("add_rmsnorm: split-K partials need a residual (it gives the dtype)")
    if not use_triton(x):
        if partials:
            summed = x[:, 0]
            for s in range(1, partials):
                summed = summed + x[:, s]
            x = summed.to(residual.dtype)
        return add_rmsnorm_reference(x, residual, weight, eps)
    x = x.contiguous()
    num_rows, size = x.shape[0], x.shape[-1]
    dtype = residual.dtype if residual is not None else x.dtype
    normed = torch.empty((num_rows, size), dtype=dtype, device=x.device)
    new_residual = torch.empty_like(normed) if residual is not None else x
    _kernels()[0][(num_rows,)](
        x, residual.contiguous() if residual is not None else x, weight, normed, new_residual, size, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=next_power_of_2(size), PARTIALS=partials,
        PDL=pdl, EARLY=early_reads(), num_warps=NORM_WARPS if size <= 4096 else 2 * NORM_WARPS,
        **launch_options(pdl),
    )
    return normed, new_residual


def qk_norm_rope_store(
    qkv: Tensor,  # [T, (Hq + 2*Hkv) * D]
    q_norm: Tensor,  # [D]
    k_norm: Tensor,  # [D]
    cos: Tensor,  # [max_positions, D] float32
    sin: Tensor,  # [max_positions, D] float32
    positions: Tensor,  # [T] int64
    slots: Tensor,  # [T] int64: cache slot of each row
    cache_keys: Tensor,  # [num_blocks, block_size, Hkv, D]
    cache_values: Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: Tensor,  # [num_slots, max_blocks] int32
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    *,
    pdl: bool = False,
) -> Tensor:
    """Norm and rotate q and k, write k and v at (slot, position) of the paged cache; returns q [T, Hq, D]."""
    block_size = cache_keys.shape[1]
    if not use_triton(qkv):
        q, k, v = qk_norm_rope_reference(qkv, q_norm, k_norm, cos, sin, positions, num_heads, num_kv_heads, eps)
        blocks, offsets = paged_rows(block_tables, slots, positions, block_size)
        cache_keys[blocks, offsets] = k
        cache_values[blocks, offsets] = v
        return q
    num_rows = qkv.shape[0]
    head_dim = q_norm.shape[0]
    if cache_keys.stride() != cache_values.stride() or cache_keys.stride(2) != head_dim or cache_keys.stride(3) != 1:
        raise ValueError("qk_norm_rope_store: cache keys/values must share a [blocks, block_size, heads, D] layout")
    q = torch.empty((num_rows, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    _kernels()[1][(num_rows, num_heads + 2 * num_kv_heads)](
        qkv, q, cache_keys, cache_values, q_norm, k_norm, cos, sin, positions, slots, block_tables,
        qkv.stride(0), cache_keys.stride(0), cache_keys.stride(1), block_tables.stride(0), eps,
        NUM_Q=num_heads, NUM_KV=num_kv_heads, D=head_dim, HALF=head_dim // 2, BLOCK_SIZE=block_size, PDL=pdl,
        EARLY=early_reads(), num_warps=QK_ROPE_WARPS,
        **launch_options(pdl),
    )
    return q

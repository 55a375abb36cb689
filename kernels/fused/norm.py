"""RMSNorm fused with the residual add, and q/k norm fused with RoPE and the KV-cache write.

Rounding follows the reference modules (shared.model.layers): the residual sum is rounded
to the model dtype, normalised in float32, rounded, then scaled by the weight; RoPE uses
the rotate-half convention with float32 cos/sin tables.

Options of the Qwen3-Next family (shared.model.families.hybrid.modules), each off by default: `centred`
norms scale the float32 normalised row by (1 + weight) before one rounding to the dtype
(CenteredRMSNorm); `rotary_dim` rotates only the first rotary_dim dims of each head (the
rest pass through normed, GatedAttention's partial rotary); `q_head_stride` reads query
head h at column h * q_head_stride of qkv (the family's q_proj interleaves each head's
query with its output gate: stride 2 * D), k and v after the Hq query heads.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from kernels.fused import cpu_rows, early_reads, launch_options, next_power_of_2, paged_rows, use_triton

NORM_WARPS = 8  # add_rmsnorm's per row (doubled past 4,096 columns; H200: 8 beat 4 by ~1-2% of the step)
QK_ROPE_WARPS = 1  # per (row, head)


def add_rmsnorm_reference(
    x: Tensor,  # [T, H]
    residual: Tensor | None,  # [T, H] or None
    weight: Tensor,  # [H]
    eps: float,
    centred: bool = False,
) -> tuple[Tensor, Tensor]:
    """(normed, new_residual): new_residual = x + residual (x when None), normed = rmsnorm(it).
    centred: normed = (y * (1 + weight)).to(dtype), y the float32 normalised row (CenteredRMSNorm)."""
    h = x if residual is None else residual + x
    y = h.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    if centred:
        return (y * (1.0 + weight.float())).to(h.dtype), h
    return weight * y.to(h.dtype), h


def _qkv_columns(qkv: Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                 q_head_stride: int | None) -> tuple[Tensor, Tensor, Tensor]:
    """Views (q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) of qkv's first columns: query head h at
    column h * q_head_stride (None: D), then the key heads, then the value heads; columns past
    them (an output gate) are not read."""
    q_stride = head_dim if q_head_stride is None else q_head_stride
    q_cols, kv_cols = num_heads * q_stride, num_kv_heads * head_dim
    if qkv.shape[1] < q_cols + 2 * kv_cols or q_stride < head_dim:
        raise ValueError(f"qkv rows of {qkv.shape[1]} columns cannot hold {num_heads} query heads (stride {q_stride}) "
                         f"and 2 x {num_kv_heads} key/value heads of {head_dim}")
    q = qkv[:, :q_cols].unflatten(1, (num_heads, q_stride))
    if q_stride != head_dim:
        q = q[..., :head_dim]
    k = qkv[:, q_cols : q_cols + kv_cols].unflatten(1, (num_kv_heads, head_dim))
    v = qkv[:, q_cols + kv_cols : q_cols + 2 * kv_cols].unflatten(1, (num_kv_heads, head_dim))
    return q, k, v


def qk_norm_rope_reference(
    qkv: Tensor,  # [T, >= (Hq + 2*Hkv) * D] (columns past k and v, e.g. an output gate, are not read)
    q_norm: Tensor,  # [D]
    k_norm: Tensor,  # [D]
    cos: Tensor,  # [max_positions, rotary_dim] float32
    sin: Tensor,  # [max_positions, rotary_dim] float32
    positions: Tensor,  # [T] int
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    centred: bool = False,  # (1 + w) norms (CenteredRMSNorm)
    rotary_dim: int | None = None,  # rotate the first rotary_dim dims of each head (None: all D)
    q_head_stride: int | None = None,  # columns between query heads in qkv (None: D)
) -> tuple[Tensor, Tensor, Tensor]:
    """(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]): q and k normed per head and rotated
    (GatedAttention's rounding with a partial rotary_dim: the rotated dims, then the rest as normed)."""
    head_dim = q_norm.shape[0]
    q, k, v = _qkv_columns(qkv, num_heads, num_kv_heads, head_dim, q_head_stride)
    q, _ = add_rmsnorm_reference(q, None, q_norm, eps, centred)
    k, _ = add_rmsnorm_reference(k, None, k_norm, eps, centred)
    width = head_dim if rotary_dim is None else rotary_dim
    c = cos[positions].to(qkv.dtype).unsqueeze(1)
    s = sin[positions].to(qkv.dtype).unsqueeze(1)
    half = width // 2

    def rotate(x: Tensor) -> Tensor:
        if width == head_dim:
            return x * c + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * s
        part = x[..., :width]
        rotated = part * c + torch.cat([-part[..., half:], part[..., :half]], dim=-1) * s
        return torch.cat([rotated, x[..., width:]], dim=-1)

    return rotate(q), rotate(k), v.contiguous()


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def add_rmsnorm_kernel(
        x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, H, eps,
        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PARTIALS: tl.constexpr, PDL: tl.constexpr,
        EARLY: tl.constexpr, CENTRED: tl.constexpr,
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
        if CENTRED:  # (1 + w) times the float32 normalised row, one rounding
            y = y * tl.rsqrt(var + eps)
            if not EARLY:
                w = tl.load(w_ptr + cols, mask=ok, other=0.0)
            out = (y * (1.0 + w.to(tl.float32))).to(out_ptr.dtype.element_ty)
        else:
            y = (y * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty)
            if not EARLY:
                w = tl.load(w_ptr + cols, mask=ok, other=0.0)
            out = (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * H + cols, out, mask=ok)

    @triton.jit
    def qk_rope_kernel(
        qkv_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, table_ptr,
        stride_qkv, stride_block, stride_pos, stride_table, eps,
        NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        PDL: tl.constexpr, EARLY: tl.constexpr, CENTRED: tl.constexpr, ROT: tl.constexpr, Q_STRIDE: tl.constexpr,
    ):
        # ROT: the rotated dims of a head (D, or fewer: partial rotary, cos/sin rows of ROT), HALF = ROT // 2;
        # Q_STRIDE: qkv columns from one query head to the next (D, or more: an interleaved gate)
        if PDL and not EARLY:  # wait for the predecessor kernel before touching anything it may write or read
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        t = tl.program_id(0)
        head = tl.program_id(1)
        d = tl.arange(0, D)
        if ROT < D:  # partial rotary: dims from ROT on pass through (their partner is themselves)
            partner = tl.where(d < ROT, (d + HALF) % ROT, d)
        else:
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
        if ROT < D:
            c = tl.load(cos_ptr + pos * ROT + d, mask=d < ROT, other=1.0)
            s = tl.load(sin_ptr + pos * ROT + d, mask=d < ROT, other=0.0)
        else:
            c = tl.load(cos_ptr + pos * D + d)
            s = tl.load(sin_ptr + pos * D + d)
        if PDL and EARLY:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if Q_STRIDE == D:
            base = qkv_ptr + t * stride_qkv + head * D
        else:  # query heads Q_STRIDE apart, then the key and value heads
            column = tl.where(head < NUM_Q, head * Q_STRIDE, NUM_Q * Q_STRIDE + (head - NUM_Q) * D)
            base = qkv_ptr + t * stride_qkv + column
        x = tl.load(base + d)
        xp = tl.load(base + partner)
        dtype = x.dtype
        if head < NUM_Q + NUM_KV:
            xf = x.to(tl.float32)
            scale = tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
            if CENTRED:  # (1 + w) times the float32 normalised value, one rounding
                y = (xf * scale * (1.0 + w.to(tl.float32))).to(dtype).to(tl.float32)
                yp = (xp.to(tl.float32) * scale * (1.0 + wp.to(tl.float32))).to(dtype).to(tl.float32)
            else:
                y = (w.to(tl.float32) * (xf * scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
                yp = (wp.to(tl.float32) * (xp.to(tl.float32) * scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            c = c.to(dtype).to(tl.float32)
            s = s.to(dtype).to(tl.float32)
            rotated = tl.where(d < HALF, -yp, yp)
            out = ((y * c).to(dtype).to(tl.float32) + (rotated * s).to(dtype).to(tl.float32)).to(dtype)
            if ROT < D:
                out = tl.where(d < ROT, out, y.to(dtype))
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
    centred: bool = False,  # (1 + weight) scaling of the float32 normalised row (CenteredRMSNorm)
) -> tuple[Tensor, Tensor]:
    """(normed, new_residual) with new_residual = residual + x (x itself when residual is None)."""
    partials = x.shape[1] if x.dim() == 3 else 0
    if partials and residual is None:
        raise ValueError("add_rmsnorm: split-K partials need a residual (it gives the dtype)")
    if not use_triton(x):
        done = cpu_rows.add_rmsnorm(x, residual, weight, eps, centred)
        if done is not None:
            return done
        if partials:
            summed = x[:, 0]
            for s in range(1, partials):
                summed = summed + x[:, s]
            x = summed.to(residual.dtype)
        return add_rmsnorm_reference(x, residual, weight, eps, centred)
    x = x.contiguous()
    num_rows, size = x.shape[0], x.shape[-1]
    dtype = residual.dtype if residual is not None else x.dtype
    normed = torch.empty((num_rows, size), dtype=dtype, device=x.device)
    new_residual = torch.empty_like(normed) if residual is not None else x
    _kernels()[0][(num_rows,)](
        x, residual.contiguous() if residual is not None else x, weight, normed, new_residual, size, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=next_power_of_2(size), PARTIALS=partials,
        PDL=pdl, EARLY=early_reads(), CENTRED=centred, num_warps=NORM_WARPS if size <= 4096 else 2 * NORM_WARPS,
        **launch_options(pdl),
    )
    return normed, new_residual


def qk_norm_rope_store(
    qkv: Tensor,  # [T, >= (Hq + 2*Hkv) * D], its row stride (columns past k and v, e.g. an output gate, are not read)
    q_norm: Tensor,  # [D]
    k_norm: Tensor,  # [D]
    cos: Tensor,  # [max_positions, rotary_dim] float32
    sin: Tensor,  # [max_positions, rotary_dim] float32
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
    centred: bool = False,  # (1 + w) q/k norms (CenteredRMSNorm)
    rotary_dim: int | None = None,  # rotate the first rotary_dim dims of each head (None: all D)
    q_head_stride: int | None = None,  # columns between query heads in qkv (None: D; 2 D: q and gate interleaved)
) -> Tensor:
    """Norm and rotate q and k, write k and v at (slot, position) of the paged cache; returns q [T, Hq, D]."""
    block_size = cache_keys.shape[1]
    head_dim = q_norm.shape[0]
    rot = head_dim if rotary_dim is None else rotary_dim
    if rot % 2 or not 0 < rot <= head_dim or cos.shape[-1] != rot or sin.shape[-1] != rot:
        raise ValueError(f"qk_norm_rope_store: rotary_dim {rot} must be even, at most head_dim {head_dim}, and the "
                         f"width of the cos/sin tables ({cos.shape[-1]}, {sin.shape[-1]})")
    q_stride = head_dim if q_head_stride is None else q_head_stride
    _qkv_columns(qkv, num_heads, num_kv_heads, head_dim, q_head_stride)  # (checks the width)
    if not use_triton(qkv):
        q = cpu_rows.qk_norm_rope_store(qkv, q_norm, k_norm, cos, sin, positions, slots, cache_keys, cache_values,
                                        block_tables, num_heads, num_kv_heads, eps, centred, rot, q_stride)
        if q is not None:
            return q
        q, k, v = qk_norm_rope_reference(qkv, q_norm, k_norm, cos, sin, positions, num_heads, num_kv_heads, eps,
                                         centred, rotary_dim, q_head_stride)
        blocks, offsets = paged_rows(block_tables, slots, positions, block_size)
        cache_keys[blocks, offsets] = k
        cache_values[blocks, offsets] = v
        return q
    num_rows = qkv.shape[0]
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
    if cache_keys.stride() != cache_values.stride() or cache_keys.stride(2) != head_dim or cache_keys.stride(3) != 1:
        raise ValueError("qk_norm_rope_store: cache keys/values must share a [blocks, block_size, heads, D] layout")
    q = torch.empty((num_rows, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    cos, sin = cos.contiguous(), sin.contiguous()  # (rows of rot values: the kernel's layout)
    _kernels()[1][(num_rows, num_heads + 2 * num_kv_heads)](
        qkv, q, cache_keys, cache_values, q_norm, k_norm, cos, sin, positions, slots, block_tables,
        qkv.stride(0), cache_keys.stride(0), cache_keys.stride(1), block_tables.stride(0), eps,
        NUM_Q=num_heads, NUM_KV=num_kv_heads, D=head_dim, HALF=rot // 2, BLOCK_SIZE=block_size, PDL=pdl,
        EARLY=early_reads(), CENTRED=centred, ROT=rot, Q_STRIDE=q_stride, num_warps=QK_ROPE_WARPS,
        **launch_options(pdl),
    )
    return q

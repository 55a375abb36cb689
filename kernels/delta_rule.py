"""The gated delta rule and the short causal convolution of Gated DeltaNet layers (the linear
attention of Qwen3-Next and Qwen3.5; issue 17), as torch references: a recurrent form for
decode and verify windows and a chunked form for prefill, both from an explicit state.

Per value head, with the state S in R^{dk x dv}, a row t (q and k already l2-normed when the
model asks for it; q scaled by 1/sqrt(dk)):

    S <- exp(g_t) S                      (decay; g_t <= 0)
    d_t = beta_t (v_t - S^T k_t)         (the delta against what S recalls for k_t)
    S <- S + k_t d_t^T
    o_t = S^T q_t

Query/key heads serve num_v_heads // num_k_heads consecutive value heads (grouped values).
The chunked form computes the same rows C at a time: within a chunk, with G_i the cumulative
log decay and S_0 the state before it,

    S_i = e^{G_i} S_0 + sum_{j<=i} e^{G_i - G_j} k_j d_j^T,
    d_i + beta_i sum_{j<i} e^{G_i - G_j} (k_i . k_j) d_j = beta_i (v_i - e^{G_i} S_0^T k_i),

a unit lower-triangular system for the chunk's deltas, then o_i = S_i^T q_i in matrix form.

Speculative rollback: the state after any row of a window is the state before it advanced by
the accepted rows, so `recurrent(..., keep_states=True)` returns every row's state, and a
caller that keeps only the state before the window recomputes the accepted prefix instead.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def _l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, l2norm: bool):
    """float32 [H, T, d] tensors with q/k heads spread over the value heads, q scaled."""
    num_k_heads, num_v_heads = k.shape[1], v.shape[1]
    if num_v_heads % num_k_heads:
        raise ValueError(f"{num_v_heads} value heads are not a multiple of {num_k_heads} key heads")
    if num_v_heads != num_k_heads:
        q = q.repeat_interleave(num_v_heads // num_k_heads, dim=1)
        k = k.repeat_interleave(num_v_heads // num_k_heads, dim=1)
    q, k, v = (x.float().transpose(0, 1) for x in (q, k, v))  # [H, T, d]
    if l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q / math.sqrt(q.shape[-1])
    return q, k, v, g.float().transpose(0, 1), beta.float().transpose(0, 1)  # g, beta: [H, T]


def _initial(state: Tensor | None, num_heads: int, dk: int, dv: int, device) -> Tensor:
    if state is None:
        return torch.zeros((num_heads, dk, dv), dtype=torch.float32, device=device)
    return state.float()


def recurrent(
    q: Tensor,  # [T, Hk, dk]
    k: Tensor,  # [T, Hk, dk]
    v: Tensor,  # [T, Hv, dv]
    g: Tensor,  # [T, Hv] log decay (<= 0)
    beta: Tensor,  # [T, Hv]
    state: Tensor | None = None,  # [Hv, dk, dv] before the first row (None: zeros)
    *,
    l2norm: bool = True,
    keep_states: bool = False,
) -> tuple[Tensor, Tensor]:
    """Row by row: (outputs [T, Hv, dv] in v's dtype, the final state [Hv, dk, dv] float32), or
    with keep_states the state after every row, [T, Hv, dk, dv], in place of the final one."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, l2norm)
    num_heads, num_rows, dv = v.shape
    s = _initial(state, num_heads, k.shape[-1], dv, v.device)
    out = torch.empty_like(v)
    states = []
    for t in range(num_rows):
        s = s * g[:, t].exp()[:, None, None]
        recalled = torch.einsum("hkv,hk->hv", s, k[:, t])
        delta = beta[:, t, None] * (v[:, t] - recalled)
        s = s + k[:, t, :, None] * delta[:, None, :]
        out[:, t] = torch.einsum("hkv,hk->hv", s, q[:, t])
        if keep_states:
            states.append(s)
    final = torch.stack(states) if keep_states else s
    return out.transpose(0, 1).to(dtype), final


def chunked(
    q: Tensor,  # [T, Hk, dk]
    k: Tensor,  # [T, Hk, dk]
    v: Tensor,  # [T, Hv, dv]
    g: Tensor,  # [T, Hv]
    beta: Tensor,  # [T, Hv]
    state: Tensor | None = None,  # [Hv, dk, dv]
    *,
    l2norm: bool = True,
    chunk: int = 64,
) -> tuple[Tensor, Tensor]:
    """The same rows `chunk` at a time (prefill): (outputs [T, Hv, dv], final state [Hv, dk, dv])."""
    if chunk < 1:
        raise ValueError(f"chunk {chunk} must be >= 1")
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, l2norm)
    num_heads, num_rows, dv = v.shape
    s = _initial(state, num_heads, k.shape[-1], dv, v.device)
    outs = []
    for start in range(0, num_rows, chunk):
        rows = slice(start, min(start + chunk, num_rows))
        qc, kc, vc, bc = q[:, rows], k[:, rows], v[:, rows], beta[:, rows]  # [H, C, d], beta [H, C]
        cum = g[:, rows].cumsum(dim=-1)  # [H, C]: G_i
        size = cum.shape[-1]
        lower = torch.ones((size, size), dtype=torch.bool, device=v.device).tril()
        # e^{G_i - G_j} for j <= i (each factor <= 1), 0 above the diagonal
        decay = torch.where(lower, (cum[:, :, None] - cum[:, None, :]).clamp(max=0).exp(), 0.0)  # [H, C, C]
        kk = torch.einsum("hid,hjd->hij", kc, kc)
        system = torch.eye(size, device=v.device) + bc[:, :, None] * (decay * kk).tril(-1)
        rhs = bc[:, :, None] * (vc - cum.exp()[:, :, None] * torch.einsum("hkv,hik->hiv", s, kc))
        delta = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # [H, C, dv]
        qk = torch.einsum("hid,hjd->hij", qc, kc) * decay
        outs.append(cum.exp()[:, :, None] * torch.einsum("hkv,hik->hiv", s, qc) + qk @ delta)
        last = cum[:, -1:]  # G_C
        s = last.exp()[:, :, None] * s + torch.einsum("hjk,hjv->hkv", kc * (last - cum).exp()[:, :, None], delta)
    out = torch.cat(outs, dim=1) if outs else v
    return out.transpose(0, 1).to(dtype), s


def causal_conv(
    x: Tensor,  # [T, C]
    weight: Tensor,  # [C, K] depthwise kernel
    state: Tensor | None = None,  # [C, K - 1]: the inputs before the first row (None: zeros)
    *,
    keep_states: bool = False,
) -> tuple[Tensor, Tensor]:
    """Short causal depthwise convolution followed by SiLU: (outputs [T, C], the state after the
    last row [C, K - 1], or with keep_states the state after every row [T, C, K - 1])."""
    channels, width = weight.shape
    if state is None:
        state = torch.zeros((channels, width - 1), dtype=x.dtype, device=x.device)
    history = torch.cat([state.to(x.dtype), x.transpose(0, 1)], dim=1)  # [C, K - 1 + T]
    out = F.conv1d(history.unsqueeze(0), weight.unsqueeze(1).to(x.dtype), groups=channels)[0]  # [C, T]
    if keep_states:
        states = history.unfold(1, width - 1, 1)[:, 1:].transpose(0, 1)  # [T, C, K - 1]
    else:
        states = history[:, history.shape[1] - (width - 1):]
    return F.silu(out).transpose(0, 1), states

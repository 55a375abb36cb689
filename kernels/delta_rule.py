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

a unit lower-triangular system (I + L) d = beta v - (beta e^G k) S_0 for the chunk's deltas.
In the WY ("UT transform") form of flash-linear-attention its solution is d = U - W S_0 with
U = (I + L)^{-1} (beta v) and W = (I + L)^{-1} (beta e^G k), neither of which depends on S_0, so
with P the decay-masked q k^T (P_ij = e^{G_i - G_j} q_i . k_j for j <= i) and K the keys decayed
to the chunk's end (e^{G_C - G_j} k_j):

    outputs  = P U + (e^G q - P W) S_0
    S_C      = K^T U + (e^{G_C} I - K^T W) S_0

Everything but S_0 is computed for all chunks at once, so only S_0 -> S_C, one batched
matmul-add per chunk, remains a loop: on a GPU a loop of many small ops per chunk is bound by
kernel launches, not flops.

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
    """The same rows `chunk` at a time (prefill): (outputs [T, Hv, dv], final state [Hv, dk, dv]).

    The loop over chunks issues one batched matmul-add per chunk (see the module docstring). The
    price is memory and some flops: the per-chunk transitions [N, H, dk, dk] and the states before
    each chunk [N + 1, H, dk, dv] are each about dk / chunk times the size of q in float32.
    Inference only: the in-place and out= ops below do not support autograd."""
    if chunk < 1:
        raise ValueError(f"chunk {chunk} must be >= 1")
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, l2norm)
    num_heads, num_rows, dv = v.shape
    dk = k.shape[-1]
    s = _initial(state, num_heads, dk, dv, v.device)
    if num_rows == 0:
        return v.transpose(0, 1).to(dtype), s
    size = min(chunk, num_rows)  # C (a prompt shorter than a chunk is one chunk, unpadded)
    num_chunks = -(-num_rows // size)  # N
    pad = num_chunks * size - num_rows
    if pad:
        # Rows with beta = 0, g = 0 and q = k = v = 0 change nothing: their delta is 0, they keep the
        # chunk's cumulative decay G_C, add nothing to the state (k = 0) and their outputs are dropped.
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))

    # Chunk-major [N, H, C, ...], contiguous (one copy here rather than one inside every batched
    # matmul below), so that a chunk's slice of the per-chunk tensors is contiguous too.
    def chunks(x: Tensor) -> Tensor:
        return x.reshape(num_heads, num_chunks, size, *x.shape[2:]).transpose(0, 1).contiguous()

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))  # [N, H, C, d]; g, beta [N, H, C]
    cum = g.cumsum(dim=-1)  # [N, H, C]: G_i, non-increasing, so e^{G_i} <= 1
    last = cum[..., -1]  # [N, H]: G_C, the whole chunk's log decay
    lower = torch.ones((size, size), dtype=torch.bool, device=v.device).tril()  # j <= i
    # e^{G_i - G_j} for j <= i (each <= 1); above the diagonal G_i - G_j > 0 could overflow, so it
    # is masked to -inf before the exp and comes out 0.
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # [N, H, C, C]

    # The deltas solve (I + L) d = beta v - (beta e^G k) S_0 with L_ij = beta_i e^{G_i - G_j} k_i.k_j
    # (j < i), so d = U - W S_0 with U = (I + L)^{-1} (beta v) and W = (I + L)^{-1} (beta e^G k)
    # (the WY / UT transform), one batched triangular solve for both right-hand sides and all chunks.
    system = (k @ k.transpose(-1, -2)).mul_(decay).mul_(beta[..., None]).tril_(-1)  # [N, H, C, C]: L
    system.diagonal(dim1=-2, dim2=-1).fill_(1)  # I + L
    rhs = torch.cat([v, cum.exp()[..., None] * k], dim=-1).mul_(beta[..., None])  # [N, H, C, dv + dk]
    u, w = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split([dv, dk], dim=-1)

    # o_i = e^{G_i} S_0^T q_i + sum_{j<=i} e^{G_i - G_j} (q_i.k_j) d_j, so with P the decay-masked
    # q k^T the chunk's outputs are (e^G q - P W) S_0 + P U: a matmul against the state before it.
    qk = (q @ k.transpose(-1, -2)).mul_(decay)  # [N, H, C, C]: P
    q_state = (cum.exp()[..., None] * q).sub_(qk @ w)  # [N, H, C, dk]
    out = qk @ u  # [N, H, C, dv]: P U, the outputs with S_0 = 0
    # S_C = e^{G_C} S_0 + sum_j e^{G_C - G_j} k_j d_j^T = (e^{G_C} I - K^T W) S_0 + K^T U with K the
    # decayed keys: an affine map per chunk, so the loop is one matmul-add per chunk.
    k_decayed = (last[..., None] - cum).exp()[..., None] * k  # [N, H, C, dk]: e^{G_C - G_j} k_j
    transition = torch.matmul(k_decayed.transpose(-1, -2), w).neg_()  # [N, H, dk, dk]
    transition.diagonal(dim1=-2, dim2=-1).add_(last.exp()[..., None])
    states = torch.empty((num_chunks + 1, num_heads, dk, dv), dtype=torch.float32, device=v.device)
    states[0] = s  # states[n]: the state before chunk n
    torch.matmul(k_decayed.transpose(-1, -2), u, out=states[1:])  # the carries K^T U, [N, H, dk, dv]
    for n in range(num_chunks):
        states[n + 1].baddbmm_(transition[n], states[n])  # in place: one matmul-add, no copy of the carry
    # (baddbmm_ on [N * H]-batched views of contiguous tensors: adds into `out` without a temporary)
    out.flatten(0, 1).baddbmm_(q_state.flatten(0, 1), states[:-1].flatten(0, 1))  # + (e^G q - P W) S_0
    out = out.transpose(1, 2).reshape(num_chunks * size, num_heads, dv)[:num_rows]  # [T, H, dv]
    return out.to(dtype), states[-1].clone()  # (a clone: a view would keep every chunk's state alive)


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

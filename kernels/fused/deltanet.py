"""The Gated DeltaNet layer (the linear attention of Qwen3-Next / Qwen3.5-MoE) for decode and
verify windows: from the in-projection rows to the gated-normed output that feeds out_proj,
with the layer's state read from and written to buffers.

Per row t of a sequence (the same function as shared.model.families.hybrid.deltanet.GatedDeltaNet.forward,
and kernels.delta_rule's recurrent form), with `proj` columns [q | k | v | z | b | a]:

    hist  = [conv state (the K - 1 previous q|k|v inputs, oldest first); proj[t, q|k|v]]
    mixed = silu(depthwise conv of hist)                  (rounded to the model dtype twice)
    q, k  = l2-normed per key head (q also / sqrt(dk)); v; all float32
    beta  = sigmoid(b) (model dtype), g = -exp(A_log) softplus(a + dt_bias)
    S    <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q   (value head h: key head h // group)
    out   = rmsnorm(o) * norm_weight * silu(z)            (model dtype)

Sequences are ragged (`seq_starts`); each reads its state from buffer state_in[s] and writes the
state after its last row to buffer state_out[s] (nothing for an empty sequence); with `kept_*`
the state after every row t is also written at row t, so a verify window rolls back by picking one.

Buffers: state_in[s] must differ from state_out[s], and no buffer a sequence writes may be read
by another sequence of the launch, for every sequence whose state matters: the programs of a key
head's value heads all read its q/k conv inputs and one of them writes them (padding sequences
may read and write the same garbage buffers among themselves).

Programs: one per (sequence, value head), or with an `arrivals` buffer `v_splits(dv)` per head,
each holding a slice of the state's value columns (less serial work a program, more SMs a step);
the gated RMSNorm over a head's dv values then runs in the head's last program to finish, which
it learns from an atomic count (no program waits for another).

Row invariance (DESIGN §11): each program walks its sequence's rows in a loop whose bound it
reads from `seq_starts` in memory, with a launch configuration that depends on the model's
shapes only, and no reduction crosses rows; so a row's bits (output and states)
are the same computed alone, as a one-row step from the state before it, or inside any window
or batch. The torch reference keeps the same property by computing every row with ops of the
same shapes.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.fused import early_reads, launch_options, next_power_of_2, use_triton

CONV_KERNEL = 4  # the kernel holds the K - 1 = 3 previous conv inputs as three rolling vectors
QK_NORM_EPS = 1e-6  # the l2 norm of q and k (kernels.delta_rule._l2norm)
# Warps of a (sequence, value head) program: STATE_WARPS at most, fewer for smaller states
# (STATE_PER_WARP state elements a warp). dk = dv = 128 in 4 warps holds the state in 128
# registers a thread without spills; 8 warps ran slower on the H200, also where nothing spilled.
STATE_WARPS = 4
STATE_PER_WARP = 4096
# Programs a value head's state is split into along dv (given an `arrivals` buffer): each holds a
# [dk, dv / V_SPLITS] slice, so a step's serial work per program shrinks and more SMs share it;
# the gated RMSNorm over dv then runs in the head's last program to finish (DESIGN §6).
V_SPLITS = 8
MIN_SLICE = 4  # value columns a program keeps at least


def state_warps(block_k: int, block_v: int) -> int:
    """num_warps of the kernel for a padded [block_k, block_v] state: a function of the model only."""
    return max(1, min(STATE_WARPS, block_k * block_v // STATE_PER_WARP))


def v_splits(head_v_dim: int) -> int:
    """Programs per value head (a power of two): a function of the model's shape only."""
    return max(1, min(V_SPLITS, next_power_of_2(head_v_dim) // MIN_SLICE))


def gated_delta_step_reference(
    proj: Tensor,  # [T, P]
    conv_weight: Tensor,  # [C, K]
    A_log: Tensor,  # [Hv]
    dt_bias: Tensor,  # [Hv]
    norm_weight: Tensor,  # [dv]
    conv_states: Tensor,  # [num_buffers, K-1, C]
    rec_states: Tensor,  # [num_buffers, Hv, dk, dv] float32
    seq_starts: Tensor,  # [S+1]
    state_in: Tensor,  # [S]
    state_out: Tensor,  # [S]
    *,
    num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int, eps: float,
    kept_conv: Tensor | None = None,  # [max_rows, K-1, C]
    kept_rec: Tensor | None = None,  # [max_rows, Hv, dk, dv] float32
) -> Tensor:  # [T, Hv*dv]
    """gated_delta_step in torch, row by row (any K). Every row runs the same ops on tensors of
    the same shapes whatever its window, so the CPU's shape-chosen code paths (vectorised loops
    and their tails, GEMM kernels) cannot make a row's bits depend on the other rows."""
    dtype = proj.dtype
    key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
    channels = 2 * key_dim + value_dim
    group = num_v_heads // num_k_heads
    weight = conv_weight.float().transpose(0, 1)  # [K, C]
    decay_rate = -A_log.float().exp()  # [Hv]
    bias = dt_bias.float()
    out = torch.zeros((proj.shape[0], value_dim), dtype=dtype, device=proj.device)
    starts = seq_starts.tolist()
    for s, (r0, r1) in enumerate(zip(starts[:-1], starts[1:])):
        if r1 <= r0:
            continue
        source = int(state_in[s])
        conv = conv_states[source]  # [K-1, C]
        state = rec_states[source].float()  # [Hv, dk, dv]
        for t in range(r0, r1):
            row = proj[t]
            hist = torch.cat([conv, row[None, :channels]])  # [K, C], oldest first
            mixed = F.silu((hist.float() * weight).sum(0).to(dtype).float()).to(dtype)  # [C]
            conv = hist[1:]
            q, k, v = mixed.float().split([key_dim, key_dim, value_dim])
            q = q.view(num_k_heads, head_k_dim)
            k = k.view(num_k_heads, head_k_dim)
            v = v.view(num_v_heads, head_v_dim)
            q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + QK_NORM_EPS)
            q = q / math.sqrt(head_k_dim)
            k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + QK_NORM_EPS)
            if group > 1:
                q = q.repeat_interleave(group, dim=0)  # [Hv, dk]
                k = k.repeat_interleave(group, dim=0)
            z = row[channels : channels + value_dim].view(num_v_heads, head_v_dim)
            b = row[channels + value_dim : channels + value_dim + num_v_heads]
            a = row[channels + value_dim + num_v_heads : channels + value_dim + 2 * num_v_heads]
            beta = b.sigmoid().float()  # [Hv], sigmoid in the model dtype as the module takes it
            g = decay_rate * F.softplus(a.float() + bias)  # [Hv] log decay
            state = state * g.exp()[:, None, None]
            recalled = torch.einsum("hkv,hk->hv", state, k)
            delta = beta[:, None] * (v - recalled)
            state = state + k[:, :, None] * delta[:, None, :]
            o = torch.einsum("hkv,hk->hv", state, q).to(dtype).float()  # [Hv, dv]
            y = (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
            y = (norm_weight.float() * y.float()).to(dtype)
            out[t] = (y.float() * F.silu(z.float())).to(dtype).reshape(-1)
            if kept_conv is not None:
                kept_conv[t] = conv
            if kept_rec is not None:
                kept_rec[t] = state
        target = int(state_out[s])
        conv_states[target] = conv
        rec_states[target] = state
    return out


@functools.cache
def _kernels():
    """Triton is imported on first use, so CPU-only installs never need it."""
    from kernels.fused import deltanet_kernels

    return deltanet_kernels.gated_delta_kernel


def _inner_contiguous(x: Tensor) -> bool:
    """Whether each x[i] is a contiguous block (the kernel steps over the first dimension by stride)."""
    expected = 1
    for size, stride in zip(reversed(x.shape[1:]), reversed(x.stride()[1:])):
        if size > 1 and stride != expected:
            return False
        expected *= size
    return True


def _check(proj, conv_weight, A_log, dt_bias, norm_weight, conv_states, rec_states, seq_starts, state_in, state_out,
           kept_conv, kept_rec, num_k_heads, num_v_heads, head_k_dim, head_v_dim) -> None:
    def bad(argument: str, why: str) -> ValueError:
        return ValueError(f"gated_delta_step: {argument} {why}")

    if num_k_heads < 1 or num_v_heads % num_k_heads:
        raise bad("num_v_heads", f"{num_v_heads} must be a multiple of num_k_heads {num_k_heads}")
    key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
    channels = 2 * key_dim + value_dim
    if conv_weight.dim() != 2 or conv_weight.shape[0] != channels:
        raise bad("conv_weight", f"has shape {tuple(conv_weight.shape)}, expected [{channels}, K]")
    width = conv_weight.shape[1]
    if width != CONV_KERNEL:
        raise bad("conv_weight", f"has kernel width K = {width}; only K = {CONV_KERNEL} is supported")
    if proj.dim() != 2 or proj.shape[1] < channels + value_dim + 2 * num_v_heads or proj.stride(1) != 1:
        raise bad("proj", f"has shape {tuple(proj.shape)}, expected [T, >= {channels + value_dim + 2 * num_v_heads}] "
                          "with unit column stride")
    for argument, x, shape in (("A_log", A_log, (num_v_heads,)), ("dt_bias", dt_bias, (num_v_heads,)),
                               ("norm_weight", norm_weight, (head_v_dim,))):
        if tuple(x.shape) != shape:
            raise bad(argument, f"has shape {tuple(x.shape)}, expected {list(shape)}")
    buffers = (("conv_states", conv_states, (width - 1, channels), proj.dtype),
               ("rec_states", rec_states, (num_v_heads, head_k_dim, head_v_dim), torch.float32),
               ("kept_conv", kept_conv, (width - 1, channels), proj.dtype),
               ("kept_rec", kept_rec, (num_v_heads, head_k_dim, head_v_dim), torch.float32))
    for argument, x, shape, dtype in buffers:
        if x is None:
            continue
        if x.dim() != 1 + len(shape) or tuple(x.shape[1:]) != shape or x.dtype != dtype:
            raise bad(argument, f"is {x.dtype} {tuple(x.shape)}, expected {dtype} [n, {', '.join(map(str, shape))}]")
        if not _inner_contiguous(x):
            raise bad(argument, "must be contiguous after its first dimension")
        if argument.startswith("kept") and x.shape[0] < proj.shape[0]:
            raise bad(argument, f"holds {x.shape[0]} rows, fewer than proj's {proj.shape[0]}")
    if seq_starts.dim() != 1 or seq_starts.shape[0] < 1:
        raise bad("seq_starts", f"has shape {tuple(seq_starts.shape)}, expected [S+1]")
    num_seqs = seq_starts.shape[0] - 1
    for argument, x in (("state_in", state_in), ("state_out", state_out)):
        if tuple(x.shape) != (num_seqs,):
            raise bad(argument, f"has shape {tuple(x.shape)}, expected [{num_seqs}] (one per sequence of seq_starts)")


def gated_delta_step(
    proj: Tensor,  # [T, P]: columns [q (Hk*dk) | k (Hk*dk) | v (Hv*dv) | z (Hv*dv) | b (Hv) | a (Hv)], P >= that
    conv_weight: Tensor,  # [C, K] depthwise causal conv kernel, C = 2*Hk*dk + Hv*dv (channels q|k|v), K = 4
    A_log: Tensor,  # [Hv]
    dt_bias: Tensor,  # [Hv]
    norm_weight: Tensor,  # [dv] the gated RMSNorm's weight
    conv_states: Tensor,  # [num_buffers, K-1, C] model dtype: the last K-1 conv inputs of each buffer, oldest first
    rec_states: Tensor,  # [num_buffers, Hv, dk, dv] float32: the delta-rule state of each buffer
    seq_starts: Tensor,  # [S+1] int32/int64: rows of sequence s are seq_starts[s]:seq_starts[s+1] (may be empty)
    state_in: Tensor,  # [S] int64: buffer each sequence's state is read from
    state_out: Tensor,  # [S] int64: buffer the state after the sequence's last row is written to (!= state_in)
    *,
    num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int, eps: float,
    kept_conv: Tensor | None = None,  # [max_rows, K-1, C]: the conv state after row t at kept_conv[t]
    kept_rec: Tensor | None = None,  # [max_rows, Hv, dk, dv] float32: the recurrent state after row t
    arrivals: Tensor | None = None,  # [>= S*Hv] int32 zeros, kept between launches: split heads along dv
    pdl: bool = False,  # launch as a programmatic dependent (kernels.fused.pdl_supported)
) -> Tensor:  # [T, Hv*dv] model dtype: the input of the layer's out_proj
    """Advance each sequence's Gated DeltaNet state by its rows; returns the gated-normed outputs.
    Rows of no sequence are left unspecified (the kernel does not write them)."""
    _check(proj, conv_weight, A_log, dt_bias, norm_weight, conv_states, rec_states, seq_starts, state_in, state_out,
           kept_conv, kept_rec, num_k_heads, num_v_heads, head_k_dim, head_v_dim)
    sizes = dict(num_k_heads=num_k_heads, num_v_heads=num_v_heads, head_k_dim=head_k_dim, head_v_dim=head_v_dim,
                 eps=eps)
    if not use_triton(proj):
        return gated_delta_step_reference(proj, conv_weight, A_log, dt_bias, norm_weight, conv_states, rec_states,
                                          seq_starts, state_in, state_out, kept_conv=kept_conv, kept_rec=kept_rec,
                                          **sizes)
    num_rows = proj.shape[0]
    num_seqs = state_in.shape[0]
    out = torch.empty((num_rows, num_v_heads * head_v_dim), dtype=proj.dtype, device=proj.device)
    if num_seqs == 0:
        return out
    # (One kept buffer without the other: the missing one's stores go to a dummy of the right kind.)
    kept_conv_t = kept_conv if kept_conv is not None else conv_states
    kept_rec_t = kept_rec if kept_rec is not None else rec_states
    block_k, block_v = next_power_of_2(head_k_dim), next_power_of_2(head_v_dim)
    parts = 1
    if arrivals is not None:
        if arrivals.dtype != torch.int32 or arrivals.dim() != 1 or arrivals.shape[0] < num_seqs * num_v_heads:
            raise ValueError(f"gated_delta_step: arrivals is {arrivals.dtype} {tuple(arrivals.shape)}, expected int32 "
                             f"[>= {num_seqs * num_v_heads}] (sequences x value heads)")
        parts = v_splits(head_v_dim)
    block_v //= parts
    _kernels()[(num_seqs, num_v_heads, parts)](
        proj, conv_weight, A_log, dt_bias, norm_weight, conv_states, rec_states, seq_starts, state_in, state_out, out,
        kept_conv_t, kept_rec_t, arrivals if arrivals is not None else seq_starts,
        proj.stride(0), conv_weight.stride(0), conv_weight.stride(1), conv_states.stride(0), rec_states.stride(0),
        kept_conv_t.stride(0), kept_rec_t.stride(0), 1.0 / math.sqrt(head_k_dim), QK_NORM_EPS, eps,
        HK=num_k_heads, HV=num_v_heads, DK=head_k_dim, DV=head_v_dim, BLOCK_K=block_k, BLOCK_V=block_v,
        V_SPLITS=parts, KEEP_CONV=kept_conv is not None, KEEP_REC=kept_rec is not None, PDL=pdl, EARLY=early_reads(),
        num_warps=state_warps(block_k, block_v), **launch_options(pdl),
    )
    return out

"""The Gated DeltaNet layer of Qwen3-Next / Qwen3.5 (linear attention; issue 17), on the CPU
reference path, with its state explicit so speculative windows can roll it back.

A linear-attention layer keeps no KV rows: its memory is a state — the last K - 1 inputs of
the short causal convolution and the delta-rule matrix per value head (kernels.delta_rule).
A verify window advances it by every row; after k of n drafts are accepted the state must be
the one after row k (the head's row counts as row 0). `forward(..., keep_states=True)`
returns the state after each row, so rollback is picking one.

Parameter names are the checkpoints', so the loader maps them one to one. Two projection
layouts: Qwen3-Next's `in_proj_qkvz` / `in_proj_ba`, whose outputs are grouped by key head
("grouped"), and Qwen3.5's `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` ("split");
then `conv1d`, `dt_bias`, `A_log`, `norm`, `out_proj` in both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.delta_rule import causal_conv, chunked, recurrent

RECURRENT_ROWS = 32  # windows up to this many rows run the recurrent form; longer ones (prefill) the chunked


@dataclass(frozen=True)
class LinearState:
    """A Gated DeltaNet layer's memory of one sequence."""

    conv: Tensor  # [conv_dim, K - 1]: the last inputs of the causal convolution
    recurrent: Tensor  # [num_v_heads, head_k_dim, head_v_dim] float32


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output, then scaled by SiLU of the gate (norm before gate)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        dtype = x.dtype
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * y.to(dtype)
        return (y * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, *, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int, eps: float, layout: str = "grouped") -> None:
        super().__init__()
        if layout not in ("grouped", "split"):
            raise ValueError(f"projection layout {layout!r} must be grouped (Qwen3-Next) or split (Qwen3.5)")
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads {num_v_heads} must be a multiple of "
                             f"linear_num_key_heads {num_k_heads}")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        self.layout = layout
        if layout == "grouped":
            self.in_proj_qkvz = nn.Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(hidden_size, 2 * num_v_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(hidden_size, 2 * self.key_dim + self.value_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(hidden_size, num_v_heads, bias=False)
            self.in_proj_a = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False,
                                padding=conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def new_state(self) -> LinearState:
        device, dtype = self.conv1d.weight.device, self.conv1d.weight.dtype  # (projections may be FP8)
        return LinearState(
            conv=torch.zeros((self.conv_dim, self.conv_kernel - 1), dtype=dtype, device=device),
            recurrent=torch.zeros((self.num_v_heads, self.head_k_dim, self.head_v_dim), dtype=torch.float32,
                                  device=device))

    def _split(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """q, k [T, Hk*dk], v [T, Hv*dv], z [T, Hv, dv], b, a [T, Hv] from the projections (grouped
        layout: each key head's group holds q, k, then its value heads' v and z)."""
        rows, group = x.shape[0], self.num_v_heads // self.num_k_heads
        if self.layout == "split":
            q, k, v = self.in_proj_qkv(x).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
            return q, k, v, self.in_proj_z(x).view(rows, -1, self.head_v_dim), self.in_proj_b(x), self.in_proj_a(x)
        qkvz = self.in_proj_qkvz(x).view(rows, self.num_k_heads, -1)
        q, k, v, z = qkvz.split([self.head_k_dim, self.head_k_dim, group * self.head_v_dim, group * self.head_v_dim],
                                dim=-1)
        b, a = self.in_proj_ba(x).view(rows, self.num_k_heads, 2 * group).split([group, group], dim=-1)
        return (q.reshape(rows, -1), k.reshape(rows, -1), v.reshape(rows, -1), z.reshape(rows, -1, self.head_v_dim),
                b.reshape(rows, -1), a.reshape(rows, -1))

    @torch.inference_mode()
    def forward(self, x: Tensor, state: LinearState, *,
                keep_states: bool = False) -> tuple[Tensor, LinearState | list[LinearState]]:
        """Rows x [T, hidden] after `state`: (outputs [T, hidden], the state after the last row,
        or with keep_states the state after every row)."""
        rows = x.shape[0]
        q, k, v, z, b, a = self._split(x)
        mixed, conv_states = causal_conv(torch.cat([q, k, v], dim=-1), self.conv1d.weight[:, 0], state.conv,
                                         keep_states=keep_states)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(rows, self.num_k_heads, self.head_k_dim)
        k = k.reshape(rows, self.num_k_heads, self.head_k_dim)
        v = v.reshape(rows, self.num_v_heads, self.head_v_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # log decay per row and head
        if keep_states or rows <= RECURRENT_ROWS:
            out, states = recurrent(q, k, v, g, beta, state.recurrent, keep_states=keep_states)
        else:
            out, states = chunked(q, k, v, g, beta, state.recurrent)
        out = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim)).reshape(rows, -1)
        if keep_states:
            return self.out_proj(out), [LinearState(c, s) for c, s in zip(conv_states, states)]
        return self.out_proj(out), LinearState(conv_states, states)

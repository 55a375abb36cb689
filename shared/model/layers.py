"""Building blocks of the Qwen3-MoE decoder: RMSNorm, rotary embedding, attention, MLPs.

Parameter names mirror the Hugging Face checkpoint (`self_attn.q_proj`, `mlp.gate`, ...), so
a state dict maps onto the modules one to one; routed experts live in an ExpertStore.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.bias import causal_lower_right

from kernels.routing import route_prompt_topk, route_topk
from shared.model.config import ModelConfig
from shared.model.experts import ExpertStore


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """cos/sin tables for every position up to max_positions, computed once in float32."""

    def __init__(self, head_dim: int, theta: float, max_positions: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        angles = torch.cat([freqs, freqs], dim=-1)  # [positions, head_dim]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """Rotate x [T, heads, head_dim] at positions [T]."""
        cos = self.cos[positions].to(x.dtype).unsqueeze(1)
        sin = self.sin[positions].to(x.dtype).unsqueeze(1)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d
        bias = config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def forward(
        self,
        x: Tensor,  # [T, hidden]
        positions: Tensor,  # [T] int64
        cache_keys: Tensor,  # [max_length, kv_heads, head_dim]
        cache_values: Tensor,
        rotary: Rotary,
        visible: int | None,
    ) -> Tensor:
        """Attend over the cache after writing this window's keys and values into it.

        visible: number of leading cache rows to attend over (eager path, known on the host);
        None attends over the whole preallocated cache with a mask built from `positions`
        (static shapes, no host synchronisation: the CUDA-graph path).
        """
        num_rows = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(num_rows, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(num_rows, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(num_rows, self.num_kv_heads, self.head_dim)
        q, k = rotary(q, positions), rotary(k, positions)
        cache_keys.index_copy_(0, positions, k)
        cache_values.index_copy_(0, positions, v)
        if visible is None:
            keys, values = cache_keys, cache_values
            key_positions = torch.arange(keys.shape[0], device=x.device)
            mask = key_positions.unsqueeze(0) <= positions.unsqueeze(1)  # [T, keys]: causal
        else:
            # Eager windows are the rows just before `visible`: causal aligned to the bottom right,
            # which flash attention runs without a materialised mask (prefill chunks).
            keys, values = cache_keys[:visible], cache_values[:visible]
            mask = causal_lower_right(num_rows, visible)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # [1, heads, T, head_dim]
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return self.o_proj(out.squeeze(0).transpose(0, 1).reshape(num_rows, -1))


class DenseMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor, routing: RoutingOptions | None = None) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass(frozen=True)
class RoutingOptions:
    """How one forward routes its rows (DESIGN §5). The default is full (exact) routing.

    moce: route with the expert store's residency map and these scales; draft_rows [T]
    marks the rows that get the draft-row rule. prompt_packed: the opt-in, lossy packed
    prompt value for prefill chunks (None = off).
    """

    moce: bool = False
    scale: float = 1.0
    r1_scale: float = 1.0
    protect: int = 0
    draft_rows: Tensor | None = None
    prompt_packed: float | None = None

    def row(self, index: int) -> RoutingOptions:
        """The options of row `index` alone (its draft-row flag, if any)."""
        if self.draft_rows is None:
            return self
        return replace(self, draft_rows=self.draft_rows[index : index + 1])


FULL_ROUTING = RoutingOptions()


class MoeBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.top_k = config.num_experts_per_tok
        self.normalize = config.norm_topk_prob
        self.experts: ExpertStore | None = None  # attached by the loader

    def route(self, x: Tensor, routing: RoutingOptions) -> tuple[Tensor, Tensor]:
        router_logits = F.linear(x, self.gate.weight).float()  # [T, experts]
        if routing.prompt_packed is not None:
            return route_prompt_topk(
                router_logits, self.top_k, resident=self.experts.resident_mask(),
                packed=routing.prompt_packed, normalize=self.normalize,
            )
        resident = self.experts.resident_mask() if routing.moce else None
        return route_topk(
            router_logits, self.top_k, resident=resident, scale=routing.scale, r1_scale=routing.r1_scale,
            protect=routing.protect, draft_rows=routing.draft_rows, normalize=self.normalize,
        )

    def forward(self, x: Tensor, routing: RoutingOptions | None = None) -> Tensor:
        routing = routing or FULL_ROUTING
        expert_ids, weights = self.route(x, routing)
        path = None
        if routing.prompt_packed is not None and routing.prompt_packed < 0:
            path = "dispatch"  # dropped (-1) routes go through dispatch, which never indexes with them
        return self.experts.forward(x, expert_ids, weights.to(x.dtype), path=path)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dense: bool) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp: nn.Module = DenseMLP(config.hidden_size, config.intermediate_size) if dense else MoeBlock(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        cache_keys: Tensor,
        cache_values: Tensor,
        rotary: Rotary,
        visible: int | None,
        routing: RoutingOptions | None,
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, cache_keys, cache_values, rotary, visible)
        return x + self.mlp(self.post_attention_layernorm(x), routing)

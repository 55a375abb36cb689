"""Building blocks of the Qwen3-MoE decoder: attention, the MoE block and the decoder layer.

Parameter names mirror the Hugging Face checkpoint (`self_attn.q_proj`, `mlp.gate`, ...), so
a state dict maps onto the modules one to one; routed experts live in an ExpertStore
(shared.model.moe.MoeBlock, the MoE block both families use).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.bias import causal_lower_right

from shared.model.families.qwen3_moe.config import ModelConfig
from shared.model.layers import DenseMLP, RMSNorm, Rotary, RoutingOptions
from shared.model.moe import MoeBlock


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

class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dense: bool) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        if dense:
            self.mlp: nn.Module = DenseMLP(config.hidden_size, config.intermediate_size)
        else:
            self.mlp = MoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                                normalize=config.norm_topk_prob)
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

"""One rank's share of a hybrid model's dense weights (DESIGN §13; the routed experts are the
loader's, shared.model.parallel.shard the rules common to both families).

With the dense weights split, rank r keeps:
- a Gated DeltaNet layer's r-th share of its key heads and of its value heads (a value head's
  key head is on the same rank: groups stay whole): their rows of the q, k and v projections and
  of the convolution's channels (q, k, v in that order), of z, b, a, A_log and dt_bias, and
  out_proj's columns of its value heads; the gated norm's weight (per head dimension) whole;
- a gated attention layer's share of its query heads (each head's query then its gate) and of its
  KV heads, and o_proj's columns;
- a dense MLP's share of its intermediate.
Each layer's output projection then gives a partial sum, the ranks' added by the norm after it.
The shared expert and the routers stay whole (rank 0 runs the shared expert's route).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from shared.model.families.hybrid.deltanet import GatedDeltaNet
from shared.model.families.hybrid.layout import split_grouped
from shared.model.parallel.shard import Shard, keep_columns, keep_dense_mlp, keep_rows


def shard_mixers(model, shard: Shard) -> None:
    """In place: every token mixer and dense MLP cut to the rank's share (shard_layer), the config
    to the rank's view (its head counts: the KV pool and the linear-attention states are sized
    from them)."""
    for layer in model.layers:
        shard_layer(layer, shard, model.config)
    model.config = rank_config(model.config, shard)


def rank_config(c, shard: Shard):
    """The config as a rank with the dense weights split sees it: its head counts."""
    return replace(c, num_attention_heads=len(shard.part(c.num_attention_heads, "num_attention_heads")),
                   num_key_value_heads=len(shard.part(c.num_key_value_heads, "num_key_value_heads")),
                   linear_num_key_heads=len(shard.part(c.linear_num_key_heads, "linear_num_key_heads")),
                   linear_num_value_heads=len(shard.part(c.linear_num_value_heads, "linear_num_value_heads")))


def shard_layer(layer, shard: Shard, c) -> None:
    """One decoder layer's token mixer and dense MLP cut to the rank's share (full precision:
    before any quantization)."""
    if layer.linear:
        _shard_deltanet(layer.linear_attn, shard.part(c.linear_num_key_heads, "linear_num_key_heads"),
                        shard.part(c.linear_num_value_heads, "linear_num_value_heads"))
    else:
        heads = shard.part(c.num_attention_heads, "num_attention_heads")
        kv_heads = shard.part(c.num_key_value_heads, "num_key_value_heads")
        attn, d = layer.self_attn, layer.self_attn.head_dim
        keep_rows(attn.q_proj, slice(heads.start * 2 * d, heads.stop * 2 * d))  # (each head: query, gate)
        keep_rows(attn.k_proj, slice(kv_heads.start * d, kv_heads.stop * d))
        keep_rows(attn.v_proj, slice(kv_heads.start * d, kv_heads.stop * d))
        keep_columns(attn.o_proj, slice(heads.start * d, heads.stop * d))
        attn.num_heads, attn.num_kv_heads = len(heads), len(kv_heads)
    if hasattr(layer.mlp, "gate_proj"):  # a dense layer
        keep_dense_mlp(layer.mlp, shard, c.intermediate_size)


def _shard_deltanet(attn: GatedDeltaNet, k_heads: range, v_heads: range) -> None:
    if attn.layout == "grouped":
        split_grouped(attn)  # (Qwen3-Next's rows permuted to Qwen3.5's: q, k, v apart)
    dk, dv = attn.head_k_dim, attn.head_v_dim
    key_dim = attn.key_dim
    q = torch.arange(k_heads.start * dk, k_heads.stop * dk)
    channels = torch.cat([q, key_dim + q, 2 * key_dim + torch.arange(v_heads.start * dv, v_heads.stop * dv)])
    values = slice(v_heads.start * dv, v_heads.stop * dv)
    heads = slice(v_heads.start, v_heads.stop)
    keep_rows(attn.in_proj_qkv, channels)
    keep_rows(attn.conv1d, channels)  # (its weight [C, 1, K]: one filter a channel)
    keep_rows(attn.in_proj_z, values)
    keep_rows(attn.in_proj_b, heads)
    keep_rows(attn.in_proj_a, heads)
    keep_rows(attn, heads, "A_log")
    keep_rows(attn, heads, "dt_bias")
    keep_columns(attn.out_proj, values)
    attn.num_k_heads, attn.num_v_heads = len(k_heads), len(v_heads)
    attn.key_dim, attn.value_dim = len(k_heads) * dk, len(v_heads) * dv
    attn.conv_dim = 2 * attn.key_dim + attn.value_dim
    attn.conv1d.in_channels = attn.conv1d.out_channels = attn.conv1d.groups = attn.conv_dim

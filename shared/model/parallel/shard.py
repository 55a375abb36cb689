"""What one rank of a model split over `size` processes holds (DESIGN §13).

- Routed experts: rank r keeps the contiguous r-th share (experts r·E/N .. (r+1)·E/N - 1); the
  loader reads only those. The router stays whole on every rank (it is small, and each rank then
  knows every row's routes without a message).
- The dense weights (`dense="split"`, the default) are split too:
  - attention: rank r keeps its share of the query heads and of the KV heads (GQA groups stay
    whole: query head h reads KV head h // (Hq / Hkv) on the same rank), so q/k/v keep their
    rows of those heads and o_proj its columns; the KV pool holds only the rank's KV heads;
  - a dense MLP layer: its share of the intermediate (gate/up rows, down columns);
  - the lm_head: the r-th share of the vocabulary's rows (zero rows pad the last share to the
    others' size), the logits gathered in rank order (a tied lm_head gets its own copy of its
    share; the embedding, a look-up of one row a token, stays whole).
  The hybrid family's token mixers split the same way (families/hybrid/shard.py).
- `dense="whole"`: every rank keeps all but its experts: one collective a layer instead of two
  and none for the logits — a step's rows are then one process's bits given the same KV — each
  rank reading every dense weight a step: the better trade where they are a small part of a
  step's bytes (a choice measured per model: docs/PERFORMANCE.md).
- Embeddings, norms and routers are replicated.

A rank's model then carries its own view of the config (its head counts), so everything sized
from the config (the KV pool, the attention workspace) is the rank's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

DENSE = ("split", "whole")


@dataclass(frozen=True)
class Shard:
    rank: int
    size: int
    dense: str = "split"  # DENSE: attention, dense MLPs and the lm_head split over the ranks, or whole on each

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"parallel size {self.size} must be >= 1")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} must lie in [0, {self.size})")
        if self.dense not in DENSE:
            raise ValueError(f"parallel_dense {self.dense!r} must be one of {', '.join(DENSE)}")

    @property
    def splits_dense(self) -> bool:
        return self.dense == "split" and self.size > 1

    def part(self, count: int, what: str) -> range:
        """This rank's contiguous share of `count` things; ValueError naming `what` unless it divides."""
        if count % self.size:
            raise ValueError(f"{what} ({count}) is not divisible by --parallel {self.size}")
        share = count // self.size
        return range(self.rank * share, (self.rank + 1) * share)


def check_shardable(config, shard: Shard) -> None:
    """ValueError naming the first field of a qwen3_moe config that shard.size ranks cannot split."""
    shard.part(config.num_experts, "num_experts")
    if shard.splits_dense:
        shard.part(config.num_attention_heads, "num_attention_heads")
        shard.part(config.num_key_value_heads, "num_key_value_heads")
    if shard.splits_dense and any(config.is_dense_layer(i) for i in range(config.num_hidden_layers)):
        shard.part(config.intermediate_size, "intermediate_size")


def _full_precision(weight: torch.Tensor) -> torch.Tensor:
    if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"--parallel splits full-precision dense weights only (this model's are {weight.dtype}): load "
                         "it with --quantize none, or keep the dense weights whole (--parallel-dense whole)")
    return weight


def keep_rows(module: nn.Module, rows: slice | torch.Tensor, name: str = "weight") -> None:
    """The module's parameter `name` keeps these rows (its first dimension's: a slice or indices)."""
    kept = _full_precision(getattr(module, name).data)[rows].clone()
    setattr(module, name, nn.Parameter(kept, requires_grad=False))
    if isinstance(module, nn.Linear) and name == "weight":
        module.out_features = kept.shape[0]


def keep_columns(linear: nn.Linear, columns: slice) -> None:
    linear.weight = nn.Parameter(_full_precision(linear.weight.data)[:, columns].clone(), requires_grad=False)
    linear.in_features = linear.weight.shape[1]


def keep_dense_mlp(mlp: nn.Module, shard: Shard, intermediate_size: int) -> None:
    """A dense MLP's share of its intermediate: gate/up rows, down columns."""
    inter = shard.part(intermediate_size, "intermediate_size")
    cut = slice(inter.start, inter.stop)
    keep_rows(mlp.gate_proj, cut)
    keep_rows(mlp.up_proj, cut)
    keep_columns(mlp.down_proj, cut)


def shard_trunk(model, shard: Shard) -> None:
    """In place, on a loaded qwen3_moe trunk whose experts the loader already sharded: attention
    heads and dense MLPs cut to the rank's share, the config to the rank's view. Full-precision
    projections only (an FP8 projection's block scales would have to split along with it)."""
    config = model.config
    check_shardable(config, shard)
    whole = Shard(0, 1)
    heads = (shard if shard.splits_dense else whole).part(config.num_attention_heads, "num_attention_heads")
    kv_heads = (shard if shard.splits_dense else whole).part(config.num_key_value_heads, "num_key_value_heads")
    d = config.head_dim
    q_rows, kv_rows = slice(heads.start * d, heads.stop * d), slice(kv_heads.start * d, kv_heads.stop * d)
    for layer in model.layers:
        attn = layer.self_attn
        if shard.splits_dense:
            keep_rows(attn.q_proj, q_rows)
            keep_rows(attn.k_proj, kv_rows)
            keep_rows(attn.v_proj, kv_rows)
            keep_columns(attn.o_proj, q_rows)
            attn.num_heads, attn.num_kv_heads = len(heads), len(kv_heads)
        if hasattr(layer.mlp, "gate_proj") and shard.splits_dense:  # a dense layer
            keep_dense_mlp(layer.mlp, shard, config.intermediate_size)
    model.config = replace(config, num_attention_heads=len(heads), num_key_value_heads=len(kv_heads))
    if shard.splits_dense:
        shard_lm_head(model, shard)
    model.shard = shard


def shard_lm_head(model, shard: Shard) -> None:
    """In place, either family: the lm_head keeps the rank's rows of the vocabulary, padded with
    zero rows to ceil(V / N) (every rank's share one size, for the gather)."""
    weight = model.lm_head.weight.data  # [V, H] (a tied model's embedding: not touched)
    share = -(-weight.shape[0] // shard.size)
    rows = weight[shard.rank * share : (shard.rank + 1) * share]
    if rows.shape[0] < share:
        rows = torch.cat([rows, rows.new_zeros(share - rows.shape[0], rows.shape[1])])
    model.lm_head.weight = nn.Parameter(rows.clone(), requires_grad=False)
    model.lm_head.out_features = share


def expert_table(num_experts: int, shard: Shard, device: torch.device) -> torch.Tensor:
    """[E] int64: a global expert id's index in this rank's store, -1 where another rank holds it."""
    owned = shard.part(num_experts, "num_experts")
    table = torch.full((num_experts,), -1, dtype=torch.int64, device=device)
    table[owned.start : owned.stop] = torch.arange(len(owned), device=device)
    return table

"""The hybrid family's weights in the fused layout (DESIGN §6, §11): what HybridFused reads,
made from the reference modules without keeping anything twice (the modules re-pointed at views
of the fused tensors, so the reference forward stays what the tests compare with).

- `split_grouped`: Qwen3-Next's grouped in-projections as Qwen3.5's split ones (rows permuted);
- `with_shared_expert`: the shared expert as one more expert after the routed ones' slots, so
  one fused launch runs routed and shared routes alike (full precision or FP8).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kernels.fused.fp8 import FP8_DTYPE, Fp8Weight, cat_rows, row_slice, take_rows
from shared.model.families.hybrid.deltanet import GatedDeltaNet
from shared.model.families.hybrid.modules import SharedMoe
from shared.model.quantize import Fp8Linear, weight_of


def split_grouped(attn: GatedDeltaNet) -> None:
    """Qwen3-Next's grouped in-projections as Qwen3.5's split ones: the same outputs, their rows
    permuted (per key head [q, k, its value heads' v, z] and [b, a] → all q, all k, all v, z, b, a).
    FP8 projections keep their values, one scale per row (kernels.fused.fp8.take_rows)."""
    hk, group = attn.num_k_heads, attn.num_v_heads // attn.num_k_heads
    dk, dv = attn.head_k_dim, attn.head_v_dim
    qkvz = torch.arange(attn.in_proj_qkvz.out_features).unflatten(0, (hk, -1))  # [Hk, 2dk + 2 group dv] row ids
    q, k, v, z = qkvz.split([dk, dk, group * dv, group * dv], dim=1)
    b, a = torch.arange(attn.in_proj_ba.out_features).unflatten(0, (hk, 2 * group)).split([group, group], dim=1)

    def rows_of(module: nn.Module, index: Tensor) -> nn.Module:  # a projection of `module`'s rows `index`
        if isinstance(module, Fp8Linear):
            return Fp8Linear(take_rows(module.fp8(), index.flatten().to(module.weight.device)))
        weight = module.weight.detach()[index.flatten().to(module.weight.device)].contiguous()
        new = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        new.weight = nn.Parameter(weight, requires_grad=False)
        return new

    attn.in_proj_qkv = rows_of(attn.in_proj_qkvz, torch.cat([q.flatten(), k.flatten(), v.flatten()]))
    attn.in_proj_z, attn.in_proj_b, attn.in_proj_a = (rows_of(attn.in_proj_qkvz, z), rows_of(attn.in_proj_ba, b),
                                                      rows_of(attn.in_proj_ba, a))
    del attn.in_proj_qkvz, attn.in_proj_ba
    attn.layout = "split"


def with_shared_expert(mlp: SharedMoe) -> tuple[Tensor, Tensor]:
    """The kernels' expert weights: the routed experts' slots, then the shared expert as one
    more (zero-padded to the routed width: zero rows add exact zeros), resident for good in the
    store (ExpertStore.with_fixed); the reference modules re-pointed at views (nothing kept twice)."""
    store, shared = mlp.store, mlp.shared_expert
    if store.num_fixed:  # fused before (another forward over the same model)
        return store.fixed_weights
    if store.fp8:
        return _with_fp8_shared_expert(mlp)
    width, hidden = store.down.shape[2], store.down.shape[1]
    shared_width = shared.gate_proj.weight.shape[0]
    gate_up = torch.zeros((1, 2 * width, hidden), dtype=store.gate_up.dtype, device=store.device)
    down = torch.zeros((1, hidden, width), dtype=store.down.dtype, device=store.device)
    gate_up[0, :shared_width].copy_(shared.gate_proj.weight.detach())
    gate_up[0, width : width + shared_width].copy_(shared.up_proj.weight.detach())
    down[0, :, :shared_width].copy_(shared.down_proj.weight.detach())
    all_gate_up, all_down = store.with_fixed(gate_up, down)
    mlp.experts.adopt(store)
    slot = store.num_slots
    shared.gate_proj.weight = nn.Parameter(all_gate_up[slot, :shared_width], requires_grad=False)
    shared.up_proj.weight = nn.Parameter(all_gate_up[slot, width : width + shared_width], requires_grad=False)
    shared.down_proj.weight = nn.Parameter(all_down[slot, :, :shared_width], requires_grad=False)
    if store.device.type == "cuda":
        # The layer's old expert tensors are free now: hand their blocks back before the next
        # layer's copies, or the allocator splits them for those and keeps ~0.6 of them stuck
        # in its cache (H200, 35B-A3B shapes: 40.6 GiB reserved beyond what was allocated).
        torch.cuda.empty_cache()
    return all_gate_up, all_down


def _with_fp8_shared_expert(mlp: SharedMoe) -> tuple[Fp8Weight, Fp8Weight]:
    """with_shared_expert for FP8 experts: the shared expert's FP8 values and scales, zero-padded
    to the routed width where narrower (zero values add exact zeros whatever their scale);
    re-pointed at the store's copy where no padding was needed."""
    store, shared = mlp.store, mlp.shared_expert
    gate, up, down = (weight_of(shared.gate_proj), weight_of(shared.up_proj), weight_of(shared.down_proj))
    if not all(isinstance(w, Fp8Weight) for w in (gate, up, down)):
        raise ValueError("FP8 routed experts need an FP8 shared expert (a checkpoint mixing them is not supported yet)")
    width = store.down.shape[2]
    shared_width = gate.shape[0]
    pad = width - shared_width
    if pad:
        gate, up = (cat_rows([w, _zeros(pad, w.shape[1], w.block, w.device)]) for w in (gate, up))
        down = _pad_columns(down, width)
    all_gate_up, all_down = store.with_fixed(cat_rows([gate, up])[None], Fp8Weight(down.q[None], down.scale[None],
                                                                                    down.block))
    mlp.experts.adopt(store)
    if not pad:  # the reference modules as views of the store's copy (nothing kept twice)
        slot = all_gate_up[store.num_slots]
        shared.gate_proj.repoint(row_slice(slot, 0, width))
        shared.up_proj.repoint(row_slice(slot, width, 2 * width))
        shared.down_proj.repoint(all_down[store.num_slots])
    if store.device.type == "cuda":
        torch.cuda.empty_cache()  # (as in with_shared_expert)
    return all_gate_up, all_down


def _zeros(rows: int, columns: int, block: tuple[int, int], device: torch.device) -> Fp8Weight:
    q = torch.zeros((rows, columns), dtype=FP8_DTYPE, device=device)
    scale = torch.ones((-(-rows // block[0]), -(-columns // block[1])), device=device)
    return Fp8Weight(q, scale, block)


def _pad_columns(weight: Fp8Weight, columns: int) -> Fp8Weight:
    """weight [N, K] with zero columns up to `columns` (scale columns of 1 for whole new blocks)."""
    rows, num_cols = weight.q.shape
    q = torch.cat([weight.q, torch.zeros((rows, columns - num_cols), dtype=FP8_DTYPE, device=weight.device)], dim=1)
    extra = -(-columns // weight.block[1]) - weight.scale.shape[1]
    scale = torch.cat([weight.scale, torch.ones((weight.scale.shape[0], extra), device=weight.device)], dim=1)
    return Fp8Weight(q.contiguous(), scale.contiguous(), weight.block)

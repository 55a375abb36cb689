"""Prefill's expert products over routes sorted by expert, FP8 weights read as stored (issue 36).

A prompt chunk's routes (T tokens × top k) are sorted by expert and each expert's run of routes
is cut into tiles of up to BLOCK_M; a program multiplies one tile by a column block of its
expert's weights. Where the routes of a chunk cover most experts, a layer's FP8 weights would
otherwise be dequantised whole before torch's grouped GEMM (kernels.fused.linear.dense: a bf16
copy of every expert written and read again, each chunk); here each weight tile is read once
per route tile as its e4m3 bytes and made bf16 in registers (fp8_kernels.tile_dot, the decode
kernels' way), so a chunk moves the FP8 bytes and no copy.

The tile table (which expert, which sorted routes) is made on the device from the experts'
route counts, with no host synchronisation (CUDA-graph safe, like the rest of prefill). Every
route is computed with one fixed tile whatever the chunk holds (GATE_UP_TILE, DOWN_TILE: never
chosen by the route count), so a route's output is the same bits whichever prompts share the
chunk (DESIGN §11: prefill's row invariance). The CPU (and a GPU without Triton) takes the
reference: the dequantised weights, expert by expert.

Weights use the ExpertStore layout: gate_up [E, 2I, H] (gate rows, then up rows), down [E, H, I].
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.fused import cdiv, next_power_of_2, use_triton
from kernels.fused import linear as linear_module
from kernels.fused.fp8 import Fp8Weight
from kernels.fused.linear import Weight, dense
from kernels.fused.moe import expert_fp8_arguments

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), fixed for every route count (row invariance).
# BLOCK_K stays inside one FP8 block column (the experts' exact way, fp8_kernels.scaled_dot).
GATE_UP_TILE = (64, 64, 128, 4, 3)  # two accumulators (gate, up) a program
DOWN_TILE = (64, 128, 128, 4, 3)


TABLE_BLOCK = 128  # tiles a program of the table kernel writes


@functools.cache
def _kernels():
    from kernels.fused.grouped_kernels import grouped_down_kernel, grouped_gate_up_kernel, tile_table_kernel

    return grouped_gate_up_kernel, grouped_down_kernel, tile_table_kernel


def tile_table(counts: Tensor, block_m: int, num_routes: int) -> tuple[Tensor, Tensor, Tensor]:
    """(expert [G], first sorted route [G], length [G]) int32 of every tile, for routes sorted by
    expert with counts [E] routes of each (the sort's first sum(counts) positions): expert e's run
    cut into tiles of up to block_m. G = cdiv(num_routes, block_m) + E bounds the tiles of any
    counts summing to at most num_routes (fixed on the host: no synchronisation); tiles past the
    last have length 0. Where Triton runs, one kernel (a prefill forward's host pays a launch a
    layer, not a dozen torch ops); else torch ops, its reference."""
    num_experts = counts.numel()
    num_tiles = cdiv(num_routes, block_m) + num_experts
    if use_triton(counts):
        expert, start, length = (torch.empty(num_tiles, dtype=torch.int32, device=counts.device) for _ in range(3))
        _kernels()[2][(cdiv(num_tiles, TABLE_BLOCK),)](
            counts, expert, start, length, num_experts, num_tiles, E_PAD=max(16, next_power_of_2(num_experts)),
            BLOCK_G=TABLE_BLOCK, BLOCK_M=block_m, num_warps=4)
        return expert, start, length
    return tile_table_reference(counts, block_m, num_routes)


def tile_table_reference(counts: Tensor, block_m: int, num_routes: int) -> tuple[Tensor, Tensor, Tensor]:
    """tile_table by torch ops."""
    num_experts = counts.numel()
    counts = counts.to(torch.int64)
    tiles = (counts + block_m - 1) // block_m  # [E]
    tile_end = torch.cumsum(tiles, dim=0)  # [E]
    route_end = torch.cumsum(counts, dim=0)
    g = torch.arange(cdiv(num_routes, block_m) + num_experts, device=counts.device)
    expert = torch.searchsorted(tile_end, g, right=True)  # [G]: E past the last tile
    valid = expert < num_experts
    e = expert.clamp(max=num_experts - 1)
    within = g - (tile_end[e] - tiles[e])
    start = route_end[e] - counts[e] + within * block_m
    length = torch.where(valid, (counts[e] - within * block_m).clamp(0, block_m), 0)
    return e.to(torch.int32), start.to(torch.int32), length.to(torch.int32)


def grouped_experts_reference(
    x: Tensor,  # [T, H]
    order: Tensor,  # [R] route ids t*k + rank, sorted by expert
    counts: Tensor,  # [E] routes of each expert (the first sum(counts) of order)
    top_k: int,
    gate_up: Weight,  # [E, 2I, H]
    down: Weight,  # [E, H, I]
) -> Tensor:
    """grouped_experts' outputs by the dequantised weights, one expert at a time (sums in float32,
    or float64 for float64 x; one rounding to x's dtype; rows past sum(counts) are zeros)."""
    work = torch.promote_types(x.dtype, torch.float32)
    out = torch.zeros((order.numel(), x.shape[1]), dtype=x.dtype, device=x.device)
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count:
            rows = x[order[start : start + count] // top_k].to(work)
            gate, up = (rows @ dense(gate_up[expert], work).to(work).T).chunk(2, dim=-1)
            out[start : start + count] = ((F.silu(gate) * up) @ dense(down[expert], work).to(work).T).to(x.dtype)
        start += count
    return out


def grouped_experts(
    x: Tensor,  # [T, H]
    order: Tensor,  # [R] int64: route ids t*k + rank, sorted by expert (stable)
    counts: Tensor,  # [E] int: routes of each expert, the first sum(counts) positions of order
    top_k: int,
    gate_up: Weight,  # [E, 2I, H] (or block-scaled FP8: kernels.fused.fp8)
    down: Weight,  # [E, H, I]
) -> Tensor:
    """Route outputs [R, H] in the sorted order, x's dtype: down(silu(gate) * up) of route order[m]'s
    token under its expert. Positions past sum(counts) (routes of no expert here) are not written."""
    if isinstance(gate_up, Fp8Weight) != isinstance(down, Fp8Weight):
        raise ValueError("grouped_experts: gate_up and down must both be FP8 or neither")
    if counts.numel() != gate_up.shape[0]:
        raise ValueError(f"grouped_experts: counts has {counts.numel()} experts, gate_up {gate_up.shape[0]}")
    if not use_triton(x):
        return grouped_experts_reference(x, order, counts, top_k, gate_up, down)
    num_routes, hidden = order.numel(), x.shape[1]
    inter = down.shape[2]
    gate_up_kernel, down_kernel, _ = _kernels()
    act = torch.empty((num_routes, inter), dtype=x.dtype, device=x.device)
    out = torch.empty((num_routes, hidden), dtype=x.dtype, device=x.device)
    if num_routes == 0:
        return out
    ieee = x.dtype == torch.float32
    order = order.contiguous()
    block_m, block_n, block_k, warps, stages = GATE_UP_TILE
    expert, start, length = tile_table(counts, block_m, num_routes)
    block_k = _tile_k(gate_up, block_k)
    gate_up_kernel[(expert.numel(), cdiv(inter, block_n))](
        x.contiguous(), order, expert, start, length, _values(gate_up), act, inter, hidden,
        **expert_fp8_arguments(gate_up, block_k, x), TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee,
        num_warps=warps, num_stages=stages,
    )
    down_m, block_n, block_k, warps, stages = DOWN_TILE
    if down_m != block_m:
        expert, start, length = tile_table(counts, down_m, num_routes)
    block_k = _tile_k(down, block_k)
    down_kernel[(expert.numel(), cdiv(hidden, block_n))](
        act, expert, start, length, _values(down), out, inter, hidden, **expert_fp8_arguments(down, block_k, x),
        BLOCK_M=down_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee, num_warps=warps, num_stages=stages,
    )
    return out


def _values(weight: Weight) -> Tensor:
    values = weight.q if isinstance(weight, Fp8Weight) else weight
    if not values.is_contiguous():
        raise ValueError("grouped_experts: expert weights must be contiguous")
    return values


def _tile_k(weight: Weight, block_k: int) -> int:
    """The K tile of an FP8 weight: whole pieces of block columns, inside one with the experts'
    exact way (EXPERT_FP8_EXACT: fp8_kernels.scaled_dot)."""
    if not isinstance(weight, Fp8Weight):
        return block_k
    if not weight.kernel_ready():
        raise ValueError(f"grouped_experts: FP8 experts in blocks of {list(weight.block)} are not ones the kernels "
                         f"read (columns a multiple of 16)")
    return weight.tile_k(min(block_k, weight.block[1]) if linear_module.EXPERT_FP8_EXACT else block_k)

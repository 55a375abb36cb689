"""A chain of dependent products in one persistent launch: issue 39's probe (DESIGN §11).

A one-row decode step is a chain of dependent kernels, each so small that its launch, ramp and
drain cost more than its bytes (docs/PERFORMANCE.md). Here the programs stay resident across a
chain of products — stage s multiplies the sum of stage s-1's split-K partials by its weight —
and meet at grid barriers, so nothing is launched between stages, and (`prefetch`) the next
stage's weights can stream into L2 while the data they multiply is still being made. The chain
is the smallest thing that answers whether a persistent step pays in Triton on the GPU
(bench/persistent_probe.py times it against the same products as today's kernels in a CUDA
graph) before a whole layer is built this way.

Invariants: a stage's partials are linear_partials' with the same tiles (the same K order and
product), so a row's bits depend neither on the other rows nor on the number of programs, and
the consumer adds partials in split order as today's do. The barrier needs every program
resident at once: on CUDA the launch is cooperative (one program a multiprocessor by default);
the interpreter runs programs one after another, so there a chain runs as one program.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from kernels.fused import cdiv, interpreting, tl_dtype, use_triton
from kernels.fused.linear import BLOCK_M, linear_config, pipeline_stages, rowwise_linear

STAGE_FIELDS = 8  # persistent_kernels.FIELDS
LINE = 128  # bytes an L2 prefetch covers
PREFETCH_WAYS = {"none": 0, "before-barrier": 1, "at-stage-start": 2}


@functools.cache
def _kernels():
    from kernels.fused.persistent_kernels import chain_kernel

    return chain_kernel


def k_per_split(num_in: int, splits: int, block_k: int) -> int:
    """K columns per split: whole K tiles (as linear_partials splits)."""
    return cdiv(cdiv(num_in, splits), block_k) * block_k


class ChainPlan:
    """Buffers, table and barrier counter of one chain at one row count (as a captured graph is
    one window size): `run(x)` returns the last stage's partials [splits, rows, num_out] float32."""

    def __init__(self, weights: list[Tensor], splits: list[int], rows: int, *, programs: int | None = None,
                 prefetch: str = "none", tile: tuple[int, int, int, int] | None = None,
                 cooperative: bool = True) -> None:
        if not weights or len(weights) != len(splits):
            raise ValueError(f"weights ({len(weights)}) and splits ({len(splits)}) must be as many, at least one")
        first = weights[0]
        for s, (weight, num_splits) in enumerate(zip(weights, splits)):
            if weight.dim() != 2 or weight.stride(1) != 1 or weight.stride(0) != weight.shape[1]:
                raise ValueError(f"weights[{s}]: a contiguous [num_out, num_in] matrix is needed")
            if weight.dtype != first.dtype or weight.device != first.device:
                raise ValueError(f"weights[{s}]: {weight.dtype} on {weight.device}, not {first.dtype} on {first.device}")
            if s and weight.shape[1] != weights[s - 1].shape[0]:
                raise ValueError(f"weights[{s}]: takes {weight.shape[1]} inputs, stage {s - 1} makes {weights[s - 1].shape[0]}")
            if num_splits < 1:
                raise ValueError(f"splits[{s}] = {num_splits} must be >= 1")
        if not 1 <= rows <= BLOCK_M:
            raise ValueError(f"rows = {rows} must lie in [1, {BLOCK_M}] (one BLOCK_M tile)")
        if prefetch not in PREFETCH_WAYS:
            raise ValueError(f"prefetch = {prefetch!r} is not one of {sorted(PREFETCH_WAYS)}")
        device = first.device
        if programs is None:
            programs = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        if programs < 1 or (device.type != "cuda" and programs != 1):
            raise ValueError(f"programs = {programs}: at least 1, and exactly 1 off CUDA (the interpreter runs "
                             f"programs one after another, so a grid barrier over more would never be passed)")
        if prefetch != "none" and device.type != "cuda":
            raise ValueError("prefetch: the L2 prefetch is PTX, so it needs CUDA")
        self.weights, self.splits, self.rows, self.programs = list(weights), list(splits), rows, programs
        self.prefetch = PREFETCH_WAYS[prefetch]
        # cooperative: the driver refuses a grid that cannot be resident at once (else a barrier
        # would hang); off, residency rests on the grid fitting the GPU with nothing else running.
        self.cooperative = cooperative
        if tile is None:
            # linear_config's tile, its stages refitted: each K step also buffers the float32
            # partials of the input (as many as the widest split before)
            block_n, block_k, warps, stages = linear_config(*first.shape, first.element_size())
            max_in = max([1, *splits[:-1]])
            tile = (block_n, block_k, warps,
                    pipeline_stages(stages, (BLOCK_M * 4 * max_in + block_n * first.element_size()) * block_k))
        self.tile = tile
        block_k = self.tile[1]
        self.input = torch.zeros((1, rows, first.shape[1]), dtype=torch.float32, device=device)  # [1, rows, K0]
        self.outputs = [torch.zeros((s, rows, w.shape[0]), dtype=torch.float32, device=device)  # [splits, rows, N]
                        for w, s in zip(weights, splits)]
        table = []
        previous, previous_splits = self.input, 1
        for weight, num_splits, out in zip(weights, splits, self.outputs):
            num_out, num_in = weight.shape
            table.append([weight.data_ptr(), out.data_ptr(), previous.data_ptr(), num_out, num_in, num_splits,
                          k_per_split(num_in, num_splits, block_k), previous_splits])
            previous, previous_splits = out, num_splits
        self.table = torch.tensor(table, dtype=torch.int64, device=device)  # [stages, STAGE_FIELDS]
        self.counter = torch.zeros(1, dtype=torch.int32, device=device)

    def run(self, x: Tensor) -> Tensor:  # x [rows, K0] in the weights' dtype
        if tuple(x.shape) != tuple(self.input.shape[1:]) or x.dtype != self.weights[0].dtype:
            raise ValueError(f"x: {tuple(x.shape)} {x.dtype}, the plan takes {tuple(self.input.shape[1:])} "
                             f"{self.weights[0].dtype}")
        self.input[0].copy_(x)
        if not use_triton(x):
            for s, (weight, num_splits) in enumerate(zip(self.weights, self.splits)):
                source = self.input if s == 0 else self.outputs[s - 1]
                self.outputs[s].copy_(stage_partials(sum_partials(source).to(weight.dtype), weight, num_splits,
                                                     self.tile[1]))
            return self.outputs[-1]
        self.counter.zero_()
        block_n, block_k, warps, stages = self.tile
        options = {"launch_cooperative_grid": True} if self.cooperative and not interpreting() else {}
        _kernels()[(self.programs,)](
            self.table, self.counter, len(self.weights), self.rows,
            BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, DTYPE=tl_dtype(x.dtype), IEEE=x.dtype == torch.float32,
            PREFETCH=self.prefetch, LINE=LINE // x.element_size(), MAX_IN_SPLITS=max([1, *self.splits[:-1]]),
            num_warps=warps, num_stages=stages, **options,
        )
        return self.outputs[-1]


def sum_partials(partials: Tensor) -> Tensor:  # [splits, rows, N] float32 -> [rows, N]
    """The partials added in split order (as every consumer of split-K partials adds them)."""
    total = partials[0].clone()
    for part in partials[1:]:
        total += part
    return total


def stage_partials(x: Tensor, weight: Tensor, splits: int, block_k: int) -> Tensor:
    """The torch reference of one stage: [splits, rows, N] float32, split s the product over K range
    s·k_per_split ..., row by row (rowwise_linear), as linear_partials' reference."""
    step = k_per_split(weight.shape[1], splits, block_k)
    return torch.stack([rowwise_linear(x[:, s * step:(s + 1) * step].float(), weight[:, s * step:(s + 1) * step].float())
                        for s in range(splits)])

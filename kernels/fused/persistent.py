"""A chain of dependent products in one persistent launch: issue 39's probe (DESIGN §11).

A one-row decode step is a chain of dependent kernels, each so small that its launch, ramp and
drain cost more than its bytes (docs/PERFORMANCE.md). Here the programs of one launch stay
resident across a chain of stages and meet at grid barriers, so nothing is launched between
stages, and (`prefetch`) the next stage's weights can stream into L2 while the data they
multiply is still being made. Stages:
- `Dense(weight, splits)`: the sum of the stage before's split-K partials (in split order,
  rounded to the weights' dtype) times the weight, as split-K partials;
- `Experts(gate_up, down, top_k)`, after a Dense stage that is its router: each row's routes
  from the router's partials (as kernels.fused.router.route makes them), then two stages — gate
  and up of each route with SiLU (its input the router's), and down with the routes' outputs
  added by weight in rank order (the combine, without residual or norm).
The chain is the smallest thing that answers whether a persistent step pays in Triton on the GPU
(bench/persistent_probe.py times it against today's kernels in a CUDA graph) before a whole
layer is built this way.

Invariants: a dense stage's partials are linear_partials' with the same tile (the same K order
and product; `tile=` linear_config's), so a row's bits depend neither on the other rows nor on
the number of programs; every program computes a row's routes the same way. The barrier needs
every program resident at once: on CUDA the launch is cooperative (one program a multiprocessor
by default); the interpreter runs programs one after another, so there a chain runs as one
program.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

import kernels.fused.linear as linear_module
from kernels.fused import cdiv, interpreting, next_power_of_2, tl_dtype, use_triton
from kernels.fused.fp8 import Fp8Weight
from kernels.fused.linear import BLOCK_M, Weight, dense, pipeline_stages, rowwise_linear
from kernels.routing import route_topk

# A stage's entry in the table the kernel walks: its fields in persistent_kernels' order (F_*).
FIELDS = ("weight", "out", "in", "num_out", "num_in", "splits", "k_per_split", "in_splits", "kind", "routes",
          "route_splits", "experts", "top_k", "scales", "scale_row_stride", "scale_expert_stride")
DENSE, GATE_UP, DOWN = 0, 1, 2  # persistent_kernels' stage kinds
LINE = 128  # bytes an L2 prefetch covers
PREFETCH_WAYS = {"none": 0, "before-barrier": 1, "at-stage-start": 2}
# (BLOCK_N, BLOCK_K, warps, pipeline stages) of every stage. One kernel holds every stage's code,
# so its registers are the most any stage needs: compiled for sm_90, linear_config's 64 × 256 in
# 4 warps spilled heavily once the experts' code joined, this tile hardly (ptxas -v; figures in
# docs/PERFORMANCE.md; bench/persistent_probe.py --tiles compares tiles on the GPU).
DEFAULT_TILE = (64, 128, 8, 3)


@dataclass(frozen=True)
class Dense:
    weight: Weight  # [num_out, num_in], rows contiguous; or block-scaled FP8 (kernels.fused.fp8)
    splits: int = 1


@dataclass(frozen=True)
class Experts:
    gate_up: Weight  # [E, 2·inter, H]: gate rows, then up rows
    down: Weight  # [E, H, inter]
    top_k: int


def _weights(stage: Dense | Experts) -> list[Weight]:
    return [stage.weight] if isinstance(stage, Dense) else [stage.gate_up, stage.down]


def _rows(weight: Weight) -> Tensor:
    return weight.q if isinstance(weight, Fp8Weight) else weight


@functools.cache
def _kernels():
    from kernels.fused.persistent_kernels import chain_kernel

    return chain_kernel


def _entry(weight: Weight, kind: int, *, out: Tensor, source: Tensor, **fields: int) -> list[int]:
    """A stage's table entry, by FIELDS (unnamed fields 0; one split of every column unless named;
    a weight in full precision has no scales)."""
    named = dict(weight=_rows(weight).data_ptr(), out=out.data_ptr(), kind=kind, splits=1,
                 k_per_split=fields["num_in"], **{"in": source.data_ptr()})
    named.update(fields)
    if isinstance(weight, Fp8Weight):
        scale = weight.scale
        named.update(scales=scale.data_ptr(), scale_row_stride=scale.stride(-2),
                     scale_expert_stride=scale.stride(0) if scale.dim() == 3 else 0)
    unknown = set(named) - set(FIELDS)
    if unknown:
        raise ValueError(f"table fields {sorted(unknown)} are not among {FIELDS}")
    return [int(named.get(name, 0)) for name in FIELDS]


def k_per_split(num_in: int, splits: int, block_k: int) -> int:
    """K columns per split: whole K tiles (as linear_partials splits)."""
    return cdiv(cdiv(num_in, splits), block_k) * block_k


def _check(stages: list[Dense | Experts], rows: int) -> None:
    if not stages or not isinstance(stages[0], Dense):
        raise ValueError("stages: a chain starts with a Dense stage")
    first = stages[0].weight
    if not 1 <= rows <= BLOCK_M:
        raise ValueError(f"rows = {rows} must lie in [1, {BLOCK_M}] (one BLOCK_M tile)")
    full = [w for stage in stages for w in _weights(stage) if not isinstance(w, Fp8Weight)]
    fp8 = [w for stage in stages for w in _weights(stage) if isinstance(w, Fp8Weight)]
    width = first.shape[1]  # what the stage before makes
    for s, stage in enumerate(stages):
        for t in _weights(stage):
            if not _rows(t).is_contiguous() or t.device != first.device or (
                    not isinstance(t, Fp8Weight) and t.dtype != full[0].dtype):
                raise ValueError(f"stages[{s}]: weights must be contiguous, on {first.device}, full-precision ones "
                                 f"all {full[0].dtype if full else ''}")
            if fp8 and isinstance(stage, Experts) and not isinstance(t, Fp8Weight):
                raise ValueError(f"stages[{s}]: a chain with FP8 weights has FP8 experts (full precision is for "
                                 f"dense stages there: the routers)")
            if isinstance(t, Fp8Weight) and (not t.kernel_ready() or t.block != fp8[0].block):
                raise ValueError(f"stages[{s}]: FP8 weights in blocks of {list(t.block)}: a chain's are all in one "
                                 f"block shape the kernels read (kernels.fused.fp8.Fp8Weight.kernel_ready)")
        if isinstance(stage, Dense):
            if stage.weight.dim() != 2 or stage.weight.shape[1] != width:
                raise ValueError(f"stages[{s}]: weight {tuple(stage.weight.shape)} does not take the {width} values "
                                 f"the stage before makes")
            if stage.splits < 1:
                raise ValueError(f"stages[{s}]: splits = {stage.splits} must be >= 1")
            width = stage.weight.shape[0]
            continue
        router = stages[s - 1]
        if not isinstance(router, Dense):
            raise ValueError(f"stages[{s}]: Experts follow the Dense stage that is their router")
        num_experts, hidden = router.weight.shape[0], router.weight.shape[1]
        if stage.gate_up.dim() != 3 or stage.gate_up.shape[0] != num_experts or stage.gate_up.shape[2] != hidden \
                or stage.gate_up.shape[1] % 2:
            raise ValueError(f"stages[{s}]: gate_up {tuple(stage.gate_up.shape)} is not [{num_experts}, 2·inter, "
                             f"{hidden}] (the router's experts and input)")
        if tuple(stage.down.shape) != (num_experts, hidden, stage.gate_up.shape[1] // 2):
            raise ValueError(f"stages[{s}]: down {tuple(stage.down.shape)} is not "
                             f"[{num_experts}, {hidden}, {stage.gate_up.shape[1] // 2}]")
        if not 1 <= stage.top_k <= num_experts:
            raise ValueError(f"stages[{s}]: top_k = {stage.top_k} must lie in [1, {num_experts}]")
        width = hidden


class ChainPlan:
    """Buffers, table and barrier counter of one chain at one row count (as a captured graph is
    one window size): `run(x)` returns the last stage's partials [splits, rows, width] float32."""

    def __init__(self, stages: list[Dense | Experts], rows: int, *, programs: int | None = None,
                 prefetch: str = "none", tile: tuple[int, int, int, int] | None = None,
                 cooperative: bool = True) -> None:
        _check(stages, rows)
        device = stages[0].weight.device
        if programs is None:
            programs = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        if programs < 1 or (device.type != "cuda" and programs != 1):
            raise ValueError(f"programs = {programs}: at least 1, and exactly 1 off CUDA (the interpreter runs "
                             f"programs one after another, so a grid barrier over more would never be passed)")
        if prefetch not in PREFETCH_WAYS:
            raise ValueError(f"prefetch = {prefetch!r} is not one of {sorted(PREFETCH_WAYS)}")
        if prefetch != "none" and device.type != "cuda":
            raise ValueError("prefetch: the L2 prefetch is PTX, so it needs CUDA")
        self.stages, self.rows, self.programs = list(stages), rows, programs
        self.prefetch = PREFETCH_WAYS[prefetch]
        # cooperative: the driver refuses a grid that cannot be resident at once (else a barrier
        # would hang); off, residency rests on the grid fitting the GPU with nothing else running.
        self.cooperative = cooperative
        if tile is None:
            tile = DEFAULT_TILE
        if len(tile) != 4 or min(tile) < 1 or tile[1] % 16 or tile[0] % 16:
            raise ValueError(f"tile = {tile}: (BLOCK_N, BLOCK_K, warps, stages), blocks multiples of 16")
        self.tile = tile
        block_k = tile[1]
        weights = [w for stage in stages for w in _weights(stage)]
        fp8 = [w for w in weights if isinstance(w, Fp8Weight)]
        self.block = fp8[0].block if fp8 else None  # the FP8 weights' (rows, columns) blocks
        # the activations' dtype: the full-precision weights' (None: every weight FP8, any will do)
        self.dtype = next((w.dtype for w in weights if not isinstance(w, Fp8Weight)), None)
        exact = any(isinstance(w, Fp8Weight) and (linear_module.EXPERT_FP8_EXACT if isinstance(stage, Experts)
                                                  else linear_module.LINEAR_FP8_EXACT)
                    for stage in stages for w in _weights(stage))
        if exact and self.block[1] % block_k:
            raise ValueError(f"tile: BLOCK_K {block_k} must divide the FP8 blocks' {self.block[1]} columns "
                             f"(an exact tile lies inside one block column)")
        experts = [s for s in stages if isinstance(s, Experts)]
        self.block_e = next_power_of_2(max([2, *(s.gate_up.shape[0] for s in experts)]))
        self.k_pad = next_power_of_2(max([2, *(s.top_k for s in experts)]))

        def buffer(*shape: int) -> Tensor:
            return torch.zeros(shape, dtype=torch.float32, device=device)

        self.input = buffer(1, rows, stages[0].weight.shape[1])  # [1, rows, K0]: x, as the first stage's "partials"
        self.outputs: list[Tensor] = []  # per stage of `stages`: its last kernel stage's output
        self.acts: list[Tensor | None] = []  # per stage: an Experts stage's routes' activations [1, rows·k, inter]
        table = []
        source, source_splits = self.input, 1
        for stage in stages:
            if isinstance(stage, Dense):
                num_out, num_in = stage.weight.shape
                out = buffer(stage.splits, rows, num_out)  # [splits, rows, N]
                table.append(_entry(stage.weight, DENSE, out=out, source=source, num_out=num_out, num_in=num_in,
                                    splits=stage.splits, k_per_split=k_per_split(num_in, stage.splits, block_k),
                                    in_splits=source_splits))
                router_in, router_in_splits = source, source_splits
                self.acts.append(None)
                source, source_splits = out, stage.splits
            else:
                num_experts, double_inter, hidden = stage.gate_up.shape
                inter = double_inter // 2
                routes = dict(routes=source.data_ptr(), route_splits=source_splits, experts=num_experts,
                              top_k=stage.top_k)
                act = buffer(1, rows * stage.top_k, inter)
                out = buffer(1, rows, hidden)
                table.append(_entry(stage.gate_up, GATE_UP, out=act, source=router_in, num_out=inter, num_in=hidden,
                                    in_splits=router_in_splits, **routes))
                table.append(_entry(stage.down, DOWN, out=out, source=act, num_out=hidden, num_in=inter, **routes))
                self.acts.append(act)
                source, source_splits = out, 1
            self.outputs.append(source)
        self.table = torch.tensor(table, dtype=torch.int64, device=device)  # [kernel stages, len(FIELDS)]
        self.max_in_splits = max(entry[FIELDS.index("in_splits")] for entry in table)  # (the kernel unrolls them)
        # Pipeline stages refitted to shared memory (the bits do not depend on them): a K step buffers
        # the input's float32 partials and, in the gate/up stage, two weight tiles.
        weight_bytes = max(1 if isinstance(w, Fp8Weight) else w.element_size() for s in stages for w in _weights(s))
        block_n, block_k, warps, num_stages = self.tile
        self.tile = (block_n, block_k, warps, pipeline_stages(
            num_stages, (self.max_in_splits * BLOCK_M * 4 + 2 * block_n * weight_bytes) * block_k))
        self.counter = torch.zeros(1, dtype=torch.int32, device=device)

    def run(self, x: Tensor) -> Tensor:  # x [rows, K0] in the full-precision weights' dtype
        if tuple(x.shape) != tuple(self.input.shape[1:]) or self.dtype not in (None, x.dtype):
            raise ValueError(f"x: {tuple(x.shape)} {x.dtype}, the plan takes {tuple(self.input.shape[1:])} "
                             f"{self.dtype or ''}")
        self.input[0].copy_(x)
        if not use_triton(x):
            self._reference(x.dtype)
            return self.outputs[-1]
        self.counter.zero_()
        block_n, block_k, warps, num_stages = self.tile
        options = {"launch_cooperative_grid": True} if self.cooperative and not interpreting() else {}
        _kernels()[(self.programs,)](
            self.table, self.counter, self.table.shape[0], self.rows,
            BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, DTYPE=tl_dtype(x.dtype), IEEE=x.dtype == torch.float32,
            PREFETCH=self.prefetch, LINE=LINE // x.element_size(), MAX_IN_SPLITS=self.max_in_splits,
            BLOCK_E=self.block_e, K_PAD=self.k_pad, HAS_FP8=self.block is not None, SBN=(self.block or (1, 1))[0],
            SBK=(self.block or (1, 1))[1], SUB=min(block_k, (self.block or (1, 1))[1]),
            DENSE_EXACT=linear_module.LINEAR_FP8_EXACT, EXPERT_EXACT=linear_module.EXPERT_FP8_EXACT,
            ASM=linear_module.fp8_way(True, x)["ASM"],  # (where the bit moves apply; each way ands its EXACT)
            num_warps=warps, num_stages=num_stages, **options,
        )
        return self.outputs[-1]

    def _reference(self, dtype: torch.dtype) -> None:
        """The chain by the torch reference (FP8 weights dequantised), into the same buffers."""
        source, router_in = self.input, None
        for stage, out, act in zip(self.stages, self.outputs, self.acts):
            if isinstance(stage, Dense):
                router_in = source
                out.copy_(stage_partials(sum_partials(source).to(dtype), dense(stage.weight, dtype), stage.splits,
                                         self.tile[1]))
            else:
                stage = Experts(dense(stage.gate_up, dtype), dense(stage.down, dtype), stage.top_k)
                routes, combined = experts_stage(sum_partials(router_in).to(dtype), source, stage)
                act.copy_(routes.unsqueeze(0))
                out.copy_(combined.unsqueeze(0))
            source = out


def sum_partials(partials: Tensor) -> Tensor:  # [splits, rows, N] float32 -> [rows, N]
    """The partials added in split order (as every consumer of split-K partials adds them)."""
    total = partials[0].clone()
    for part in partials[1:]:
        total += part
    return total


def stage_partials(x: Tensor, weight: Tensor, splits: int, block_k: int) -> Tensor:
    """The torch reference of a Dense stage: [splits, rows, N] float32, split s the product over K
    range s·k_per_split ..., row by row (rowwise_linear), as linear_partials' reference."""
    step = k_per_split(weight.shape[1], splits, block_k)
    return torch.stack([rowwise_linear(x[:, s * step:(s + 1) * step].float(), weight[:, s * step:(s + 1) * step].float())
                        for s in range(splits)])


def experts_stage(x: Tensor, router_partials: Tensor, stage: Experts) -> tuple[Tensor, Tensor]:
    """The torch reference of an Experts stage: (the routes' activations [rows·k, inter] float32 of
    dtype values, the combined outputs [rows, H] float32). x [rows, H] the router's input."""
    logits = sum_partials(router_partials).to(x.dtype)
    ids, weights = route_topk(logits, stage.top_k, normalize=True)  # [rows, k]
    inter = stage.down.shape[2]
    acts, combined = [], []
    for row in range(x.shape[0]):
        total = torch.zeros(stage.down.shape[1], dtype=torch.float32, device=x.device)
        for rank in range(stage.top_k):
            expert = int(ids[row, rank])
            gate_up = rowwise_linear(x[row:row + 1].float(), stage.gate_up[expert].float())  # [1, 2·inter]
            act = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype).float()
            acts.append(act)
            total = total + weights[row, rank] * rowwise_linear(act, stage.down[expert].float())[0]
        combined.append(total)
    return torch.cat(acts), torch.stack(combined)

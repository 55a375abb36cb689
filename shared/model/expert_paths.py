"""The expert store's compute paths (shared.model.experts.ExpertStore): an MoE layer's routed
experts run over the store's weights, by dispatch, by gathered batched matmuls, or by grouped
GEMMs over the routes sorted by expert.

- "dispatch" runs each selected expert once on its rows (kernels.moe): it handles dropped
  (-1) routes and partial residency, and synchronises with the host;
- "gather" gathers each route's expert weights and runs batched matmuls;
- "grouped" runs torch._grouped_mm over the routes sorted by expert; with slots, the routed
  experts are made resident a group at a time, every expert's rows forming the same problem
  in the same order as with every expert resident, so the bits are the all-resident ones.

"gather" and "grouped" need no -1 routes and never synchronise (CUDA-graph safe); "gather"
needs every expert resident. FP8 stacks are dequantised for the experts a path runs, except
where "grouped" reads them as stored (kernels.fused.grouped, where Triton runs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.fused import use_triton
from kernels.fused.fp8 import Fp8Weight
from kernels.fused.grouped import grouped_experts
from kernels.fused.linear import dense
from kernels.fused.moe import silu_mul
from kernels.moe import moe_forward


# FP8 experts in the grouped path: prefill's products read the FP8 tiles (kernels.fused.grouped)
# where Triton runs, rather than torch._grouped_mm over a dequantised copy of every expert
# (bench/fp8_grouped.py measures both; docs/PERFORMANCE.md).
GROUPED_FP8 = True


def grouped_mm_available(dtype: torch.dtype) -> bool:
    """torch._grouped_mm runs bf16 on Hopper-class GPUs (torch >= 2.8)."""
    return (
        hasattr(torch, "_grouped_mm")
        and dtype == torch.bfloat16
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability() >= (9, 0)
    )


class ExpertPaths:
    """The compute half of ExpertStore (a base class: it reads the store's gate_up / down,
    num_experts, num_slots, num_fixed, fixed_weights, all_resident, fp8 and path, and calls its
    ensure and slot)."""

    def default_path(self, device: torch.device) -> str:
        """dispatch on the CPU; on CUDA grouped GEMMs where torch has them (with slots: a group
        of experts resident at a time), else with every expert resident a gather (sync-free)."""
        if device.type != "cuda":
            return "dispatch"
        if grouped_mm_available(torch.bfloat16 if self.fp8 else self.gate_up.dtype):
            return "grouped"
        return "gather" if self.all_resident else "dispatch"

    def forward(self, hidden: Tensor, expert_ids: Tensor, weights: Tensor, *, path: str | None = None) -> Tensor:
        """MoE output [T, hidden] for routed `expert_ids` / `weights` [T, k], by `path` (the
        module's three; default: the store's, else default_path)."""
        path = path or self.path or self.default_path(hidden.device)
        if path in ("gather", "grouped"):
            if not self.all_resident and path == "gather":
                raise ValueError(f"the {path!r} expert path needs every expert resident")
            return self._forward_gather(hidden, expert_ids, weights) if path == "gather" else self._forward_grouped(
                hidden, expert_ids, weights
            )
        if path != "dispatch":
            raise ValueError(f"expert path {path!r} must be 'dispatch', 'gather' or 'grouped'")
        streamed = False
        if not self.all_resident:  # all resident: nothing can miss, and counting would sync
            wanted = [e for e in torch.unique(expert_ids).tolist() if e >= 0]
            # More distinct experts than slots (a long row block, e.g. a prompt's catch-up):
            # each is loaded just before its rows run (experts run one after another).
            streamed = len(wanted) > self.num_slots
            if not streamed:
                self.ensure(wanted)

        def run(expert: int, rows: Tensor) -> Tensor:
            if streamed:
                self.ensure([expert])
            slot = self.slot(expert)
            gate, up = F.linear(rows, dense(self.gate_up[slot], rows.dtype)).chunk(2, dim=-1)
            return F.linear(F.silu(gate) * up, dense(self.down[slot], rows.dtype))

        return moe_forward(hidden, expert_ids, weights, run, num_experts=self.num_experts, resident=None)

    def _forward_grouped(self, hidden: Tensor, expert_ids: Tensor, weights: Tensor) -> Tensor:
        num_tokens, top_k = expert_ids.shape
        per_route = self.grouped_routes(hidden, expert_ids).view(num_tokens, top_k, -1)
        return (per_route * weights.unsqueeze(-1).to(per_route.dtype)).sum(dim=1)

    def grouped_routes(self, hidden: Tensor, expert_ids: Tensor) -> Tensor:
        """Each route's expert output [T*k, hidden], unweighted, in (token, rank) order.

        With slots, the routed experts are made resident in groups of at most num_slots (a
        synchronisation), and each group's routes run through torch._grouped_mm on the slots:
        every expert's rows form the same problem, in the same order, in a call over the same
        number of rows (the other groups' rows sorted behind the last offset, where nothing is
        computed) as with every expert resident, so the bits are the all-resident ones. Fixed
        experts (with_fixed; route id num_experts + i) run with the first group."""
        if self.all_resident and not self.num_fixed:
            out, rows = self.grouped_sorted(hidden, expert_ids)
            return out[rows]
        gate_up, down = self.fixed_weights or (self.gate_up, self.down)  # [slots (+ fixed), ...]
        num_groups = gate_up.shape[0]
        flat = expert_ids.reshape(-1)  # [T*k]
        experts, counts = torch.unique(flat, return_counts=True)
        pairs = [(e, c) for e, c in zip(experts.tolist(), counts.tolist()) if e >= 0]
        routed = [(e, c) for e, c in pairs if e < self.num_experts]
        fixed = [(e, c) for e, c in pairs if e >= self.num_experts]  # route id E + i: fixed expert i
        out = torch.empty((flat.numel(), hidden.shape[1]), dtype=hidden.dtype, device=hidden.device)
        groups = [routed[i : i + self.num_slots] for i in range(0, len(routed), self.num_slots)] or [[]]
        for number, group in enumerate(groups):
            self.ensure([e for e, _ in group])
            members = group + (fixed if number == 0 else [])  # fixed experts run with the first group
            # (the last entry: a dropped route, id -1, sorts behind with the other groups' routes)
            key_of_expert = torch.full((self.num_experts + self.num_fixed + 1,), num_groups, dtype=torch.int64)
            if members:
                key_of_expert[[e for e, _ in members]] = torch.tensor(
                    [self.slot(e) if e < self.num_experts else self.num_slots + e - self.num_experts for e, _ in members])
            keys = key_of_expert.to(flat.device, non_blocking=True)[flat]  # [T*k]: slot, or num_groups
            part, order = self._grouped_mm(hidden, keys, expert_ids.shape[1], (gate_up, down))
            done = sum(count for _, count in members)
            out[order[:done]] = part[:done]
        return out

    def grouped_sorted(self, hidden: Tensor, expert_ids: Tensor) -> tuple[Tensor, Tensor]:
        """(route outputs [T*k, hidden] grouped by expert, rows [T*k]: where route t*k + rank's
        output lies) by torch._grouped_mm over the routes sorted by expert (every expert resident).
        Consumers read through `rows` rather than un-permuting T*k hidden-sized rows."""
        out, order = self._grouped_mm(hidden, expert_ids.reshape(-1), expert_ids.shape[1])
        position = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        return out, position

    def _grouped_mm(self, hidden: Tensor, keys: Tensor, top_k: int,
                    weights: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """(outputs [T*k, hidden] of the routes sorted by key, the sort order [T*k]): route r =
        t*k + rank runs weights[keys[r]] (default: the slots'); keys equal to len(weights) sort
        behind the last offset and are not computed (their rows hold garbage)."""
        gate_up, down = weights or (self.gate_up, self.down)
        num_groups = gate_up.shape[0]
        order = torch.argsort(keys, stable=True)
        # Counts by scatter_add, not bincount: bincount sizes its output on the host (a sync).
        counts = torch.zeros(num_groups + 1, dtype=torch.int64, device=keys.device).scatter_add_(
            0, keys, torch.ones_like(keys))
        if isinstance(gate_up, Fp8Weight) and GROUPED_FP8 and use_triton(hidden):
            # FP8 weights read as stored: no dequantised copy of every expert a chunk
            return grouped_experts(hidden, order, counts[:num_groups], top_k, gate_up, down), order
        gate_up, down = dense(gate_up, hidden.dtype), dense(down, hidden.dtype)
        rows = hidden[order // top_k]  # [T*k, hidden], grouped by key
        ends = torch.cumsum(counts[:num_groups], dim=0).to(torch.int32)
        act = silu_mul(torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=ends))
        return torch._grouped_mm(act, down.transpose(1, 2), offs=ends), order

    def _forward_gather(self, hidden: Tensor, expert_ids: Tensor, weights: Tensor) -> Tensor:
        num_tokens, top_k = expert_ids.shape
        flat = expert_ids.reshape(-1)  # [T*k]
        rows = hidden.repeat_interleave(top_k, dim=0).unsqueeze(-1)  # [T*k, hidden, 1]
        gate_up, down = dense(self.gate_up[flat], hidden.dtype), dense(self.down[flat], hidden.dtype)
        gate, up = torch.bmm(gate_up, rows).squeeze(-1).chunk(2, dim=-1)
        out = torch.bmm(down, (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)  # [T*k, hidden]
        out = out.view(num_tokens, top_k, -1) * weights.unsqueeze(-1).to(out.dtype)
        return out.sum(dim=1)

"""Expert store: one MoE layer's routed experts in host memory with a bounded set of device slots.

Every expert's weights live in host memory (pinned on CUDA, so copies are asynchronous);
`num_slots` device slots hold the resident ones, replaced least-recently-used. The slot map
is the residency map handed to routing (`resident_mask`), so MoCE routing prefers experts
already on the device. With all experts resident (the default) the store is a plain stacked
weight tensor and lookups need no host synchronisation.

Weights are stacked in nn.Linear layout: gate_up [experts, 2*intermediate, hidden] (gate
rows first, then up rows) and down [experts, hidden, intermediate].
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.fused.moe import silu_mul
from kernels.moe import moe_forward


def grouped_mm_available(dtype: torch.dtype) -> bool:
    """torch._grouped_mm runs bf16 on Hopper-class GPUs (torch >= 2.8)."""
    return (
        hasattr(torch, "_grouped_mm")
        and dtype == torch.bfloat16
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability() >= (9, 0)
    )


@dataclass
class ExpertCounters:
    hits: int = 0
    misses: int = 0
    bytes_moved: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 1.0


class ExpertStore:
    def __init__(
        self,
        gate_up: Tensor,  # [experts, 2*intermediate, hidden]
        down: Tensor,  # [experts, hidden, intermediate]
        *,
        device: torch.device | str,
        num_slots: int | None = None,
    ) -> None:
        num_experts = gate_up.shape[0]
        if down.shape[0] != num_experts or gate_up.shape[2] != down.shape[1] or gate_up.shape[1] != 2 * down.shape[2]:
            raise ValueError(f"gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} are not one set of experts")
        num_slots = num_experts if num_slots is None else num_slots
        if not 1 <= num_slots <= num_experts:
            raise ValueError(f"num_slots {num_slots} must lie in [1, {num_experts}]")
        self.device = torch.device(device)
        self.num_experts = num_experts
        self.num_slots = num_slots
        self.counters = ExpertCounters()
        self.all_resident = num_slots == num_experts
        self.path: str | None = None  # expert path override (benchmarks); None = default_path
        if self.all_resident:
            self.gate_up = gate_up.to(self.device)
            self.down = down.to(self.device)
            self.host_gate_up = self.host_down = None
            self.slot_of_expert = torch.arange(num_experts, device=self.device)
            self._lru: OrderedDict[int, int] = OrderedDict((e, e) for e in range(num_experts))
            return
        pin = self.device.type == "cuda"
        self.host_gate_up = gate_up.cpu().pin_memory() if pin else gate_up.cpu()
        self.host_down = down.cpu().pin_memory() if pin else down.cpu()
        self.gate_up = torch.empty((num_slots, *gate_up.shape[1:]), dtype=gate_up.dtype, device=self.device)
        self.down = torch.empty((num_slots, *down.shape[1:]), dtype=down.dtype, device=self.device)
        self.slot_of_expert = torch.full((num_experts,), -1, dtype=torch.int64, device=self.device)
        self._lru = OrderedDict()  # expert -> slot, least recently used first
        for expert in range(num_slots):  # start with the first experts resident
            self._load(expert, expert)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's weights."""
        return (self.gate_up[0].numel() + self.down[0].numel()) * self.gate_up.element_size()

    def expert_weights(self, expert: int) -> tuple[Tensor, Tensor]:
        """(gate_up, down) of one expert, wherever it lives."""
        if self.all_resident:
            return self.gate_up[expert], self.down[expert]
        return self.host_gate_up[expert], self.host_down[expert]

    def resident_mask(self) -> Tensor:
        """[experts] bool: which experts sit in a device slot now (the routing residency map)."""
        return self.slot_of_expert >= 0

    def resident_experts(self) -> list[int]:
        """Resident experts, least recently used first."""
        return list(self._lru)

    def _load(self, expert: int, slot: int) -> None:
        self.gate_up[slot].copy_(self.host_gate_up[expert], non_blocking=True)
        self.down[slot].copy_(self.host_down[expert], non_blocking=True)
        self.slot_of_expert[expert] = slot
        self._lru[expert] = slot
        self.counters.bytes_moved += self.expert_bytes

    def ensure(self, experts: list[int]) -> None:
        """Make `experts` resident (LRU replacement), counting hits and misses.

        Raises ValueError if more distinct experts are asked for at once than there are slots.
        """
        wanted = list(dict.fromkeys(experts))
        if len(wanted) > self.num_slots:
            raise ValueError(f"{len(wanted)} distinct experts needed at once but only {self.num_slots} slots")
        for expert in wanted:
            if expert in self._lru:
                self.counters.hits += 1
                self._lru.move_to_end(expert)
        for expert in wanted:
            if expert in self._lru:
                continue
            self.counters.misses += 1  # (never with every expert resident: all are in _lru)
            victim = next(e for e in self._lru if e not in wanted)
            slot = self._lru.pop(victim)
            self.slot_of_expert[victim] = -1
            self._load(expert, slot)

    def default_path(self, device: torch.device) -> str:
        """dispatch on the CPU; on CUDA with every expert resident, a sync-free path."""
        if device.type != "cuda" or not self.all_resident:
            return "dispatch"
        return "grouped" if grouped_mm_available(self.gate_up.dtype) else "gather"

    def forward(self, hidden: Tensor, expert_ids: Tensor, weights: Tensor, *, path: str | None = None) -> Tensor:
        """MoE output [T, hidden] for routed `expert_ids` / `weights` [T, k].

        Paths: "dispatch" runs each selected expert once on its rows (kernels.moe; handles
        dropped -1 routes and partial residency; synchronises with the host); "gather"
        gathers each route's expert weights and runs batched matmuls; "grouped" runs
        torch._grouped_mm over routes sorted by expert. "gather" and "grouped" need every
        expert resident and no -1 routes, and never synchronise (CUDA-graph safe).
        """
        path = path or self.path or self.default_path(hidden.device)
        if path in ("gather", "grouped"):
            if not self.all_resident:
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
            slot = expert if self.all_resident else self._lru[expert]
            gate, up = F.linear(rows, self.gate_up[slot]).chunk(2, dim=-1)
            return F.linear(F.silu(gate) * up, self.down[slot])

        return moe_forward(hidden, expert_ids, weights, run, num_experts=self.num_experts, resident=None)

    def _forward_grouped(self, hidden: Tensor, expert_ids: Tensor, weights: Tensor) -> Tensor:
        num_tokens, top_k = expert_ids.shape
        per_route = self.grouped_routes(hidden, expert_ids).view(num_tokens, top_k, -1)
        return (per_route * weights.unsqueeze(-1).to(per_route.dtype)).sum(dim=1)

    def grouped_routes(self, hidden: Tensor, expert_ids: Tensor) -> Tensor:
        """Each route's expert output [T*k, hidden], unweighted, in (token, rank) order."""
        out, rows = self.grouped_sorted(hidden, expert_ids)
        return out[rows]

    def grouped_sorted(self, hidden: Tensor, expert_ids: Tensor) -> tuple[Tensor, Tensor]:
        """(route outputs [T*k, hidden] grouped by expert, rows [T*k]: where route t*k + rank's
        output lies) by torch._grouped_mm over the routes sorted by expert (every expert resident).
        Consumers read through `rows` rather than un-permuting T*k hidden-sized rows."""
        flat = expert_ids.reshape(-1)  # [T*k]
        top_k = expert_ids.shape[1]
        order = torch.argsort(flat, stable=True)
        rows = hidden[order // top_k]  # [T*k, hidden], grouped by expert
        # Counts by scatter_add, not bincount: bincount sizes its output on the host (a sync).
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat)
        )
        ends = torch.cumsum(counts, dim=0).to(torch.int32)
        act = silu_mul(torch._grouped_mm(rows, self.gate_up.transpose(1, 2), offs=ends))
        out = torch._grouped_mm(act, self.down.transpose(1, 2), offs=ends)  # [T*k, hidden]
        position = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        return out, position

    def _forward_gather(self, hidden: Tensor, expert_ids: Tensor, weights: Tensor) -> Tensor:
        num_tokens, top_k = expert_ids.shape
        flat = expert_ids.reshape(-1)  # [T*k]
        rows = hidden.repeat_interleave(top_k, dim=0).unsqueeze(-1)  # [T*k, hidden, 1]
        gate, up = torch.bmm(self.gate_up[flat], rows).squeeze(-1).chunk(2, dim=-1)
        out = torch.bmm(self.down[flat], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)  # [T*k, hidden]
        out = out.view(num_tokens, top_k, -1) * weights.unsqueeze(-1).to(out.dtype)
        return out.sum(dim=1)

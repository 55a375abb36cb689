"""The routed-experts block both families use: a router and an ExpertStore (DESIGN §5).

The router's logits are softmax-ed and the top k kept (renormalised where the checkpoint says
so), by `kernels.routing`: full routing by default, MoCE routing of draft rows with the
store's residency map where RoutingOptions ask for it. The experts live in an ExpertStore
(attached by the family's loader: all resident, or device slots with the rest in host memory).
The hybrid family's block (families/hybrid/modules.SharedMoe) is this one plus a gated shared
expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.fused.router import MoceTables
from kernels.routing import route_prompt_topk, route_topk
from shared.model.experts import ExpertStore
from shared.model.layers import FULL_ROUTING, RoutingOptions


class MoeBlock(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, normalize: bool) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.top_k = top_k
        self.normalize = normalize
        self.experts: ExpertStore | None = None  # attached by the loader

    @property
    def store(self) -> ExpertStore:
        """The ExpertStore that runs the routed experts (the hybrid block's sits in a module)."""
        return self.experts

    def route(self, x: Tensor, routing: RoutingOptions) -> tuple[Tensor, Tensor]:
        """(expert_ids [T, k], weights [T, k] float32) of rows x [T, hidden]."""
        router_logits = F.linear(x, self.gate.weight).float()  # [T, experts]
        if routing.prompt_packed is not None:
            return route_prompt_topk(
                router_logits, self.top_k, resident=self.store.resident_mask(),
                packed=routing.prompt_packed, normalize=self.normalize,
            )
        resident = self.store.resident_mask() if routing.moce else None
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
        return self.store.forward(x, expert_ids, weights.to(x.dtype), path=path)


class MoceOptions:
    """The fused router's MoCE arguments for a forward's RoutingOptions: the store's residency
    map, the multiplier tables (made once per setting, on the device) and the draft rows."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._tables: dict[tuple[int, float, float, int], MoceTables] = {}

    def __call__(self, store: ExpertStore, top_k: int,
                 routing: RoutingOptions | None) -> tuple[Tensor | None, MoceTables | None, Tensor | None]:
        """(resident [E] bool, tables, draft_rows [T] bool): all None for full routing."""
        if routing is None or not routing.moce:
            return None, None, None
        if routing.prompt_packed is not None:
            raise ValueError("the fused path does not take packed prompt routing (prefill uses the reference path)")
        key = (top_k, routing.scale, routing.r1_scale, routing.protect)
        if key not in self._tables:
            self._tables[key] = MoceTables(top_k, scale=routing.scale, r1_scale=routing.r1_scale,
                                           protect=routing.protect, device=self.device)
        return store.resident_mask(), self._tables[key], routing.draft_rows

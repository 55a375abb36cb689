"""MoE dispatch and combine, given routed expert ids and weights.

Tokens are grouped by expert (resident experts first, then by id, so the experts already in
fast memory can run before the others have arrived), each selected expert runs once on
all of its tokens, and the weighted outputs are summed back per token. A route with id -1
(dropped by prompt expert dropout, see kernels.routing) contributes nothing: it is masked out
before any indexing and never used as an index. A token whose routes are all -1 gets zeros.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.routing import DROPPED_ID  # id -1: a route that runs no expert

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


@dataclass(frozen=True)
class Dispatch:
    """Which token rows each selected expert runs on, in run order."""

    expert_ids: Tensor  # [num_groups] int64: the distinct selected experts, resident first, then by id
    offsets: Tensor  # [num_groups + 1] int64: group g owns rows offsets[g]:offsets[g+1] of token_index/route_index
    token_index: Tensor  # [num_routes] int64: which token each routed row comes from
    route_index: Tensor  # [num_routes] int64: flat index t*k + rank of that route (to find its weight)

    @property
    def num_groups(self) -> int:
        return self.expert_ids.shape[0]

    @property
    def num_routes(self) -> int:
        return self.token_index.shape[0]


def dispatch(
    expert_ids: Tensor,  # [T, k] int, -1 = dropped route
    *,
    num_experts: int,
    resident: Tensor | None = None,  # [num_experts] bool
) -> Dispatch:
    """Group the routes of `expert_ids` by expert; within a group rows keep (token, rank) order."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts {num_experts!r} must be an integer >= 1")
    if not isinstance(expert_ids, Tensor) or expert_ids.dim() != 2 or expert_ids.dtype not in _INT_DTYPES:
        raise ValueError(f"expert_ids {_describe(expert_ids)} must be a 2-D integer tensor [T, k]")
    device = expert_ids.device
    if resident is not None:
        if not isinstance(resident, Tensor) or resident.dtype != torch.bool or tuple(resident.shape) != (num_experts,):
            raise ValueError(f"resident {_describe(resident)} must be a bool tensor of shape [{num_experts}]")
        resident = resident.to(device)

    flat = expert_ids.reshape(-1).to(torch.int64)  # [T*k]
    bad = (flat < DROPPED_ID) | (flat >= num_experts)
    if bool(bad.any()):
        value = int(flat[bad][0])
        raise ValueError(f"expert_ids contains {value}, outside [-1, {num_experts})")

    # Filter the -1 routes first: everything below indexes only with real expert ids.
    route_index = torch.nonzero(flat != DROPPED_ID).reshape(-1)  # [num_routes]
    routed = flat[route_index]  # [num_routes], all in [0, num_experts)
    key = routed
    if resident is not None:
        key = routed + num_experts * (~resident[routed]).to(torch.int64)  # resident experts sort first
    key, order = torch.sort(key, stable=True)  # stable: (token, rank) order within a group
    route_index = route_index[order]
    group_keys, counts = torch.unique_consecutive(key, return_counts=True)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), torch.cumsum(counts, dim=0)])
    return Dispatch(
        expert_ids=group_keys % num_experts,
        offsets=offsets,
        token_index=route_index // max(expert_ids.shape[1], 1),
        route_index=route_index,
    )


def combine(
    expert_outputs: Tensor,  # [num_routes, H] in plan order
    plan: Dispatch,
    weights: Tensor,  # [T, k]
    num_tokens: int,
) -> Tensor:
    """Sum weight × expert output per token ([T, H]); accumulates in float32 in rank order,
    returns expert_outputs.dtype. Tokens without routes get zeros."""
    if expert_outputs.dim() != 2 or expert_outputs.shape[0] != plan.num_routes:
        raise ValueError(
            f"expert_outputs {tuple(expert_outputs.shape)} must be [num_routes={plan.num_routes}, H]"
        )
    if weights.dim() != 2 or weights.shape[0] != num_tokens:
        raise ValueError(f"weights {tuple(weights.shape)} must be [num_tokens={num_tokens}, k]")
    route_weights = weights.reshape(-1)[plan.route_index].float()  # [num_routes]
    top_k = weights.shape[1]
    # Place each route at its (token, rank) slot and sum over ranks in rank order: the result
    # does not depend on the order the groups ran in (resident-first or not), bit for bit.
    per_route = torch.zeros(num_tokens * top_k, expert_outputs.shape[1], dtype=torch.float32, device=expert_outputs.device)
    per_route.index_copy_(0, plan.route_index, expert_outputs.float() * route_weights[:, None])
    return per_route.view(num_tokens, top_k, -1).sum(dim=1).to(expert_outputs.dtype)


def moe_forward(
    hidden: Tensor,  # [T, H]
    expert_ids: Tensor,  # [T, k], -1 = dropped route
    weights: Tensor,  # [T, k]
    run_expert: Callable[[int, Tensor], Tensor],
    *,
    num_experts: int,
    resident: Tensor | None = None,  # [num_experts] bool
) -> Tensor:
    """Run the MoE layer: run_expert(expert_id, rows [n_e, H]) -> [n_e, H] is called exactly
    once per distinct selected expert, in dispatch order. Returns [T, H] in the experts'
    output dtype (hidden's dtype when no route is selected)."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be 2-D [T, H]")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != hidden.shape[0] or weights.shape != expert_ids.shape:
        raise ValueError(
            f"expert_ids {tuple(expert_ids.shape)} and weights {tuple(weights.shape)} must both be "
            f"[T={hidden.shape[0]}, k]"
        )
    plan = dispatch(expert_ids, num_experts=num_experts, resident=resident)
    if plan.num_routes == 0:
        return torch.zeros_like(hidden)
    rows = hidden[plan.token_index]  # [num_routes, H], grouped by expert
    bounds = plan.offsets.tolist()
    outputs = []
    for g, expert_id in enumerate(plan.expert_ids.tolist()):
        start, end = bounds[g], bounds[g + 1]
        out = run_expert(expert_id, rows[start:end])
        if out.dim() != 2 or out.shape[0] != end - start:
            raise ValueError(f"run_expert({expert_id}) returned {tuple(out.shape)}, expected [{end - start}, H]")
        outputs.append(out)
    return combine(torch.cat(outputs, dim=0), plan, weights, hidden.shape[0])


def swiglu_expert(
    gate_proj: Tensor | Sequence[Tensor],  # [E, I, H] or E × [I, H]
    up_proj: Tensor | Sequence[Tensor],  # [E, I, H] or E × [I, H]
    down_proj: Tensor | Sequence[Tensor],  # [E, H, I] or E × [H, I]
) -> Callable[[int, Tensor], Tensor]:
    """A run_expert for SwiGLU experts, down(silu(gate(x)) * up(x)), with per-expert weights
    in nn.Linear layout [out, in] indexed by expert id. Rows are cast to the weights' dtype."""
    num_experts = len(gate_proj)
    if len(up_proj) != num_experts or len(down_proj) != num_experts:
        raise ValueError(
            f"gate_proj, up_proj, down_proj hold {num_experts}, {len(up_proj)}, {len(down_proj)} experts; must be equal"
        )
    for name, weight in (("gate_proj", gate_proj), ("up_proj", up_proj), ("down_proj", down_proj)):
        if isinstance(weight, Tensor) and weight.dim() != 3:
            raise ValueError(f"{name} {tuple(weight.shape)} must be 3-D [E, out, in]")
    if isinstance(gate_proj, Tensor) and isinstance(up_proj, Tensor) and isinstance(down_proj, Tensor):
        inter, hid = gate_proj.shape[1:]
        if tuple(up_proj.shape[1:]) != (inter, hid) or tuple(down_proj.shape[1:]) != (hid, inter):
            raise ValueError(
                f"up_proj {tuple(up_proj.shape)} / down_proj {tuple(down_proj.shape)} do not match "
                f"gate_proj {tuple(gate_proj.shape)}"
            )

    def run_expert(expert_id: int, rows: Tensor) -> Tensor:  # rows [n_e, H] -> [n_e, H]
        if not 0 <= expert_id < num_experts:
            raise ValueError(f"expert_id {expert_id!r} outside [0, {num_experts})")
        gate, up, down = gate_proj[expert_id], up_proj[expert_id], down_proj[expert_id]
        x = rows.to(gate.dtype)
        return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)

    return run_expert


def _describe(value: object) -> str:
    if isinstance(value, Tensor):
        return f"{tuple(value.shape)} {value.dtype}"
    return type(value).__name__

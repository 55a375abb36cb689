"""Router softmax + top-k + renormalisation in one kernel per row (DESIGN §5).

The same rule as kernels.routing.route_topk: float32 softmax, k picks one rank at a time,
each the argmax (lowest id on ties) of the remaining experts' scores, where a resident
expert's score is multiplied by mult(rank) (MoCE; draft rows use the draft table), then
the unboosted probabilities of the chosen experts renormalised with the 2**-14 floor.

With `shared_gate` (Qwen3-Next's shared expert, off by default) the logits have one more
column, the shared expert's gate logit: the rule above runs over the first E columns as
without it, and each row gets one more route, expert E, weighted by sigmoid(logit) in
float32 (the logit rounded to the model dtype like the others), so the shared expert runs
as expert E of an [E + 1, ...] expert tensor through the same expert and combine kernels.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from kernels.fused import cpu_rows, launch_options, next_power_of_2, tl_dtype, use_triton
from kernels.routing import WEIGHT_FLOOR, moce_multipliers, route_topk

ROUTE_WARPS = 1  # per row, up to 256 experts (launch settings are module constants: bench/config_sweep.py)
# Without MoCE a pick's score is its probability, so one reduction gives both (the max and its
# lowest index: tl.argmax's own rule); with MoCE the probability is a second reduction.
MAX_WITH_INDEX = True


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def topk_kernel(
        logits_ptr, ids_ptr, weights_ptr, resident_ptr, draft_ptr, other_mult_ptr, draft_mult_ptr, live_ptr, E, floor,
        row_len,
        TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_E: tl.constexpr, NORMALIZE: tl.constexpr,
        MOCE: tl.constexpr, PARTIALS: tl.constexpr, ROUND_TO: tl.constexpr, HAS_LIVE: tl.constexpr, PDL: tl.constexpr,
        SHARED: tl.constexpr, OUT_K: tl.constexpr, MAX_WITH_INDEX: tl.constexpr,
    ):
        # row_len: logits per row, E (+ 1 with SHARED: column E is the shared expert's gate logit);
        # OUT_K: routes per row, TOP_K (+ 1 with SHARED: expert E, weight sigmoid(logit_E)).
        if PDL:  # wait for the predecessor kernel before touching anything it may write or read
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        t = tl.program_id(0)
        e = tl.arange(0, BLOCK_E)
        ok = e < E
        if PARTIALS > 0:  # split-K partial logits [T, PARTIALS, E] float32: summed in split order
            x = tl.zeros((BLOCK_E,), tl.float32)
            for s in tl.static_range(PARTIALS):
                x += tl.load(logits_ptr + (t * PARTIALS + s) * row_len + e, mask=ok, other=0.0)
            x = tl.where(ok, x.to(ROUND_TO).to(tl.float32), float("-inf"))  # the model-dtype logits
            if SHARED:  # the gate logit's partials, in the same order, rounded alike
                shared_logit = tl.load(logits_ptr + t * PARTIALS * row_len + E)
                for s in tl.static_range(1, PARTIALS):
                    shared_logit += tl.load(logits_ptr + (t * PARTIALS + s) * row_len + E)
                shared_logit = shared_logit.to(ROUND_TO).to(tl.float32)
        else:
            x = tl.load(logits_ptr + t * row_len + e, mask=ok, other=float("-inf")).to(tl.float32)
            if SHARED:
                shared_logit = tl.load(logits_ptr + t * row_len + E).to(tl.float32)
        p = tl.exp(x - tl.max(x, axis=0))
        p = p / tl.sum(p, axis=0)
        remaining = tl.where(ok, p, float("-inf"))
        if MOCE:
            resident = tl.load(resident_ptr + e, mask=ok, other=0) != 0
            is_draft = tl.load(draft_ptr + t) != 0
        ranks = tl.arange(0, K_PAD)
        picked = tl.zeros((K_PAD,), tl.int64)
        chosen = tl.zeros((K_PAD,), tl.float32)
        for rank in tl.static_range(TOP_K):
            if MOCE:
                mult = tl.where(is_draft, tl.load(draft_mult_ptr + rank), tl.load(other_mult_ptr + rank))
                score = tl.where(resident, remaining * mult, remaining)
            else:
                score = remaining
            if MAX_WITH_INDEX and not MOCE:
                prob, best = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
            else:
                best = tl.argmax(score, axis=0, tie_break_left=True)
                prob = tl.sum(tl.where(e == best, p, 0.0), axis=0)
            picked = tl.where(ranks == rank, best.to(tl.int64), picked)
            chosen = tl.where(ranks == rank, prob, chosen)
            remaining = tl.where(e == best, float("-inf"), remaining)
        if NORMALIZE:
            chosen = chosen / tl.maximum(tl.sum(chosen, axis=0), floor)
        if HAS_LIVE:  # a padding row selects no expert (-1): the expert kernels skip it
            is_live = tl.load(live_ptr + t) != 0
            picked = tl.where(is_live, picked, -1)
        tl.store(ids_ptr + t * OUT_K + ranks, picked, mask=ranks < TOP_K)
        tl.store(weights_ptr + t * OUT_K + ranks, chosen, mask=ranks < TOP_K)
        if SHARED:  # the shared expert: route TOP_K, expert E
            shared_id = tl.zeros((), tl.int64) + E
            if HAS_LIVE:
                shared_id = tl.where(is_live, shared_id, -1)
            tl.store(ids_ptr + t * OUT_K + TOP_K, shared_id)
            tl.store(weights_ptr + t * OUT_K + TOP_K, 1.0 / (1.0 + tl.exp(-shared_logit)))

    return topk_kernel


class MoceTables:
    """Device tensors of the MoCE multipliers for one top_k and setting (built once, graph-safe)."""

    def __init__(self, top_k: int, *, scale: float, r1_scale: float, protect: int, device: torch.device | str):
        other, draft = moce_multipliers(top_k, scale=scale, r1_scale=r1_scale, protect=protect)
        self.other = torch.tensor(other, dtype=torch.float32, device=device)
        self.draft = torch.tensor(draft, dtype=torch.float32, device=device)
        self.scale, self.r1_scale, self.protect = scale, r1_scale, protect


def route(
    router_logits: Tensor,  # [T, E (+1)], or split-K partials [T, splits, E (+1)] float32 (see round_to)
    top_k: int,
    *,
    round_to: torch.dtype | None = None,  # partials: the dtype their sum is rounded to (the model's)
    normalize: bool,
    resident: Tensor | None = None,  # [E] bool: MoCE residency map (None = plain top-k)
    draft_rows: Tensor | None = None,  # [T] bool
    tables: MoceTables | None = None,  # required with resident
    live: Tensor | None = None,  # [T] int: 0 marks a padding row, whose ids become -1 (no expert runs for it)
    pdl: bool = False,  # launch as a programmatic dependent (kernels.fused.pdl_supported)
    shared_gate: bool = False,  # the last logit column is a shared expert's gate: one more route, expert E
) -> tuple[Tensor, Tensor]:
    """(expert_ids [T, k] int64 in rank order, weights [T, k] float32); with shared_gate, [T, k + 1]:
    route k is expert E (the shared one; -1 on padding rows) weighted by sigmoid(logit_E) in float32."""
    if resident is not None and tables is None:
        raise ValueError("route: MoCE routing (resident given) needs its multiplier tables")
    partials = router_logits.shape[1] if router_logits.dim() == 3 else 0
    if partials and round_to is None:
        raise ValueError("route: split-K partial logits need round_to")
    if not use_triton(router_logits):
        if resident is None and not shared_gate:
            native = cpu_rows.route(router_logits, top_k, round_to, normalize, live)
            if native is not None:
                return native
        if partials:
            summed = router_logits[:, 0]
            for s in range(1, partials):
                summed = summed + router_logits[:, s]
            router_logits = summed.to(round_to)
        if shared_gate:
            shared_weight = torch.sigmoid(router_logits[:, -1].float())  # [T]
            router_logits = router_logits[:, :-1]
        if resident is None:
            ids, weights = route_topk(router_logits, top_k, normalize=normalize)
        else:
            ids, weights = route_topk(router_logits, top_k, resident=resident, scale=tables.scale,
                                      r1_scale=tables.r1_scale, protect=tables.protect, draft_rows=draft_rows,
                                      normalize=normalize)
        if shared_gate:
            ids = torch.cat([ids, torch.full_like(ids[:, :1], router_logits.shape[1])], dim=1)
            weights = torch.cat([weights, shared_weight.unsqueeze(1)], dim=1)
        if live is not None:
            ids = torch.where(live.to(ids.device).unsqueeze(1) != 0, ids, -1)
        return ids, weights
    num_rows, row_len = router_logits.shape[0], router_logits.shape[-1]
    num_experts = row_len - 1 if shared_gate else row_len
    device = router_logits.device
    num_routes = top_k + 1 if shared_gate else top_k
    ids = torch.empty((num_rows, num_routes), dtype=torch.int64, device=device)
    weights = torch.empty((num_rows, num_routes), dtype=torch.float32, device=device)
    moce = resident is not None
    if moce and draft_rows is None:
        draft_rows = torch.zeros(num_rows, dtype=torch.bool, device=device)
    dummy = weights
    _kernels()[(num_rows,)](
        router_logits.contiguous(), ids, weights,
        resident if moce else dummy, draft_rows if moce else dummy,
        tables.other if moce else dummy, tables.draft if moce else dummy, live if live is not None else dummy,
        num_experts, WEIGHT_FLOOR, row_len,
        TOP_K=top_k, K_PAD=max(2, next_power_of_2(top_k)), BLOCK_E=max(16, next_power_of_2(num_experts)),
        NORMALIZE=normalize, MOCE=moce, PARTIALS=partials, ROUND_TO=tl_dtype(round_to or router_logits.dtype),
        HAS_LIVE=live is not None, PDL=pdl, SHARED=shared_gate, OUT_K=num_routes, MAX_WITH_INDEX=MAX_WITH_INDEX,
        num_warps=ROUTE_WARPS if num_experts <= 256 else 4, **launch_options(pdl),
    )
    return ids, weights

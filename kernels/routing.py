"""Residency-aware top-k expert routing for MoE layers.

Decode rows (`route_topk`): probs = softmax(router_logits) in float32 over E experts; the k
experts are picked one rank at a time, each the argmax of the remaining experts' scaled
scores (ties: lowest expert id). A resident expert's score is multiplied by mult(rank), a
non-resident expert's by 1, so a slightly less likely expert that is already in fast memory
can win a rank. Without a residency map this is plain top-k.

    draft rows:  m = b·b (squaring the scale doubles the log bonus), P = 1, no rank-1 bonus
    other rows:  m = b, P = protect, rank-1 bonus active iff r > 1 and P > 1
    mult(rank) = m  if rank >= P and m > 1
               = r  elif rank >= 1 and the rank-1 bonus is active
               = 1  otherwise

with b = `scale`, r = `r1_scale`, P = `protect`. With m <= 1 the ranks past P keep the
multiplier r. The weights are always the *unboosted* probabilities of the chosen experts,
renormalised over the chosen set with a floor, w = p / max(sum p, 2**-14) (w = p when the
model does not renormalise, normalize=False): the boost changes which experts run, never
how much each contributes.

Prefill rows (`route_prompt_topk`) take one packed float per chunk (opt-in and lossy), see
`unpack_prompt_value`: v >= 0 protects a tail of the chunk and the first P ranks and adds a
logit bonus to resident experts at later ranks; v < 0 is expert dropout of weak
non-resident experts at ranks >= 3.

All arithmetic is float32 and vectorised over rows and experts (only the k ranks are a
Python loop); torch.argmax returns the first maximal index, which gives the lowest-id tie
break on CPU and CUDA alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

WEIGHT_FLOOR = 2.0**-14  # denominator floor of the renormalisation; keeps tiny sums finite
MAX_PROMPT_BONUS = 40.0  # cap on the additive prompt logit bonus
DROPOUT_FIRST_RANK = 3  # expert dropout never touches ranks 0..2
DROPPED_ID = -1  # id of a dropped route (weight 0); moe.dispatch skips it


@dataclass(frozen=True)
class PromptRouting:
    """A decoded packed prompt value; see `unpack_prompt_value`."""

    tail: int  # the last `tail` rows of the chunk are routed exactly (0 = none)
    protect: int  # ranks < protect are routed exactly
    bonus: float  # additive logit bonus for resident experts at ranks >= protect, capped at 40
    dropout_skip: int  # dropout leaves the last `dropout_skip` rows alone
    dropout_tau: float  # weight threshold of expert dropout (0 = no dropout)


def unpack_prompt_value(packed: float) -> PromptRouting:
    """Decode the packed prompt value v.

    v >= 0: tail = int(v) // 10000, rem = v - 10000·tail, protect = int(rem) // 100,
    bonus = min(rem - 100·protect, 40); e.g. 300.85 → (0, 3, ≈0.85), 320335 → (32, 3, 35),
    0 → plain top-k.
    v < 0: expert dropout, skip = int(-v), tau = -v - skip; e.g. -0.05 → (0, ≈0.05),
    -32.05 → (32, ≈0.05); integer negatives give tau = 0 and change nothing.
    """
    if isinstance(packed, bool) or not isinstance(packed, (int, float)) or not math.isfinite(packed):
        raise ValueError(f"packed {packed!r} must be a finite number")
    v = float(packed)
    if v < 0:
        skip = int(-v)
        return PromptRouting(tail=0, protect=0, bonus=0.0, dropout_skip=skip, dropout_tau=-v - skip)
    tail = int(v) // 10000
    rem = v - 10000 * tail
    protect = int(rem) // 100
    bonus = min(rem - 100 * protect, MAX_PROMPT_BONUS)
    return PromptRouting(tail=tail, protect=protect, bonus=bonus, dropout_skip=0, dropout_tau=0.0)


def route_topk(
    router_logits: Tensor,  # [T, E]
    top_k: int,
    *,
    resident: Tensor | None = None,  # [E] bool
    scale: float = 1.0,
    r1_scale: float = 1.0,
    protect: int = 0,
    draft_rows: Tensor | None = None,  # [T] bool
    normalize: bool = True,
) -> tuple[Tensor, Tensor]:
    """Residency-boosted top-k of decode rows (see the module docstring for the rule).

    Returns (expert_ids [T, k] int64 in rank order, weights [T, k] float32).
    """
    num_experts = _check_logits(router_logits, top_k)
    resident = _check_mask(resident, "resident", num_experts, router_logits.device)
    draft_rows = _check_mask(draft_rows, "draft_rows", router_logits.shape[0], router_logits.device)
    for name, value in (("scale", scale), ("r1_scale", r1_scale)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} {value!r} must be finite and > 0")
    if isinstance(protect, bool) or not isinstance(protect, int) or protect < 0:
        raise ValueError(f"protect {protect!r} must be an integer >= 0")

    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
    if resident is None:
        # Plain top-k in one kernel: a stable descending sort orders equal probabilities by
        # ascending id, exactly what rank-by-rank argmax with lowest-id ties picks.
        expert_ids = torch.sort(probs, dim=-1, descending=True, stable=True)[1][:, :top_k]
        return expert_ids, _weights(probs, expert_ids, normalize)

    # The multipliers are exact float32 values (m, r or 1), so every score is one float32
    # product, which keeps tie behaviour reproducible by any float32 reference.
    other_mult, draft_mult = moce_multipliers(top_k, scale=scale, r1_scale=r1_scale, protect=protect)
    if draft_rows is None:
        draft_mult = other_mult  # no draft rows: the draft table is never used
    device = probs.device
    one = torch.ones((), dtype=torch.float32, device=device)

    def scores(rank: int, remaining: Tensor) -> Tensor:
        if other_mult[rank] == 1.0 and draft_mult[rank] == 1.0:
            return remaining
        row_mult = torch.full((probs.shape[0],), other_mult[rank], dtype=torch.float32, device=device)  # [T]
        if draft_rows is not None:
            row_mult = row_mult.masked_fill(draft_rows, draft_mult[rank])
        # Chosen experts are -inf in `remaining` and stay -inf after a positive multiplier.
        return remaining * torch.where(resident[None, :], row_mult[:, None], one)

    expert_ids = _select(probs, top_k, scores)
    return expert_ids, _weights(probs, expert_ids, normalize)


def route_prompt_topk(
    router_logits: Tensor,  # [T, E] rows t = 0..T-1 of one prefill chunk
    top_k: int,
    *,
    resident: Tensor | None,  # [E] bool
    packed: float,
    normalize: bool = True,
) -> tuple[Tensor, Tensor]:
    """Top-k of the prefill rows of one chunk under a packed prompt value (opt-in, lossy).

    v >= 0: rows in the protected tail (tail > 0 and t + tail >= T) are plain top-k; other
    rows pick ranks < protect by plain argmax, later ranks by argmax of router_logit + bonus
    for resident experts (router_logit for the rest), compared in logit space.
    v < 0: plain top-k; then, in rows t < T - skip when tau > 0, a non-resident expert at
    rank >= 3 whose renormalised weight p / max(sum p, 2**-14) is below tau gets id -1 and
    weight 0, and the kept weights are renormalised over the kept experts (same floor). With
    normalize=False the kept weights stay the raw p.
    resident=None: no bonus and no dropout, plain top-k (there is nothing to favour or spare).
    A zero bonus (e.g. v = 0 or v = 300) is plain top-k as well.
    Weights always come from the unboosted probabilities.
    Returns (expert_ids [T, k] int64, -1 for dropped routes, weights [T, k] float32).
    """
    num_experts = _check_logits(router_logits, top_k)
    resident = _check_mask(resident, "resident", num_experts, router_logits.device)
    prompt = unpack_prompt_value(packed)

    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
    num_rows = probs.shape[0]
    rows = torch.arange(num_rows, device=probs.device)

    if resident is None or (prompt.bonus <= 0 and prompt.dropout_tau <= 0):
        expert_ids = _select(probs, top_k, _plain)
        return expert_ids, _weights(probs, expert_ids, normalize)

    if prompt.dropout_tau <= 0:  # bonus mode
        exact_rows = (rows + prompt.tail >= num_rows) if prompt.tail > 0 else torch.zeros_like(rows, dtype=torch.bool)
        # Logit-space scores. -inf logits are lifted to the lowest finite value so that the
        # already-chosen experts are the only -inf entries and can never win a rank again.
        bonus = torch.tensor(prompt.bonus, dtype=torch.float32, device=probs.device)
        boosted = router_logits.float().clamp_min(torch.finfo(torch.float32).min)
        boosted = torch.where(resident[None, :], boosted + bonus, boosted)  # [T, E]

        def scores(rank: int, remaining: Tensor) -> Tensor:
            if rank < prompt.protect:
                return remaining
            logit_scores = boosted.masked_fill(torch.isneginf(remaining), -math.inf)
            return torch.where(exact_rows[:, None], remaining, logit_scores)

        expert_ids = _select(probs, top_k, scores)
        return expert_ids, _weights(probs, expert_ids, normalize)

    # Expert dropout.
    expert_ids = _select(probs, top_k, _plain)
    chosen_probs = probs.gather(1, expert_ids)  # [T, k]
    renormed = _renormalise(chosen_probs, True)  # the threshold always uses renormalised weights
    ranks = torch.arange(top_k, device=probs.device)
    drop = (
        (rows < num_rows - prompt.dropout_skip)[:, None]
        & (ranks >= DROPOUT_FIRST_RANK)[None, :]
        & ~resident[expert_ids]
        & (renormed < torch.tensor(prompt.dropout_tau, dtype=torch.float32, device=probs.device))
    )  # [T, k]
    weights = _renormalise(chosen_probs.masked_fill(drop, 0.0), normalize)
    return expert_ids.masked_fill(drop, DROPPED_ID), weights


# --- helpers -----------------------------------------------------------------------------


def _check_logits(router_logits: Tensor, top_k: int) -> int:
    if not isinstance(router_logits, Tensor) or router_logits.dim() != 2 or not router_logits.is_floating_point():
        shape = tuple(router_logits.shape) if isinstance(router_logits, Tensor) else type(router_logits).__name__
        raise ValueError(f"router_logits {shape} must be a 2-D floating-point tensor [T, E]")
    num_experts = router_logits.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k {top_k!r} must be an integer in [1, {num_experts}]")
    return num_experts


def _check_mask(mask: Tensor | None, name: str, length: int, device: torch.device) -> Tensor | None:
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != (length,):
        desc = f"{tuple(mask.shape)} {mask.dtype}" if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"{name} {desc} must be a bool tensor of shape [{length}]")
    return mask.to(device)


def moce_multipliers(top_k: int, *, scale: float, r1_scale: float, protect: int) -> tuple[list[float], list[float]]:
    """(other rows', draft rows') mult(rank) for rank = 0..k-1, exact float32 values (DESIGN §5)."""
    b = torch.tensor(scale, dtype=torch.float32)
    r = torch.tensor(r1_scale, dtype=torch.float32)
    draft = _rank_multipliers(top_k, m=b * b, r=r, protect=1, r1_active=False)
    other = _rank_multipliers(top_k, m=b, r=r, protect=protect, r1_active=bool(r > 1) and protect > 1)
    return other, draft


def _rank_multipliers(top_k: int, *, m: Tensor, r: Tensor, protect: int, r1_active: bool) -> list[float]:
    """mult(rank) for rank = 0..k-1 as exact float32 values (python floats hold them exactly)."""
    out = []
    for rank in range(top_k):
        if rank >= protect and bool(m > 1):
            out.append(float(m))
        elif rank >= 1 and r1_active:
            out.append(float(r))
        else:
            out.append(1.0)
    return out


def _plain(rank: int, remaining: Tensor) -> Tensor:
    """Unboosted scores: plain top-k."""
    return remaining


def _select(probs: Tensor, top_k: int, scores: Callable[[int, Tensor], Tensor]) -> Tensor:
    """Greedy rank-by-rank argmax. scores(rank, remaining) maps the probs with chosen experts
    set to -inf ([T, E]) to that rank's scores; chosen experts must stay -inf."""
    remaining = probs.clone()  # [T, E]
    picks = []
    for rank in range(top_k):
        pick = torch.argmax(scores(rank, remaining), dim=-1)  # [T], first max = lowest id
        picks.append(pick)
        remaining.scatter_(1, pick[:, None], -math.inf)
    return torch.stack(picks, dim=1).to(torch.int64)  # [T, k]


def _weights(probs: Tensor, expert_ids: Tensor, normalize: bool) -> Tensor:
    """Unboosted probabilities of the chosen experts, renormalised if the model does."""
    return _renormalise(probs.gather(1, expert_ids), normalize)  # [T, k]


def _renormalise(chosen_probs: Tensor, normalize: bool) -> Tensor:
    """w = p / max(sum p, 2**-14) over a row (the floor keeps near-zero sums finite)."""
    if not normalize:
        return chosen_probs
    return chosen_probs / chosen_probs.sum(dim=-1, keepdim=True).clamp_min(WEIGHT_FLOOR)

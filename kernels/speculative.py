"""Verification of draft chains (DESIGN §3) and the exact output law used to test it.

Modes
- exact (default; greedy is its temperature-0 case): the target draws its own token y_j
  from p_j with u_pick(pos_j) and accepts d_j iff d_j == y_j; it emits the accepted drafts,
  then y at the first mismatch (or the bonus y_k). Output depends only on the seed.
- probabilistic (speculative sampling): accept d_j iff u_accept·q_j(d_j) < p_j(d_j);
  otherwise emit a draw from max(0, p_j − q_j) normalised, with u_resid; after k accepted
  drafts emit the bonus from p_k with u_pick. Point-mass drafts (no q row) have q = one-hot,
  so they are accepted iff u_accept < p(d) and the residual is p with d removed.

Admission (retention) statistics must not depend on the candidate's own draw: in
probabilistic mode the `top` gate uses max q_j; `pick` (q_j(d_j)) is approximate.

Positions: draft j of a round decides the token at position base + j, where base is the
number of committed tokens; draws are keyed by (seed, position, stream).
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.retention import RetentionPolicy
from kernels.sampling import PAD_ID, SparseRows, draw, lookup, sample
from kernels.rng import uniform


class Mode(str, enum.Enum):
    EXACT = "exact"
    PROBABILISTIC = "probabilistic"


class Gate(str, enum.Enum):
    TOP = "top"  # max q_j: a property of q, fixed before the draw (lossless)
    PICK = "pick"  # q_j(d_j): the candidate's own probability (approximate, biased)


def admission_confidences(
    draft_ids: Tensor, draft: SparseRows | None, *, mode: Mode, gate: Gate = Gate.TOP
) -> Tensor:
    """Per-step confidences c_j [k] (float64) that retention compares with its floors.

    exact mode: q_j(d_j) (admission cannot bias exact mode: its output is y, not d);
    probabilistic `top`: max q_j; `pick`: q_j(d_j). Point-mass drafts (draft=None) give 1.
    """
    if draft is None:
        return torch.ones(draft_ids.shape[0], dtype=torch.float64)
    if draft.num_rows != draft_ids.shape[0]:
        raise ValueError(f"{draft.num_rows} q rows for {draft_ids.shape[0]} draft tokens")
    if mode == Mode.PROBABILISTIC and gate == Gate.TOP:
        return draft.probs.max(dim=-1).values
    return lookup(draft, draft_ids)


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying a batch of chains."""

    emitted_ids: Tensor  # [batch, k+1] int64: accepted drafts then the correction/bonus; -1 after
    num_emitted: Tensor  # [batch] int64 = num_accepted + 1
    accepted: Tensor  # [batch, k] bool: per-step accept flags (False past the first rejection)
    num_accepted: Tensor  # [batch] int64

    def emitted(self, index: int = 0) -> list[int]:
        return self.emitted_ids[index, : int(self.num_emitted[index])].tolist()


def verify_chains(
    target: SparseRows,
    draft_ids: Tensor,
    num_drafts: Tensor,
    draft: SparseRows | None,
    *,
    mode: Mode,
    seed: int | Tensor,
    base_positions: Tensor,
    sampler: str = "inverse_cdf",
    accept_seed: int | Tensor | None = None,
) -> Verdict:
    """Verify a batch of chains in one vectorised pass, with no loop over the steps: every
    step's test and draw is a function of its own rows and position, and which of them
    count follows from the first rejection.

    target: batch*(k+1) rows, chain-major: p_0..p_k of each chain (row j = the target
    distribution at draft position j; row k serves the bonus).
    draft_ids: [batch, k] int64; num_drafts: [batch] retained drafts per chain (<= k).
    draft: batch*k q rows, chain-major, or None for point-mass drafts.
    seed: one uint64 for all chains or an int64 tensor [batch] of per-chain seeds.
    base_positions: [batch] int64, the position decided by draft 0.
    accept_seed: the key of the accept and residual draws (probabilistic mode); the verifier
    derives it from the seed and a secret the drafter never sees (DESIGN §10), so a drafter
    cannot predict them. None = the seed itself. The pick stream (exact mode, the bonus)
    always uses `seed`.
    """
    batch, k = draft_ids.shape
    if target.num_rows != batch * (k + 1):
        raise ValueError(f"target has {target.num_rows} rows; {batch} chains of {k} drafts need {batch * (k + 1)}")
    if draft is not None and draft.num_rows != batch * k:
        raise ValueError(f"draft has {draft.num_rows} q rows; {batch} chains of {k} drafts need {batch * k}")
    if mode == Mode.PROBABILISTIC and sampler != "inverse_cdf":
        raise ValueError("probabilistic mode samples residuals by inverse CDF; use sampler='inverse_cdf'")
    device = target.token_ids.device
    secret = seed if accept_seed is None else accept_seed
    steps = torch.arange(k + 1, device=device)
    positions = base_positions.unsqueeze(-1) + steps  # [batch, k+1]: the position each row decides
    retained = steps[:k] < num_drafts.unsqueeze(-1)  # [batch, k]
    if mode == Mode.EXACT:
        # The target's own token of every row at once; a draft is accepted iff it equals it,
        # and the first row not accepted (a mismatch, or the bonus) emits the target's token.
        own = draw(target, _per_row(seed, k + 1), positions.reshape(-1), sampler=sampler).view(batch, k + 1)
        accepted = torch.cumprod((own[:, :k] == draft_ids) & retained, dim=-1).bool()
        return _verdict(draft_ids, accepted, own.gather(1, accepted.sum(dim=-1, keepdim=True)).squeeze(-1))
    # Probabilistic: every step's test and correction at once (they depend on their own rows
    # and positions only); which of them counts follows from the first rejection.
    secret_rows = secret.unsqueeze(-1) if isinstance(secret, Tensor) else secret
    u_accept = uniform(secret_rows, positions[:, :k].contiguous(), "accept")  # [batch, k]
    u_residual = uniform(secret_rows, positions[:, :k].contiguous(), "residual")
    width = target.token_ids.shape[-1]
    p_ids = target.token_ids.view(batch, k + 1, width)[:, :k].reshape(batch * k, width)
    p_probs = target.probs.view(batch, k + 1, width)[:, :k].reshape(batch * k, width)
    p_rows = SparseRows(p_ids, p_probs)  # [batch*k, width]: p_0..p_k-1 of each chain
    drafted = draft_ids.reshape(-1)
    p_drafted = lookup(p_rows, drafted)
    if draft is None:
        q_drafted = torch.ones_like(p_drafted)
        q_on_p = (p_ids == drafted.unsqueeze(-1)).to(p_probs.dtype)
    else:
        q_drafted = lookup(draft, drafted)
        q_on_p = lookup(draft, p_ids)
    ok = (u_accept.reshape(-1) * q_drafted < p_drafted).view(batch, k)
    residual = torch.clamp(p_probs - q_on_p, min=0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    # Rejection has probability 0 when the residual is empty; fall back to p then.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-300), p_probs)
    correction = sample(SparseRows(p_ids, residual), u_residual.reshape(-1)).view(batch, k)
    accepted = torch.cumprod(ok & retained, dim=-1).bool()
    num_accepted = accepted.sum(dim=-1)
    # A chain that accepted every retained draft takes the bonus from p at that position;
    # the others the correction of the step that rejected.
    rows = torch.arange(batch, device=device)
    bonus_rows = SparseRows(target.token_ids.view(batch, k + 1, -1)[rows, num_accepted],
                            target.probs.view(batch, k + 1, -1)[rows, num_accepted])
    bonus = draw(bonus_rows, seed, base_positions + num_accepted, sampler=sampler)
    if k:
        stopped_at = correction.gather(1, num_accepted.clamp(max=k - 1).unsqueeze(-1)).squeeze(-1)
        bonus = torch.where(num_accepted < num_drafts, stopped_at, bonus)
    return _verdict(draft_ids, accepted, bonus)


def _verdict(draft_ids: Tensor, accepted: Tensor, final: Tensor) -> Verdict:
    """The verdict of chains whose drafts [batch, k] were `accepted` (a prefix of each chain)
    and whose last emitted token is `final` [batch] (the correction, or the bonus)."""
    batch = draft_ids.shape[0]
    num_accepted = accepted.sum(dim=-1)
    emitted = torch.cat([torch.where(accepted, draft_ids, PAD_ID),
                         torch.full((batch, 1), PAD_ID, dtype=torch.int64, device=draft_ids.device)], dim=-1)
    emitted.scatter_(1, num_accepted.unsqueeze(-1), final.unsqueeze(-1))
    return Verdict(emitted, num_accepted + 1, accepted, num_accepted)


def _per_row(seed: int | Tensor, rows_per_chain: int) -> int | Tensor:
    """A chain's seed for each of its rows (rows laid out chain-major)."""
    return seed.repeat_interleave(rows_per_chain) if isinstance(seed, Tensor) else seed


def verify_chain(
    target: SparseRows,
    draft_ids: Sequence[int] | Tensor,
    draft: SparseRows | None,
    *,
    mode: Mode,
    seed: int,
    base_position: int,
    sampler: str = "inverse_cdf",
    accept_seed: int | None = None,
) -> Verdict:
    """Verify one request's chain: target has len(draft_ids)+1 rows, draft one q row per draft."""
    ids = torch.as_tensor(draft_ids, dtype=torch.int64).reshape(1, -1)
    return verify_chains(
        target,
        ids,
        torch.tensor([ids.shape[1]]),
        draft,
        mode=mode,
        seed=seed,
        base_positions=torch.tensor([base_position]),
        sampler=sampler,
        accept_seed=accept_seed,
    )


# ---------------------------------------------------------------------------------------
# Exact output law (tests): every branch enumerated, no sampling noise.
# ---------------------------------------------------------------------------------------

Law = dict[tuple[int, ...], float]
DistFn = Callable[[tuple[int, ...]], Sequence[float]]  # prefix -> dense distribution over the vocab


def _add(law: Law, key: tuple[int, ...], mass: float) -> None:
    if mass > 0:
        law[key] = law.get(key, 0.0) + mass


def extend_with_target(law: Law, p_fn: DistFn, horizon: int) -> Law:
    """Complete every sequence of `law` to `horizon` tokens by plain sampling from p."""
    out: Law = {}
    stack = list(law.items())
    while stack:
        tokens, mass = stack.pop()
        if len(tokens) >= horizon:
            _add(out, tokens[:horizon], mass)
            continue
        for token, prob in enumerate(p_fn(tokens)):
            if prob > 0:
                stack.append((tokens + (token,), mass * prob))
    return out


def target_law(p_fn: DistFn, horizon: int) -> Law:
    """The law of the first `horizon` tokens under plain decoding."""
    return extend_with_target({(): 1.0}, p_fn, horizon)


def chain_law(
    p_fn: DistFn, draft_ids: Sequence[int], q_rows: Sequence[Sequence[float]] | None, *, mode: Mode
) -> Law:
    """Law of the tokens one round emits for a fixed drafted chain (accept × residual).

    q_rows None means point-mass drafts. In exact mode the verifier's own draws decide.
    """
    law: Law = {}

    def walk(step: int, emitted: tuple[int, ...], mass: float) -> None:
        p = list(p_fn(emitted))
        if step == len(draft_ids):
            for token, prob in enumerate(p):
                _add(law, emitted + (token,), mass * prob)
            return
        d = draft_ids[step]
        if mode == Mode.EXACT:
            for token, prob in enumerate(p):
                if token == d:
                    walk(step + 1, emitted + (d,), mass * prob)
                else:
                    _add(law, emitted + (token,), mass * prob)
            return
        q = [0.0] * len(p)
        if q_rows is None:
            q[d] = 1.0
        else:
            q = list(q_rows[step])
        accept = min(1.0, p[d] / q[d]) if q[d] > 0 else 0.0
        walk(step + 1, emitted + (d,), mass * accept)
        residual = [max(0.0, pi - qi) for pi, qi in zip(p, q)]
        total = sum(residual)
        if total <= 0:
            residual, total = p, 1.0
        for token, r in enumerate(residual):
            _add(law, emitted + (token,), mass * (1.0 - accept) * r / total)

    walk(0, (), 1.0)
    return law


def output_law(
    p_fn: DistFn,
    q_fn: DistFn,
    *,
    num_drafts: int,
    mode: Mode,
    gate: Gate,
    policy: RetentionPolicy,
    horizon: int,
    point_mass: bool = False,
) -> Law:
    """Exact law of the first `horizon` tokens for one speculative round then plain decoding.

    Enumerates the drafter's draws d_j ~ q_fn(d_<j) (or the point masses q_fn gives when
    point_mass), the retention decision on the gate's confidences, and every accept /
    residual branch of verification.
    """
    law: Law = {}
    vocab = len(p_fn(()))
    for chain in itertools.product(range(vocab), repeat=num_drafts):
        mass = 1.0
        q_rows: list[list[float]] = []
        confidences: list[float] = []
        for step, token in enumerate(chain):
            q = list(q_fn(tuple(chain[:step])))
            mass *= q[token]
            q_rows.append(q)
            if point_mass or mode == Mode.EXACT or gate == Gate.PICK:
                confidences.append(q[token])
            else:
                confidences.append(max(q))
        if mass <= 0:
            continue
        kept = policy.keep(confidences)
        round_law = chain_law(p_fn, chain[:kept], None if point_mass else q_rows[:kept], mode=mode)
        for tokens, prob in round_law.items():
            _add(law, tokens, mass * prob)
    return extend_with_target(law, p_fn, horizon)


def law_distance(a: Law, b: Law) -> float:
    """Largest absolute difference between two laws over the union of their outcomes."""
    return max((abs(a.get(key, 0.0) - b.get(key, 0.0)) for key in set(a) | set(b)), default=0.0)

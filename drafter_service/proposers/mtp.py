"""MTP drafting: chain up to k tokens with the model's one MTP layer (DESIGN §6).

Per session the MTP layer keeps its own KV rows: one row per committed position i but the
last, built from (trunk hidden[i], token[i+1]); the last row's logits give q_0, the
distribution of the first draft. Each further step feeds the MTP layer's own output hidden
state and the drafted token back in; draft rows are rolled back after the chain is sent.

Batching: the chains of every session with a draft pending run step by step as one call of the
MTP runner (shared.model.mtp_runner), and so do their commits' catch-ups (`draft_batch`,
`settle_batch`). On the fused path the sessions' rows live in one paged pool and a call is one
ragged forward of row-invariant kernels, so a chain is bit for bit what it is alone; the
reference modules (`--fused off`) keep a cache per session and run them one after another.

Draws (q_j is the processed distribution of the MTP logits, the target's sampling settings):
- greedy: the argmax (point masses, no q rows sent);
- exact mode: drawn on the draft stream, or with the target's own u_pick when coupled;
- probabilistic: drawn on the draft stream; the q row sent is exactly the row drawn from.
Retention is applied step by step before anything of a rejected step is written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.retention import RetentionPolicy
from kernels.sampling import SamplingParams, SparseRows, draw, process_logits
from kernels.speculative import Gate, Mode, admission_confidences
from shared.model.fused import FusedForward
from shared.model.kv_cache import CacheLength
from shared.model.layers import RoutingOptions
from shared.model.mtp_runner import MtpRows, MtpRunner, PooledMtpRunner, ReferenceMtpRunner
from drafter_service.proposers import Proposal


class MTPState:
    """A session's MTP rows (a slot of the proposer's runner and their length) and the pending
    first-draft logits; MTPProposer.new_state makes it."""

    def __init__(self, cache: CacheLength, slot: int | None) -> None:
        self.cache = cache
        self.slot = slot  # the runner's slot (None once released)
        self.next_logits: Tensor | None = None  # [vocab]: q_0 of the next chain
        self.last_out: Tensor | None = None  # [hidden]: MTP output of the last committed row
        # Committed rows not yet run through the MTP layer (MTPProposer.settle), the session's
        # debt: they wait until a chain needs MTP, or until the debt is due (Drafter.mtp_due).
        self.pending: list[tuple[Tensor, list[int]]] = []

    @property
    def pending_rows(self) -> int:
        return sum(len(ids) for _, ids in self.pending)


@dataclass(frozen=True)
class DraftJob:
    """One session's chain of up to num_drafts MTP drafts (MTPProposer.draft_batch)."""

    state: MTPState
    num_drafts: int
    sampling: SamplingParams
    seed: int
    base_position: int  # position of the first draft
    mode: Mode
    gate: Gate
    coupled: bool
    policy: RetentionPolicy


@dataclass
class _Chain:
    """A job's chain while it is drafted."""

    job: DraftJob
    committed: int  # the cache length before the draft rows
    logits: Tensor  # [vocab]: q of the next draft
    hidden: Tensor  # [hidden]: the MTP output it came from
    token_ids: list[int]
    rows: list[dict[int, float]]
    confidences: list[float]
    done: bool = False


class MTPProposer:
    def __init__(self, model, routing: RoutingOptions | None = None, fused: FusedForward | None = None, *,
                 use_graphs: bool | None = None) -> None:
        """model: a loaded model with an MTP layer (any family); fused: its fused forward (the
        pooled runner: every session's rows in one forward; use_graphs: its chain steps as CUDA
        graphs, default on CUDA), else the reference modules."""
        self.model = model
        self.runner: MtpRunner = (ReferenceMtpRunner(model, routing) if fused is None
                                  else PooledMtpRunner(model, fused, routing, use_graphs=use_graphs))

    # -- sessions -------------------------------------------------------------------------------

    def new_state(self, max_length: int) -> MTPState:
        """A session's MTP state with room for max_length rows."""
        slot, cache = self.runner.acquire(max_length)
        return MTPState(cache, slot)

    def release(self, state: MTPState) -> None:
        """Give a session's slot back (run on the worker, behind the session's last job)."""
        if state.slot is not None:
            self.runner.release(state.slot)
            state.slot = None

    # -- committed rows -------------------------------------------------------------------------

    def catch_up(self, state: MTPState, hidden: Tensor, next_token_ids: list[int]) -> None:
        """Append committed rows: hidden [m, H] (trunk final-norm) with the token after each."""
        self.catch_up_batch([(state, hidden, next_token_ids)])

    def catch_up_batch(self, items: list[tuple[MTPState, Tensor, list[int]]]) -> None:
        """catch_up of several sessions, their rows in one forward where the fused path runs."""
        items = [(state, hidden, ids) for state, hidden, ids in items if ids]
        if not items:
            return
        outs = self.runner.run([MtpRows(state.slot, hidden, torch.tensor(ids, dtype=torch.int64))
                                for state, hidden, ids in items])
        for (state, _, _), (logits, out) in zip(items, outs):
            state.next_logits, state.last_out = logits[-1], out[-1]

    def defer(self, state: MTPState, hidden: Tensor, next_token_ids: list[int]) -> None:
        """catch_up later (settle): the rows of one commit join the session's debt."""
        if next_token_ids:
            state.pending.append((hidden, list(next_token_ids)))

    def settle(self, state: MTPState) -> None:
        """Run the deferred commits' rows (settle_batch)."""
        self.settle_batch([state])

    def settle_batch(self, states: list[MTPState]) -> None:
        """settle several sessions: the n-th deferred commits of every session share a call, for
        each n (the same forwards as eager catch-ups). On the fused path a session's consecutive
        commits first merge into one catch-up while their rows fit its max_rows: a row's bits do
        not depend on the rows beside it there, so that is bit for bit the commits one by one
        (the reference modules' products would round differently with more rows)."""
        if isinstance(self.runner, PooledMtpRunner):
            for state in states:
                state.pending = _merged(state.pending, self.runner.fused.max_rows)
        while any(state.pending for state in states):
            self.catch_up_batch([(state, *state.pending.pop(0)) for state in states if state.pending])

    # -- chains ---------------------------------------------------------------------------------

    def draft(self, state: MTPState, num_drafts: int, *, sampling: SamplingParams, seed: int, base_position: int,
              mode: Mode, gate: Gate, coupled: bool, policy: RetentionPolicy) -> Proposal:
        return self.draft_batch([DraftJob(state, num_drafts, sampling, seed, base_position, mode, gate, coupled,
                                          policy)])[0]

    def draft_batch(self, jobs: list[DraftJob]) -> list[Proposal]:
        """Each job's chain; step by step, the sessions still drafting run their next MTP row in
        one forward. A chain is what it would be alone: its draws depend on its own seed and
        positions, its rows' bits not on the others (fused path)."""
        if len({id(job.state) for job in jobs}) != len(jobs):
            raise ValueError("a batch drafts one chain per session")
        chains = [_Chain(job, job.state.cache.length, job.state.next_logits, job.state.last_out, [], [], [])
                  for job in jobs]
        for step in range(max((job.num_drafts for job in jobs), default=0)):
            drawing = [chain for chain in chains if not chain.done and step < chain.job.num_drafts]
            forwards = []
            for chain, kept in zip(drawing, self._draw_step(drawing, step)):
                if not kept:
                    chain.done = True
                elif step + 1 < chain.job.num_drafts:
                    forwards.append(chain)
            if forwards:
                outs = self.runner.run([MtpRows(c.job.state.slot, c.hidden.unsqueeze(0),
                                                torch.tensor(c.token_ids[-1:], dtype=torch.int64)) for c in forwards])
                for chain, (logits, out) in zip(forwards, outs):
                    chain.logits, chain.hidden = logits[0], out[0]
        proposals = []
        for chain in chains:
            chain.job.state.cache.truncate(chain.committed)  # draft rows are speculative
            greedy = chain.job.sampling.greedy
            q_rows = None if greedy else SparseRows.from_dicts(chain.rows) if chain.rows else None
            proposals.append(Proposal("MTP", chain.token_ids, q_rows, chain.confidences))
        return proposals

    def _draw_step(self, chains: list[_Chain], step: int) -> list[bool]:
        """Draw each chain's draft `step` from its current logits; False where retention stops
        the chain (nothing of a rejected step is kept). Chains with the same sampling settings
        are processed together (one host copy for them all; rows are processed independently,
        so each is what it is alone), and greedy chains skip the draw: their q rows are point
        masses on the argmax, drawn from with certainty (confidence 1 under every gate)."""
        kept = [False] * len(chains)
        by_params: dict[SamplingParams, list[int]] = {}
        for index, chain in enumerate(chains):
            by_params.setdefault(chain.job.sampling, []).append(index)
        for params, indices in by_params.items():
            logits = torch.stack([chains[i].logits for i in indices])  # [n, vocab]
            if params.greedy:
                # (torch.argmax takes the first maximum: the lowest id on ties, as process_logits)
                for index, token in zip(indices, logits.argmax(dim=-1).tolist()):
                    kept[index] = self._keep(chains[index], step, token, 1.0, None)
                continue
            q = process_logits(logits, params).to("cpu")  # [n, width]
            for row, index in enumerate(indices):
                kept[index] = self._draw(chains[index], step, q[row])
        return kept

    def _draw(self, chain: _Chain, step: int, q: SparseRows) -> bool:
        """Draw a sampled chain's draft `step` from its processed row q [1, width]."""
        job = chain.job
        stream = "pick" if (job.coupled and job.mode == Mode.EXACT) else "draft"
        position = torch.tensor([job.base_position + step])
        token = int(draw(q, job.seed, position, stream=stream)[0])
        confidence = float(admission_confidences(torch.tensor([token]), q, mode=job.mode, gate=job.gate)[0])
        return self._keep(chain, step, token, confidence, q.row(0))

    @staticmethod
    def _keep(chain: _Chain, step: int, token: int, confidence: float, q_row: dict[int, float] | None) -> bool:
        """Append the drawn draft unless retention stops the chain at this step."""
        if chain.job.policy.keep([*chain.confidences, confidence]) <= step:
            return False
        chain.token_ids.append(token)
        if q_row is not None:
            chain.rows.append(q_row)
        chain.confidences.append(confidence)
        return True


def _merged(pending: list[tuple[Tensor, list[int]]], max_rows: int) -> list[tuple[Tensor, list[int]]]:
    """Consecutive commits joined while their rows fit max_rows (a longer one stays alone)."""
    groups: list[list[tuple[Tensor, list[int]]]] = []
    rows = 0  # in the last group
    for commit in pending:
        if groups and rows + len(commit[1]) <= max_rows:
            groups[-1].append(commit)
            rows += len(commit[1])
        else:
            groups.append([commit])
            rows = len(commit[1])
    return [(torch.cat([hidden for hidden, _ in group]), [token for _, ids in group for token in ids])
            for group in groups]

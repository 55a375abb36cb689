"""MTP drafting: chain up to k tokens with the model's one MTP layer (DESIGN §6).

Per session the MTP layer keeps its own KV rows: one row per committed position i but the
last, built from (trunk hidden[i], token[i+1]); the last row's logits give q_0, the
distribution of the first draft. Each further step feeds the MTP layer's own output hidden
state and the drafted token back in; draft rows are rolled back after the chain is sent.

Batching (issue 11): on the fused path the sessions' rows live in one paged pool (a slot
each), so the chains of every session with a draft pending run step by step as one ragged
forward, and so do their commits' catch-ups (`draft_batch`, `settle_batch`); the kernels are
row-invariant, so a chain is bit for bit what it is alone. The reference modules (the CPU
default) keep a cache per session and run the sessions one after another.

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

from kernels.fused import paged_rows
from kernels.retention import RetentionPolicy
from kernels.sampling import SamplingParams, SparseRows, draw, process_logits
from kernels.speculative import Gate, Mode, admission_confidences
from shared.model import Qwen3MoeModel, RoutingOptions
from shared.model.families.qwen3_moe.fused import FusedModel
from shared.model.rows import Rows
from shared.model.kv_cache import CacheLength, KVPool
from drafter_service.proposers import Proposal

POOL_BLOCK = 64  # positions per block of the fused path's MTP pool
POOL_START_BLOCKS = 64  # blocks at start; the pool doubles when a session needs more
POOL_START_SLOTS = 8


class MTPState:
    """The MTP layer's per-session cache and the pending first-draft logits. The cache is the
    session's own KVCache (reference modules) or a slot of the proposer's shared pool (fused
    path: every session's rows run in one forward); MTPProposer.new_state makes either."""

    def __init__(self, cache: CacheLength, slot: int | None = None) -> None:
        self.cache = cache
        self.slot = slot  # slot of the proposer's pool (None: cache is the session's own KVCache)
        self.next_logits: Tensor | None = None  # [vocab]: q_0 of the next chain
        self.last_out: Tensor | None = None  # [hidden]: MTP output of the last committed row
        # Committed rows not yet run through the MTP layer (MTPProposer.settle): a commit's rows
        # wait until a chain needs MTP or until the chain is sent, off the round's latency path.
        self.pending: list[tuple[Tensor, list[int]]] = []


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
    def __init__(self, model: Qwen3MoeModel, routing: RoutingOptions | None = None,
                 fused: FusedModel | None = None) -> None:
        self.model = model
        self.routing = routing
        self.fused = fused  # the fused-kernel MTP forward (None = reference modules, a cache per session)
        self.pool: KVPool | None = self._new_pool() if fused is not None else None

    def _new_pool(self) -> KVPool:
        c = self.model.config
        return KVPool(num_layers=1, num_slots=POOL_START_SLOTS, max_length=c.max_position_embeddings,
                      num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype=self.model.dtype,
                      device=self.model.device, block_size=POOL_BLOCK, num_blocks=POOL_START_BLOCKS)

    # -- sessions' caches ---------------------------------------------------------------------

    def new_state(self, max_length: int) -> MTPState:
        """A session's MTP state with room for max_length rows."""
        if self.pool is None:
            return MTPState(self.model.new_mtp_cache(max_length))
        pool = self.pool
        if not 1 <= max_length <= pool.max_length:
            raise ValueError(f"MTP cache length {max_length} must lie in [1, {pool.max_length}]")
        needed = pool.blocks_for(max_length)
        if needed > pool.num_free_blocks or not pool.num_free:
            pool.grow(num_blocks=max(2 * pool.num_blocks, pool.num_blocks - pool.num_free_blocks + needed),
                      num_slots=2 * pool.num_slots if not pool.num_free else None)
        slot, cache = pool.acquire(max_length)
        return MTPState(cache, slot)

    def release(self, state: MTPState) -> None:
        """Give a session's pool slot back (run on the worker, behind the session's last job).
        The last session out of a pool that grew shrinks it to its start size: a burst of long
        sessions does not keep its memory for the drafter's lifetime."""
        if state.slot is None:
            return
        pool = self.pool
        pool.release(state.slot)
        state.slot = None
        if pool.num_free == pool.num_slots and (pool.num_blocks > POOL_START_BLOCKS or pool.num_slots > POOL_START_SLOTS):
            self.pool = self._new_pool()
            del pool
            if self.model.device.type == "cuda":
                torch.cuda.empty_cache()  # (the drafter often shares its GPU with a verifier)

    # -- forwards -------------------------------------------------------------------------------

    def _forward_batch(self, items: list[tuple[MTPState, Tensor, Tensor]]) -> list[tuple[Tensor, Tensor]]:
        """Each item's MTP rows (state, hidden [m, H], next token ids [m]) appended to its cache;
        on the fused path the sessions' rows run as one ragged forward (row-invariant kernels:
        each row's bits are what it gets alone). Per item: logits [m, vocab], MTP hidden [m, H]."""
        if self.fused is None:
            return [self.model.forward_mtp(hidden, ids, state.cache, routing=self._routing(ids.shape[0]))
                    for state, hidden, ids in items]
        results: list[tuple[Tensor, Tensor] | None] = [None] * len(items)
        group: list[int] = []
        for index, (state, _, ids) in enumerate(items):
            rows = ids.shape[0]
            if rows > self.fused.max_rows:  # a long catch-up (a prompt): the reference modules
                results[index] = self._long_catch_up(*items[index])
                continue
            if sum(items[i][2].shape[0] for i in group) + rows > self.fused.max_rows:
                self._run_group([items[i] for i in group], results, group)
                group = []
            group.append(index)
        if group:
            self._run_group([items[i] for i in group], results, group)
        return results

    def _run_group(self, items: list[tuple[MTPState, Tensor, Tensor]], results: list, indices: list[int]) -> None:
        device = self.model.device
        positions, slots, starts = [], [], [0]
        for state, _, ids in items:
            start = state.cache.reserve(ids.shape[0])
            positions.extend(range(start, start + ids.shape[0]))
            slots.extend([state.slot] * ids.shape[0])
            starts.append(starts[-1] + ids.shape[0])
        seq_slots = [state.slot for state, _, _ in items]
        rows = Rows(
            positions=torch.tensor(positions, device=device), slots=torch.tensor(slots, device=device),
            seq_starts=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_slots=torch.tensor(seq_slots, device=device),
            max_rows_per_seq=max(ids.shape[0] for _, _, ids in items),
        )
        hidden = torch.cat([h.to(device) for _, h, _ in items])
        ids = torch.cat([i.to(device) for _, _, i in items])
        logits, out = self.fused.forward_mtp(hidden, ids, rows, self.pool.paged(), routing=self._routing(ids.shape[0]))
        for index, start, end in zip(indices, starts, starts[1:]):
            results[index] = (logits[start:end], out[start:end])

    def _long_catch_up(self, state: MTPState, hidden: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Rows beyond the fused path's max_rows through the reference modules, on a contiguous
        copy of the session's rows, written back to its blocks."""
        pool, length, rows = self.pool, state.cache.length, ids.shape[0]
        cache = self.model.new_mtp_cache(length + rows)
        if length:
            keys, values = pool.read(state.slot, length)
            cache.keys[:, :length], cache.values[:, :length] = keys, values
        cache.length = length
        result = self.model.forward_mtp(hidden, ids, cache, routing=self._routing(rows))
        start = state.cache.reserve(rows)
        span = torch.arange(start, start + rows, device=self.model.device)
        blocks, offsets = paged_rows(pool.block_tables, torch.full_like(span, state.slot), span, pool.block_size)
        pool.keys[0, blocks, offsets] = cache.keys[0, start:]
        pool.values[0, blocks, offsets] = cache.values[0, start:]
        return result

    def _routing(self, rows: int) -> RoutingOptions | None:
        if self.routing is None:
            return None
        draft_rows = torch.ones(rows, dtype=torch.bool, device=self.model.device)
        return RoutingOptions(moce=True, scale=self.routing.scale, r1_scale=self.routing.r1_scale,
                              protect=self.routing.protect, draft_rows=draft_rows)

    # -- committed rows -------------------------------------------------------------------------

    def catch_up(self, state: MTPState, hidden: Tensor, next_token_ids: list[int]) -> None:
        """Append committed rows: hidden [m, H] (trunk final-norm) with the token after each."""
        self.catch_up_batch([(state, hidden, next_token_ids)])

    def catch_up_batch(self, items: list[tuple[MTPState, Tensor, list[int]]]) -> None:
        """catch_up of several sessions, their rows in one forward where the fused path runs."""
        items = [(state, hidden, ids) for state, hidden, ids in items if ids]
        if not items:
            return
        device = self.model.device
        outs = self._forward_batch([(state, hidden.to(device), torch.tensor(ids, dtype=torch.int64, device=device))
                                    for state, hidden, ids in items])
        for (state, _, _), (logits, out) in zip(items, outs):
            state.next_logits, state.last_out = logits[-1], out[-1]

    def defer(self, state: MTPState, hidden: Tensor, next_token_ids: list[int]) -> None:
        """catch_up later (settle): the rows of one commit, kept apart so each runs as before."""
        if next_token_ids:
            state.pending.append((hidden, list(next_token_ids)))

    def settle(self, state: MTPState) -> None:
        """Run the deferred commits' rows, one catch_up per commit (the same forwards as eager)."""
        self.settle_batch([state])

    def settle_batch(self, states: list[MTPState]) -> None:
        """settle several sessions: their n-th deferred commits run in one forward, for each n."""
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
                device = self.model.device
                outs = self._forward_batch([(c.job.state, c.hidden.unsqueeze(0),
                                             torch.tensor(c.token_ids[-1:], device=device)) for c in forwards])
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

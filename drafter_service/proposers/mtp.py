"""MTP drafting: chain up to k tokens with the model's one MTP layer (DESIGN §6).

Per session the MTP layer keeps its own KV cache: one row per committed position i but the
last, built from (trunk hidden[i], token[i+1]); the last row's logits give q_0, the
distribution of the first draft. Each further step feeds the MTP layer's own output hidden
state and the drafted token back in; draft rows are rolled back after the chain is sent.

Draws (q_j is the processed distribution of the MTP logits, the target's sampling settings):
- greedy: the argmax (point masses, no q rows sent);
- exact mode: drawn on the draft stream, or with the target's own u_pick when coupled;
- probabilistic: drawn on the draft stream; the q row sent is exactly the row drawn from.
Retention is applied step by step before anything of a rejected step is written.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.retention import RetentionPolicy
from kernels.sampling import SamplingParams, SparseRows, draw, process_logits
from kernels.speculative import Gate, Mode, admission_confidences
from shared.model import KVCache, Qwen3MoeModel, RoutingOptions
from shared.model.fast import FusedModel, Rows
from drafter_service.proposers import Proposal


class MTPState:
    """The MTP layer's per-session cache and the pending first-draft logits."""

    def __init__(self, model: Qwen3MoeModel, max_length: int) -> None:
        self.cache: KVCache = model.new_mtp_cache(max_length)
        self.next_logits: Tensor | None = None  # [vocab]: q_0 of the next chain
        self.last_out: Tensor | None = None  # [hidden]: MTP output of the last committed row
        # Committed rows not yet run through the MTP layer (MTPProposer.settle): a commit's rows
        # wait until a chain needs MTP or until the chain is sent, off the round's latency path.
        self.pending: list[tuple[Tensor, list[int]]] = []


class MTPProposer:
    def __init__(self, model: Qwen3MoeModel, routing: RoutingOptions | None = None,
                 fused: FusedModel | None = None) -> None:
        self.model = model
        self.routing = routing
        self.fused = fused  # the fused-kernel MTP forward for short row counts (None = reference modules)

    def _forward(self, hidden: Tensor, next_token_ids: Tensor, cache: KVCache) -> tuple[Tensor, Tensor]:
        """MTP rows appended to the cache: logits [T, vocab] and the MTP output hidden [T, hidden]."""
        rows = next_token_ids.shape[0]
        routing = self._routing(rows)
        if self.fused is None or rows > self.fused.max_rows:  # long catch-ups: the reference modules
            return self.model.forward_mtp(hidden, next_token_ids, cache, routing=routing)
        start = cache.reserve(rows)
        window = Rows.window(start, rows, 0, self.model.device)
        return self.fused.forward_mtp(hidden, next_token_ids, window, cache.paged(), routing=routing)

    def _routing(self, rows: int) -> RoutingOptions | None:
        if self.routing is None:
            return None
        draft_rows = torch.ones(rows, dtype=torch.bool, device=self.model.device)
        return RoutingOptions(moce=True, scale=self.routing.scale, r1_scale=self.routing.r1_scale,
                              protect=self.routing.protect, draft_rows=draft_rows)

    def catch_up(self, state: MTPState, hidden: Tensor, next_token_ids: list[int]) -> None:
        """Append committed rows: hidden [m, H] (trunk final-norm) with the token after each."""
        if not next_token_ids:
            return
        tokens = torch.tensor(next_token_ids, dtype=torch.int64, device=self.model.device)
        logits, out = self._forward(hidden.to(self.model.device), tokens, state.cache)
        state.next_logits, state.last_out = logits[-1], out[-1]

    def defer(self, state: MTPState, hidden: Tensor, next_token_ids: list[int]) -> None:
        """catch_up later (settle): the rows of one commit, kept apart so each runs as before."""
        if next_token_ids:
            state.pending.append((hidden, list(next_token_ids)))

    def settle(self, state: MTPState) -> None:
        """Run the deferred commits' rows, one catch_up per commit (the same forwards as eager)."""
        while state.pending:
            hidden, next_token_ids = state.pending.pop(0)
            self.catch_up(state, hidden, next_token_ids)

    def draft(
        self,
        state: MTPState,
        num_drafts: int,
        *,
        sampling: SamplingParams,
        seed: int,
        base_position: int,
        mode: Mode,
        gate: Gate,
        coupled: bool,
        policy: RetentionPolicy,
    ) -> Proposal:
        tokens: list[int] = []
        rows: list[dict[int, float]] = []
        confidences: list[float] = []
        logits, hidden = state.next_logits, state.last_out
        committed_rows = state.cache.length
        stream = "pick" if (coupled and mode == Mode.EXACT) else "draft"
        for step in range(num_drafts):
            q = process_logits(logits.unsqueeze(0), sampling).to("cpu")  # [1, width]
            position = torch.tensor([base_position + step])
            token = int(draw(q, seed, position, stream=stream)[0])
            confidence = float(admission_confidences(torch.tensor([token]), q, mode=mode, gate=gate)[0])
            if policy.keep([*confidences, confidence]) <= step:
                break  # retention: nothing of a rejected step is written
            tokens.append(token)
            rows.append(q.row(0))
            confidences.append(confidence)
            if step + 1 < num_drafts:
                logits, out = self._forward(hidden.unsqueeze(0), torch.tensor([token], device=self.model.device),
                                            state.cache)
                logits, hidden = logits[0], out[0]
        state.cache.truncate(committed_rows)  # draft rows are speculative
        q_rows = None if sampling.greedy else SparseRows.from_dicts(rows) if rows else None
        return Proposal("MTP", tokens, q_rows, confidences)

"""Model-side work of the verifier: prefill and verification rounds (runs on the model worker).

Invariant per session: the KV cache holds every committed token but the last (the head);
a round runs the window [head, d0..dk-1], verifies the drafts with `kernels.speculative`,
and truncates the cache to the rows that stay committed (head + accepted drafts).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kernels.sampling import SparseRows, process_logits
from kernels.speculative import verify_chain
from shared.model import KVCache, Qwen3MoeModel
from verifier_service.requests import RequestSpec


@dataclass
class Session:
    spec: RequestSpec
    cache: KVCache
    token_ids: list[int]  # committed: prompt + completion
    hidden_rows: list[Tensor] = field(default_factory=list)  # final-norm rows of token_ids[:-1], CPU bf16

    @property
    def capacity_left(self) -> int:
        """Drafts a window may still carry without overrunning the cache."""
        return self.cache.max_length - self.cache.length - 1

    def hidden(self) -> Tensor:
        return torch.cat(self.hidden_rows) if self.hidden_rows else torch.zeros((0, 0), dtype=torch.bfloat16)


@dataclass(frozen=True)
class RoundOutcome:
    emitted: list[int]  # accepted drafts, then the verifier's own token
    num_accepted: int
    hidden_rows: Tensor  # [num_accepted + 1, hidden]: rows of the head and accepted drafts (CPU bf16)
    forward_ms: float
    verify_ms: float
    slot_misses: int = 0  # expert slot misses of the target model in this round


class Engine:
    def __init__(self, model: Qwen3MoeModel, *, max_context: int, prefill_chunk: int) -> None:
        self.model = model
        self.max_context = max_context
        self.prefill_chunk = prefill_chunk
        self.stores = [layer.mlp.experts for layer in model.layers if hasattr(layer.mlp, "experts")]

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def open(self, spec: RequestSpec) -> Session:
        """Allocate the session's cache and prefill the prompt but its last token (the head)."""
        length = min(self.max_context, len(spec.prompt_ids) + spec.max_new_tokens + spec.max_draft_tokens + 1)
        session = Session(spec=spec, cache=self.model.new_cache(length), token_ids=list(spec.prompt_ids))
        body = torch.tensor(spec.prompt_ids[:-1], dtype=torch.int64, device=self.model.device)
        for start in range(0, body.shape[0], self.prefill_chunk):
            _, hidden = self.model(body[start : start + self.prefill_chunk], session.cache)
            session.hidden_rows.append(hidden.to("cpu", torch.bfloat16))
        return session

    def run_round(self, session: Session, drafts: list[int], q_rows: SparseRows | None) -> RoundOutcome:
        spec = session.spec
        base = len(session.token_ids)  # position of the first token this round decides
        started = time.perf_counter()
        misses = self.slot_misses()
        window = torch.tensor([session.token_ids[-1], *drafts], dtype=torch.int64, device=self.model.device)
        logits, hidden = self.model(window, session.cache)
        target = process_logits(logits, spec.sampling).to("cpu")  # row j: p at position base + j
        forwarded = time.perf_counter()
        verdict = verify_chain(target, drafts, q_rows, mode=spec.mode, seed=spec.seed, base_position=base)
        accepted = int(verdict.num_accepted[0])
        emitted = verdict.emitted()
        session.cache.truncate(base + accepted)  # keep the head's and accepted drafts' rows
        rows = hidden[: accepted + 1].to("cpu", torch.bfloat16)
        session.hidden_rows.append(rows)
        session.token_ids.extend(emitted)
        done = time.perf_counter()
        return RoundOutcome(emitted, accepted, rows, (forwarded - started) * 1e3, (done - forwarded) * 1e3,
                            self.slot_misses() - misses)

    def slot_misses(self) -> int:
        return sum(store.counters.misses for store in self.stores)

    def slot_hit_rate(self) -> float:
        hits = sum(store.counters.hits for store in self.stores)
        misses = self.slot_misses()
        return hits / (hits + misses) if hits + misses else 1.0

"""What a verifier round works on and returns: a session's state, a round's request and
outcome, the greedy verdict, and the decode step computed ahead (verifier_service.engine)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from kernels.logprobs import RowLogprobs
from kernels.sampling import SparseRows
from shared.model.kv_cache import CacheLength
from verifier_service.requests import RequestSpec


@dataclass
class Session:
    spec: RequestSpec
    cache: CacheLength  # the length of its rows in the runner (shared.model.runner: acquire)
    token_ids: list[int]  # committed: prompt + completion
    hidden_rows: list[Tensor] = field(default_factory=list)  # final-norm rows of token_ids[:-1], CPU bf16
    slot: int | None = None  # its slot in the runner (None once closed)

    @property
    def prefill_left(self) -> int:
        """Prompt tokens still to prefill (the cache holds the prompt but its last token once done)."""
        return len(self.spec.prompt_ids) - 1 - self.cache.length

    @property
    def capacity_left(self) -> int:
        """Drafts a window may still carry without overrunning the cache."""
        return self.cache.max_length - self.cache.length - 1

    def may_decode(self) -> bool:
        """Whether a plain round could still commit a token the request wants (the engine loop
        runs granted rounds only while it can: verifier_service.loop)."""
        if self.cache.length >= self.cache.max_length:
            return False
        produced = len(self.token_ids) - len(self.spec.prompt_ids)
        return produced < self.spec.max_new_tokens and not (produced and self.token_ids[-1] in self.spec.eos_token_ids)

    def hidden(self) -> Tensor:
        return torch.cat(self.hidden_rows) if self.hidden_rows else torch.zeros((0, 0), dtype=torch.bfloat16)


@dataclass(frozen=True)
class RoundOutcome:
    emitted: list[int]  # accepted drafts, then the verifier's own token
    num_accepted: int
    hidden_rows: Tensor  # [num_accepted + 1, hidden]: rows of the head and accepted drafts (CPU bf16)
    forward_ms: float
    verify_ms: float
    slot_misses: int = 0  # expert slot misses of the target model in the step this round ran in
    num_verified: int = 0  # drafts verified: a prefix of those asked when a batch sized its windows
    cost_to_others_s: float = 0.0  # what it cost the other lanes: its draft rows in their step, their wait for it (engine loop)
    cost_from_others_s: float = 0.0  # what the other lanes added to it: their draft rows in its step, its wait for them (engine loop)
    logprobs: RowLogprobs | None = None  # [len(emitted)] on the host, where the request asks (verifier_service.logprobs)


def greedy_verdict(drafts: list[int], greedy_ids: list[int]) -> tuple[list[int], int]:
    """(emitted, accepted) when the target is greedy: p_j is a point mass on greedy_ids[j], so in
    either mode a draft is accepted iff it equals that token, and the first mismatch (or the
    bonus) emits it."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == greedy_ids[accepted]:
        accepted += 1
    return [*drafts[:accepted], greedy_ids[accepted]], accepted


@dataclass(frozen=True)
class RoundRequest:
    """One session's round for Engine.run_rounds: verify `drafts` (none: decode one token)."""

    session: Session
    drafts: list[int]
    q_rows: SparseRows | None = None
    decode_ahead: bool = False  # another plain round follows (see Engine.run_round)


@dataclass
class Ahead:
    """A greedy decode step already enqueued for these sessions' next round (decode-ahead):
    one row each, row i of sessions[i], written at positions[i]."""

    sessions: list[Session]
    positions: list[int]
    ring: int | tuple[Tensor, Tensor]  # the pinned slot its tokens and hidden rows arrive in (CPU: the rows)

    def matches(self, sessions: list[Session]) -> list[int] | None:
        """Each session's row if the step is exactly theirs, in any order, at their next position."""
        rows = {id(s): i for i, s in enumerate(self.sessions)}
        if len(sessions) != len(rows) or any(id(s) not in rows for s in sessions):
            return None
        order = [rows[id(s)] for s in sessions]
        if any(s.cache.length != self.positions[i] for s, i in zip(sessions, order)):
            return None
        return order

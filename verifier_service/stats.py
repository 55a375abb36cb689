"""A request's running statistics and the RequestStats message of its final event."""

from __future__ import annotations

import time

from shared.protocol import verifier_pb2


class RequestStats:
    def __init__(self, prompt_tokens: int, started: float, queued_s: float) -> None:
        self.started = started  # before the admission queue: TTFT includes the wait
        self.queued_s = queued_s
        self.first_token_at: float | None = None
        self.prompt_tokens = prompt_tokens
        self.rounds = self.proposed = self.retained = self.accepted = self.speculative_rounds = 0
        self.committed = 0  # tokens delivered, plus the eos or stop token that ended the request
        self.by_source: dict[str, list[int]] = {}  # source -> [retained, accepted]

    def round(self, source: str, proposed: int, retained: int, accepted: int, committed: int,
              speculative: bool = False) -> None:
        self.rounds += 1
        self.speculative_rounds += speculative
        self.committed += committed
        self.proposed += proposed
        self.retained += retained
        self.accepted += accepted
        if retained:
            counts = self.by_source.setdefault(source, [0, 0])
            counts[0] += retained
            counts[1] += accepted

    def message(self, completion_tokens: int, faults: int) -> verifier_pb2.RequestStats:
        now = time.perf_counter()
        elapsed = max(now - self.started, 1e-9)
        return verifier_pb2.RequestStats(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=completion_tokens,
            rounds=self.rounds,
            proposed=self.proposed,
            retained=self.retained,
            accepted=self.accepted,
            mean_accepted_length=self.committed / self.rounds if self.rounds else 0.0,
            ttft_ms=((self.first_token_at or now) - self.started) * 1e3,
            tokens_per_s=completion_tokens / elapsed,
            acceptance_by_source={s: a / r for s, (r, a) in self.by_source.items() if r},
            drafter_faults=faults,
            queue_ms=self.queued_s * 1e3,
            speculative_rounds=self.speculative_rounds,
        )


def finish_span(span, message: verifier_pb2.RequestStats, finish_reason: str) -> None:
    """The request's span gets its final stats (what the final event carries)."""
    span.set_attributes({
        "tandem.prompt_tokens": message.prompt_tokens, "tandem.completion_tokens": message.completion_tokens,
        "tandem.rounds": message.rounds, "tandem.proposed": message.proposed, "tandem.retained": message.retained,
        "tandem.accepted": message.accepted, "tandem.ttft_ms": message.ttft_ms,
        "tandem.tokens_per_s": message.tokens_per_s,
        "tandem.mean_accepted_length_with_bonus": message.mean_accepted_length,
        "tandem.drafter_faults": message.drafter_faults, "tandem.finish_reason": finish_reason,
        "tandem.speculative_rounds": message.speculative_rounds, "tandem.drafter_detaches": message.drafter_detaches,
        "tandem.ahead_hits": message.ahead_hits, "tandem.ahead_misses": message.ahead_misses,
        **{f"tandem.acceptance.{source}": rate for source, rate in message.acceptance_by_source.items()},
    })

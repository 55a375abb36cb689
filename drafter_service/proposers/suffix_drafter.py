"""The suffix proposer on its own: a request index each, and the global index (benchmarks,
and any caller without the service; the drafter service composes the same pieces itself)."""

from __future__ import annotations

from drafter_service.proposers.global_index import GlobalIndex, best_match, with_prompt_end
from drafter_service.proposers.suffix import MIN_TOKEN_PROB, SuffixIndex, SuffixMatch

DEFAULT_GLOBAL_BYTES = 512 << 20  # as the drafter's --global-index-mb default


class SuffixDrafter:
    """The suffix proposer on its own (benchmarks, and any caller without the service):
    start(request_id, prompt_ids), propose(request_id, max_tokens), extend(request_id,
    token_ids), finish(request_id) (the output then joins the global index)."""

    def __init__(self, global_bytes: int = DEFAULT_GLOBAL_BYTES, min_prob: float = MIN_TOKEN_PROB) -> None:
        self.global_index = GlobalIndex(global_bytes, min_prob)  # (0 bytes: off)
        self.min_prob = min_prob
        self._requests: dict[object, tuple[SuffixIndex, int]] = {}  # id → (index, prompt length)

    def start(self, request_id: object, prompt_ids: list[int]) -> None:
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already active")
        index = SuffixIndex(self.min_prob)
        index.extend(list(prompt_ids))
        self._requests[request_id] = (index, len(prompt_ids))

    def extend(self, request_id: object, token_ids: list[int], count: bool = True) -> None:
        """Commit tokens; count=False leaves their counting to count_pending (off the latency path)."""
        self._index(request_id).extend(list(token_ids), count)

    def count_pending(self, request_id: object) -> None:
        self._index(request_id).count_pending()

    def propose(self, request_id: object, max_tokens: int) -> list[int]:
        match = self.match(request_id, max_tokens)
        return match.continuation if match else []

    def match(self, request_id: object, max_tokens: int) -> SuffixMatch | None:
        """The better (by score) of the request's and the global proposal."""
        return best_match(self._index(request_id), self.global_index, max_tokens)

    def finish(self, request_id: object, keep: bool = True) -> None:
        """The request ends; its output joins the global index (keep=False: it does not)."""
        index, prompt_length = self._requests.pop(request_id)
        if keep:  # (with its prompt's last tokens as contexts)
            self.global_index.add(*with_prompt_end(index.tokens, prompt_length))

    def _index(self, request_id: object) -> SuffixIndex:
        try:
            return self._requests[request_id][0]
        except KeyError:
            raise ValueError(f"request {request_id!r} is not active") from None

"""Suffix lookup: propose the continuation of the longest earlier match of the current suffix.

Per session: every committed token extends an n-gram index (the last MIN_MATCH tokens →
their newest end positions), an amortised O(1) update. A lookup takes the candidates that
share the last MIN_MATCH tokens, extends each match backwards up to MAX_MATCH tokens, and
keeps the longest (newest on ties); the tokens that followed it are the proposal.

Across sessions: a bounded global index of (context → next-token counts) over recent
sessions' outputs, proposing the most frequent continuation. Proposals depend only on
committed tokens (this session's, or other sessions' already committed outputs).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass

MIN_MATCH = 3
MAX_MATCH = 32
CANDIDATES_PER_KEY = 8  # newest occurrences kept per n-gram


@dataclass(frozen=True)
class SuffixMatch:
    length: int  # tokens of the current suffix matched (MIN_MATCH..MAX_MATCH)
    continuation: list[int]  # up to k tokens that followed the match


class SuffixIndex:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], deque[int]] = {}

    def extend(self, token_ids: list[int]) -> None:
        for token in token_ids:
            self.tokens.append(token)
            end = len(self.tokens)
            if end >= MIN_MATCH:
                key = tuple(self.tokens[end - MIN_MATCH : end])
                self._ends.setdefault(key, deque(maxlen=CANDIDATES_PER_KEY)).append(end)

    def lookup(self, k: int) -> SuffixMatch | None:
        """The longest earlier match of the current suffix and up to k following tokens."""
        n = len(self.tokens)
        if n < MIN_MATCH + 1 or k < 1:
            return None
        candidates = self._ends.get(tuple(self.tokens[n - MIN_MATCH :]), ())
        best: tuple[int, int] | None = None  # (length, end)
        for end in reversed(candidates):  # newest first: ties keep the newest
            if end >= n:
                continue  # the current suffix itself
            length = MIN_MATCH
            while length < MAX_MATCH and end - length > 0 and self.tokens[end - length - 1] == self.tokens[n - length - 1]:
                length += 1
            if best is None or length > best[0]:
                best = (length, end)
        if best is None:
            return None
        length, end = best
        return SuffixMatch(length, self.tokens[end : end + k])


class GlobalIndex:
    """Frequency-scored continuations over recent sessions' outputs, bounded in memory."""

    def __init__(self, max_contexts: int = 200_000) -> None:
        self.max_contexts = max_contexts
        self._next: OrderedDict[tuple[int, ...], Counter[int]] = OrderedDict()

    def add(self, token_ids: list[int]) -> None:
        for end in range(MIN_MATCH, len(token_ids)):
            key = tuple(token_ids[end - MIN_MATCH : end])
            counts = self._next.get(key)
            if counts is None:
                counts = self._next[key] = Counter()
                if len(self._next) > self.max_contexts:
                    self._next.popitem(last=False)  # forget the least recently updated context
            else:
                self._next.move_to_end(key)
            counts[token_ids[end]] += 1

    def lookup(self, context: list[int], k: int, min_count: int = 2) -> SuffixMatch | None:
        """Greedy chain of the most frequent continuations (ties: lowest token id)."""
        proposal: list[int] = []
        window = list(context[-MIN_MATCH:])
        while len(proposal) < k and len(window) == MIN_MATCH:
            counts = self._next.get(tuple(window))
            if not counts:
                break
            token, count = min(counts.items(), key=lambda item: (-item[1], item[0]))
            if count < min_count:
                break
            proposal.append(token)
            window = window[1:] + [token]
        return SuffixMatch(MIN_MATCH, proposal) if proposal else None

    def __len__(self) -> int:
        return len(self._next)

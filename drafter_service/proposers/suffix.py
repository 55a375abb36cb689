"""Suffix drafting: continue the longest earlier match of the current suffix, by its counts.

Both indexes count, for every context of the lengths in ORDERS (1..8, then sparser up to
32 tokens), which tokens followed it: the per-request index (here, Python dicts) over the
request's prompt and output, the global index (global_index.py: a native table bounded in
bytes) over previous requests' outputs. A context is a rolling hash of its tokens, so an
update is O(len(ORDERS)) per token and a lookup O(1).

A proposal (as in SuffixDecoding, arXiv 2411.04975) starts from the longest context that
matches the end of the committed tokens, then follows the most frequent continuation
(ties: the most recently seen), conditioning on a longer context as the match grows, while
the chain's estimated probability (the product of continuation frequencies) stays above a
floor, for at most factor × match length + offset tokens. The global index's proposal wins
when its score (the sum of the prefix probabilities: expected accepted tokens) is higher.

Proposals depend only on committed tokens (this request's, or other requests' finished
outputs), never on a draw, so they are the same on a replay.

The rule is _propose below, the counting _count_stream; both run natively, step for step the
same, into and over the same dicts (_suffix_walk.c's propose_counts, _request_counts.c's
count_stream: compiled at install with the global index's table). Without the compiled
extension the request's index runs these Python functions themselves.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

from typing import NamedTuple

try:  # (the native walk over this module's counts and their counting; without them, Python's)
    from drafter_service.proposers._context_table import count_stream as _native_count
    from drafter_service.proposers._context_table import propose_counts as _native_propose
except ImportError:  # not compiled (the global index, which needs it, can then be off)
    _native_count = _native_propose = None

ORDERS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 32)  # context lengths counted
MAX_MATCH = ORDERS[-1]
NUM_ORDERS = len(ORDERS)
NO_ORDER = 1 << 30  # past the longest order
# Hashes stay below 2**31 so CPython's arithmetic on them stays fast; a collision (a few per
# hundred thousand contexts) can only cost a wrong draft, which verification rejects.
MOD = (1 << 31) - 1
BASE = 0x9E3779B9 % MOD
POW = [1]
for _ in range(MAX_MATCH):
    POW.append(POW[-1] * BASE % MOD)
del _

# A context seen with one next token only is an int: the token, plus (count - 1) << COUNT_SHIFT
# (a repeat is then an addition, not a dict: text that repeats itself counts 4x faster).
COUNT_SHIFT = 32
TOKEN_MASK = (1 << COUNT_SHIFT) - 1
ONE_MORE = 1 << COUNT_SHIFT
COUNT_CHUNK = 4096  # tokens counted per job (tens of ms on a slow CPU: a long prompt cannot stall the loop)
MIN_TOKEN_PROB = 0.1  # stop a chain when its estimated probability drops below this
# A chain holds at most factor × (matched context tokens) + offset drafts. Chosen on a replay
# of real code (bench/suffix_replay.py, docs/PERFORMANCE.md): one more than the match for the
# request's own text; twice the match for other requests' outputs, which repeat longer.
REQUEST_FACTOR, REQUEST_OFFSET = 1.0, 1.0
GLOBAL_FACTOR, GLOBAL_OFFSET = 2.0, 0.0


_new_tuple = tuple.__new__


class SuffixMatch(NamedTuple):  # (a tuple: built on every round's path, cheaper than a dataclass)
    length: int  # tokens of the current suffix matched (1..MAX_MATCH)
    continuation: list[int]  # the proposed tokens
    score: float = 0.0  # expected accepted tokens under the counts (sum of prefix probabilities)
    source: str = "request"  # "request" or "global"


class ContextCounts:
    """Context hash → next-token counts, one table per order (a request's own index).

    A value is the single token seen after the context (an int: the token, plus its count - 1
    shifted left by COUNT_SHIFT), or a dict token → count whose order is recency (a token moves
    to the end when counted). _context_table.c keeps the same counts for the global index."""

    def __init__(self) -> None:
        self.tables: list[dict] = [{} for _ in ORDERS]
        self.size = 0  # contexts, over every order
        self.levels = [(table, order, POW[order]) for table, order in zip(self.tables, ORDERS)]

    def __len__(self) -> int:
        return self.size

    def count(self, order_index: int, key: int, token: int) -> None:
        table = self.tables[order_index]
        value = table.get(key)
        if value is None:
            table[key] = token
            self.size += 1
        elif type(value) is int:
            table[key] = value + ONE_MORE if value & TOKEN_MASK == token else _split(value, token)
        else:
            value[token] = value.pop(token, 0) + 1

    def get(self, order_index: int, key: int):
        return self.tables[order_index].get(key)


def _split(single: int, token: int) -> dict[int, int]:
    """The counts of a context seen only with one token (packed), now followed by another."""
    return {single & TOKEN_MASK: (single >> COUNT_SHIFT) + 1, token: 1}


def _best(value) -> tuple[int, float]:
    """(most frequent next token, its frequency); ties go to the most recently counted."""
    if type(value) is int:
        return value & TOKEN_MASK, 1.0
    best, best_count, total = -1, 0, 0
    for token, count in value.items():
        total += count
        if count >= best_count:
            best, best_count = token, count
    return best, best_count / total


def _hash_tokens(prefix: list[int], token_ids: list[int]) -> None:
    """Append the rolling prefix hashes of token_ids to prefix (prefix[i] hashes the first i tokens)."""
    h = prefix[-1]
    for token in token_ids:
        h = (h * BASE + token + 1) % MOD
        prefix.append(h)


def _count_stream(counts: ContextCounts, token_ids: list[int], prefix: list[int], start: int,
                  stop: int | None = None) -> None:
    """Count the contexts before each token token_ids[start:stop] (prefix: hashes of token_ids[:i])."""
    stop = len(token_ids) if stop is None else stop
    # (on every round's path: ContextCounts.count inlined)
    levels = counts.levels
    added = 0
    for n in range(start, stop):
        token, hn = token_ids[n], prefix[n]
        for table, order, power in levels:
            if order > n:
                break
            key = (hn - prefix[n - order] * power) % MOD
            value = table.get(key)
            if value is None:
                table[key] = token
                added += 1
            elif type(value) is int:
                table[key] = value + ONE_MORE if value & TOKEN_MASK == token else _split(value, token)
            else:
                value[token] = value.pop(token, 0) + 1
    counts.size += added


@cache
def _chain_limits(factor: float, offset: float) -> tuple[int, ...]:
    """The most drafts a chain may hold after a match of each order (non-decreasing)."""
    return tuple(int(order * factor + offset + 1e-6) for order in ORDERS)


def _propose(counts: ContextCounts, prefix: list[int], max_tokens: int, min_prob: float, factor: float,
             offset: float, source: str, beat: float = 0.0) -> SuffixMatch | None:
    """The chain from the longest context of `counts` matching the end of the hashed tokens;
    None also when it could not score above `beat` (a chain of n drafts scores at most n)."""
    if beat >= max_tokens:
        return None
    n = len(prefix) - 1
    hn = prefix[n]
    tables = counts.tables  # (ContextCounts.get inlined: this runs on every round's path)
    # A context is counted with all its suffixes, so the orders that match form a prefix of
    # ORDERS: binary search for the last one.
    low, high = 0, NUM_ORDERS  # ORDERS[:low] match, ORDERS[high:] do not
    if beat:
        # Only a match of ORDERS[first:] allows a chain long enough to score above beat: if the
        # shortest of them does not match, neither does a longer one (one look-up, no search).
        first = bisect_right(_chain_limits(factor, offset), beat)
        order = ORDERS[first] if first < NUM_ORDERS else n + 1
        if order > n or (hn - prefix[n - order] * POW[order]) % MOD not in tables[first]:
            return None
        low = first + 1
    while low < high:
        mid = (low + high) // 2
        order = ORDERS[mid]
        found = False
        if order <= n:
            key = (hn - prefix[n - order] * POW[order]) % MOD
            found = key in tables[mid]
        if found:
            low = mid + 1
        else:
            high = mid
    oi = low - 1
    if oi < 0:
        return None
    matched = ORDERS[oi]
    limit = min(max_tokens, int(matched * factor + offset + 1e-6))
    if limit <= beat:
        return None
    draft: list[int] = []
    hashes = prefix[-MAX_MATCH - 1 :]  # the last hashes, extended as tokens are drafted
    end = len(hashes) - 1
    prob, score = 1.0, 0.0
    length = matched  # the match grows with every drafted token
    next_order = ORDERS[oi + 1] if oi + 1 < NUM_ORDERS else NO_ORDER
    while length < matched + limit:
        while length >= next_order:  # into longer contexts
            oi += 1
            next_order = ORDERS[oi + 1] if oi + 1 < NUM_ORDERS else NO_ORDER
        h = hashes[end]
        value = None
        while oi >= 0:
            order = ORDERS[oi]
            if order <= end:
                key = (h - hashes[end - order] * POW[order]) % MOD
                value = tables[oi].get(key)
                if value is not None:
                    break
            oi -= 1
            next_order = ORDERS[oi + 1]
        if value is None:
            break
        if type(value) is int:  # only ever followed by one token: certain under the counts
            token = value & TOKEN_MASK
        else:
            token, p = _best(value)
            prob *= p
            if prob < min_prob:
                break
        draft.append(token)
        score += prob
        length += 1
        if beat and score + (matched + limit - length) * prob <= beat:
            return None  # even certain drafts from here on would not beat it
        hashes.append((h * BASE + token + 1) % MOD)
        end += 1
    if not draft:
        return None
    return SuffixMatch(matched, draft, score, source)


class SuffixIndex:
    """One request's committed tokens (prompt and output) with their context counts.

    extend(..., count=False) only appends the tokens (and their hashes: a lookup matches
    the current end at once); their contexts are counted by count_pending(), which the
    drafter runs after sending a chain, off the round's latency path. A lookup then misses
    only repeats inside the tokens of the last commit. A long prompt is counted the same
    way, COUNT_CHUNK tokens a job, so that it cannot stall other sessions' drafting."""

    def __init__(self, min_prob: float = MIN_TOKEN_PROB, factor: float = REQUEST_FACTOR,
                 offset: float = REQUEST_OFFSET) -> None:
        self.tokens: list[int] = []
        self.prefix: list[int] = [0]
        self.counts = ContextCounts()
        self.counted = 0  # tokens whose preceding contexts are counted
        self.min_prob, self.factor, self.offset = min_prob, factor, offset

    def extend(self, token_ids: list[int], count: bool = True) -> None:
        self.tokens.extend(token_ids)
        _hash_tokens(self.prefix, token_ids)
        if count:
            self.count_pending()

    def count_pending(self, max_tokens: int | None = None) -> int:
        """Count the contexts of up to max_tokens pending tokens (all: None), in order; returns
        how many stay pending."""
        stop = len(self.tokens) if max_tokens is None else min(len(self.tokens), self.counted + max_tokens)
        if _native_count is None:
            _count_stream(self.counts, self.tokens, self.prefix, self.counted, stop)
        elif stop > self.counted:
            self.counts.size += _native_count(self.counts.tables, self.tokens, self.prefix, self.counted, stop)
        self.counted = stop
        return len(self.tokens) - stop

    @contextmanager
    def assuming(self, token_ids: list[int]) -> Iterator[None]:
        """Within the block the index ends with `token_ids` too (draft-ahead: lookups after tokens
        not committed yet); counts are untouched and the tokens leave on exit."""
        length = len(self.tokens)
        self.tokens.extend(token_ids)
        _hash_tokens(self.prefix, token_ids)
        try:
            yield
        finally:
            del self.tokens[length:]
            del self.prefix[length + 1:]

    def lookup(self, k: int, beat: float = 0.0) -> SuffixMatch | None:
        """The request's own proposal of at most k tokens (None: no context matches, or it
        cannot score above `beat`, and its walk stops as soon as that is certain)."""
        if k < 1:
            return None
        if _native_propose is None:
            return _propose(self.counts, self.prefix, k, self.min_prob, self.factor, self.offset, "request", beat)
        found = _native_propose(self.counts.tables, self.prefix, k, self.min_prob, self.factor, self.offset, beat)
        # (tuple.__new__: a SuffixMatch without its generated __new__, on every round's path)
        return None if found is None else _new_tuple(SuffixMatch, (*found, "request"))

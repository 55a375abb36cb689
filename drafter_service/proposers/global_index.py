"""The global suffix index: previous requests' outputs, in a stated number of bytes (issue 37).

It holds the counts suffix.py's rule needs (for every context of the lengths in ORDERS inside
an output, or reaching back into its prompt's last MAX_MATCH tokens, the output's tokens that
followed it) in a native table (`_context_table.c`: one
open-addressing array of 8-byte slots per context length, hashed on the same 31-bit rolling
hashes as the per-request index), plus each held output's tokens (4 bytes a token) so that an
output can leave again. A proposal is the same as suffix.py's walk over the same counts would
give, token for token (tests/drafter_service/proposers/test_global_index.py compares them); a
round's whole proposal, this walk and the request's own, is one native call (best_match,
`_suffix_walk.c`).

Bounded in bytes: the table's allocations and the held tokens together stay within
`max_bytes`. When counting an output would pass it, the oldest held outputs leave, whole (their
counts are taken back), until it fits; what remains is always whole outputs that can be
matched, the most recent ones. When the output being added is the oldest itself (larger than
the whole budget, or added in steps while newer ones were), it keeps the part counted so far
and adds no more.
Eviction is by age, not by last match: a context table cannot tell which output a match came
from.
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from collections.abc import Iterator

from drafter_service.proposers.suffix import (
    GLOBAL_FACTOR,
    GLOBAL_OFFSET,
    MAX_MATCH,
    MIN_TOKEN_PROB,
    SuffixIndex,
    SuffixMatch,
)

_new_tuple = tuple.__new__
TOKEN_BYTES = 4  # an output's tokens as uint32
OUTPUT_BYTES = 128  # an array's own header and the deque's share, per held output


def _native_table():
    try:
        from drafter_service.proposers._context_table import ContextTable
    except ImportError as error:
        raise ImportError(
            "the global suffix index needs its native table, compiled at install: run `pip install -e .` "
            "(or `python setup.py build_ext --inplace`), or turn the index off (--global-index-mb 0)") from error
    return ContextTable()


def with_prompt_end(tokens: list[int], prompt_length: int) -> tuple[list[int], int]:
    """A finished request's output (`tokens` past `prompt_length`) as GlobalIndex.add takes it:
    led by its prompt's last tokens (at most MAX_MATCH, the longest context), and how many."""
    lead = min(prompt_length, MAX_MATCH)
    return tokens[prompt_length - lead:], lead


class _Output:
    """A held output: its tokens (uint32), the first `lead` of them its prompt's end (contexts
    only, never counted), and how far they are counted."""

    __slots__ = ("tokens", "lead", "counted", "held")

    def __init__(self, tokens: array, lead: int) -> None:
        self.tokens = tokens
        self.lead = lead
        self.counted = lead
        self.held = True  # False once evicted (a step of its addition still to come then stops)

    @property
    def nbytes(self) -> int:
        return len(self.tokens) * TOKEN_BYTES + OUTPUT_BYTES


class GlobalIndex:
    """Context counts over previous requests' outputs in at most max_bytes (0: off)."""

    def __init__(self, max_bytes: int, min_prob: float = MIN_TOKEN_PROB, factor: float = GLOBAL_FACTOR,
                 offset: float = GLOBAL_OFFSET) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes {max_bytes} must be >= 0")
        self.max_bytes = max_bytes
        self.min_prob, self.factor, self.offset = min_prob, factor, offset
        self.table = _native_table() if max_bytes else None
        self.outputs: deque[_Output] = deque()  # held, oldest first
        self.token_bytes = 0  # of the held outputs
        self.evictions = 0  # outputs evicted so far

    @property
    def nbytes(self) -> int:
        """Bytes the index holds: the native table's allocations and the held outputs."""
        return (self.table.bytes if self.table is not None else 0) + self.token_bytes

    @property
    def requests(self) -> int:
        """Outputs held (whole, or the first part of one larger than the budget)."""
        return len(self.outputs)

    def __len__(self) -> int:
        """Contexts held, over every length."""
        return self.table.contexts if self.table is not None else 0

    def add(self, token_ids: list[int], lead: int = 0) -> None:
        """Count a finished output: each of its tokens after the contexts before it, within the
        output and its prompt's last `lead` tokens, with which `token_ids` begins (at most
        MAX_MATCH: the longest context). Only the output's tokens are counted — a request's
        prompt is its own — but a request whose prompt ends as this one's did finds what followed
        it from its first round (chat templates end every prompt the same way)."""
        for _ in self.adding(token_ids, max(len(token_ids) - lead, 1), lead):
            pass

    def adding(self, token_ids: list[int], chunk: int, lead: int = 0) -> Iterator[None]:
        """add() in steps of `chunk` tokens: a generator that yields between steps (the caller
        may do other work there, other outputs' steps included); the first step runs at the
        first next(). Between steps the counted part of the output is matched already."""
        if not 0 <= lead <= MAX_MATCH:
            raise ValueError(f"lead {lead}: a prompt's last 0..{MAX_MATCH} tokens")
        if self.table is None or len(token_ids) <= lead:
            return
        output = _Output(array("I", token_ids), lead)
        self.outputs.append(output)
        self.token_bytes += output.nbytes
        for start in range(lead, len(output.tokens), chunk):
            if start > lead:
                yield
            if not output.held:
                return
            stop = min(start + chunk, len(output.tokens))
            while output.counted < stop:
                output.counted = self.table.count(output.tokens, output.counted, stop,
                                                  self.max_bytes - self.token_bytes)
                if output.counted < stop:
                    if self.outputs[0] is output:  # the oldest itself (alone, or added in steps with newer ones)
                        self._truncate(output)  # keeps what is counted, and adds no more
                        return
                    yield from self._evicting_oldest(chunk)
                    if not output.held:  # evicted meanwhile by another output's step
                        return

    def _evicting_oldest(self, chunk: int) -> Iterator[None]:
        """The oldest held output leaves, whole: at once out of the held outputs, its counts
        taken back `chunk` tokens a step (a long output would otherwise stall the caller's
        loop; between steps its not yet uncounted part may still be matched)."""
        output = self.outputs.popleft()
        output.held = False
        self.evictions += 1
        for start in range(output.lead, output.counted, chunk):
            if start > output.lead:
                yield
            self.table.uncount(output.tokens, start, min(start + chunk, output.counted))
        self.token_bytes -= output.nbytes

    def _truncate(self, output: _Output) -> None:
        self.token_bytes -= output.nbytes
        if output.counted > output.lead:
            output.tokens = output.tokens[: output.counted]
            self.token_bytes += output.nbytes
        else:
            self.outputs.remove(output)
            output.held = False

    def lookup(self, index: SuffixIndex, k: int, beat: SuffixMatch | None = None) -> SuffixMatch | None:
        """The global proposal of at most k tokens after the request's committed tokens; None
        when there is none or it cannot score above `beat` (the request's own proposal), whose
        walk is then skipped."""
        if k < 1 or self.table is None:
            return None
        found = self.table.propose(index.prefix, k, self.min_prob, self.factor, self.offset,
                                   beat.score if beat is not None else 0.0)
        # (tuple.__new__: a SuffixMatch without its generated __new__, on every round's path)
        return None if found is None else _new_tuple(SuffixMatch, (*found, "global"))


def best_match(index: SuffixIndex, global_index: GlobalIndex | None, k: int) -> SuffixMatch | None:
    """The better by score of the request's own proposal and the global one (ties: the
    request's own). The global walk runs first: the request's own walk then stops as soon as it
    cannot reach that score (often at once: a long certain chain). Both walks and the choice
    are one native call (ContextTable.best) on every round's path; `composed_best_match` is the
    same rule composed of the two lookups."""
    table = global_index.table if global_index is not None else None
    if table is None or k < 1:
        return index.lookup(k)
    found = table.best(index.counts.tables, index.prefix, k, global_index.min_prob, global_index.factor,
                       global_index.offset, index.min_prob, index.factor, index.offset)
    return None if found is None else _new_tuple(SuffixMatch, found)


def composed_best_match(index: SuffixIndex, global_index: GlobalIndex | None, k: int) -> SuffixMatch | None:
    """best_match as two lookups (tests hold the two equal)."""
    other = global_index.lookup(index, k) if global_index is not None else None
    if other is None:
        return index.lookup(k)
    own = index.lookup(k, math.nextafter(other.score, -math.inf))  # (ties go to the request's own)
    return own if own is not None and own.score >= other.score else other

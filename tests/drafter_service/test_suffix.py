"""Suffix drafting: context counts, the per-request index, the standalone drafter (the global
index: tests/drafter_service/proposers/test_global_index.py)."""

import random
from collections import defaultdict

import pytest

from drafter_service.proposers.suffix import (
    GLOBAL_FACTOR,
    GLOBAL_OFFSET,
    MIN_TOKEN_PROB,
    REQUEST_FACTOR,
    REQUEST_OFFSET,
    ORDERS,
    ContextCounts,
    SuffixIndex,
    SuffixMatch,
    _best,
)
from drafter_service.proposers.global_index import GlobalIndex
from drafter_service.proposers.suffix_drafter import SuffixDrafter


def index_of(tokens, **kwargs):
    index = SuffixIndex(**kwargs)
    index.extend(list(tokens))
    return index


def reference_propose(streams, context, k, min_prob=MIN_TOKEN_PROB, factor=REQUEST_FACTOR, offset=REQUEST_OFFSET):
    """The proposal rule on exact token tuples (no hashing, no incremental state): counts of
    the token after every context of each order in `streams`, then the same walk."""
    counts = [defaultdict(dict) for _ in ORDERS]  # order index -> context -> {token: count}, recency ordered
    for stream in streams:
        for i, token in enumerate(stream):
            for oi, order in enumerate(ORDERS):
                if order > i:
                    break
                seen = counts[oi][tuple(stream[i - order : i])]
                seen[token] = seen.pop(token, 0) + 1
    oi = -1
    for i, order in enumerate(ORDERS):
        if order > len(context) or tuple(context[len(context) - order :]) not in counts[i]:
            break
        oi = i
    if oi < 0:
        return None
    matched = ORDERS[oi]
    limit = min(k, int(matched * factor + offset + 1e-6))
    text, draft, prob, score = list(context), [], 1.0, 0.0
    while len(draft) < limit:
        while oi + 1 < len(ORDERS) and ORDERS[oi + 1] <= matched + len(draft):
            oi += 1
        seen = None
        while oi >= 0:
            order = ORDERS[oi]
            if order <= len(text) and tuple(text[len(text) - order :]) in counts[oi]:
                seen = counts[oi][tuple(text[len(text) - order :])]
                break
            oi -= 1
        if seen is None:
            break
        total = sum(seen.values())
        best = max(reversed(list(seen.items())), key=lambda item: item[1])  # ties: the most recent
        prob *= best[1] / total
        if prob < min_prob:
            break
        draft.append(best[0])
        text.append(best[0])
        score += prob
    return SuffixMatch(matched, draft, score) if draft else None


# --- the per-request index ---------------------------------------------------------------


def test_a_repeated_passage_is_proposed_to_its_end():
    passage = [11, 12, 13, 14, 15, 16, 17, 18]
    index = index_of([1, 2, *passage, 3, 4, 5, *passage[:4]])
    match = index.lookup(16)
    assert match.continuation == passage[4:] + [3]  # 4 matched tokens: 4 + 1 drafts
    assert match.length == 4 and match.score == pytest.approx(5.0)
    longer = index_of([1, 2, *passage, 3, 4, 5, *passage[:4]], factor=2.0, offset=0.0).lookup(16)
    assert longer.continuation == passage[4:] + [3, 4, 5, 11]  # the match grows with every drafted token


def test_the_longest_context_decides_between_continuations():
    # "2 3" was followed by 50 twice and by 60 once; "1 2 3" only by 60.
    tokens = [7, 2, 3, 50, 8, 2, 3, 50, 1, 2, 3, 60, 9, 1, 2, 3]
    assert index_of(tokens).lookup(1).continuation == [60]
    assert index_of(tokens[:-3] + [5, 2, 3]).lookup(1).continuation == [50]  # only "2 3" matches now


def test_the_most_frequent_continuation_wins_and_ties_go_to_the_most_recent():
    assert index_of([4, 8, 4, 8, 4, 9, 4]).lookup(1).continuation == [8]  # 8 twice, 9 once
    assert index_of([4, 8, 4, 9, 4]).lookup(1).continuation == [9]  # one each: the newer


def test_chains_stop_where_the_estimated_probability_drops_under_the_floor():
    # After "5 6": 7 in two of three cases (p 2/3), then after "6 7" always 1 (p 1): 2 drafts,
    # but a floor of 0.7 rejects the first one already.
    tokens = [5, 6, 7, 1, 5, 6, 7, 1, 5, 6, 9, 3, 5, 6]
    assert index_of(tokens).lookup(8).continuation[:2] == [7, 1]
    assert index_of(tokens, min_prob=0.7).lookup(8) is None


def test_the_chain_is_limited_by_the_match_length():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
    assert index_of(tokens).lookup(16).continuation == [3, 4, 5]  # 2 matched tokens: 2 + 1 drafts
    assert index_of(tokens, factor=3.0, offset=0.0).lookup(16).continuation == [3, 4, 5, 6, 7, 8]
    assert index_of(tokens, factor=1.0, offset=0.0).lookup(16).continuation == [3, 4]
    assert index_of(tokens).lookup(1).continuation == [3]


def test_counting_later_only_hides_repeats_inside_the_uncounted_tokens():
    index = index_of([1, 2, 3, 4])
    index.extend([9, 1, 2, 3], count=False)
    assert index.lookup(4).continuation == [4]  # the match is in counted tokens; 9 is not counted yet
    index.extend([7, 8, 7], count=False)  # the earlier 7 lies in uncounted tokens
    assert index.lookup(1) is None
    assert index.count_pending(1) == 6  # one more counted (9), six pending
    assert index.lookup(1) is None
    assert index.count_pending() == 0
    assert index.lookup(1).continuation == [8] and index.counted == len(index.tokens)
    whole = index_of(index.tokens)
    assert whole.counts.tables == index.counts.tables  # counting in pieces counts the same


def test_nothing_to_propose():
    assert index_of([1, 2, 3]).lookup(4) is None  # 3 never came before
    assert index_of([1, 2, 1]).lookup(0) is None
    assert SuffixIndex().lookup(4) is None


@pytest.mark.parametrize("seed", range(6))
def test_proposals_match_the_exact_reference_on_random_text(seed):
    """Hashed, incremental counts give the proposals of the rule on exact tuples."""
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 12])
    tokens = [rng.randrange(vocab) for _ in range(300)]
    index = SuffixIndex()
    for start in range(0, len(tokens), 7):  # extended in pieces, as rounds commit
        index.extend(tokens[start : start + 7])
        committed = tokens[: start + 7]
        for k in (1, 4, 16):
            assert index.lookup(k) == reference_propose([committed], committed, k), (start, k)


# --- counts, the global index, the standalone drafter ------------------------------------


def test_counts_keep_recency_order():
    counts = ContextCounts()
    for token in (3, 4, 3):
        counts.count(0, 99, token)
    assert counts.get(0, 99) == {4: 1, 3: 2}  # 3 counted last: last in order
    assert len(counts) == 1


def test_the_global_index_proposes_other_requests_outputs():
    output = [30 + i for i in range(20)]
    index = GlobalIndex(1 << 20)
    index.add(output)
    asking = index_of([1, 2, 3, *output[:6]])
    match = index.lookup(asking, 8)
    assert match.continuation == output[6:14] and match.source == "global"  # 6 matched: up to 12 drafts
    reference = reference_propose([output], asking.tokens, 8, factor=GLOBAL_FACTOR, offset=GLOBAL_OFFSET)
    assert (match.length, match.continuation, match.score) == (reference.length, reference.continuation, reference.score)
    sure = SuffixMatch(6, [0] * 8, 8.0)  # a proposal of 8 sure drafts: nothing of at most 8 beats it
    assert index.lookup(asking, 8, beat=sure) is None
    assert index.lookup(asking, 8, beat=SuffixMatch(6, [0] * 7, 7.5)) == match


def test_the_standalone_drafter_picks_the_better_source_and_learns_finished_outputs():
    drafter = SuffixDrafter()
    drafter.start("a", [1, 2, 3, 4])
    drafter.extend("a", [40, 41, 42, 43, 44, 45])
    assert drafter.propose("a", 4) == []  # nothing repeats yet
    drafter.finish("a")
    drafter.start("b", [9, 9, 9])
    drafter.extend("b", [40, 41, 42])
    assert drafter.propose("b", 4) == [43, 44, 45]  # a's output: 3 matched tokens, 3 drafts
    drafter.extend("b", [43, 44, 45, 40, 41])
    own = drafter._index("b").lookup(4)
    assert own.continuation == [42, 43, 44]  # 2 matched: 3 drafts from its own text
    best = drafter.match("b", 4)
    assert best.source == "global" and best.continuation == [42, 43, 44, 45]  # 2 matched: 4 from outputs
    with pytest.raises(ValueError, match="already active"):
        drafter.start("b", [1])
    with pytest.raises(ValueError, match="not active"):
        drafter.propose("zzz", 4)
    assert "a" not in drafter._requests and len(drafter.global_index) > 0


def test_a_context_with_one_continuation_counts_without_a_dict():
    """Repeats of the only token seen after a context stay an int (token + count); a second
    token turns it into the recency-ordered dict with the full counts."""
    counts = ContextCounts()
    for _ in range(3):
        counts.count(0, 7, 5)
    packed = counts.get(0, 7)
    assert type(packed) is int and _best(packed) == (5, 1.0)
    counts.count(0, 7, 9)
    assert counts.get(0, 7) == {5: 3, 9: 1}
    assert _best(counts.get(0, 7)) == (5, 0.75)

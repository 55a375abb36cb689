"""Suffix lookup: the per-session SuffixIndex and the cross-session GlobalIndex."""

import random

import pytest

from drafter_service.proposers.suffix import (
    CANDIDATES_PER_KEY,
    MAX_MATCH,
    MIN_MATCH,
    GlobalIndex,
    SuffixIndex,
    SuffixMatch,
)


def index_of(tokens):
    index = SuffixIndex()
    index.extend(list(tokens))
    return index


class CountingList(list):
    """A list that counts element reads, to bound a lookup's work structurally (no timing)."""

    reads = 0

    def __getitem__(self, item):
        CountingList.reads += 1
        return super().__getitem__(item)


# --- SuffixIndex -------------------------------------------------------------------------


def test_constants():
    assert (MIN_MATCH, MAX_MATCH) == (3, 32)
    assert CANDIDATES_PER_KEY >= 2


def test_longest_match_wins_over_a_shorter_newer_one():
    # Current suffix: 7 9 1 2 3. Older occurrence "9 1 2 3" (length 4), newer "8 1 2 3" (length 3).
    tokens = [9, 1, 2, 3, 50, 51, 8, 1, 2, 3, 60, 61, 7, 9, 1, 2, 3]
    assert index_of(tokens).lookup(2) == SuffixMatch(4, [50, 51])


def test_longest_match_wins_by_several_tokens():
    tokens = [
        40,
        41,
        42,
        1,
        2,
        3,
        70,
        71,
        72,
        5,
        1,
        2,
        3,
        80,
        81,
        6,
        1,
        2,
        3,
        90,
        40,
        41,
        42,
        1,
        2,
        3,
    ]
    match = index_of(tokens).lookup(3)
    assert match == SuffixMatch(6, [70, 71, 72])


def test_newest_occurrence_wins_on_equal_length():
    tokens = [5, 1, 2, 3, 10, 11, 6, 1, 2, 3, 20, 21, 7, 1, 2, 3]
    assert index_of(tokens).lookup(2) == SuffixMatch(3, [20, 21])


def test_newest_wins_on_equal_longer_length():
    tokens = [9, 1, 2, 3, 10, 11, 9, 1, 2, 3, 20, 21, 9, 1, 2, 3]
    assert index_of(tokens).lookup(2) == SuffixMatch(4, [20, 21])


@pytest.mark.parametrize(
    "tokens",
    [
        [1, 2, 7, 8, 1, 2],  # a 2-token repeat
        [4, 1, 2, 5, 6, 1, 2],
        [1, 2, 3],  # too short to have an earlier occurrence
        [1, 2, 3, 4, 5, 6, 7],  # nothing repeats
        [],
    ],
)
def test_minimum_match_is_three(tokens):
    assert index_of(tokens).lookup(4) is None


def test_three_token_repeat_is_enough():
    assert index_of([1, 2, 3, 9, 1, 2, 3]).lookup(1) == SuffixMatch(3, [9])


def test_match_length_is_capped_at_32():
    passage = list(range(100, 140))  # 40 tokens
    tokens = passage + [999] + passage
    match = index_of(tokens).lookup(3)
    assert match == SuffixMatch(MAX_MATCH, [999, 100, 101])


@pytest.mark.parametrize("length", [MAX_MATCH - 1, MAX_MATCH])
def test_match_length_just_below_and_at_the_cap(length):
    passage = list(range(100, 100 + length))
    tokens = [1] + passage + [999] + [2] + passage
    match = index_of(tokens).lookup(1)
    assert match == SuffixMatch(length, [999])


def test_constant_history_caps_length():
    match = index_of([7] * 100).lookup(4)
    assert match is not None and match.length == MAX_MATCH
    assert match.continuation == [7]  # the newest longest match ends one token before the end


def test_proposal_is_following_tokens_at_most_k():
    index = index_of([1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3])
    assert index.lookup(1) == SuffixMatch(3, [4])
    assert index.lookup(2) == SuffixMatch(3, [4, 5])
    assert index.lookup(5) == SuffixMatch(3, [4, 5, 6, 7, 8])


def test_proposal_never_runs_past_the_end_of_history():
    index = index_of([1, 2, 3, 4, 5, 1, 2, 3])
    match = index.lookup(100)
    assert match == SuffixMatch(3, [4, 5, 1, 2, 3])  # stops at the last committed token


def test_k_below_one_proposes_nothing():
    index = index_of([1, 2, 3, 4, 1, 2, 3])
    assert index.lookup(0) is None
    assert index.lookup(-1) is None


def test_current_suffix_itself_is_not_matched():
    # The only occurrence of (7, 8, 9) is the current suffix.
    assert index_of([1, 2, 3, 7, 8, 9]).lookup(4) is None
    # Self-overlap: (1, 1, 1) ends at 3 and at 4 (the current suffix); only end 3 may match.
    assert index_of([1, 1, 1, 1]).lookup(4) == SuffixMatch(3, [1])


def test_every_match_is_an_earlier_occurrence_with_a_nonempty_continuation():
    rng = random.Random(1)
    tokens = [rng.randrange(3) for _ in range(400)]
    index = SuffixIndex()
    for position, token in enumerate(tokens):
        index.extend([token])
        for k in (1, 4):
            match = index.lookup(k)
            if match is None:
                continue
            n = position + 1
            assert MIN_MATCH <= match.length <= MAX_MATCH
            assert 1 <= len(match.continuation) <= k
            # Some earlier end e < n has tokens[e-length:e] == the current suffix and
            # tokens[e:e+k] == the continuation.
            history = tokens[:n]
            suffix = history[n - match.length :]
            ends = [
                e
                for e in range(match.length, n)
                if history[e - match.length : e] == suffix and history[e : e + k] == match.continuation
            ]
            assert ends, (position, match)


def reference_lookup(history, k):
    """Brute force: the newest CANDIDATES_PER_KEY ends of the last MIN_MATCH tokens (the
    current one included), the longest common suffix (capped), newest on ties."""
    n = len(history)
    if n < MIN_MATCH + 1 or k < 1:
        return None
    key = history[n - MIN_MATCH :]
    ends = [e for e in range(MIN_MATCH, n + 1) if history[e - MIN_MATCH : e] == key][-CANDIDATES_PER_KEY:]
    best = None
    for e in ends:
        if e >= n:
            continue
        length = MIN_MATCH
        while length < MAX_MATCH and e - length > 0 and history[e - length - 1] == history[n - length - 1]:
            length += 1
        if best is None or (length, e) > best:
            best = (length, e)
    if best is None:
        return None
    return SuffixMatch(best[0], history[best[1] : best[1] + k])


@pytest.mark.parametrize("vocab", [2, 3, 6])
def test_matches_brute_force_reference(vocab):
    rng = random.Random(vocab)
    tokens = [rng.randrange(vocab) for _ in range(300)]
    index = SuffixIndex()
    for position, token in enumerate(tokens):
        index.extend([token])
        for k in (1, 5):
            assert index.lookup(k) == reference_lookup(tokens[: position + 1], k), (
                position,
                k,
            )


def test_incremental_extend_equals_one_extend():
    rng = random.Random(7)
    tokens = [rng.randrange(4) for _ in range(600)]
    whole = index_of(tokens)
    pieces = SuffixIndex()
    start = 0
    while start < len(tokens):
        size = rng.choice([0, 1, 1, 2, 3, 5, 17])
        pieces.extend(tokens[start : start + size])
        start += size
        prefix = index_of(tokens[:start])
        for k in (1, 3, 8):
            assert pieces.lookup(k) == prefix.lookup(k)
    assert pieces.tokens == whole.tokens == tokens
    assert {key: list(ends) for key, ends in pieces._ends.items()} == {
        key: list(ends) for key, ends in whole._ends.items()
    }
    for k in (1, 2, 8, 40):
        assert pieces.lookup(k) == whole.lookup(k)


def test_candidates_per_key_are_bounded():
    rng = random.Random(3)
    index = SuffixIndex()
    for _ in range(50):
        index.extend([rng.randrange(2) for _ in range(100)])  # 5000 tokens, at most 8 keys
    assert len(index.tokens) == 5000
    assert 0 < len(index._ends) <= 2**MIN_MATCH
    for key, ends in index._ends.items():
        assert len(key) == MIN_MATCH
        assert ends.maxlen == CANDIDATES_PER_KEY
        assert len(ends) == CANDIDATES_PER_KEY  # every key recurs far more often than that
        assert list(ends) == sorted(ends)  # newest last
        assert ends[-1] > len(index.tokens) - 200  # only recent occurrences are kept


def test_lookup_work_does_not_grow_with_history():
    """Element reads of one lookup are bounded by the candidates kept times the match cap."""
    bound = 2 + CANDIDATES_PER_KEY * 2 * (MAX_MATCH + 1)
    reads = []
    for size in (200, 20_000):
        rng = random.Random(size)
        index = index_of([rng.randrange(2) for _ in range(size)])
        index.tokens = CountingList(index.tokens)
        CountingList.reads = 0
        match = index.lookup(8)
        assert match is not None
        reads.append(CountingList.reads)
    assert all(r <= bound for r in reads), reads


def test_repeated_passage_in_long_random_history_is_found():
    rng = random.Random(0)
    history = [rng.randrange(50_000) for _ in range(20_000)]
    passage = history[5_000:5_040]
    tokens = history + [rng.randrange(50_000) for _ in range(3_000)] + [10**6] + passage[:20]
    match = index_of(tokens).lookup(8)
    assert match == SuffixMatch(20, passage[20:28])


def test_repeated_passage_found_after_incremental_growth():
    rng = random.Random(5)
    index = SuffixIndex()
    history = [rng.randrange(50_000) for _ in range(10_000)]
    for start in range(0, len(history), 97):
        index.extend(history[start : start + 97])
    passage = history[1_234:1_300]
    index.extend([10**6])
    index.extend(passage[:40])
    assert index.lookup(5) == SuffixMatch(MAX_MATCH, passage[40:45])


# --- GlobalIndex -------------------------------------------------------------------------


def test_global_most_frequent_continuation_chain():
    index = GlobalIndex()
    index.add([1, 2, 3, 4, 5, 6])
    index.add([1, 2, 3, 4, 5, 6])
    index.add([1, 2, 3, 9])
    assert index.lookup([0, 1, 2, 3], 3) == SuffixMatch(MIN_MATCH, [4, 5, 6])
    assert index.lookup([0, 1, 2, 3], 2) == SuffixMatch(MIN_MATCH, [4, 5])


def test_global_majority_beats_insertion_order():
    index = GlobalIndex()
    index.add([1, 2, 3, 9])
    index.add([1, 2, 3, 9])
    for _ in range(3):
        index.add([1, 2, 3, 4])
    assert index.lookup([1, 2, 3], 1) == SuffixMatch(MIN_MATCH, [4])


def test_global_ties_go_to_the_lowest_id():
    index = GlobalIndex()
    for _ in range(2):
        index.add([1, 2, 3, 7])
    for _ in range(2):
        index.add([1, 2, 3, 5])
    for _ in range(2):
        index.add([1, 2, 3, 6])
    assert index.lookup([1, 2, 3], 1) == SuffixMatch(MIN_MATCH, [5])


def test_global_min_count_is_respected():
    index = GlobalIndex()
    index.add([1, 2, 3, 4])
    assert index.lookup([1, 2, 3], 2) is None  # default min_count = 2
    assert index.lookup([1, 2, 3], 2, min_count=1) == SuffixMatch(MIN_MATCH, [4])
    # The chain stops at the first step whose best count is under min_count.
    index = GlobalIndex()
    index.add([1, 2, 3, 4, 5])
    index.add([1, 2, 3, 4, 5])
    index.add([1, 2, 3, 4])
    assert index.lookup([1, 2, 3], 5, min_count=3) == SuffixMatch(MIN_MATCH, [4])
    assert index.lookup([1, 2, 3], 5, min_count=2) == SuffixMatch(MIN_MATCH, [4, 5])
    assert index.lookup([1, 2, 3], 5, min_count=4) is None


def test_global_chain_stops_when_no_continuation():
    index = GlobalIndex()
    index.add([1, 2, 3, 4])
    index.add([1, 2, 3, 4])
    assert index.lookup([1, 2, 3], 10) == SuffixMatch(MIN_MATCH, [4])  # (2, 3, 4) is unknown
    assert index.lookup([8, 8, 8], 10) is None
    assert index.lookup([2, 3], 10) is None  # context shorter than MIN_MATCH
    assert index.lookup([1, 2, 3], 0) is None


def test_global_short_sequences_add_nothing():
    index = GlobalIndex()
    index.add([])
    index.add([1, 2, 3])
    assert len(index) == 0
    index.add([1, 2, 3, 4])
    assert len(index) == 1


def test_global_contexts_are_bounded_oldest_updated_evicted():
    index = GlobalIndex(max_contexts=3)
    index.add([1, 2, 3, 10])  # A
    index.add([4, 5, 6, 11])  # B
    index.add([7, 8, 9, 12])  # C
    index.add([1, 2, 3, 10])  # A updated: B is now the least recently updated
    index.add([20, 21, 22, 23])  # D evicts B
    assert len(index) == 3
    assert index.lookup([4, 5, 6], 1, min_count=1) is None
    assert index.lookup([1, 2, 3], 1) == SuffixMatch(MIN_MATCH, [10])
    assert index.lookup([7, 8, 9], 1, min_count=1) == SuffixMatch(MIN_MATCH, [12])
    assert index.lookup([20, 21, 22], 1, min_count=1) == SuffixMatch(MIN_MATCH, [23])
    index.add([30, 31, 32, 33])  # evicts C (A was updated after it)
    assert index.lookup([7, 8, 9], 1, min_count=1) is None
    assert index.lookup([1, 2, 3], 1) == SuffixMatch(MIN_MATCH, [10])


def test_global_lookup_does_not_refresh_recency():
    index = GlobalIndex(max_contexts=2)
    index.add([1, 2, 3, 4])  # A
    index.add([5, 6, 7, 8])  # B
    assert index.lookup([1, 2, 3], 1, min_count=1) is not None  # a read, not an update
    index.add([9, 9, 9, 9])  # evicts A, the least recently *updated*
    assert index.lookup([1, 2, 3], 1, min_count=1) is None
    assert index.lookup([5, 6, 7], 1, min_count=1) is not None


def test_global_size_never_exceeds_the_bound():
    rng = random.Random(11)
    index = GlobalIndex(max_contexts=50)
    for _ in range(40):
        index.add([rng.randrange(20) for _ in range(30)])
        assert len(index) <= 50
    assert len(index) == 50

"""The native proposal walk (_suffix_walk.c) against suffix.py's _propose, token for token:
over a request's own counts (propose_counts, what SuffixIndex.lookup runs), on random and
real-code text, with tokens pending, assumed, and every early stop (beat, floor, limit); a
round's whole proposal in one call (best_match: ContextTable.best) against the rule composed
in Python over Python counts; and the request's native counting (count_stream) against
_count_stream: the same dicts, in the same order."""

import math
import random
import sysconfig
from pathlib import Path

import pytest

from drafter_service.proposers import suffix
from drafter_service.proposers._context_table import count_stream, propose_counts
from drafter_service.proposers.global_index import GlobalIndex, best_match, composed_best_match
from drafter_service.proposers.suffix import (
    GLOBAL_FACTOR,
    GLOBAL_OFFSET,
    MIN_TOKEN_PROB,
    ORDERS,
    ContextCounts,
    SuffixIndex,
    _count_stream,
    _hash_tokens,
    _propose,
)

SETTINGS = [(0.1, 1.0, 1.0), (0.1, 2.0, 0.0), (0.3, 0.5, 2.0), (0.0, 4.0, 3.0)]  # (min_prob, factor, offset)


def python_walk(index, k, beat=0.0):
    return _propose(index.counts, index.prefix, k, index.min_prob, index.factor, index.offset, "request", beat)


def assert_same_walks(index, rng, ks=(1, 4, 16, 40, 100)):
    for k in ks:
        for beat in (0.0, 0.5, 1.5, 3.0, 7.25, float(k)):
            want = python_walk(index, k, beat)
            assert index.lookup(k, beat) == want, (len(index.tokens), k, beat)
    with index.assuming([rng.randrange(max(index.tokens) + 1)]):  # draft-ahead: one token more, uncounted
        assert index.lookup(8) == python_walk(index, 8)


def stream(rng, vocab):
    """Text with repeats (so chains exist): random tokens, and copies of earlier stretches."""
    tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
    while len(tokens) < 600:
        if rng.random() < 0.5:
            start = rng.randrange(len(tokens))
            tokens += tokens[start : start + rng.randrange(1, 60)]
        else:
            tokens += [rng.randrange(vocab) for _ in range(rng.randrange(1, 10))]
    return tokens


@pytest.mark.parametrize("seed", range(12))
def test_the_native_walk_is_the_python_rule_on_random_text(seed):
    """Small and large vocabularies, four settings (a chain limit past the 64 drafts held on
    the stack too), asked after every few tokens, with the last ones not counted yet."""
    rng = random.Random(seed)
    vocab = (2, 5, 40, 3_000_000)[seed % 4]
    index = SuffixIndex(*SETTINGS[seed % len(SETTINGS)])
    tokens = stream(rng, vocab)
    proposed = 0
    at = 0
    while at < len(tokens):
        step = tokens[at : at + rng.randrange(1, 12)]
        index.extend(step, count=False)
        assert_same_walks(index, rng)
        proposed += index.lookup(16) is not None
        index.count_pending()
        at += len(step)
    assert proposed > 10  # the walks did run (not only None against None)


def test_the_native_walk_is_the_python_rule_on_real_code():
    """Standard-library sources, a token per character, one request over several files: long
    lists of continuations after short contexts, long certain chains after long ones."""
    rng = random.Random(0)
    files = sorted((Path(sysconfig.get_paths()["stdlib"]) / "json").glob("*.py"))
    index = SuffixIndex()
    chains = 0
    for path in files:
        text = [ord(c) for c in path.read_text(encoding="utf-8")]
        for at in range(0, len(text), 97):
            index.extend(text[at : at + 97])
            assert_same_walks(index, rng, ks=(4, 16))
            chains += len((index.lookup(16) or suffix.SuffixMatch(0, [])).continuation) >= 8
    assert chains > 20


def test_hash_collisions_take_the_same_search_path():
    """Counts where orders match out of order (as a hash collision can make them: a longer
    context counted without a shorter one): the binary search, and the one look-up a beat
    allows, visit the same orders in both walks, so the proposal is still the same."""
    rng = random.Random(1)
    index = SuffixIndex()
    index.extend([rng.randrange(7) for _ in range(200)])
    for oi in range(0, len(ORDERS), 3):  # forget every third order's contexts: matches with holes
        index.counts.tables[oi].clear()
    for end in range(1, 200, 7):
        probe = SuffixIndex()
        probe.counts = index.counts
        probe.extend(index.tokens[:end], count=False)
        assert_same_walks(probe, rng, ks=(4, 16))


def test_a_huge_cap_is_only_a_cap():
    """The walks hold what a chain can reach (its limit after the longest match), not max_tokens."""
    rng = random.Random(3)
    tokens = stream(rng, 5)
    tokens += tokens[:100]  # ends in a repeat: a match of 32 tokens
    index = SuffixIndex(0.0, 4.0, 3.0)  # chains of up to 131 drafts: past the stack's 64
    index.extend(tokens)
    global_index, global_counts = outputs_and_counts([tokens])
    for k in (10**12, 2**62):
        assert index.lookup(k) == python_walk(index, k) and len(index.lookup(k).continuation) > 64
        assert best_match(index, global_index, k) == python_best(index, global_counts, k)


def test_bad_counts_are_errors_not_proposals():
    index = SuffixIndex()
    index.extend([1, 2, 3, 2])  # only the last token's context of order 1 matches: [2]
    args = (index.prefix, 8, 0.1, 1.0, 1.0, 0.0)
    assert propose_counts(index.counts.tables, *args) == (1, [3, 2], 2.0)  # two certain drafts
    with pytest.raises(TypeError):
        propose_counts(index.counts.tables[:3], *args)
    with pytest.raises(TypeError):
        propose_counts([[] for _ in ORDERS], *args)
    last = (index.prefix[-1] - index.prefix[-2] * suffix.POW[1]) % suffix.MOD
    index.counts.tables[0][last] = {5: 1, 2**40: 1}  # the pick (ties: the later) past 32 bits
    with pytest.raises(ValueError):
        propose_counts(index.counts.tables, *args)
    with pytest.raises(ValueError):  # a prefix hash outside [0, MOD)
        propose_counts(index.counts.tables, [0, -1, 5], 8, 0.1, 1.0, 1.0, 0.0)


def test_without_the_extension_the_request_walks_and_counts_in_python(monkeypatch):
    rng = random.Random(2)
    tokens = stream(rng, 6)
    index = SuffixIndex()
    index.extend(tokens)
    native = [index.lookup(k, beat) for k in (4, 16) for beat in (0.0, 2.0)]
    monkeypatch.setattr(suffix, "_native_propose", None)
    monkeypatch.setattr(suffix, "_native_count", None)
    in_python = SuffixIndex()
    in_python.extend(tokens)
    assert ordered(in_python.counts) == ordered(index.counts) and in_python.counts.size == index.counts.size
    assert [in_python.lookup(k, beat) for k in (4, 16) for beat in (0.0, 2.0)] == native
    assert any(native)


# -- a round's whole proposal in one call --------------------------------------------------


def python_best(index, global_counts, k):
    """best_match's rule over Python counts only: suffix.py's walk, global first."""
    other = _propose(global_counts, index.prefix, k, MIN_TOKEN_PROB, GLOBAL_FACTOR, GLOBAL_OFFSET, "global") if k > 0 else None
    own = _propose(index.counts, index.prefix, k, index.min_prob, index.factor, index.offset, "request",
                   math.nextafter(other.score, -math.inf) if other else 0.0) if k > 0 else None
    return own if own is not None and (other is None or own.score >= other.score) else other


def outputs_and_counts(outputs):
    index, counts = GlobalIndex(32 << 20), ContextCounts()
    for tokens in outputs:
        index.add(tokens)
        prefix = [0]
        _hash_tokens(prefix, tokens)
        _count_stream(counts, tokens, prefix, 0)
    return index, counts


@pytest.mark.parametrize("seed", range(8))
def test_one_call_proposes_what_the_python_rule_does(seed):
    """Requests that repeat earlier outputs (the global chain wins), themselves (their own
    wins), both, or neither; asked after every few tokens with the last ones uncounted."""
    rng = random.Random(seed)
    vocab = (3, 8, 50, 3_000_000)[seed % 4]
    outputs = [stream(rng, vocab)[: rng.randrange(50, 600)] for _ in range(4)]
    global_index, global_counts = outputs_and_counts(outputs)
    sources = {None: 0, "global": 0, "request": 0}
    for _ in range(6):
        index = SuffixIndex(*SETTINGS[rng.randrange(len(SETTINGS))])
        tokens = stream(rng, vocab)[:150] + rng.choice(outputs)[:150] + stream(rng, vocab)[:100]
        at = 0
        while at < len(tokens):
            step = tokens[at : at + rng.randrange(1, 9)]
            index.extend(step, count=False)
            for k in (0, 1, 4, 16, 100):
                want = python_best(index, global_counts, k)
                assert best_match(index, global_index, k) == want, (at, k)
                assert composed_best_match(index, global_index, k) == want
                sources[want.source if want else None] += 1
            index.count_pending()
            at += len(step)
    assert min(sources.values()) > 0, sources  # every outcome was compared


def test_one_call_proposes_what_the_python_rule_does_on_real_code():
    files = sorted((Path(sysconfig.get_paths()["stdlib"]) / "json").glob("*.py"))
    texts = [[ord(c) for c in path.read_text(encoding="utf-8")] for path in files]
    global_index, global_counts = outputs_and_counts(texts[1:])
    index = SuffixIndex()
    for text in (texts[0], texts[2]):  # a file not held, then one held
        for at in range(0, len(text), 31):
            index.extend(text[at : at + 31], count=False)
            assert best_match(index, global_index, 16) == python_best(index, global_counts, 16)
            index.count_pending()
    assert best_match(index, global_index, 16).source == "global"


# -- a request's counting --------------------------------------------------------------------


def ordered(counts):
    """The counts as they are laid out: every dict's items in order (order is recency)."""
    return [[(key, value if type(value) is int else list(value.items())) for key, value in table.items()]
            for table in counts.tables]


def python_index(tokens):
    index = SuffixIndex()
    index.tokens.extend(tokens)
    _hash_tokens(index.prefix, tokens)
    _count_stream(index.counts, index.tokens, index.prefix, 0)
    return index


@pytest.mark.parametrize("seed", range(8))
def test_native_counting_makes_the_same_dicts_in_the_same_order(seed):
    """Counted in random steps natively, against _count_stream over the whole text at once:
    the same contexts, packed ints, split dicts and recency order (ties in the walk depend on
    it), and then the same proposals."""
    rng = random.Random(seed)
    vocab = (2, 5, 40, 3_000_000)[seed % 4]
    tokens = stream(rng, vocab) + [rng.randrange(2**32) for _ in range(3)] + stream(rng, vocab)[:80]
    index = SuffixIndex()
    at = 0
    while at < len(tokens):
        step = tokens[at : at + rng.randrange(1, 40)]
        index.extend(step, count=False)
        index.count_pending(rng.randrange(1, 30) if rng.random() < 0.5 else None)
        at += len(step)
    index.count_pending()
    want = python_index(tokens)
    assert index.counts.size == want.counts.size == sum(map(len, want.counts.tables))
    assert ordered(index.counts) == ordered(want.counts)
    assert any(type(v) is dict for table in want.counts.tables for v in table.values())  # splits were made
    for k in (4, 16):
        assert index.lookup(k) == want.lookup(k)


def test_native_counting_on_real_code():
    files = sorted((Path(sysconfig.get_paths()["stdlib"]) / "json").glob("*.py"))
    tokens = [ord(c) for path in files for c in path.read_text(encoding="utf-8")]
    index = SuffixIndex()
    for at in range(0, len(tokens), 500):
        index.extend(tokens[at : at + 500])
    assert ordered(index.counts) == ordered(python_index(tokens).counts)


def test_native_counting_refuses_what_it_cannot_count():
    index = SuffixIndex()
    index.extend([1, 2, 3], count=False)
    tables, prefix = index.counts.tables, index.prefix
    with pytest.raises(ValueError):
        count_stream(tables, [1, 2**32, 3], prefix, 0, 3)  # past the packed token's 32 bits
    with pytest.raises(ValueError):
        count_stream(tables, [1, -2, 3], prefix, 0, 3)
    with pytest.raises(ValueError):
        count_stream(tables, index.tokens, prefix, 2, 4)  # past the tokens
    with pytest.raises(TypeError):
        count_stream(tables[:2], index.tokens, prefix, 0, 3)
    assert count_stream(tables, index.tokens, prefix, 0, 3) == 3  # before tokens 2 and 3: 1 + 2 contexts, all new

"""The global suffix index (issue 37): its native table against suffix.py's Python counts, the
byte bound, eviction of whole outputs, additions in interleaved steps, the settings."""

import argparse
import random
import sysconfig
from array import array
from pathlib import Path

import pytest

from drafter_service import settings as drafter_settings
from drafter_service.proposers import _context_table, suffix
from drafter_service.proposers import global_index as global_module
from drafter_service.proposers._context_table import ContextTable
from drafter_service.proposers.global_index import GlobalIndex, best_match
from drafter_service.proposers.suffix import (
    GLOBAL_FACTOR,
    GLOBAL_OFFSET,
    MIN_TOKEN_PROB,
    ContextCounts,
    SuffixIndex,
    SuffixMatch,
    _count_stream,
    _hash_tokens,
    _propose,
)


def python_counts(outputs, leads=None):
    """The counts the global index held before issue 37: suffix.py's dicts over each output
    (after its first `lead` tokens, its prompt's end: contexts only)."""
    counts = ContextCounts()
    for tokens, lead in zip(outputs, leads or [0] * len(outputs)):
        prefix = [0]
        _hash_tokens(prefix, tokens)
        _count_stream(counts, tokens, prefix, lead)
    return counts


def python_lookup(counts, context, k, beat=0.0):
    index = SuffixIndex()
    index.extend(list(context), count=False)
    return _propose(counts, index.prefix, k, MIN_TOKEN_PROB, GLOBAL_FACTOR, GLOBAL_OFFSET, "global", beat)


def native_lookup(index, context, k, beat=0.0):
    asking = SuffixIndex()
    asking.extend(list(context), count=False)
    return index.lookup(asking, k, SuffixMatch(1, [0], beat) if beat else None)


def queries(rng, outputs, vocab, count):
    """Contexts to ask with: the ends of stretches of the outputs (matches), some after noise."""
    for _ in range(count):
        noise = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        if rng.random() < 0.8:
            tokens = rng.choice(outputs)
            end = rng.randrange(len(tokens) + 1)
            noise = noise[: rng.randrange(len(noise) + 1)] + tokens[max(0, end - rng.randrange(1, 45)) : end]
        yield noise


def assert_same_proposals(index, outputs, rng, vocab, count=60, leads=None):
    counts = python_counts(outputs, leads)
    assert len(index) == len(counts)
    for context in queries(rng, outputs, vocab, count):
        for k in (1, 4, 16, 40):
            for beat in (0.0, 1.5, 3.0):
                assert native_lookup(index, context, k, beat) == python_lookup(counts, context, k, beat), (context, k, beat)


# -- the same proposals as the Python counts -----------------------------------------------


def test_the_native_table_hashes_the_contexts_suffix_py_counts():
    assert (_context_table.ORDERS, _context_table.MOD, _context_table.BASE) == (suffix.ORDERS, suffix.MOD, suffix.BASE)


@pytest.mark.parametrize("seed", range(8))
def test_proposals_equal_the_python_counts_token_for_token(seed):
    """Random text over small and large vocabularies (tokens past the slot's 20 bits too),
    added in steps of random sizes: the native walk proposes exactly what suffix.py's does."""
    rng = random.Random(seed)
    vocab = (2, 5, 40, 3_000_000)[seed % 4]
    outputs = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 500))] for _ in range(rng.randrange(2, 8))]
    index = GlobalIndex(16 << 20)
    for tokens in outputs:
        for _ in index.adding(tokens, rng.randrange(1, 60)):
            pass
    assert index.requests == len(outputs) and index.evictions == 0
    assert_same_proposals(index, outputs, rng, vocab)


@pytest.mark.parametrize("seed", range(4))
def test_a_prompt_s_end_is_context_only(seed):
    """Outputs added with their prompts' last tokens (0..MAX_MATCH of them): the contexts reach
    back into those tokens, only the output's tokens are counted, proposal for proposal the same
    as suffix.py's counts from `lead` on; evicting them takes back exactly what was counted."""
    rng = random.Random(seed)
    vocab = (3, 40)[seed % 2]
    leads = [rng.choice((0, 1, 7, suffix.MAX_MATCH)) for _ in range(6)]
    outputs = [[rng.randrange(vocab) for _ in range(lead + rng.randrange(1, 300))] for lead in leads]
    index = GlobalIndex(16 << 20)
    for tokens, lead in zip(outputs, leads):
        for _ in index.adding(tokens, rng.randrange(1, 60), lead):
            pass
    assert_same_proposals(index, outputs, rng, vocab, leads=leads)
    assert index.token_bytes == sum(len(t) * global_module.TOKEN_BYTES + global_module.OUTPUT_BYTES for t in outputs)
    for _ in index._evicting_oldest(50):
        pass
    assert len(index) == len(python_counts(outputs[1:], leads[1:]))
    assert_same_proposals(index, outputs[1:], rng, vocab, count=20, leads=leads[1:])
    with pytest.raises(ValueError, match="lead"):
        index.add([1, 2, 3], suffix.MAX_MATCH + 1)
    index.add([1, 2, 3], 3)  # (a prompt's end and no output: nothing held)
    assert index.requests == len(outputs) - 1


def test_a_request_whose_prompt_ends_as_an_earlier_one_s_drafts_its_output_at_once():
    """A chat template ends every prompt the same way: the first round of a request repeats
    the earlier output's start only if that output was counted after its prompt's end."""
    from drafter_service.proposers.suffix_drafter import SuffixDrafter

    template_end = [90, 91, 92, 93]
    output = [5, 6, 7, 8, 9, 10, 11, 12]
    drafter = SuffixDrafter(16 << 20)
    drafter.start("first", [1, 2, 3] + template_end)
    drafter.extend("first", output)
    drafter.finish("first")
    drafter.start("second", [40, 41, 42] + template_end)
    assert drafter.propose("second", 4) == output[:4]
    without = GlobalIndex(16 << 20)
    without.add(output)  # (the output alone: its first token follows no context of it)
    asking = SuffixIndex()
    asking.extend([40, 41, 42] + template_end, count=False)
    assert without.lookup(asking, 4) is None


def test_proposals_equal_the_python_counts_on_real_code():
    """Standard-library sources, a token per character: real repeats, long lists of
    continuations after short contexts."""
    files = sorted((Path(sysconfig.get_paths()["stdlib"]) / "json").glob("*.py"))
    outputs = [[ord(c) for c in path.read_text(encoding="utf-8")] for path in files]
    index = GlobalIndex(64 << 20)
    for tokens in outputs:
        index.add(tokens)
    assert_same_proposals(index, outputs, random.Random(0), 128, count=150)


def test_counts_past_what_a_slot_holds_stay_exact():
    """A context followed by one token more often than a slot's count field holds (a list
    then), and that token leaving again."""
    tokens = [7] * 5000 + [8] * 3 + [7] * 10
    index = GlobalIndex(4 << 20)
    index.add(tokens)
    for k in (1, 4, 16):
        for context in ([7, 7, 7], [8], [7, 8], [8, 7]):
            assert native_lookup(index, context, k) == python_lookup(python_counts([tokens]), context, k)


@pytest.mark.parametrize("seed", range(4))
def test_the_global_walk_first_chooses_what_the_own_walk_first_chose(seed):
    """best_match (global first, the request's own walk cut short by its score) picks what the
    rule before it picked (own first, then the global walk cut short; ties: the request's own)."""
    rng = random.Random(seed)
    vocab = (3, 6, 20, 60)[seed]
    outputs = [[rng.randrange(vocab) for _ in range(rng.randrange(20, 400))] for _ in range(5)]
    index = GlobalIndex(16 << 20)
    for tokens in outputs:
        index.add(tokens)
    for context in queries(rng, outputs, vocab, 150):
        asking = SuffixIndex()
        asking.extend(context)
        for k in (1, 4, 16):
            own = asking.lookup(k)
            other = index.lookup(asking, k, own)
            before = other if other is not None and (own is None or other.score > own.score) else own
            assert best_match(asking, index, k) == before
            assert best_match(asking, None, k) == own


# -- bytes, eviction -----------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_the_byte_bound_holds_and_the_oldest_outputs_leave_whole(seed):
    rng = random.Random(seed)
    vocab = (3, 12, 50, 400)[seed]
    outputs = [[rng.randrange(vocab) for _ in range(rng.randrange(50, 2500))] for _ in range(14)]
    index = GlobalIndex(1_000_000)
    for n, tokens in enumerate(outputs, 1):
        for _ in index.adding(tokens, 97):
            assert index.nbytes <= index.max_bytes
        assert index.nbytes <= index.max_bytes
        held = [list(output.tokens) for output in index.outputs]
        assert held == outputs[n - len(held) : n]  # the most recent outputs, whole
        assert index.evictions == n - len(held)
    assert index.evictions > 0  # the budget forced some out
    # What is left counts exactly as if only the held outputs had ever been added.
    assert_same_proposals(index, outputs[len(outputs) - index.requests :], rng, vocab)


def test_an_evicted_output_is_no_longer_proposed():
    first, second = list(range(1000, 1400)), list(range(2000, 2400))
    index = GlobalIndex(1 << 20)
    index.add(first)
    assert native_lookup(index, first[:10], 8).continuation == first[10:18]
    budget = index.nbytes + 1000  # room for little more than `first`
    small = GlobalIndex(budget)
    small.add(first)
    small.add(second)
    assert (small.requests, small.evictions) == (1, 1) and small.nbytes <= budget
    assert native_lookup(small, first[:10], 8) is None
    assert native_lookup(small, second[:10], 8).continuation == second[10:18]


def test_an_evicted_output_leaves_in_steps_too():
    """Making room takes an old output's counts back `chunk` tokens a step (a long output would
    stall the loop); once the steps are done the index is what adding at once leaves."""
    rng = random.Random(7)
    outputs = [[rng.randrange(40) for _ in range(n)] for n in (6000, 3000, 3000)]
    at_once, in_steps = GlobalIndex(1_100_000), GlobalIndex(1_100_000)
    extra = 0  # pauses beyond those of adding in steps: the eviction's
    for tokens in outputs:
        at_once.add(tokens)
        extra += sum(1 for _ in in_steps.adding(tokens, 500)) - (len(tokens) // 500 - 1)
        assert in_steps.nbytes <= in_steps.max_bytes
    assert at_once.evictions == in_steps.evictions == 1 and extra == len(outputs[0]) // 500 - 1  # its 12 steps
    assert [list(o.tokens) for o in in_steps.outputs] == [list(o.tokens) for o in at_once.outputs] == outputs[1:]
    assert_same_proposals(in_steps, outputs[1:], rng, 40, count=30)


def test_an_output_larger_than_the_budget_keeps_its_first_part():
    tokens = list(range(50_000))
    index = GlobalIndex(400_000)
    index.add(tokens)
    (held,) = index.outputs
    assert 0 < len(held.tokens) < len(tokens) and list(held.tokens) == tokens[: len(held.tokens)]
    assert index.nbytes <= index.max_bytes
    kept = len(held.tokens)
    assert native_lookup(index, tokens[kept - 40 : kept - 20], 4).continuation == tokens[kept - 20 : kept - 16]


def interleave(index, outputs, chunk):
    """Add outputs in alternating steps of `chunk` tokens (as finished requests do on the loop)."""
    steps = [index.adding(tokens, chunk) for tokens in outputs]
    while steps:
        for step in list(steps):
            if next(step, StopIteration) is StopIteration:
                steps.remove(step)


def test_outputs_added_in_interleaved_steps_count_in_that_order():
    rng = random.Random(5)
    outputs = [[rng.randrange(30) for _ in range(3000)] for _ in range(2)]
    index = GlobalIndex(16 << 20)
    interleave(index, outputs, 200)
    counts = ContextCounts()
    prefixes = [[0] for _ in outputs]
    for tokens, prefix in zip(outputs, prefixes):
        _hash_tokens(prefix, tokens)
    for start in range(0, 3000, 200):
        for tokens, prefix in zip(outputs, prefixes):
            _count_stream(counts, tokens, prefix, start, start + 200)
    for context in queries(rng, outputs, 30, 60):
        for k in (1, 4, 16):
            assert native_lookup(index, context, k) == python_lookup(counts, context, k)


def test_an_output_evicted_while_it_is_added_adds_no_more():
    rng = random.Random(6)
    outputs = [[rng.randrange(30) for _ in range(3000)] for _ in range(3)]
    index = GlobalIndex(700_000)  # room for one of them, not two
    index.add(outputs[0])
    interleave(index, outputs[1:], 200)
    held = [list(output.tokens) for output in index.outputs]
    assert index.evictions == 2 and index.nbytes <= index.max_bytes
    assert held == [outputs[2]]  # the first evicted; the second, the oldest then, stopped, then left too
    assert len(index) == len(python_counts(held))  # nothing of the evicted ones is left


def test_evicting_everything_leaves_an_empty_table():
    rng = random.Random(1)
    table = ContextTable()
    empty = table.bytes
    tokens = array("I", [rng.randrange(3_000_000 if i % 2 else 20) for i in range(4000)])
    assert table.count(tokens, 0, 1500, 1 << 24) == 1500 and table.count(tokens, 1500, 4000, 1 << 24) == 4000
    assert table.contexts > 0 and table.bytes > empty
    table.uncount(tokens, 0, 2500)
    table.uncount(tokens, 2500, 4000)  # (in two pieces)
    assert table.contexts == 0
    assert table.propose([0, 5, 7], 4, 0.1, 2.0, 0.0, 0.0) is None
    assert table.count(tokens, 0, 10, empty - 1) == 0  # over its budget: nothing is counted
    with pytest.raises(TypeError, match="uint32"):
        table.count(array("i", [1, 2, 3]), 0, 3, 1 << 20)  # signed: not token ids
    with pytest.raises(ValueError, match="outside"):
        table.count(tokens, 0, 5000, 1 << 20)


# -- off, settings ---------------------------------------------------------------------------


def test_a_zero_budget_turns_the_index_off_without_the_native_table(monkeypatch):
    monkeypatch.setattr(global_module, "_native_table", lambda: pytest.fail("the native table was built"))
    index = GlobalIndex(0)
    index.add([1, 2, 3, 1, 2])
    assert (index.nbytes, index.requests, len(index)) == (0, 0, 0)
    assert native_lookup(index, [1, 2], 4) is None
    with pytest.raises(ValueError, match="max_bytes"):
        GlobalIndex(-1)


def test_the_drafter_setting_is_in_mib_and_validated():
    parser = drafter_settings.add_arguments(argparse.ArgumentParser())
    settings = drafter_settings.from_args(parser.parse_args([]), {"TANDEM_DRAFTER_GLOBAL_INDEX_MB": "64"})
    assert settings.global_index_mb == 64
    assert drafter_settings.from_args(parser.parse_args(["--global-index-mb", "0"]), {}).global_index_mb == 0
    with pytest.raises(ValueError, match="global_index_mb -1 must be >= 0"):
        drafter_settings.DrafterSettings(global_index_mb=-1)

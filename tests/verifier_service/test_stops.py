"""Completion bookkeeping: text deltas concatenate to the decoded completion, stop sequences
are never streamed (not even their first characters), eos and the token budget end it."""

import random
import sysconfig
from pathlib import Path

import pytest

from shared.model.registry import resolve_model
from shared.tokenizer import load_tokenizer
from verifier_service.stops import Completion

TEXT = (Path(sysconfig.get_paths()["stdlib"]) / "json" / "decoder.py").read_text()[:3000] + " héllo wörld ✓ 日本語 end"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(None))


def stream(tokenizer, completion, ids, seed=0):
    """Feed ids in random round sizes (1..5 tokens); returns the concatenated deltas."""
    rng, out, i = random.Random(seed), "", 0
    while i < len(ids) and completion.finish_reason is None:
        k = rng.randint(1, 5)
        _, delta = completion.extend(ids[i : i + k])
        out += delta
        i += k
    return out


@pytest.mark.parametrize("seed", range(3))
def test_deltas_concatenate_to_the_decoded_completion(tokenizer, seed):
    ids = tokenizer.encode(TEXT).ids
    c = Completion(10**6, frozenset(), (), tokenizer)
    assert stream(tokenizer, c, ids, seed) == tokenizer.decode(ids) and c.token_ids == ids


@pytest.mark.parametrize("stop", ["def ", "wörld", "日本"])
def test_stop_sequence_is_cut_and_never_streamed(tokenizer, stop):
    ids = tokenizer.encode(TEXT).ids
    c = Completion(10**6, frozenset(), (stop,), tokenizer)
    out = stream(tokenizer, c, ids)
    full = tokenizer.decode(ids)
    assert c.finish_reason == "stop"
    assert out == full[: full.find(stop)]


def test_eos_and_budget(tokenizer):
    ids = tokenizer.encode(TEXT).ids
    c = Completion(10**6, frozenset({ids[7]}), (), tokenizer)
    stream(tokenizer, c, ids)
    assert c.finish_reason == "stop" and c.token_ids == ids[: ids.index(ids[7])]
    c = Completion(5, frozenset(), (), tokenizer)
    stream(tokenizer, c, ids)
    assert c.finish_reason == "length" and c.token_ids == ids[:5]

"""Parity with transformers.Qwen3MoeForCausalLM on tiny random checkpoints (fp32, 1e-4)."""

import pytest
import torch

from shared.model import load_model

from .conftest import make_hf_checkpoint

TOLERANCE = 1e-4

CONFIGS = {
    "normalised-topk": dict(norm_topk_prob=True),
    "unnormalised-topk": dict(norm_topk_prob=False),
    "sparse-step-and-mlp-only": dict(decoder_sparse_step=2, mlp_only_layers=[2], num_hidden_layers=4),
    "mha-no-gqa": dict(num_key_value_heads=4),
    "gqa-4-to-1": dict(num_key_value_heads=1),
    "tied-embeddings": dict(tie_word_embeddings=True),
}


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def pair(request, tmp_path_factory):
    path, hf = make_hf_checkpoint(tmp_path_factory.mktemp(request.param), seed=len(request.param), **CONFIGS[request.param])
    return hf, load_model(path)


def test_full_sequence_scoring(pair):
    hf, ours = pair
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    logits, hidden = ours.score(ids)
    assert logits.shape == (40, 97) and hidden.shape == (40, 32)
    assert (logits - expected).abs().max() < TOLERANCE


def test_incremental_decoding_and_rollback(pair):
    hf, ours = pair
    ids = torch.randint(0, 97, (30,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    cache = ours.new_cache(64)
    rows = [ours(ids[i : i + w], cache)[0] for i, w in ((0, 7), (7, 1), (8, 9), (17, 13))]
    assert (torch.cat(rows) - expected).abs().max() < TOLERANCE
    # Roll back as after rejected drafts: write junk, truncate, continue with the real tokens.
    cache.truncate(12)
    ours(torch.tensor([5, 6, 7, 8]), cache)
    cache.truncate(12)
    logits, _ = ours(ids[12:], cache)
    assert (logits - expected[12:]).abs().max() < TOLERANCE
    assert cache.length == 30


def test_greedy_generation_matches_generate(pair):
    hf, ours = pair
    prompt = torch.randint(0, 97, (6,), generator=torch.Generator().manual_seed(3))
    expected = hf.generate(prompt[None], max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)[0, 6:]
    cache = ours.new_cache(64)
    logits, _ = ours(prompt, cache)
    tokens = []
    for _ in range(32):
        token = logits[-1].argmax()
        tokens.append(int(token))
        logits, _ = ours(token.view(1), cache)
    assert tokens == expected.tolist()

"""The Qwen3-Next / Qwen3.5-MoE trunk (shared.model.families.hybrid.modules) against transformers'
Qwen3NextForCausalLM and Qwen3_5MoeForCausalLM (text) on the same random weights: logits of a whole sequence (fp32, within 1e-4), and incremental
decoding with verify windows rolled back after rejected drafts equal to a from-scratch
forward."""

import pytest
import torch

from shared.model.families.hybrid.config import NextConfig
# the configs themselves (not the next_configs fixture): the parametrize lists need their names at collection
from ...conftest import NEXT_CONFIGS as CONFIGS


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(name, next_pair):
    reference, ours = next_pair(name)
    assert [layer.linear for layer in ours.layers] == [t == "linear_attention" for t in reference.config.layer_types]
    tokens = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(tokens.unsqueeze(0)).logits[0]
    logits, _ = ours(tokens, ours.new_cache(64))
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name,row_invariant", [(name, False) for name in sorted(CONFIGS)] + [("qwen3.5", True)])
def test_windows_rolled_back_after_rejected_drafts_decode_like_a_fresh_forward(name, row_invariant, next_pair):
    """Prefill, then verify windows of a head and 4 drafts, keeping 0..4 drafts each time: the
    logits of every committed row equal a from-scratch forward over the committed tokens.
    row_invariant: the windows run as one-row steps (exact mode on the CPU), whose kept
    states roll back the same way, and each row's logits are its one-row step's bits."""
    _, ours = next_pair(name)
    gen = torch.Generator().manual_seed(2)
    committed = torch.randint(0, 97, (12,), generator=gen).tolist()
    cache, plain = ours.new_cache(64), ours.new_cache(64)
    for memory in (cache, plain):
        ours.prefill(torch.tensor(committed[:-1]), memory)  # the prompt but its last token (the head)
    rows = []
    for accepted in (2, 0, 4, 1):
        drafts = torch.randint(0, 97, (4,), generator=gen).tolist()
        logits, _ = ours(torch.tensor([committed[-1], *drafts]), cache, keep_states=True, row_invariant=row_invariant)
        cache.truncate(len(committed) + accepted)  # the head and the accepted drafts stay
        if row_invariant:  # the kept rows are what plain decoding (one row a step) gives, bit for bit
            for j, token in enumerate([committed[-1], *drafts[:accepted]]):
                row, _ = ours(torch.tensor([token]), plain)
                assert torch.equal(row[0], logits[j])
        rows.append(logits[: accepted + 1])
        committed += [*drafts[:accepted], int(logits[accepted].argmax())]  # the bonus token
    fresh, _ = ours(torch.tensor(committed[:-1]), ours.new_cache(64))
    torch.testing.assert_close(torch.cat(rows), fresh[11:], rtol=1e-4, atol=1e-5)


def test_a_qwen3_5_composite_config_gives_its_text_config():
    from transformers.models.qwen3_5_moe import Qwen3_5MoeConfig

    composite = Qwen3_5MoeConfig(text_config=CONFIGS["qwen3.5"]).to_dict()
    config = NextConfig.from_dict(composite)
    assert config.linear_projection == "split" and config.layer_types[2] == "full_attention"
    assert config.hidden_size == 32 and config.partial_rotary_factor == 0.25


def test_bad_configs_name_the_field():
    raw = dict(CONFIGS["hybrid"], layer_types=["linear_attention"] * 3)
    with pytest.raises(ValueError, match="layer_types has 3 entries"):
        NextConfig.from_dict(raw)
    with pytest.raises(ValueError, match="unknown layer type"):
        NextConfig.from_dict(dict(CONFIGS["hybrid"], layer_types=["linear_attention", "mamba"] * 2))
    with pytest.raises(ValueError, match="config.json"):
        NextConfig.from_dict({"hidden_size": 32})


@pytest.mark.parametrize("field, value, says", [
    ("hidden_size", 0, "hidden_size = 0 must be a positive integer"),
    ("num_attention_heads", True, "num_attention_heads = True must be a positive integer"),
    ("linear_conv_kernel_dim", -4, "linear_conv_kernel_dim = -4"),
    ("num_key_value_heads", 3, "not a multiple of num_key_value_heads = 3"),
    ("linear_num_value_heads", 3, "linear_num_value_heads = 3 is not a multiple"),
    ("num_experts_per_tok", 99, "num_experts_per_tok = 99 exceeds num_experts"),
])
def test_bad_sizes_name_the_field(field, value, says):
    """Sizes are checked as qwen3_moe's are (a zero, a json true or a mismatch once loaded as
    shapes): a ValueError naming the field, not a failure deep in the model's construction."""
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        NextConfig.from_dict(dict(CONFIGS["hybrid"], layer_types=["linear_attention", "full_attention"] * 2,
                                  **{field: value}))

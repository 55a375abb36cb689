"""The MTP layer of the Qwen3-Next / Qwen3.5-MoE family (shared.model.families.hybrid.modules) against a slow
reference: the pre-fc norms and fc written out here, the decoder layer and its final norm run
by transformers (its model class of one full-attention layer, fed the fc's output as input
embeddings, over the whole sequence at once). Ours runs incrementally: a catch-up, then
chained one-row steps fed their own output, as the drafter drafts."""

import pytest
import torch
import torch.nn.functional as F

from .next_checkpoints import with_mtp


def reference_layer(name, model, configs):
    """transformers' model of one full-attention MoE layer holding our MTP layer's weights."""
    from transformers import Qwen3NextConfig, Qwen3NextModel
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig, Qwen3_5MoeTextModel

    one = dict(configs[name], num_hidden_layers=1, layer_types=["full_attention"], mlp_only_layers=[])
    one.pop("full_attention_interval", None)
    if name == "qwen3.5":
        reference = Qwen3_5MoeTextModel(Qwen3_5MoeTextConfig(**one))
    else:
        reference = Qwen3NextModel(Qwen3NextConfig(**one))
    state = {k.replace("layers.0.", "layers.0.", 1): v for k, v in model.mtp.state_dict().items()
             if k.startswith(("layers.0.", "norm."))}
    state["embed_tokens.weight"] = model.embed_tokens.weight
    missing, unexpected = reference.load_state_dict(state, strict=False)
    assert not unexpected and all(k.startswith("rotary") for k in missing), (missing, unexpected)
    return reference.eval()


def centred_rmsnorm(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + weight)


@pytest.mark.parametrize("name", ["hybrid", "qwen3.5"])
def test_the_mtp_layer_matches_a_slow_reference_when_chained(name, next_configs, next_pair):
    model = with_mtp(next_pair(name)[1])
    mtp = model.mtp
    reference = reference_layer(name, model, next_configs)
    tokens = torch.randint(0, 97, (16,), generator=torch.Generator().manual_seed(8))
    _, hidden = model(tokens, model.new_cache(32))
    # ours: 10 committed rows (h_i, token i+1), then 4 chained steps on their own outputs
    cache = model.new_mtp_cache(32)
    logits, out = model.forward_mtp(hidden[:10], tokens[1:11], cache)
    rows_h, rows_t, ours = [hidden[:10]], [tokens[1:11]], [logits]
    for step in range(4):
        token = tokens[11 + step : 12 + step]
        rows_h.append(out[-1:])
        rows_t.append(token)
        logits, out = model.forward_mtp(out[-1:], token, cache)
        ours.append(logits)
    assert cache.length == 14
    # the reference over all 14 rows at once
    h, t = torch.cat(rows_h), torch.cat(rows_t)
    with torch.no_grad():
        x = F.linear(torch.cat([centred_rmsnorm(model.embed_tokens(t), mtp.pre_fc_norm_embedding.weight),
                                centred_rmsnorm(h, mtp.pre_fc_norm_hidden.weight)], dim=-1), mtp.fc.weight)
        out = reference(inputs_embeds=x.unsqueeze(0)).last_hidden_state[0]
        expected = F.linear(out, model.lm_head.weight)
    torch.testing.assert_close(torch.cat(ours), expected, rtol=1e-4, atol=1e-5)


def test_a_model_without_the_mtp_layer_says_so(next_pair):
    model = next_pair("hybrid")[1]
    with pytest.raises(ValueError, match="no MTP layer"):
        model.new_mtp_cache(8)
    with pytest.raises(ValueError, match="no MTP layer"):
        model.forward_mtp(torch.zeros(1, 32), torch.tensor([1]), None)

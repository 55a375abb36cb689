"""MTP layer (DESIGN §6) against a slow reference written here from the design text."""

import math

import pytest
import torch
import torch.nn.functional as F

from shared.model import load_model


def rms(x, weight, eps):
    return weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, positions, theta):  # x [T, heads, d]
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = positions[:, None].float() * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin


def reference_layer(layer, x, config):
    """One decoder layer over a whole sequence: causal attention + MoE, loops where clearer."""
    a, eps, n = layer.self_attn, config.rms_norm_eps, x.shape[0]
    h = rms(x, layer.input_layernorm.weight, eps)
    q = rms((h @ a.q_proj.weight.T).view(n, a.num_heads, a.head_dim), a.q_norm.weight, eps)
    k = rms((h @ a.k_proj.weight.T).view(n, a.num_kv_heads, a.head_dim), a.k_norm.weight, eps)
    v = (h @ a.v_proj.weight.T).view(n, a.num_kv_heads, a.head_dim)
    pos = torch.arange(n)
    q, k = rope(q, pos, config.rope_theta), rope(k, pos, config.rope_theta)
    group = a.num_heads // a.num_kv_heads
    out = torch.zeros(n, a.num_heads, a.head_dim)
    for head in range(a.num_heads):
        kh, vh = k[:, head // group], v[:, head // group]
        scores = q[:, head] @ kh.T / math.sqrt(a.head_dim)
        scores = scores.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
        out[:, head] = scores.softmax(-1) @ vh
    x = x + out.reshape(n, -1) @ a.o_proj.weight.T
    h = rms(x, layer.post_attention_layernorm.weight, eps)
    block = layer.mlp
    probs = (h @ block.gate.weight.T).softmax(-1)
    moe = torch.zeros_like(h)
    inter = config.moe_intermediate_size
    for t in range(n):
        top = probs[t].topk(config.num_experts_per_tok)
        weights = top.values / top.values.sum() if config.norm_topk_prob else top.values
        for e, w in zip(top.indices.tolist(), weights):
            gate_up, down = block.experts.expert_weights(e)
            g, u = h[t] @ gate_up[:inter].T, h[t] @ gate_up[inter:].T
            moe[t] += w * ((F.silu(g) * u) @ down.T)
    return x + moe


def reference_mtp(model, hidden, next_ids):
    """x = fc(cat([norm_e(embed(tok)), norm_h(h)])) -> layer -> mtp.norm -> lm_head."""
    mtp, c = model.mtp, model.config
    e = rms(model.embed_tokens.weight[next_ids], mtp.pre_fc_norm_embedding.weight, c.rms_norm_eps)
    hh = rms(hidden, mtp.pre_fc_norm_hidden.weight, c.rms_norm_eps)
    x = torch.cat([e, hh], -1) @ mtp.fc.weight.T  # embedding first
    x = reference_layer(mtp.layers[0], x, c)
    out = rms(x, mtp.norm.weight, c.rms_norm_eps)
    return out @ model.lm_head.weight.T, out


@pytest.fixture(scope="module")
def model(mtp_checkpoint):
    return load_model(mtp_checkpoint)


def test_checkpoint_has_mtp_tensors_with_qwen3_next_names(mtp_checkpoint):
    from safetensors import safe_open

    with safe_open(mtp_checkpoint / "model.safetensors", "pt") as f:
        names = set(f.keys())
    for name in ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                 "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.gate.weight",
                 "mtp.layers.0.mlp.experts.3.down_proj.weight"):
        assert name in names


def test_trunk_matches_the_reference_layers(model):
    ids = torch.randint(0, 97, (12,), generator=torch.Generator().manual_seed(0))
    logits, hidden = model.score(ids)
    x = model.embed_tokens.weight[ids]
    for layer in model.layers:
        x = reference_layer(layer, x, model.config)
    expected_hidden = rms(x, model.norm.weight, model.config.rms_norm_eps)
    assert (hidden - expected_hidden).abs().max() < 1e-4
    assert (logits - expected_hidden @ model.lm_head.weight.T).abs().max() < 1e-4


def test_score_mtp_matches_reference(model):
    ids = torch.randint(0, 97, (16,), generator=torch.Generator().manual_seed(1))
    _, hidden = model.score(ids)
    mtp_logits = model.score_mtp(hidden, ids)
    assert mtp_logits.shape == (15, 97)
    expected, _ = reference_mtp(model, hidden[:15], ids[1:])
    assert (mtp_logits - expected).abs().max() < 1e-4


def test_chained_drafting_feeds_its_own_hidden_state(model):
    ids = torch.randint(0, 97, (10,), generator=torch.Generator().manual_seed(2))
    _, hidden = model.score(ids)
    # Fill the MTP cache with the teacher-forced rows 0..7 (hidden[i], ids[i+1]).
    cache = model.new_mtp_cache(32)
    model.forward_mtp(hidden[:8], ids[1:9], cache)
    # Step 1: row 8 (hidden[8], ids[9]) drafts token 10; step 2 feeds the MTP output back.
    logits1, out1 = model.forward_mtp(hidden[8:9], ids[9:10], cache)
    d0 = logits1[-1].argmax().view(1)
    logits2, _ = model.forward_mtp(out1, d0, cache)
    ref_logits, ref_out = reference_mtp(model, hidden[:9], ids[1:10])
    assert (logits1[-1] - ref_logits[-1]).abs().max() < 1e-4
    chain_hidden = torch.cat([hidden[:9], ref_out[-1:]])
    chain_ids = torch.cat([ids[1:10], d0])
    ref2, _ = reference_mtp(model, chain_hidden, chain_ids)
    assert (logits2[-1] - ref2[-1]).abs().max() < 1e-4


def test_mtp_cache_rollback(model):
    ids = torch.randint(0, 97, (12,), generator=torch.Generator().manual_seed(3))
    _, hidden = model.score(ids)
    cache = model.new_mtp_cache(32)
    model.forward_mtp(hidden[:6], ids[1:7], cache)
    junk = torch.randn(3, model.config.hidden_size)
    model.forward_mtp(junk, torch.tensor([1, 2, 3]), cache)  # a rejected draft chain
    cache.truncate(6)
    logits, _ = model.forward_mtp(hidden[6:11], ids[7:12], cache)
    full = model.score_mtp(hidden, ids)
    assert (logits - full[6:11]).abs().max() < 1e-4


def test_score_mtp_without_mtp_layer_is_an_error(tmp_path):
    from .conftest import make_hf_checkpoint

    path, _ = make_hf_checkpoint(tmp_path)
    plain = load_model(path)
    logits, hidden = plain.score(torch.arange(5))
    with pytest.raises(ValueError, match="no MTP layer"):
        plain.score_mtp(hidden, torch.arange(5))

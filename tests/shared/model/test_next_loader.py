"""Loading Qwen3-Next and Qwen3.5-MoE checkpoints into the CPU reference trunk: what
transformers saves, and sharded checkpoints of both layouts (Qwen3.5's composite config and
language-model prefix, per-expert tensors, the MTP layer, a vision tensor skipped); what each
service loads (parts); bad checkpoints name the tensor."""

import pytest
import torch

from shared.model.families.hybrid.loader import load_next

from .next_checkpoints import with_mtp, write_checkpoint


def test_a_checkpoint_transformers_saved_loads_to_its_logits(tmp_path, next_pair):
    reference, _ = next_pair("hybrid")
    reference.save_pretrained(tmp_path)
    model = load_next(tmp_path)
    tokens = torch.randint(0, 97, (24,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = reference(tokens.unsqueeze(0)).logits[0]
    logits, _ = model(tokens, model.new_cache(32))
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_a_sharded_qwen3_5_checkpoint_loads_to_the_same_logits(tmp_path, next_pair):
    _, source = next_pair("qwen3.5")
    write_checkpoint(tmp_path, source)
    model = load_next(tmp_path)
    assert model.config.linear_projection == "split"
    tokens = torch.randint(0, 97, (24,), generator=torch.Generator().manual_seed(6))
    expected, _ = source(tokens, source.new_cache(32))
    logits, _ = model(tokens, model.new_cache(32))
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("case", ["missing", "mis-shaped"])
def test_a_checkpoint_that_does_not_fit_names_its_tensor(tmp_path, case, next_pair):
    _, source = next_pair("qwen3.5")
    name = "model.language_model.layers.2.self_attn.k_proj.weight"
    write_checkpoint(tmp_path, source, drop=name if case == "missing" else None,
                     reshape=name if case == "mis-shaped" else None)
    with pytest.raises(ValueError, match=rf"{case} tensors: .*layers.2.self_attn.k_proj.weight"):
        load_next(tmp_path)


@pytest.mark.parametrize("layout", ["qwen3_next", "qwen3_5"])
def test_the_mtp_layer_loads_and_each_service_loads_its_part(tmp_path, layout, next_pair):
    """parts: the verifier's trunk without the MTP layer; a lean drafter's embeddings, MTP
    layer and lm_head, never the trunk; both compute what the whole model computes."""
    name = "hybrid" if layout == "qwen3_next" else "qwen3.5"
    source = with_mtp(next_pair(name)[1])
    write_checkpoint(tmp_path, source, layout)
    whole, trunk, lean = (load_next(tmp_path, parts=parts) for parts in ("all", "trunk", "mtp"))
    assert whole.mtp is not None and trunk.mtp is None and len(lean.layers) == 0 and lean.norm is None
    assert not any(n.startswith(("layers.", "norm.")) for n, _ in lean.named_parameters())
    size = {m: sum(p.numel() for p in m.parameters()) for m in (whole, trunk, lean)}
    assert size[lean] + size[trunk] == size[whole] + source.embed_tokens.weight.numel() + \
        (0 if source.config.tie_word_embeddings else source.lm_head.weight.numel())  # shared by both
    tokens = torch.randint(0, 97, (12,), generator=torch.Generator().manual_seed(3))
    expected, hidden = source(tokens, source.new_cache(16))
    logits, _ = trunk(tokens, trunk.new_cache(16))
    assert torch.equal(logits, expected)
    want, _ = source.forward_mtp(hidden[:-1], tokens[1:], source.new_mtp_cache(16))
    got, _ = lean.forward_mtp(hidden[:-1], tokens[1:], lean.new_mtp_cache(16))
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="without its trunk"):
        lean.new_cache(8)


def test_a_lean_drafter_of_a_checkpoint_without_mtp_loads_no_layer(tmp_path, next_pair):
    """(It drafts by suffix lookup only: embeddings and lm_head, and nothing of the trunk.)"""
    write_checkpoint(tmp_path, next_pair("qwen3.5")[1])
    assert load_next(tmp_path).mtp is None
    lean = load_next(tmp_path, parts="mtp")
    assert lean.mtp is None and len(lean.layers) == 0
    with pytest.raises(ValueError, match="no MTP layer"):
        lean.new_mtp_cache(8)


@pytest.mark.parametrize("tied", [False, True])
def test_random_weights_made_fp8_a_module_at_a_time_are_the_whole_model_quantized(tied):
    """random_next(quantize="fp8") allocates and quantizes one module at a time (how an 80B-A3B
    model is built on one GPU) and gives the same model as quantizing it once made whole."""
    from shared.model.families.hybrid.config import NextConfig
    from shared.model.families.hybrid.loader import random_next
    from shared.model.quantize import is_fp8, quantize_model

    config = NextConfig.from_dict(dict(
        model_type="qwen3_next", vocab_size=97, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, intermediate_size=40, moe_intermediate_size=16,
        shared_expert_intermediate_size=12, num_experts=8, num_experts_per_tok=2, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        max_position_embeddings=128, layer_types=["linear_attention", "full_attention"] * 2, mlp_only_layers=[2], mtp_num_hidden_layers=1,
        tie_word_embeddings=tied))
    by_module = random_next(config, dtype=torch.float32, device="cpu", seed=3, quantize="fp8")
    whole = quantize_model(random_next(config, dtype=torch.float32, device="cpu", seed=3))
    assert is_fp8(by_module) and (by_module.lm_head.weight is by_module.embed_tokens.weight) == tied
    mine, theirs = dict(by_module.named_parameters()), dict(whole.named_parameters())
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[n].view(torch.uint8) if mine[n].dtype == torch.float8_e4m3fn else mine[n],
                           theirs[n].view(torch.uint8) if theirs[n].dtype == torch.float8_e4m3fn else theirs[n])
               for n in mine)
    tokens = torch.arange(12) % 97
    assert torch.equal(by_module(tokens, by_module.new_cache(16))[0], whole(tokens, whole.new_cache(16))[0])

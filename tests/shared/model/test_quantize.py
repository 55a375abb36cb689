"""shared.model.quantize: a model made block-scaled FP8 on load (issue 36) — which weights
convert, that the FP8 model computes exactly what its dequantised weights say on the
reference path, and that the fused forward (kernels reading FP8) agrees with it row for row.
On a CPU box the kernels run in Triton's interpreter."""

import pytest
import torch
from torch import nn

from kernels.fused.fp8 import quantize
from shared.model import ModelConfig, load_model
from shared.model.families.qwen3_moe.fused import FusedModel
from shared.model.loader import resident_bytes
from shared.model.quantize import KEPT, Fp8Linear, is_fp8, quantize_model, weight_of
from shared.model.rows import Rows

CONFIG = dict(
    model_type="qwen3_moe", vocab_size=97, hidden_size=48, intermediate_size=40, moe_intermediate_size=24,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
    num_experts_per_tok=2, max_position_embeddings=256, rope_theta=10000.0, norm_topk_prob=True,
    mtp_num_hidden_layers=1, mlp_only_layers=[1], initializer_range=0.2,
)
BLOCK = (16, 16)  # several blocks a matrix, and I = 24 is not whole blocks (per-row scales in gate_up)


def build(seed=5):
    model = load_model(config=ModelConfig.from_dict(CONFIG), random_weights=True, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn(param.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def full():
    return build()


@pytest.fixture(scope="module")
def fp8():
    return quantize_model(build(), BLOCK)


def twin_of(full_model):
    """The full-precision model with each weight replaced by what its FP8 form dequantises to."""
    twin = build()
    with torch.no_grad():
        for name, module in twin.named_modules():
            if type(module) is nn.Linear and not name.endswith(KEPT):
                module.weight.copy_(quantize(module.weight, BLOCK).dequantize())
        for module in twin.modules():
            store = getattr(module, "experts", None)
            if store is not None and hasattr(store, "gate_up"):
                store.gate_up.copy_(quantize(store.gate_up, BLOCK).dequantize())
                store.down.copy_(quantize(store.down, BLOCK).dequantize())
    return twin


def test_projections_and_experts_convert_routers_and_lm_head_stay(full, fp8):
    converted = {name for name, m in fp8.named_modules() if isinstance(m, Fp8Linear)}
    kept = {name for name, m in fp8.named_modules() if type(m) is nn.Linear}
    assert "layers.0.self_attn.q_proj" in converted and "layers.1.mlp.down_proj" in converted
    assert "mtp.fc" in converted
    assert kept == {"lm_head", "layers.0.mlp.gate", "layers.2.mlp.gate", "mtp.layers.0.mlp.gate"}
    assert is_fp8(fp8) and not is_fp8(full)
    assert fp8.layers[0].mlp.experts.fp8 and fp8.layers[0].mlp.experts.gate_up.q.dtype == torch.float8_e4m3fn
    # named as the published checkpoints name them
    names = dict(fp8.named_parameters())
    assert names["layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert names["layers.0.self_attn.q_proj.weight_scale_inv"].shape == (4, 3)  # [64 / 16, 48 / 16]
    # float32 weights become a byte each (plus a scale a block): the embedding and lm_head stay
    assert resident_bytes(fp8) < 0.5 * resident_bytes(full)


def test_the_fp8_model_computes_what_its_weights_say(full, fp8):
    ids = torch.randint(0, 97, (24,), generator=torch.Generator().manual_seed(1))
    logits, hidden = fp8(ids, fp8.new_cache(32))
    twin_logits, twin_hidden = twin_of(full)(ids, full.new_cache(32))
    assert torch.equal(logits, twin_logits) and torch.equal(hidden, twin_hidden)
    # and it is the full model within FP8's error (3 mantissa bits; a flipped route of this tiny
    # random model moves its logits more than trained ones move), far from another model
    full_logits, _ = full(ids, full.new_cache(32))
    other_logits, _ = build(seed=9)(ids, full.new_cache(32))
    error = float((logits - full_logits).norm() / full_logits.norm())
    assert error < 0.3 and error < 0.25 * float((other_logits - full_logits).norm() / full_logits.norm())


@pytest.mark.parametrize("window", [1, 4])
def test_fused_forward_reads_fp8_as_the_reference_does(fp8, window):
    fused = FusedModel(fp8, max_rows=8, max_length=64)
    assert isinstance(fused.layers[0].qkv, type(weight_of(fp8.layers[0].self_attn.q_proj)))
    ids = torch.randint(0, 97, (20 + window,), generator=torch.Generator().manual_seed(window))
    ref_logits, ref_hidden = fp8(ids, fp8.new_cache(40))
    cache = fp8.new_cache(40)
    fp8(ids[:20], cache)
    logits, hidden = fused.forward(ids[20:], Rows.window(20, window, 0, "cpu"), cache.paged())
    torch.testing.assert_close(logits, ref_logits[20:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hidden, ref_hidden[20:], rtol=1e-4, atol=1e-4)
    assert torch.equal(logits.argmax(-1), ref_logits[20:].argmax(-1))
    # fusing re-pointed q/k/v at the fused FP8 rows: the reference is unchanged by it
    again, _ = fp8(ids, fp8.new_cache(40))
    assert torch.equal(again, ref_logits)


def test_an_fp8_model_keeps_its_dtype_and_the_options_are_checked():
    model = quantize_model(build(seed=6), BLOCK)
    with pytest.raises(ValueError, match="do not change dtype"):
        model.to(torch.float64)
    with pytest.raises(ValueError, match="quantize 'int4' must be one of auto, none, fp8"):
        load_model(config=ModelConfig.from_dict(CONFIG), random_weights=True, quantize="int4")
    loaded = load_model(config=ModelConfig.from_dict(CONFIG), random_weights=True, quantize="fp8")
    assert is_fp8(loaded) and loaded.layers[0].self_attn.q_proj.block == (128, 128)


def test_a_fused_group_stays_fp8_only_where_it_is_fp8_throughout():
    """A checkpoint that leaves one projection of a fused group unconverted (a release's
    modules_to_not_convert) has that group dequantised: the kernels take one matrix per group."""
    from shared.model.quantize import whole_groups

    weights = {f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"} | {
        "layers.0.linear_attn.in_proj_qkvz.weight", "layers.0.linear_attn.in_proj_ba.weight",
        "layers.1.self_attn.q_proj.weight", "layers.1.self_attn.k_proj.weight", "layers.1.self_attn.v_proj.weight"}
    fp8 = weights - {"layers.0.linear_attn.in_proj_ba.weight", "layers.1.self_attn.v_proj.weight"}
    assert whole_groups(fp8, weights) == {f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"}


def test_fp8_experts_behind_slots_compute_the_resident_bits():
    """Experts in host memory with device slots, FP8: a copy moves an expert's FP8 values and
    scales (under half its float32 bytes here), and the model computes what it computes with
    every expert resident, on the reference path and the fused one."""
    config = ModelConfig.from_dict(CONFIG)
    resident = load_model(config=config, random_weights=True, seed=3, quantize="fp8")
    slotted = load_model(config=config, random_weights=True, seed=3, quantize="fp8", num_expert_slots=3)
    store = slotted.layers[0].mlp.experts
    assert store.fp8 and not store.all_resident and store.host_gate_up.q.dtype == torch.float8_e4m3fn
    assert store.expert_bytes < 0.3 * 4 * 3 * CONFIG["hidden_size"] * CONFIG["moe_intermediate_size"]
    assert resident_bytes(slotted) < resident_bytes(resident)
    ids = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(2))
    expected, _ = resident(ids, resident.new_cache(32))
    assert torch.equal(slotted(ids, slotted.new_cache(32))[0], expected)
    assert store.counters.misses > 0  # (the forward did copy experts in)
    cache = slotted.new_cache(40)
    slotted(ids[:16], cache)
    logits, _ = FusedModel(slotted, max_rows=8, max_length=64).forward(ids[16:], Rows.window(16, 4, 0, "cpu"),
                                                                       cache.paged())
    torch.testing.assert_close(logits, expected[16:], rtol=1e-4, atol=1e-4)

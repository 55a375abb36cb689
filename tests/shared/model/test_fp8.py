"""FP8 checkpoints in the published layout (shared/model/fp8.py): block scales applied as
transformers applies them, both families, sharded files with scales in another shard, odd
sizes, and an error that names what is wrong for any other scheme."""

import json

import pytest
import torch

from shared.model import load_model
from shared.model.families.hybrid.loader import load_next
from shared.model.fp8 import CheckpointTensors, Fp8Blocks, dequantize
from shared.model.loader import resident_bytes
from shared.model.quantize import Fp8Linear, is_fp8, weight_of

from .conftest import make_hf_checkpoint
from .fp8_checkpoints import quantize, quantize_checkpoint
from .next_checkpoints import with_mtp, write_checkpoint

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


@pytest.mark.parametrize("shape,block", [((37, 50), (16, 16)), ((32, 48), (16, 16)), ((8, 300), (128, 128)),
                                         ((5, 7), (2, 3))])
def test_dequantize_applies_each_block_s_scale(shape, block):
    g = torch.Generator().manual_seed(shape[0])
    q = (torch.randn(shape, generator=g) * 100).to(torch.float8_e4m3fn)
    scales = torch.rand(-(-shape[0] // block[0]), -(-shape[1] // block[1]), generator=g) + 0.01
    out = dequantize(q, scales, block)
    expected = torch.empty(shape)
    for i in range(shape[0]):
        for j in range(shape[1]):
            expected[i, j] = q[i, j].float() * scales[i // block[0], j // block[1]]
    assert out.dtype == torch.float32 and torch.equal(out, expected)
    with pytest.raises(ValueError, match=r"w_scale_inv .* does not fit w"):
        dequantize(q, scales[:-1], block, "w")


def test_quantize_then_dequantize_is_within_fp8_rounding():
    w = torch.randn(40, 72, generator=torch.Generator().manual_seed(1))
    q, scale_inv = quantize(w, (16, 16))
    back = dequantize(q, scale_inv, (16, 16))
    scale = dequantize(torch.ones_like(w).to(torch.float8_e4m3fn), scale_inv, (16, 16))  # each element's block scale
    # e4m3: half an ulp of 3 mantissa bits, or half the smallest subnormal (2**-9) for the small ones
    assert ((back - w).abs() <= w.abs() * 2**-4 + scale * 2**-10).all()


def test_the_published_config_is_read_and_other_schemes_are_named():
    assert Fp8Blocks.from_config({"model_type": "qwen3_moe"}) is None
    assert Fp8Blocks.from_config({"quantization_config": FP8}) == Fp8Blocks((128, 128))
    assert Fp8Blocks.from_config({"quantization_config": {k: v for k, v in FP8.items() if k != "fmt"}}).block == (128, 128)
    for change, field in ((dict(quant_method="awq"), "quant_method 'awq'"), (dict(fmt="e5m2"), "fmt 'e5m2'"),
                          (dict(activation_scheme="static"), "activation_scheme 'static'"),
                          (dict(weight_block_size=None), "weight_block_size None"),
                          (dict(weight_block_size=[128]), r"weight_block_size \[128\]"),
                          (dict(weight_block_size=[128, 0]), r"weight_block_size \[128, 0\]")):
        with pytest.raises(ValueError, match=rf"quantization_config.{field} .*tandem loads quant_method 'fp8'"):
            Fp8Blocks.from_config({"quantization_config": FP8 | change})
    with pytest.raises(ValueError, match="quantization_config must be an object"):
        Fp8Blocks.from_config({"quantization_config": "fp8"})


@pytest.mark.parametrize("sizes", [dict(hidden_size=48, moe_intermediate_size=32), dict(hidden_size=40, moe_intermediate_size=24)],
                         ids=["blocks-divide", "odd-sizes"])
def test_a_qwen3_moe_fp8_checkpoint_loads_as_transformers_loads_it(tmp_path, sizes):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    path, original = make_hf_checkpoint(tmp_path / "fp8", seed=4, **sizes)
    quantized = quantize_checkpoint(path, (16, 16), dequantized_twin=tmp_path / "twin")
    assert any(".experts." in name for name in quantized) and any("self_attn" in name for name in quantized)
    ours, twin = load_model(path, quantize="fp8"), load_model(tmp_path / "twin")
    tokens = torch.randint(0, 97, (30,), generator=torch.Generator().manual_seed(3))
    logits, _ = ours.score(tokens)
    assert torch.equal(logits, twin.score(tokens)[0])  # the dequantized weights, bit for bit (kept FP8, dequantised per op)
    # --quantize auto (the default) on the CPU, and none: dequantised on load, the same bits
    for setting in ("auto", "none"):
        dequantised = load_model(path, quantize=setting)
        assert not is_fp8(dequantised) and torch.equal(dequantised.score(tokens)[0], logits)
    # FP8's rounding, no more: a projection's weights within half an e4m3 ulp (or subnormal step) of the original's
    w = original.model.layers[1].self_attn.o_proj.weight.float()
    # kept FP8 (shared.model.quantize): the projections and the experts, the routers as stored
    assert isinstance(ours.layers[1].self_attn.o_proj, Fp8Linear) and ours.layers[1].mlp.experts.fp8
    assert type(ours.layers[1].mlp.gate) is torch.nn.Linear
    assert resident_bytes(ours) < 0.5 * resident_bytes(twin)
    ours_w = weight_of(ours.layers[1].self_attn.o_proj).dequantize()
    assert not torch.equal(ours_w, w) and ((ours_w - w).abs() <= w.abs() * 2**-4 + w.abs().max() * 2**-9 / 448).all()
    assert torch.equal(ours.embed_tokens.weight, original.model.embed_tokens.weight)  # left as it was
    # experts in host memory behind slots: FP8 there too (a copy moves FP8 values and scales)
    slotted = load_model(path, num_expert_slots=3, quantize="fp8")
    slotted_twin = load_model(tmp_path / "twin", num_expert_slots=3)
    assert isinstance(slotted.layers[1].self_attn.o_proj, Fp8Linear) and slotted.layers[1].mlp.experts.fp8
    assert not slotted.layers[1].mlp.experts.all_resident
    assert torch.equal(slotted.score(tokens)[0], slotted_twin.score(tokens)[0])
    if sizes["moe_intermediate_size"] % 16:
        return  # (transformers fuses the experts' FP8 tensors before applying their scales: blocks must divide them)
    reference = AutoModelForCausalLM.from_pretrained(path, quantization_config=FineGrainedFP8Config(dequantize=True),
                                                     dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(tokens[None]).logits[0]
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)  # transformers' own FP8 loading


@pytest.mark.parametrize("block", [(16, 16), (8, 24)])
def test_a_sharded_hybrid_fp8_checkpoint_with_scales_in_the_other_shard_loads_every_part(tmp_path, block, next_pair):
    source = with_mtp(next_pair("qwen3.5")[1])
    path = write_checkpoint(tmp_path / "fp8", source)
    quantized = quantize_checkpoint(path, block, scales_elsewhere=True, dequantized_twin=tmp_path / "twin")
    assert any("linear_attn" in name for name in quantized) and any(name.startswith("mtp.") for name in quantized)
    tokens = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(4))
    for parts in ("all", "trunk"):
        ours, twin = load_next(path, parts=parts), load_next(tmp_path / "twin", parts=parts)
        assert is_fp8(ours) and ours.layers[0].mlp.experts.block is not None  # kept FP8, experts too
        logits, _ = ours(tokens, ours.new_cache(32))
        assert torch.equal(logits, twin(tokens, twin.new_cache(32))[0])
        assert (logits - source(tokens, source.new_cache(32))[0]).abs().max() > 0  # (FP8 changed the weights)
    slotted, slotted_twin = load_next(path, num_expert_slots=3), load_next(tmp_path / "twin", num_expert_slots=3)
    assert slotted.layers[0].mlp.store.fp8 and not slotted.layers[0].mlp.store.all_resident
    assert torch.equal(slotted(tokens, slotted.new_cache(32))[0], slotted_twin(tokens, slotted_twin.new_cache(32))[0])
    lean, lean_twin = load_next(path, parts="mtp"), load_next(tmp_path / "twin", parts="mtp")
    weights, twin_weights = effective_weights(lean), effective_weights(lean_twin)
    assert weights.keys() == twin_weights.keys() and all(torch.equal(weights[n], twin_weights[n]) for n in weights)


def test_a_fused_group_a_release_left_partly_unconverted_loads_dequantised(tmp_path):
    """Qwen3-Next's in_proj_ba left in bf16 (as a release's modules_to_not_convert may): its group
    (in_proj_qkvz, fused with it into one matrix) loads dequantised, the rest stays FP8, and the
    fused forward runs the mix (CPU: torch references)."""
    from shared.model.families import build_fused
    from shared.model.kv_cache import KVPool
    from shared.model.rows import Rows

    from shared.model.families.hybrid.config import NextConfig
    from shared.model.families.hybrid.loader import random_next

    config = NextConfig.from_dict(dict(  # a Qwen3-Next (grouped in-projections) the fused path runs
        model_type="qwen3_next", vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, intermediate_size=40, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_experts=8, num_experts_per_tok=2, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        max_position_embeddings=128, layer_types=["linear_attention", "full_attention"]))
    source = random_next(config, dtype=torch.float32, device="cpu", seed=6, std=0.2)
    path = write_checkpoint(tmp_path / "fp8", source, layout="qwen3_next")
    quantized = quantize_checkpoint(path, (16, 16), dequantized_twin=tmp_path / "twin", not_converted=("in_proj_ba",))
    assert any("in_proj_qkvz" in name for name in quantized) and not any("in_proj_ba" in name for name in quantized)
    ours, twin = load_next(path), load_next(tmp_path / "twin")
    linear_attn = ours.layers[0].linear_attn
    assert type(linear_attn.in_proj_qkvz) is torch.nn.Linear and type(linear_attn.in_proj_ba) is torch.nn.Linear
    assert isinstance(linear_attn.out_proj, Fp8Linear)
    tokens = torch.randint(0, 97, (12,), generator=torch.Generator().manual_seed(5))
    logits, _ = ours(tokens, ours.new_cache(32))
    assert torch.equal(logits, twin(tokens, twin.new_cache(32))[0])
    fused = build_fused(ours, max_rows=8, max_length=64, num_state_slots=2)
    c = ours.config
    pool = KVPool(num_layers=ours.num_kv_layers, num_slots=2, max_length=64, num_kv_heads=c.num_key_value_heads,
                  head_dim=c.head_dim, dtype=ours.dtype, device="cpu", block_size=8)
    slot, length = pool.acquire(64)
    fused.states.reset(slot)
    length.reserve(12)
    fused.prefill(tokens[:8], [(0, 8, slot)], pool.paged())
    read, write = fused.states.buffers(slot)
    rows = Rows.window(8, 4, slot, "cpu")
    rows = Rows(**{**rows.__dict__, "state_in": torch.tensor([read]), "state_out": torch.tensor([write])})
    window, _ = fused.forward(tokens[8:], rows, pool.paged())
    torch.testing.assert_close(window, logits[8:], rtol=1e-4, atol=1e-4)


def effective_weights(model) -> dict:
    """Every weight of the model as the forward uses it: FP8 ones dequantised (float32)."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, Fp8Linear):
            out[f"{name}.weight"] = module.fp8().dequantize()
        elif getattr(module, "block", None) is not None and hasattr(module, "gate_up_proj"):  # FP8 experts
            gate_up, down = module.store.gate_up, module.store.down
            out[f"{name}.gate_up_proj"], out[f"{name}.down_proj"] = gate_up.dequantize(), down.dequantize()
    for name, param in model.named_parameters():
        if param.dtype != torch.float8_e4m3fn and not name.endswith("_scale_inv"):
            out.setdefault(name, param)
    return out


def test_fp8_tensors_without_their_scale_or_their_config_are_named(tmp_path):
    path, _ = make_hf_checkpoint(tmp_path / "a", seed=5)
    quantize_checkpoint(path, (16, 16))
    name = "model.layers.1.self_attn.o_proj.weight"
    with torch.no_grad():
        from safetensors.torch import load_file, save_file

        tensors = load_file(path / "model.safetensors")
        del tensors[name + "_scale_inv"]
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{name} is FP8 but the checkpoint has no {name}_scale_inv"):
        load_model(path)
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="is stored in torch.float8_e4m3fn but config.json has no quantization_config"):
        load_model(path)
    config["quantization_config"] = FP8 | {"quant_method": "gptq"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method 'gptq' is not supported"):
        load_model(path)


def test_scales_are_not_tensors_of_the_model(tmp_path):
    files = {"a.weight": tmp_path / "x", "a.weight_scale_inv": tmp_path / "x", "stray_scale_inv": tmp_path / "x"}
    assert CheckpointTensors(files, Fp8Blocks((2, 2))).names() == {"a.weight": tmp_path / "x",
                                                                 "stray_scale_inv": tmp_path / "x"}

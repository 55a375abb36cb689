"""Loading Qwen3-Next and Qwen3.5-MoE checkpoints into the CPU reference trunk: what
transformers saves, and a sharded Qwen3.5-style checkpoint (composite config, language-model
prefix, per-expert tensors, vision and MTP tensors skipped); bad checkpoints name the tensor."""

import json

import pytest
import torch
from safetensors.torch import save_file

from shared.model.next_loader import load_next

from .test_qwen3_next import CONFIGS, pair


def test_a_checkpoint_transformers_saved_loads_to_its_logits(tmp_path):
    reference, _ = pair("hybrid")
    reference.save_pretrained(tmp_path)
    model = load_next(tmp_path)
    tokens = torch.randint(0, 97, (24,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = reference(tokens.unsqueeze(0)).logits[0]
    logits, _ = model(tokens, model.new_cache(32))
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def qwen3_5_checkpoint(path, model, drop=None, reshape=None):
    """`model`'s weights as a sharded Qwen3.5-MoE checkpoint: composite config, tensors under
    model.language_model., experts one by one, plus tensors a text server skips."""
    tensors = {}
    for name, value in model.state_dict().items():
        if name == "lm_head.weight":
            tensors[name] = value
        elif name.endswith("mlp.experts.gate_up_proj"):
            prefix, inter = name.removesuffix("gate_up_proj"), value.shape[1] // 2
            for e in range(value.shape[0]):
                tensors[f"model.language_model.{prefix}{e}.gate_proj.weight"] = value[e, :inter]
                tensors[f"model.language_model.{prefix}{e}.up_proj.weight"] = value[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e in range(value.shape[0]):
                tensors[f"model.language_model.{prefix}{e}.down_proj.weight"] = value[e]
        elif not name.startswith("rotary"):
            tensors[f"model.language_model.{name}"] = value
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 4)
    tensors["mtp.fc.weight"] = torch.zeros(4, 8)
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = torch.zeros(3, 3)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k].contiguous().clone() for k in keys}, str(path / file))
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: file for file, keys in shards.items() for k in keys}}))
    text = dict(CONFIGS["qwen3.5"], model_type="qwen3_5_moe_text")
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "text_config": text}))


def test_a_sharded_qwen3_5_checkpoint_loads_to_the_same_logits(tmp_path):
    _, source = pair("qwen3.5")
    qwen3_5_checkpoint(tmp_path, source)
    model = load_next(tmp_path)
    assert model.config.linear_projection == "split"
    tokens = torch.randint(0, 97, (24,), generator=torch.Generator().manual_seed(6))
    expected, _ = source(tokens, source.new_cache(32))
    logits, _ = model(tokens, model.new_cache(32))
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("case", ["missing", "mis-shaped"])
def test_a_checkpoint_that_does_not_fit_names_its_tensor(tmp_path, case):
    _, source = pair("qwen3.5")
    name = "model.language_model.layers.2.self_attn.k_proj.weight"
    qwen3_5_checkpoint(tmp_path, source, drop=name if case == "missing" else None,
                       reshape=name if case == "mis-shaped" else None)
    with pytest.raises(ValueError, match=rf"{case} tensors: .*layers.2.self_attn.k_proj.weight"):
        load_next(tmp_path)

"""Loader: formats, dtype, errors naming the bad tensor or key, random weights."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.model import ModelConfig, load_model

from .conftest import TINY, make_hf_checkpoint


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    path, hf = make_hf_checkpoint(tmp_path_factory.mktemp("hf"))
    return path, hf


def rewrite(src, dst, edit_tensors=None, edit_config=None):
    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(src / "model.safetensors")
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    if edit_config:
        edit_config(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_missing_tensor_is_named(hf_checkpoint, tmp_path):
    path = rewrite(hf_checkpoint[0], tmp_path / "m", lambda t: t.pop("model.layers.1.mlp.experts.5.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight"):
        load_model(path)


def test_wrong_shape_is_named(hf_checkpoint, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)

    path = rewrite(hf_checkpoint[0], tmp_path / "s", edit)
    with pytest.raises(ValueError, match=r"mis-shaped tensors: model\.layers\.0\.self_attn\.q_proj\.weight \(3, 3\)"):
        load_model(path)


def test_unexpected_tensor_is_named(hf_checkpoint, tmp_path):
    def edit(t):
        t["model.layers.0.surprise.weight"] = torch.zeros(2)

    path = rewrite(hf_checkpoint[0], tmp_path / "u", edit)
    with pytest.raises(ValueError, match=r"unexpected tensors: model\.layers\.0\.surprise\.weight"):
        load_model(path)


def test_unknown_model_type(hf_checkpoint, tmp_path):
    path = rewrite(hf_checkpoint[0], tmp_path / "t", edit_config=lambda c: c.update(model_type="llama"))
    with pytest.raises(ValueError, match="model_type 'llama' is not supported"):
        load_model(path)


def test_missing_config_keys_are_named():
    with pytest.raises(ValueError, match=r"missing required keys: hidden_size, num_experts \(or num_local_experts\)"):
        ModelConfig.from_dict({"model_type": "qwen3_moe", "vocab_size": 5, "num_hidden_layers": 1, "num_attention_heads": 1,
                               "moe_intermediate_size": 4, "num_experts_per_tok": 1, "rope_theta": 1e4})


def test_both_key_spellings():
    base = {"model_type": "qwen3_moe"} | {k: v for k, v in TINY.items() if k != "num_experts"}
    a = ModelConfig.from_dict(base | {"num_experts": 8, "rope_theta": 5e5})
    b = ModelConfig.from_dict(base | {"num_local_experts": 8, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}})
    assert a == b
    assert a.num_experts == 8 and a.rope_theta == 5e5
    assert ModelConfig.from_dict(a.to_dict()) == a


def test_sharded_index(hf_checkpoint, tmp_path):
    src, hf = hf_checkpoint
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    target = tmp_path / "sharded"
    target.mkdir()
    weight_map = {}
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, target / file)
        weight_map |= {n: file for n in shard_names}
    (target / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (target / "config.json").write_text((src / "config.json").read_text())
    ids = torch.arange(20) % 97
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    assert (load_model(target).score(ids)[0] - expected).abs().max() < 1e-4


def test_index_naming_a_missing_shard(tmp_path, hf_checkpoint):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": "gone.safetensors"}}))
    (tmp_path / "config.json").write_text((hf_checkpoint[0] / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="gone.safetensors"):
        load_model(tmp_path)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_dtypes(hf_checkpoint, dtype):
    path, hf = hf_checkpoint
    model = load_model(path, dtype=dtype)
    assert model.embed_tokens.weight.dtype == dtype
    ids = torch.arange(16)
    logits, _ = model.score(ids)
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    assert logits.dtype == torch.float32
    assert (logits - expected).abs().max() < 0.25  # rounding of 16-bit weights, not a wiring error


def test_random_weights_from_config_alone():
    config = ModelConfig.from_dict({"model_type": "qwen3_moe", "rope_theta": 1e4} | TINY)
    a = load_model(config=config, random_weights=True, seed=3)
    b = load_model(config=config, random_weights=True, seed=3)
    ids = torch.arange(8)
    assert torch.equal(a.score(ids)[0], b.score(ids)[0])  # reproducible from the seed
    assert a.norm.weight.eq(1).all()


def test_progress_bar_is_shown_when_asked(hf_checkpoint, capsys):
    load_model(hf_checkpoint[0], progress=True)
    assert "loading" in capsys.readouterr().err


def test_each_service_loads_its_part_of_the_embedded_model():
    """parts: the verifier's trunk without the MTP layer; a lean drafter's embeddings, MTP layer
    and lm_head (never the trunk); each computes what the whole model computes."""
    whole, trunk, lean = (load_model(parts=parts) for parts in ("all", "trunk", "mtp"))
    assert whole.mtp is not None and trunk.mtp is None
    assert len(lean.layers) == 0 and lean.norm is None and lean.mtp is not None
    assert not any(name.startswith(("layers.", "norm.")) for name, _ in lean.named_parameters())
    tokens = torch.randint(0, whole.config.vocab_size, (10,), generator=torch.Generator().manual_seed(1))
    expected, hidden = whole(tokens, whole.new_cache(16))
    assert torch.equal(trunk(tokens, trunk.new_cache(16))[0], expected)
    want, _ = whole.forward_mtp(hidden[:-1], tokens[1:], whole.new_mtp_cache(16))
    got, _ = lean.forward_mtp(hidden[:-1], tokens[1:], lean.new_mtp_cache(16))
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="without its trunk"):
        lean.new_cache(8)
    with pytest.raises(ValueError, match="parts 'lean' must be one of"):
        load_model(parts="lean")


def test_the_family_follows_the_config(tmp_path, next_pair):
    from shared.model.families.hybrid.loader import expert_modules
    from shared.model.families.hybrid.modules import Qwen3NextModel

    from .next_checkpoints import write_checkpoint

    write_checkpoint(tmp_path, next_pair("qwen3.5")[1], "qwen3_5")
    model = load_model(tmp_path)
    assert isinstance(model, Qwen3NextModel) and model.config.linear_projection == "split"
    random = load_model(tmp_path, random_weights=True, parts="trunk")
    assert isinstance(random, Qwen3NextModel) and random.mtp is None and len(random.layers) == 4
    offloaded = load_model(tmp_path, num_expert_slots=2)  # (read into host memory, 2 device slots a block)
    stores = [experts.store for experts in expert_modules(offloaded)]
    assert stores and all(store.num_slots == 2 and not store.all_resident for store in stores)
    tokens = torch.arange(10) % 97
    assert torch.equal(offloaded(tokens, offloaded.new_cache(16))[0], model(tokens, model.new_cache(16))[0])

"""Tiny Qwen3-Next / Qwen3.5-MoE checkpoints in Hugging Face layout for tests: sharded
safetensors with per-expert tensors, the MTP layer under `mtp.*` (which transformers' classes
drop, so it is written here), and for Qwen3.5 the composite config with the language model's
tensors under `model.language_model.` plus a vision tensor a text server skips."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from shared.model.families.hybrid.loader import random_next
from shared.model.families.hybrid.config import NextConfig
from shared.model.families.hybrid.modules import Qwen3NextModel

LAYOUTS = ("qwen3_next", "qwen3_5")


def with_mtp(model: Qwen3NextModel, seed: int = 7) -> Qwen3NextModel:
    """`model` with an MTP layer of random weights (the trunk's weights kept)."""
    out = Qwen3NextModel(replace(model.config, mtp_num_hidden_layers=1))
    out.load_state_dict(model.state_dict(), strict=False)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in out.mtp.named_parameters():
            std = 0.2 if "norm" in name else 0.02
            param.copy_(torch.randn(param.shape, generator=generator) * std)
    return out.eval()


def write_checkpoint(path: Path, model: Qwen3NextModel, layout: str = "qwen3_5", *, drop: str | None = None,
                     reshape: str | None = None) -> Path:
    """Write `model` as a two-shard checkpoint in `layout`; drop / reshape: spoil one tensor
    (by its checkpoint name) to test the loader's errors."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} must be one of {LAYOUTS}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    trunk_prefix = "model.language_model." if layout == "qwen3_5" else "model."
    tensors = {}
    for name, value in model.state_dict().items():
        if name.startswith("rotary"):
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        prefix = "" if name.startswith(("mtp.", "lm_head.")) else trunk_prefix
        if name.endswith("mlp.experts.gate_up_proj"):
            experts, inter = name.removesuffix("gate_up_proj"), value.shape[1] // 2
            for e in range(value.shape[0]):
                tensors[f"{prefix}{experts}{e}.gate_proj.weight"] = value[e, :inter]
                tensors[f"{prefix}{experts}{e}.up_proj.weight"] = value[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            experts = name.removesuffix("down_proj")
            for e in range(value.shape[0]):
                tensors[f"{prefix}{experts}{e}.down_proj.weight"] = value[e]
        else:
            tensors[prefix + name] = value
    if layout == "qwen3_5":
        tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 4)
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
    config = {k: v for k, v in asdict(model.config).items() if k not in ("linear_projection", "eos_token_ids")}
    config["layer_types"], config["mlp_only_layers"] = list(config["layer_types"]), list(config["mlp_only_layers"])
    config["eos_token_id"] = 0
    if layout == "qwen3_5":
        config = {"model_type": "qwen3_5_moe", "text_config": dict(config, model_type="qwen3_5_moe_text")}
    else:
        config["model_type"] = "qwen3_next"
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


# Shapes the fused path runs (head_dim a power of two, the shared expert no wider than a routed
# one), with an MTP layer: the family on the fast path through the services.
FUSED_CONFIG = dict(
    vocab_size=97, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    intermediate_size=40, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=8,
    num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=128,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    partial_rotary_factor=0.25, rms_norm_eps=1e-6, model_type="qwen3_5_moe_text", mtp_num_hidden_layers=1)


def write_fused_checkpoint(path: Path, seed: int = 3, layer_types: list[str] | None = None) -> Path:
    """A random Qwen3.5-layout checkpoint of FUSED_CONFIG (non-trivial norms) with its MTP layer;
    layer_types: fewer layers (the interpreter's time grows with them)."""
    config = FUSED_CONFIG if layer_types is None else FUSED_CONFIG | dict(
        num_hidden_layers=len(layer_types), layer_types=layer_types)
    model = random_next(NextConfig.from_dict(config), dtype=torch.float32, device="cpu", seed=seed, std=0.3)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn(param.shape, generator=generator))
    return write_checkpoint(path, model, "qwen3_5")

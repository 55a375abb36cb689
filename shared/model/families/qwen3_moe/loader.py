"""Load a `qwen3_moe` checkpoint (config.json + safetensors) or build one from random weights.

Routed experts go to an ExpertStore per MoE layer (all resident by default, or
`num_expert_slots` device slots with LRU replacement); the rest as shared.model.loader says.
An FP8 checkpoint's weights stay FP8 where --quantize says so (shared.model.quantize): its
projections and its experts (in host memory too, behind slots).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor
from tqdm import tqdm

from shared.model.experts import ExpertStore, copy_streams
from shared.model.families.qwen3_moe.config import ModelConfig
from shared.model.moe import MoeBlock
from shared.model.families.qwen3_moe.model import Qwen3MoeModel
from shared.model.parallel.shard import Shard, shard_trunk
from kernels.fused.fp8 import FP8_DTYPE, cat_rows, stack
from shared.model.fp8 import SCALE_SUFFIX, CheckpointTensors, Fp8Blocks
from shared.model.quantize import keep_fp8, keeps_fp8, quantize_model, whole_groups
from shared.model.loader import list_files, problem
from shared.model.registry import resolve_model

EXPERT_NAME = re.compile(r"^(model\.layers\.\d+|mtp\.layers\.0)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
SINGLE_FILE = "model.safetensors"
# checkpoint tensors a service's parts leave out (qwen3_moe names)
SKIPPED_BY_PARTS = {"all": (), "trunk": ("mtp.",), "mtp": ("model.layers.", "model.norm.")}


def checkpoint_name(param_name: str) -> str:
    """Our parameter name → the Hugging Face tensor name."""
    if param_name.startswith(("lm_head.", "mtp.")):
        return param_name
    return "model." + param_name


def _moe_blocks(model: Qwen3MoeModel) -> dict[str, MoeBlock]:
    """Checkpoint prefix (e.g. 'model.layers.3', 'mtp.layers.0') → MoE block."""
    blocks = {}
    for index, layer in enumerate(model.layers):
        if isinstance(layer.mlp, MoeBlock):
            blocks[f"model.layers.{index}"] = layer.mlp
    if model.mtp is not None:
        blocks["mtp.layers.0"] = model.mtp.layers[0].mlp
    return blocks

def _build(config: ModelConfig, dtype: torch.dtype, device: torch.device, trunk: bool = True,
           prepare=None) -> Qwen3MoeModel:
    """The model's parameters allocated on the device in `dtype`, uninitialised; prepare(model):
    changes made on the meta device first (FP8 parameters in place of others)."""
    with torch.device("meta"):
        model = Qwen3MoeModel(config, trunk=trunk).to(dtype)
    if prepare is not None:
        prepare(model)
    model = model.to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty gives each module its own storage: tie again
        model.lm_head.weight = model.embed_tokens.weight
    # to_empty leaves the rotary tables uninitialised; rebuild them on the device.
    model.rotary = type(model.rotary)(config.head_dim, config.rope_theta, config.max_position_embeddings).to(device)
    return model.eval().requires_grad_(False)


def load_qwen3_moe(path: Path | None, *, device: torch.device, dtype: torch.dtype, num_expert_slots: int | None,
                   random_weights: bool, config: ModelConfig | None, seed: int, progress: bool,
                   parts: str, quantize: str = "auto", shard: Shard | None = None) -> Qwen3MoeModel:
    """shared.model.loader.load_model for this family (path resolved unless config is given);
    quantize: shared.model.quantize.QUANTIZE; shard: one rank's share of the model (only its
    experts are read; shared.model.parallel.shard)."""
    if shard is not None and parts != "trunk":
        raise ValueError("a model split over ranks is a verifier's trunk (parts='trunk')")
    model = _load(path, device=device, dtype=dtype, num_expert_slots=num_expert_slots, random_weights=random_weights,
                  config=config, seed=seed, progress=progress, parts=parts, keep=keeps_fp8(quantize, device),
                  shard=shard)
    if shard is not None:
        shard_trunk(model, shard)  # (before quantizing: the rank's share is what gets block scales)
    return quantize_model(model) if quantize == "fp8" else model


def _load(path: Path | None, *, device: torch.device, dtype: torch.dtype, num_expert_slots: int | None,
          random_weights: bool, config: ModelConfig | None, seed: int, progress: bool, parts: str,
          keep: bool, shard: Shard | None = None) -> Qwen3MoeModel:
    """keep: a checkpoint's FP8 weights stay FP8 (else dequantised to dtype); shard: read only
    the rank's experts."""
    if random_weights:
        if config is None:
            config = ModelConfig.from_file(path)
        if parts == "trunk" and config.has_mtp:
            config = ModelConfig.from_dict({**config.to_dict(), "mtp_num_hidden_layers": 0})
        return _random_model(config, dtype=dtype, device=device, num_expert_slots=num_expert_slots, seed=seed,
                             trunk=parts != "mtp", shard=shard)
    path = resolve_model(path)
    config = ModelConfig.from_file(path)
    fp8 = Fp8Blocks.of_checkpoint(path)
    tensors = CheckpointTensors(list_files(path), fp8)  # (FP8: shared/model/fp8.py)
    files = tensors.names()
    has_mtp = config.has_mtp or any(name.startswith("mtp.") for name in files)
    if has_mtp != config.has_mtp or parts == "trunk":  # MTP tensors present / not wanted
        config = ModelConfig.from_dict({**config.to_dict(), "mtp_num_hidden_layers": int(has_mtp and parts != "trunk")})
    skipped = SKIPPED_BY_PARTS[parts]
    files = {name: file for name, file in files.items() if not name.startswith(skipped)}
    # FP8 weights stay FP8 (shared.model.quantize): projections whose fused group is FP8 throughout,
    # and the routed experts where every one is stored FP8 (behind slots too: a copy moves FP8
    # values and scales)
    stored = tensors.stored_fp8(files) if fp8 is not None and keep else set()

    def prepare(meta_model: Qwen3MoeModel) -> None:  # (on the meta device, before anything is allocated)
        weights = {n for n, _ in meta_model.named_parameters()}
        keep_fp8(meta_model, whole_groups({n for n in weights if checkpoint_name(n) in stored}, weights), fp8.block)

    model = _build(config, dtype, device, trunk=parts != "mtp", prepare=prepare if stored else None)
    fp8_experts = any(EXPERT_NAME.match(n) for n in stored) and all(n in stored for n in files if EXPERT_NAME.match(n))
    params = dict(model.named_parameters())
    expected = {checkpoint_name(name): param for name, param in params.items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    blocks = _moe_blocks(model)
    owned = _owned(config, shard)
    experts: dict[str, dict[str, list[Tensor | None]]] = {
        prefix: {kind: [None] * len(owned) for kind in ("gate", "up", "down")} for prefix in blocks
    }
    h, inter = config.hidden_size, config.moe_intermediate_size
    expert_shape = {"gate": (inter, h), "up": (inter, h), "down": (h, inter)}

    unexpected, misshaped = [], []
    seen: set[str] = set()
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    bar = tqdm(total=len(files), desc=f"loading {path.name}", unit="tensor", disable=not progress, file=sys.stderr)
    for file, names in by_file.items():
        with safe_open(file, framework="pt", device="cpu") as handle:
            for name in names:
                bar.update(1)
                match = EXPERT_NAME.match(name)
                if match and match.group(1) in experts and int(match.group(2)) < config.num_experts:
                    prefix, expert, kind = match.group(1), int(match.group(2)), match.group(3)
                    if expert not in owned:  # another rank's
                        seen.add(name)
                        continue
                    tensor = tensors.get_fp8(handle, file, name) if fp8_experts else tensors.get(handle, file, name)
                    if tuple(tensor.shape) != expert_shape[kind]:
                        misshaped.append(f"{name} {tuple(tensor.shape)} (expected {expert_shape[kind]})")
                        continue
                    experts[prefix][kind][expert - owned.start] = tensor if fp8_experts else tensor.to(dtype)
                    seen.add(name)
                    continue
                if name not in expected:
                    unexpected.append(name)
                    continue
                param = expected[name]
                shape = tuple(handle.get_slice(name).get_shape())
                if shape != tuple(param.shape):
                    misshaped.append(f"{name} {shape} (expected {tuple(param.shape)})")
                    continue
                if param.dtype == FP8_DTYPE:  # an FP8 projection kept FP8: its values and block scales
                    problem_ = tensors.copy_fp8(handle, file, name, param, expected[name + SCALE_SUFFIX])
                    if problem_:
                        misshaped.append(problem_)
                        continue
                    seen.add(name + SCALE_SUFFIX)
                else:
                    param.copy_(tensors.get(handle, file, name).to(dtype))
                seen.add(name)
    bar.close()
    missing = sorted(set(expected) - seen)
    for prefix, kinds in experts.items():
        for kind, tensors in kinds.items():
            missing += [f"{prefix}.mlp.experts.{e}.{kind}_proj.weight" for e, t in zip(owned, tensors) if t is None]
    problems = [
        problem(kind, names)
        for kind, names in (("missing", missing), ("unexpected", sorted(unexpected)), ("mis-shaped", misshaped))
        if names
    ]
    if problems:
        raise ValueError(f"checkpoint {path} does not match its config: " + "; ".join(problems))
    copy_stream, prefetch_stream = copy_streams(device, num_expert_slots)
    for prefix, block in blocks.items():
        kinds = experts[prefix]
        if fp8_experts:
            gate_up, down = cat_rows([stack(kinds["gate"]), stack(kinds["up"])]), stack(kinds["down"])
        else:
            gate_up = torch.cat([torch.stack(kinds["gate"]), torch.stack(kinds["up"])], dim=1)
            down = torch.stack(kinds["down"])
        block.experts = ExpertStore(gate_up, down, device=device, num_slots=num_expert_slots,
                                    copy_stream=copy_stream, prefetch_stream=prefetch_stream)
    return model

def _random_model(
    config: ModelConfig, *, dtype: torch.dtype, device: torch.device, num_expert_slots: int | None, seed: int,
    trunk: bool = True, shard: Shard | None = None,
) -> Qwen3MoeModel:
    """Random N(0, initializer_range) weights (norm weights 1), created on the device; shard: the
    rank keeps its experts of the same draws (every layer's experts are drawn, one at a time)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    model = _build(config, dtype, device, trunk)
    std = config.initializer_range
    for name, param in model.named_parameters():
        if name.endswith("norm.weight") or "norm_" in name.rsplit(".", 2)[-2]:
            param.fill_(1.0)
        else:
            param.normal_(0.0, std, generator=generator)
    h, inter, e = config.hidden_size, config.moe_intermediate_size, config.num_experts
    copy_stream, prefetch_stream = copy_streams(device, num_expert_slots)
    # On the device even with slots (the store moves them to host memory): the same seed gives
    # the same experts whatever the residency, and a GPU fills them far faster than the CPU.
    owned = _owned(config, shard)
    for block in _moe_blocks(model).values():
        gate_up = torch.empty((e, 2 * inter, h), dtype=dtype, device=device).normal_(0.0, std, generator=generator)
        down = torch.empty((e, h, inter), dtype=dtype, device=device).normal_(0.0, std, generator=generator)
        if len(owned) < e:
            gate_up, down = gate_up[owned.start : owned.stop].clone(), down[owned.start : owned.stop].clone()
        block.experts = ExpertStore(gate_up, down, device=device, num_slots=num_expert_slots, copy_stream=copy_stream,
                                    prefetch_stream=prefetch_stream)
    return model


def _owned(config: ModelConfig, shard: Shard | None) -> range:
    """The experts this process keeps: all, or the rank's share."""
    return range(config.num_experts) if shard is None else shard.part(config.num_experts, "num_experts")


def save_checkpoint(model: Qwen3MoeModel, path: str | Path) -> None:
    """Write config.json + model.safetensors with Hugging Face tensor names (per-expert)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, Tensor] = {}
    for name, param in model.named_parameters():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        tensors[checkpoint_name(name)] = param.detach().cpu().contiguous()
    inter = model.config.moe_intermediate_size
    for prefix, block in _moe_blocks(model).items():
        store = block.experts
        for expert in range(model.config.num_experts):
            gate_up, down = store.expert_weights(expert)
            tensors[f"{prefix}.mlp.experts.{expert}.gate_proj.weight"] = gate_up[:inter].cpu().contiguous()
            tensors[f"{prefix}.mlp.experts.{expert}.up_proj.weight"] = gate_up[inter:].cpu().contiguous()
            tensors[f"{prefix}.mlp.experts.{expert}.down_proj.weight"] = down.cpu().contiguous()
    save_file(tensors, str(path / SINGLE_FILE), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")


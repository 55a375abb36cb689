"""Load a Qwen3-Next or Qwen3.5-MoE checkpoint (config.json + safetensors) into the CPU
reference trunk (shared.model.families.hybrid.modules; issue 17). An FP8 checkpoint's weights
stay FP8 (shared.model.quantize): projections whose fused group is FP8 throughout, and the
routed experts (in host memory too, behind slots).

Tensor names as the checkpoints have them: `model.*` (Qwen3-Next) or `model.language_model.*`
(Qwen3.5-MoE's composite checkpoints), `lm_head.weight`; routed experts per expert
(`mlp.experts.{e}.gate_proj.weight`, ...) or already fused (`mlp.experts.gate_up_proj`,
`down_proj`, as transformers saves them); the MTP layer under `mtp.*` (its experts per expert
too), built when the checkpoint has those tensors (transformers drops them when it saves).
The vision tower (`model.visual.*`) is not served. With `num_expert_slots` the routed experts
go to host memory behind that many device slots per MoE block (ExpertStore). `parts` loads what a service runs: "trunk"
(the verifier: no MTP layer), "mtp" (a lean drafter: embeddings, the MTP layer if there is
one, and lm_head; never the trunk), or "all". Every missing, unexpected or mis-shaped tensor is named in one
error.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from shared.model.families.hybrid.config import NextConfig
from shared.model.experts import copy_streams
from shared.model.families.hybrid.modules import DecoderLayer, Experts, Qwen3NextModel, SharedMoe
from kernels.fused.fp8 import FP8_DTYPE, Fp8Weight, cat_rows, stack
from shared.model.fp8 import SCALE_SUFFIX, CheckpointTensors, Fp8Blocks
from shared.model.loader import PARTS, list_files, problem
from shared.model.families.hybrid.shard import rank_config, shard_layer, shard_mixers
from shared.model.parallel.shard import Shard, shard_lm_head
from shared.model.quantize import keep_fp8, keeps_fp8, quantize_model, whole_groups

PREFIXES = ("model.language_model.", "model.")  # the trunk's tensors, longest first
EXPERT = re.compile(r"^((?:mtp\.)?layers\.\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
FUSED_EXPERTS = re.compile(r"^(?:mtp\.)?layers\.\d+\.mlp\.experts\.(gate_up|down)_proj$")
TRUNK_ONLY = ("layers.", "norm.")  # what a lean drafter skips


def _our_name(name: str, parts: str) -> str | None:
    """A checkpoint tensor's parameter name in Qwen3NextModel (None: not loaded)."""
    if name.startswith("model.visual."):
        return None
    if name.startswith("mtp."):
        return None if parts == "trunk" else name
    for prefix in PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    return None if parts == "mtp" and name.startswith(TRUNK_ONLY) else name  # (lm_head.weight unprefixed)


def read_config(path: Path, *, has_mtp: bool) -> NextConfig:
    """The checkpoint's config, with the MTP layer if `has_mtp` (its tensors decide, not the file)."""
    return NextConfig.from_dict(json.loads((path / "config.json").read_text()), mtp_num_hidden_layers=int(has_mtp))


def load_next(path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
              parts: str = "all", num_expert_slots: int | None = None, keep_fp8_weights: bool = True,
              shard: Shard | None = None) -> Qwen3NextModel:
    """num_expert_slots: device slots per MoE layer, the routed experts in host memory (None:
    every expert resident; with slots they are read into host memory, never the device's).
    keep_fp8_weights: an FP8 checkpoint's weights stay FP8 (else dequantised to dtype).
    shard: a rank's share of a model split over processes: only its routed experts are read."""
    if parts not in PARTS:
        raise ValueError(f"parts {parts!r} must be one of {', '.join(PARTS)}")
    path = Path(path)
    device = torch.device(device)
    fp8 = Fp8Blocks.of_checkpoint(path)
    tensors = CheckpointTensors(list_files(path), fp8)  # (FP8: shared/model/fp8.py)
    files = tensors.names()
    has_mtp = any(name.startswith("mtp.") for name in files)
    config = read_config(path, has_mtp=has_mtp and parts != "trunk")
    # FP8 weights stay FP8 (shared.model.quantize): projections whose fused group is FP8 throughout,
    # and per-expert routed experts where every one is stored FP8 (behind slots too)
    stored = {ours for name in (tensors.stored_fp8(files) if fp8 is not None and keep_fp8_weights else ())
              if (ours := _our_name(name, parts)) is not None}
    expert_names = {ours for name in files if (ours := _our_name(name, parts)) is not None and EXPERT.match(ours)}
    fp8_experts = bool(expert_names) and expert_names <= stored
    owned = _owned(config, shard)

    def keep(meta_model: Qwen3NextModel) -> None:  # (on the meta device, before anything is allocated)
        if len(owned) < config.num_experts:
            for experts in expert_modules(meta_model):
                experts.keep(owned)
        weights = {n for n, _ in meta_model.named_parameters()}
        if stored:
            keep_fp8(meta_model, whole_groups(stored - expert_names, weights), fp8.block)
        if fp8_experts:
            per_row = config.moe_intermediate_size % fp8.block[0] != 0
            for experts in expert_modules(meta_model):
                experts.hold_fp8(fp8.block, per_row_gate_up=per_row)

    model = _empty_model(config, dtype=dtype, device=device, trunk=parts != "mtp", prepare=keep)
    if num_expert_slots:
        for experts in expert_modules(model):
            experts.to_empty(device="cpu")
    params = dict(model.named_parameters())  # (a tied lm_head is embed_tokens: listed once)
    per_expert: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    unexpected, misshaped, seen = [], [], set()
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(file, framework="pt", device="cpu") as handle:
            for name in names:
                ours = _our_name(name, parts)
                if ours is None:
                    continue
                match = EXPERT.match(ours)
                if match:
                    layer, expert, kind = match.group(1), int(match.group(2)), match.group(3)
                    if expert in owned:  # (else another rank's)
                        get = tensors.get_fp8 if fp8_experts else tensors.get
                        per_expert.setdefault((layer, kind), {})[expert - owned.start] = get(handle, file, name)
                    continue
                if ours not in params:
                    unexpected.append(name)
                    continue
                if params[ours].dtype == FP8_DTYPE:  # an FP8 projection kept FP8: values and block scales
                    problem_ = tensors.copy_fp8(handle, file, name, params[ours], params[ours + SCALE_SUFFIX])
                    if problem_:
                        misshaped.append(problem_)
                        continue
                    seen.update((ours, ours + SCALE_SUFFIX))
                    continue
                tensor = tensors.get(handle, file, name)
                if len(owned) < config.num_experts and FUSED_EXPERTS.match(ours):  # the rank's rows
                    tensor = tensor[owned.start : owned.stop]
                if tensor.shape != params[ours].shape:
                    misshaped.append(f"{name} {tuple(tensor.shape)} (expected {tuple(params[ours].shape)})")
                    continue
                with torch.no_grad():
                    params[ours].copy_(tensor.to(dtype))
                seen.add(ours)
    _fuse_experts(per_expert, params, seen, misshaped)
    missing = sorted(set(params) - seen)
    problems = [problem(kind, names) for kind, names in
                (("missing", missing), ("unexpected", sorted(unexpected)), ("mis-shaped", misshaped)) if names]
    if problems:
        raise ValueError(f"checkpoint {path} does not match its config: " + "; ".join(problems))
    _rebuild_rotary(model)
    offload_experts(model, num_expert_slots, device)
    return model.eval().requires_grad_(False)


def _owned(config: NextConfig, shard: Shard | None) -> range:
    """The routed experts this process keeps: all, or the rank's share."""
    return range(config.num_experts) if shard is None else shard.part(config.num_experts, "num_experts")


def expert_modules(model: Qwen3NextModel) -> list[Experts]:
    """The routed experts of every MoE block: the trunk's, then the MTP layer's."""
    layers = list(model.layers) + ([] if model.mtp is None else list(model.mtp.layers))
    return [layer.mlp.experts for layer in layers if isinstance(layer.mlp, SharedMoe)]


def offload_experts(model: Qwen3NextModel, num_slots: int | None, device: torch.device) -> None:
    """Move every MoE block's routed experts to host memory with `num_slots` device slots (None
    or 0: leave them resident). The blocks share one copy stream and one prefetch stream."""
    if not num_slots:
        return
    copy_stream, prefetch_stream = copy_streams(device, num_slots)
    for experts in expert_modules(model):
        experts.offload(num_slots, device=device, copy_stream=copy_stream, prefetch_stream=prefetch_stream)


def load_hybrid(path: Path | None, *, device: torch.device, dtype: torch.dtype, num_expert_slots: int | None,
                random_weights: bool, config: NextConfig | None, seed: int, progress: bool,
                parts: str, quantize: str = "auto", shard: Shard | None = None) -> Qwen3NextModel:
    """shared.model.loader.load_model for this family (or its shapes with random weights);
    quantize: shared.model.quantize.QUANTIZE ("fp8" with random weights: a module at a time, random_next);
    shard: a rank's share of a verifier's trunk split over processes (its routed experts; the
    token mixers stay whole on every rank)."""
    if shard is not None and parts != "trunk":
        raise ValueError("a model split over ranks is a verifier's trunk (parts='trunk')")
    if random_weights:
        model = random_next(config or read_config(path, has_mtp=True), dtype=dtype, device=device, seed=seed,
                            parts=parts, quantize=quantize, shard=shard)
        offload_experts(model, num_expert_slots, device)  # (made on the device: the same seed, the same experts)
    else:
        model = load_next(path, dtype=dtype, device=device, parts=parts, num_expert_slots=num_expert_slots,
                          keep_fp8_weights=keeps_fp8(quantize, device), shard=shard)
        if shard is not None and shard.splits_dense:
            shard_mixers(model, shard)  # (before quantizing: the rank's share is what gets block scales)
        if quantize == "fp8":
            model = quantize_model(model)
    if shard is not None:
        if shard.splits_dense:
            shard_lm_head(model, shard)
        model.shard = shard
    return model


def random_next(config: NextConfig, *, dtype: torch.dtype, device: str | torch.device, seed: int = 0,
                parts: str = "all", std: float = 0.02, quantize: str = "none",
                shard: Shard | None = None) -> Qwen3NextModel:
    """A model of `config`'s shapes with random N(0, std) weights (norm weights 0: the
    zero-centred norms scale by 1 + w), made on the device (benchmarks at real sizes), a module
    at a time; quantize "fp8": each made block-scaled FP8 before the next is allocated, so a
    model whose full-precision weights would not fit (80B-A3B in bf16 on one H200) is built.
    The same seed gives the same values either way (one generator, the parameters' order);
    shard: every module made whole, then the rank's routed experts kept (the same values as the
    whole model's)."""
    if parts not in PARTS:
        raise ValueError(f"parts {parts!r} must be one of {', '.join(PARTS)}")
    if parts == "trunk" and config.mtp_num_hidden_layers:
        config = replace(config, mtp_num_hidden_layers=0)
    device = torch.device(device)
    with torch.device("meta"):
        model = Qwen3NextModel(config, trunk=parts != "mtp").to(dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    for prefix, module in _build_units(model):
        if config.tie_word_embeddings and prefix == "lm_head":  # the embedding, made already
            model.lm_head.weight = model.embed_tokens.weight
            continue
        module.to_empty(device=device)
        with torch.no_grad():
            for name, param in module.named_parameters(prefix=prefix):
                if name.endswith("A_log"):
                    param.uniform_(-1.0, 1.0, generator=generator)
                elif name.endswith("dt_bias"):
                    param.fill_(1.0)
                elif "norm" in name.rsplit(".", 1)[0].rsplit(".", 1)[-1]:
                    param.fill_(1.0 if name.endswith("linear_attn.norm.weight") else 0.0)
                else:
                    param.normal_(0.0, std, generator=generator)
        if shard is not None and isinstance(module, DecoderLayer):  # the rank's share, before any quantizing
            owned = _owned(config, shard)
            if len(owned) < config.num_experts and isinstance(module.mlp, SharedMoe):
                module.mlp.experts.keep(owned)
            if shard.splits_dense:
                shard_layer(module, shard, config)
        if quantize == "fp8":
            quantize_model(module)
    if shard is not None and shard.splits_dense:
        model.config = rank_config(config, shard)
    if quantize == "fp8":  # (what a unit is itself, e.g. mtp.fc, its parent converts; the rest is FP8 already)
        quantize_model(model)
    _rebuild_rotary(model)
    return model.eval().requires_grad_(False)


def _build_units(model: Qwen3NextModel):
    """(name prefix, module) of the model's parts in parameter order, each decoder layer one."""
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList):
            yield from ((f"{name}.{index}", layer) for index, layer in enumerate(child))
        elif name == "mtp":
            for sub_name, sub in child.named_children():
                if isinstance(sub, nn.ModuleList):
                    yield from ((f"mtp.{sub_name}.{index}", layer) for index, layer in enumerate(sub))
                else:
                    yield f"mtp.{sub_name}", sub
        else:
            yield name, child


def _empty_model(config: NextConfig, *, dtype: torch.dtype, device: torch.device, trunk: bool,
                 prepare=None) -> Qwen3NextModel:
    """The model's parameters allocated on the device in `dtype`, uninitialised (built on the
    meta device first: a float32 copy of a 35B model does not fit beside its bf16 one).
    prepare(model): changes made on the meta device first (FP8 parameters in place of others)."""
    with torch.device("meta"):
        model = Qwen3NextModel(config, trunk=trunk).to(dtype)
    if prepare is not None:
        prepare(model)
    model = model.to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty gives each module its own storage: tie again
        model.lm_head.weight = model.embed_tokens.weight
    return model


def _rebuild_rotary(model: Qwen3NextModel) -> None:
    """The rotary tables on the model's device (to_empty and device moves leave them stale)."""
    c = model.config
    model.rotary = type(model.rotary)(int(c.head_dim * c.partial_rotary_factor), c.rope_theta,
                                      c.max_position_embeddings).to(model.device)


def _fuse_experts(per_expert: dict, params: dict, seen: set, misshaped: list) -> None:
    """Per-expert tensors into each MoE block's [E, 2I, H] gate_up and [E, H, I] down parameters."""
    for prefix in sorted({prefix for prefix, _ in per_expert}):
        gate_up, down = f"{prefix}.mlp.experts.gate_up_proj", f"{prefix}.mlp.experts.down_proj"
        if gate_up not in params:
            misshaped.append(f"{prefix}'s routed experts (the config makes it dense)")
            continue
        num_experts = params[gate_up].shape[0]
        tensors = {kind: per_expert.get((prefix, kind), {}) for kind in ("gate", "up", "down")}
        if any(sorted(t) != list(range(num_experts)) for t in tensors.values()):
            continue  # incomplete: reported as missing
        ordered = {kind: [t[e] for e in range(num_experts)] for kind, t in tensors.items()}
        try:
            if params[gate_up].dtype == FP8_DTYPE:  # kept FP8 (values and block scales)
                fused = cat_rows([stack(ordered["gate"]), stack(ordered["up"])])
                stacked = stack(ordered["down"])
            else:
                fused = torch.cat([torch.stack(ordered["gate"]), torch.stack(ordered["up"])], dim=1)
                stacked = torch.stack(ordered["down"])
        except (RuntimeError, ValueError) as error:
            misshaped.append(f"{prefix}'s expert tensors ({error})")
            continue
        for name, tensor in ((gate_up, fused), (down, stacked)):
            # (FP8: the values and their block scales, each into its parameter)
            parts = {name: tensor.q, name + SCALE_SUFFIX: tensor.scale} if isinstance(tensor, Fp8Weight) else {name: tensor}
            if any(value.shape != params[key].shape for key, value in parts.items()):
                misshaped.append(f"{name} {tuple(tensor.shape)} (expected {tuple(params[name].shape)})")
                continue
            with torch.no_grad():
                for key, value in parts.items():
                    params[key].copy_(value.to(params[key].dtype))
                    seen.add(key)

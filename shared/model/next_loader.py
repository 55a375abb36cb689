"""Load a Qwen3-Next or Qwen3.5-MoE checkpoint (config.json + safetensors) into the CPU
reference trunk (shared.model.qwen3_next; issue 17).

Tensor names as the checkpoints have them: `model.*` (Qwen3-Next) or `model.language_model.*`
(Qwen3.5-MoE's composite checkpoints), `lm_head.weight`; routed experts per expert
(`mlp.experts.{e}.gate_proj.weight`, ...) or already fused (`mlp.experts.gate_up_proj`,
`down_proj`, as transformers saves them). The vision tower (`model.visual.*`) is not served,
and the MTP layer (`mtp.*`) is not wired yet: both are skipped. Every missing, unexpected or
mis-shaped tensor is named in one error.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from shared.model.loader import _list_files, _problem
from shared.model.qwen3_next import NextConfig, Qwen3NextModel

PREFIXES = ("model.language_model.", "model.")  # the trunk's tensors, longest first
SKIPPED = ("model.visual.", "mtp.")
EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def _our_name(name: str) -> str | None:
    """A checkpoint tensor's parameter name in Qwen3NextModel (None: skipped)."""
    if name.startswith(SKIPPED):
        return None
    for prefix in PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name  # lm_head.weight


def load_next(path: str | Path, *, dtype: torch.dtype = torch.float32) -> Qwen3NextModel:
    path = Path(path)
    config = NextConfig.from_dict(json.loads((path / "config.json").read_text()))
    model = Qwen3NextModel(config).to(dtype)
    params = dict(model.named_parameters())  # (a tied lm_head is embed_tokens: listed once)
    per_expert: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    unexpected, misshaped, seen = [], [], set()
    by_file: dict[Path, list[str]] = {}
    for name, file in _list_files(path).items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(file, framework="pt", device="cpu") as handle:
            for name in names:
                ours = _our_name(name)
                if ours is None:
                    continue
                match = EXPERT.match(ours)
                if match:
                    layer, expert, kind = int(match.group(1)), int(match.group(2)), match.group(3)
                    per_expert.setdefault((layer, kind), {})[expert] = handle.get_tensor(name)
                    continue
                if ours not in params:
                    unexpected.append(name)
                    continue
                tensor = handle.get_tensor(name)
                if tensor.shape != params[ours].shape:
                    misshaped.append(f"{name} {tuple(tensor.shape)} (expected {tuple(params[ours].shape)})")
                    continue
                with torch.no_grad():
                    params[ours].copy_(tensor.to(dtype))
                seen.add(ours)
    _fuse_experts(model, per_expert, params, seen, misshaped)
    missing = sorted(set(params) - seen)
    problems = [_problem(kind, names) for kind, names in
                (("missing", missing), ("unexpected", sorted(unexpected)), ("mis-shaped", misshaped)) if names]
    if problems:
        raise ValueError(f"checkpoint {path} does not match its config: " + "; ".join(problems))
    return model.eval()


def _fuse_experts(model: Qwen3NextModel, per_expert: dict, params: dict, seen: set, misshaped: list) -> None:
    """Per-expert tensors into each layer's [E, 2I, H] gate_up and [E, H, I] down parameters."""
    for layer in sorted({layer for layer, _ in per_expert}):
        gate_up, down = f"layers.{layer}.mlp.experts.gate_up_proj", f"layers.{layer}.mlp.experts.down_proj"
        if gate_up not in params:
            misshaped.append(f"layer {layer}'s routed experts (the config makes it dense)")
            continue
        num_experts = params[gate_up].shape[0]
        tensors = {kind: per_expert.get((layer, kind), {}) for kind in ("gate", "up", "down")}
        if any(sorted(t) != list(range(num_experts)) for t in tensors.values()):
            continue  # incomplete: reported as missing
        try:
            fused = torch.cat([torch.stack([tensors["gate"][e] for e in range(num_experts)]),
                               torch.stack([tensors["up"][e] for e in range(num_experts)])], dim=1)
            stacked = torch.stack([tensors["down"][e] for e in range(num_experts)])
        except RuntimeError as error:
            misshaped.append(f"layer {layer}'s expert tensors ({error})")
            continue
        for name, tensor in ((gate_up, fused), (down, stacked)):
            if tensor.shape != params[name].shape:
                misshaped.append(f"{name} {tuple(tensor.shape)} (expected {tuple(params[name].shape)})")
                continue
            with torch.no_grad():
                params[name].copy_(tensor.to(params[name].dtype))
            seen.add(name)

"""Checkpoints rewritten in the published FP8 layout for tests: every linear weight (`*proj*.weight`,
2-D) as float8_e4m3fn with a float32 `*_scale_inv` per block, in the same shard (or, on request,
in another); embeddings, lm_head, norms and routers left as they are; config.json given the
releases' quantization_config."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FP8_MAX = 448.0  # the largest finite float8 e4m3 value


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [out, in], scale_inv float32 [ceil(out / rows), ceil(in / columns)]) with
    weight ≈ q × scale_inv block by block (each block's largest magnitude maps to FP8_MAX)."""
    rows, columns = block
    out, inp = weight.shape
    scales = torch.empty(math.ceil(out / rows), math.ceil(inp / columns))
    q = torch.empty(out, inp, dtype=torch.float8_e4m3fn)
    w = weight.float()
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            part = w[i * rows : (i + 1) * rows, j * columns : (j + 1) * columns]
            scale = float(part.abs().max()) / FP8_MAX or 1.0
            scales[i, j] = scale
            q[i * rows : (i + 1) * rows, j * columns : (j + 1) * columns] = (part / scale).to(torch.float8_e4m3fn)
    return q, scales


def quantize_checkpoint(path: Path, block: tuple[int, int], *, scales_elsewhere: bool = False,
                        dequantized_twin: Path | None = None, not_converted: tuple[str, ...] = ()) -> list[str]:
    """Rewrite the checkpoint at `path` in the FP8 layout; returns the names quantized.
    scales_elsewhere: a sharded checkpoint's scales go to another shard than their weights.
    dequantized_twin: also write there the same checkpoint with the dequantized weights in
    float32 (what loading the FP8 one must give). not_converted: name fragments left as they are
    (a release's modules_to_not_convert)."""
    path = Path(path)
    index_file = path / "model.safetensors.index.json"
    shards = sorted(path.glob("*.safetensors"))
    weight_map = json.loads(index_file.read_text())["weight_map"] if index_file.is_file() else None
    if scales_elsewhere and (weight_map is None or len(shards) < 2):
        raise ValueError("scales_elsewhere needs a sharded checkpoint")
    contents = {}
    for shard in shards:
        with safe_open(shard, framework="pt") as handle:
            contents[shard.name] = {name: handle.get_tensor(name) for name in handle.keys()}
    quantized, twin = [], {name: dict(tensors) for name, tensors in contents.items()}
    for shard_name, tensors in contents.items():
        for name in list(tensors):
            value = tensors[name]
            module = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
            if not ("proj" in module and value.dim() == 2 and value.is_floating_point()):
                continue
            if any(fragment in name for fragment in not_converted):
                continue
            q, scale_inv = quantize(value, block)
            tensors[name] = q
            target = shard_name
            if scales_elsewhere:
                target = next(s.name for s in shards if s.name != shard_name)
            contents[target][name + "_scale_inv"] = scale_inv
            if weight_map is not None:
                weight_map[name + "_scale_inv"] = target
            twin[shard_name][name] = q.float() * scale_inv.repeat_interleave(block[0], 0)[: q.shape[0]] \
                .repeat_interleave(block[1], 1)[:, : q.shape[1]]
            quantized.append(name)
    for shard_name, tensors in contents.items():
        save_file(tensors, str(path / shard_name), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    original = dict(config)
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": list(block), "modules_to_not_convert": ["lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    if weight_map is not None:
        index_file.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if dequantized_twin is not None:
        dequantized_twin = Path(dequantized_twin)
        dequantized_twin.mkdir(parents=True, exist_ok=True)
        for shard_name, tensors in twin.items():
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(dequantized_twin / shard_name),
                      metadata={"format": "pt"})
        (dequantized_twin / "config.json").write_text(json.dumps(original))
        if index_file.is_file():
            twin_map = {name: shard for name, shard in weight_map.items() if not name.endswith("_scale_inv")}
            (dequantized_twin / index_file.name).write_text(json.dumps({"metadata": {}, "weight_map": twin_map}))
    return quantized

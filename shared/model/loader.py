"""Load a checkpoint of any family tandem serves (config.json + safetensors), or build one
from random weights: the family follows config.json's `model_type` (shared.model.families),
whose loader reads the tensors.

- single file (`model.safetensors`) or sharded (`model.safetensors.index.json`);
- any dtype (fp32/bf16/fp16) and device; FP8 checkpoints in the published block-scaled layout
  (shared/model/fp8.py), kept FP8 on a GPU (shared/model/quantize.py); `quantize="fp8"` makes
  any model so;
- every missing, unexpected or mis-shaped tensor is named in one error;
- `random_weights=True` builds the model from the config alone, directly on the device
  (benchmarks at real sizes without a file).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open

from shared.model.moe import MoeBlock
from shared.model.registry import resolve_model

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_NAMES_IN_ERROR = 8
PARTS = ("all", "trunk", "mtp")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # a --dtype's torch dtype


def list_files(path: Path) -> dict[str, Path]:
    """Tensor name → file holding it."""
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map")
        files = {name: path / file for name, file in weight_map.items()}
        absent = sorted({str(f) for f in files.values() if not f.is_file()})
        if absent:
            raise FileNotFoundError(f"{index} names shard files that do not exist: {', '.join(absent)}")
        return files
    single = path / SINGLE_FILE
    if not single.is_file():
        raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")
    with safe_open(single, framework="pt") as handle:
        return {name: single for name in handle.keys()}


def problem(kind: str, names: list[str]) -> str:
    shown = ", ".join(names[:MAX_NAMES_IN_ERROR])
    more = f" (and {len(names) - MAX_NAMES_IN_ERROR} more)" if len(names) > MAX_NAMES_IN_ERROR else ""
    return f"{kind} tensors: {shown}{more}"

def model_type(path: Path) -> str:
    """The checkpoint's model family: config.json's model_type (a composite config's own)."""
    config = path / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"no config.json at {config}")
    return str(json.loads(config.read_text()).get("model_type", ""))

def load_model(
    path: str | Path | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    num_expert_slots: int | None = None,
    random_weights: bool = False,
    config=None,
    seed: int = 0,
    progress: bool | None = None,
    parts: str = "all",
    quantize: str = "auto",
    shard=None,
):
    """Load a checkpoint (a directory, a model name under models/, or None for the embedded
    default model), or build a random-weight model from `config` (a family's parsed config: a
    ModelConfig, a NextConfig) or `path`'s config.

    The family follows config.json's model_type (shared.model.families). parts: what a service
    runs — "all", "trunk" (the verifier: no MTP layer) or "mtp" (a lean drafter: embeddings,
    the MTP layer when the checkpoint has one, lm_head; never the trunk). quantize
    (shared.model.quantize.QUANTIZE): "auto" keeps an FP8 checkpoint FP8 on a GPU and
    dequantises it on the CPU, "none" dequantises it everywhere, "fp8" makes every projection
    and routed expert block-scaled FP8. shard (shared.model.parallel.shard.Shard): one rank's
    share of a verifier's trunk split over processes (families with the PARALLEL capability)."""
    from shared.model.families import family_for, family_of_config
    from shared.model.quantize import QUANTIZE

    if parts not in PARTS:
        raise ValueError(f"parts {parts!r} must be one of {', '.join(PARTS)}")
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize {quantize!r} must be one of {', '.join(QUANTIZE)}")
    device = torch.device(device)
    if progress is None:
        progress = sys.stderr.isatty()
    if config is None:
        path = resolve_model(path)
        family = family_for(model_type(path))
    else:
        family = family_of_config(config)
    extra = {}
    if shard is not None and shard.size > 1:
        from shared.model.families import PARALLEL

        if PARALLEL not in family.capabilities:
            raise ValueError(f"the {family.name} family cannot be split over processes (--parallel)")
        extra["shard"] = shard
    return family.load(path, device=device, dtype=dtype, num_expert_slots=num_expert_slots,
                       random_weights=random_weights, config=config, seed=seed, progress=progress, parts=parts,
                       quantize=quantize, **extra)


def resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's weights on its device: parameters and buffers, and the device slots
    of its expert stores (each storage counted once: tied weights, views)."""
    seen, total = set(), 0
    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        if isinstance(module, MoeBlock) and module.store is not None:
            store = module.store
            tensors += store.tensors()
            # its experts' host copies (a hybrid block's parameters) are not counted
            seen.update(t.untyped_storage().data_ptr() for t in store.host_tensors())
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total

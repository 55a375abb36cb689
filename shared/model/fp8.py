"""FP8 checkpoints as they are published (issue 36): block-scaled float8 e4m3 weights.

The layout of the Qwen3 / Qwen3.5 / Qwen3-Next FP8 releases (and DeepSeek-V3's before them):
config.json carries a `quantization_config` — quant_method "fp8", fmt "e4m3", a
`weight_block_size` [rows, columns], activation_scheme "dynamic", and the modules left in
bf16 — and each converted linear weight `<name>` [out, in] is a float8_e4m3fn tensor with a
float32 `<name>_scale_inv` of one scale per block [ceil(out / rows), ceil(in / columns)]:
the weight is q × scale_inv, block by block.

This first step dequantises those weights while loading, to the model's dtype (`--dtype`
keeps meaning the activation dtype): any checkpoint in the format loads and runs on every path,
at the cost of bf16 weights' memory and bytes. Which tensors are FP8 follows the file (a
tensor stored in float8 is dequantised, any other is read as is), so the modules a release
leaves unconverted need no list. Nothing here imports above shared/model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn,)
SUPPORTED = "quant_method 'fp8' with fmt 'e4m3', a weight_block_size of two positive integers and activation_scheme 'dynamic'"


@dataclass(frozen=True)
class Fp8Blocks:
    """A checkpoint's FP8 scheme: one float32 scale per block of `block` = (rows, columns)."""

    block: tuple[int, int]

    @classmethod
    def from_config(cls, raw: dict) -> Fp8Blocks | None:
        """The scheme of a config.json's dict (None: no quantization_config, plain weights);
        ValueError naming the field for any scheme tandem does not load."""
        quantization = raw.get("quantization_config")
        if quantization is None:
            return None
        if not isinstance(quantization, dict):
            raise ValueError(f"quantization_config must be an object, not {type(quantization).__name__}")
        method = quantization.get("quant_method")
        if method != "fp8":
            raise ValueError(f"quantization_config.quant_method {method!r} is not supported: tandem loads {SUPPORTED}")
        fmt = quantization.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization_config.fmt {fmt!r} is not supported: tandem loads {SUPPORTED}")
        scheme = quantization.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ValueError(f"quantization_config.activation_scheme {scheme!r} is not supported (static activation "
                             f"scales): tandem loads {SUPPORTED}")
        block = quantization.get("weight_block_size")
        if (not isinstance(block, list) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ValueError(f"quantization_config.weight_block_size {block!r} must be two positive integers "
                             f"(per-tensor or per-channel FP8 is not supported): tandem loads {SUPPORTED}")
        return cls((block[0], block[1]))

    @classmethod
    def of_checkpoint(cls, path: Path) -> Fp8Blocks | None:
        return cls.from_config(json.loads((Path(path) / "config.json").read_text()))


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], name: str = "weight") -> torch.Tensor:
    """float32 weights [out, in] of an FP8 tensor q [out, in] and its block scales
    [ceil(out / rows), ceil(in / columns)]: q × scale_inv, block by block."""
    if q.dim() != 2:
        raise ValueError(f"{name}: an FP8 weight must be 2-D, not {tuple(q.shape)}")
    rows, columns = block
    expected = (math.ceil(q.shape[0] / rows), math.ceil(q.shape[1] / columns))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"{name}{SCALE_SUFFIX} {tuple(scale_inv.shape)} does not fit {name} {tuple(q.shape)} in "
                         f"blocks of {list(block)} (expected {expected})")
    scales = scale_inv.float().repeat_interleave(rows, dim=0)[: q.shape[0]].repeat_interleave(columns, dim=1)[:, : q.shape[1]]
    return q.float() * scales


class CheckpointTensors:
    """A checkpoint's tensors by name, as its loaders read them: FP8 weights dequantised with
    their scales (the scales are not tensors of the model: `names` leaves them out)."""

    def __init__(self, files: dict[str, Path], fp8: Fp8Blocks | None) -> None:
        self.files = files
        self.fp8 = fp8

    def names(self) -> dict[str, Path]:
        """Tensor name → file, without the scales of weights the checkpoint holds."""
        return {name: file for name, file in self.files.items()
                if not (name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in self.files)}

    def get(self, handle, file: Path, name: str) -> torch.Tensor:
        """The tensor `name` from `handle`, the open safetensors `file` (FP8: dequantised, float32)."""
        tensor = handle.get_tensor(name)
        if tensor.dtype not in FP8_DTYPES:
            return tensor
        if self.fp8 is None:
            raise ValueError(f"{name} is stored in {tensor.dtype} but config.json has no quantization_config "
                             f"(tandem loads {SUPPORTED})")
        scale_name = name + SCALE_SUFFIX
        scale_file = self.files.get(scale_name)
        if scale_file is None:
            raise ValueError(f"{name} is FP8 but the checkpoint has no {scale_name}")
        if scale_file == file:
            scale = handle.get_tensor(scale_name)
        else:  # (in another shard)
            with safe_open(scale_file, framework="pt", device="cpu") as other:
                scale = other.get_tensor(scale_name)
        return dequantize(tensor, scale, self.fp8.block, name)

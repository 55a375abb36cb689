"""FP8 checkpoints as they are published (issue 36): block-scaled float8 e4m3 weights.

The layout of the Qwen3 / Qwen3.5 / Qwen3-Next FP8 releases (and DeepSeek-V3's before them):
config.json carries a `quantization_config` — quant_method "fp8", fmt "e4m3", a
`weight_block_size` [rows, columns], activation_scheme "dynamic", and the modules left in
bf16 — and each converted linear weight `<name>` [out, in] is a float8_e4m3fn tensor with a
float32 `<name>_scale_inv` of one scale per block [ceil(out / rows), ceil(in / columns)]:
the weight is q × scale_inv, block by block.

The loaders keep such weights FP8 (`copy_fp8`, `get_fp8`; shared.model.quantize holds them)
where --quantize says so (by default on a GPU) or dequantise them to the model's dtype (`get`:
on the CPU, and a fused group a release left partly unconverted). `--dtype` keeps meaning the
activations' dtype.
Which tensors are FP8 follows the file (a tensor stored in float8 is FP8, any other is read as
is), so the modules a release leaves unconverted need no list. Nothing here imports above
shared/model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from kernels.fused.fp8 import Fp8Weight

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn,)
FP8_HEADER_DTYPES = ("F8_E4M3",)  # safetensors' name of float8_e4m3fn
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
    return Fp8Weight(q, scale_inv.float(), block).dequantize(torch.float32)


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
        return dequantize(tensor, self._scale(handle, file, name, tensor), self.fp8.block, name)

    def get_fp8(self, handle, file: Path, name: str) -> Fp8Weight:
        """An FP8 weight as it is stored: its float8 values and block scales (kept FP8)."""
        tensor = handle.get_tensor(name)
        if tensor.dtype not in FP8_DTYPES:
            raise ValueError(f"{name} is stored in {tensor.dtype}, not FP8")
        scale = self._scale(handle, file, name, tensor).float()
        try:
            return Fp8Weight(tensor, scale, self.fp8.block)
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from None

    def copy_fp8(self, handle, file: Path, name: str, weight: torch.Tensor, scale: torch.Tensor) -> str | None:
        """Copy the FP8 weight `name` into an FP8 parameter pair (values `weight`, block scales
        `scale`); what does not fit comes back as a mis-shape message instead."""
        fp8 = self.get_fp8(handle, file, name)
        if fp8.shape != weight.shape or fp8.scale.shape != scale.shape:
            return (f"{name} {tuple(fp8.shape)}, scales {tuple(fp8.scale.shape)} (expected {tuple(weight.shape)}, "
                    f"{tuple(scale.shape)})")
        with torch.no_grad():
            weight.copy_(fp8.q)
            scale.copy_(fp8.scale)
        return None

    def stored_fp8(self, names) -> set[str]:
        """Which of `names` the checkpoint stores in float8 (read from the files' headers)."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.files[name], []).append(name)
        found = set()
        for file, file_names in by_file.items():
            with safe_open(file, framework="pt", device="cpu") as handle:
                found.update(n for n in file_names if handle.get_slice(n).get_dtype() in FP8_HEADER_DTYPES)
        return found

    def _scale(self, handle, file: Path, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if self.fp8 is None:
            raise ValueError(f"{name} is stored in {tensor.dtype} but config.json has no quantization_config "
                             f"(tandem loads {SUPPORTED})")
        scale_name = name + SCALE_SUFFIX
        scale_file = self.files.get(scale_name)
        if scale_file is None:
            raise ValueError(f"{name} is FP8 but the checkpoint has no {scale_name}")
        if scale_file == file:
            return handle.get_tensor(scale_name)
        with safe_open(scale_file, framework="pt", device="cpu") as other:  # (in another shard)
            return other.get_tensor(scale_name)

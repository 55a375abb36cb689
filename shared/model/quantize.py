"""FP8 weights inside a loaded model (issue 36; DESIGN §6): what the fused kernels read.

A projection stored in block-scaled FP8 is an `Fp8Linear` (its parameters named as the
published checkpoints name them, `weight` in float8 e4m3 and `weight_scale_inv`); routed
experts are an ExpertStore over FP8 stacks. The reference forward dequantises per op (the
CPU's path and the tests' oracle); the fused forwards hand the FP8 weights to the kernels
(`weight_of`), which read a byte a weight instead of two.

`quantize_model` makes a full-precision model FP8 on load (`--quantize fp8`): every
projection and expert except the routers and the lm_head, in blocks of FP8_BLOCK — the
scheme of the published releases, for benchmarks with random weights and for users' own
models. `--dtype` keeps meaning the activations' dtype. Nothing here imports above shared/model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.fused.fp8 import FP8_DTYPE, Fp8Weight, cat_rows, quantize, row_slice
from kernels.fused.linear import Weight

# --quantize: "auto", an FP8 checkpoint's weights stay FP8 on a GPU (half the memory and bytes)
# and are dequantised on the CPU (where per-op dequantisation costs more than it saves); "none",
# full precision everywhere; "fp8", FP8 everywhere, full-precision weights converted too.
QUANTIZE = ("auto", "none", "fp8")


FP8_BLOCK = (128, 128)  # the published FP8 releases' weight_block_size
# Left in full precision by quantize_model: the routers (a route flips on a small change of its
# logit) and the lm_head (the published releases keep both; the sampled distribution itself).
KEPT = ("lm_head", "mlp.gate", "shared_expert_gate")


def keeps_fp8(quantize: str, device: torch.device) -> bool:
    """Whether a checkpoint's FP8 weights load as FP8 under this --quantize on this device."""
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize {quantize!r} must be one of {', '.join(QUANTIZE)}")
    return quantize == "fp8" or (quantize == "auto" and torch.device(device).type == "cuda")


class Fp8Linear(nn.Module):
    """y = x @ (q × scale)^T, no bias: a block-scaled FP8 projection."""

    def __init__(self, weight: Fp8Weight) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight.q, requires_grad=False)  # [out, in] float8_e4m3fn
        self.weight_scale_inv = nn.Parameter(weight.scale, requires_grad=False)  # [out / rows, in / columns] float32
        self.block = weight.block

    @classmethod
    def empty(cls, out_features: int, in_features: int, block: tuple[int, int], device: torch.device) -> Fp8Linear:
        """An unfilled one (a loader copies a checkpoint's values and scales into it)."""
        rows, columns = block
        q = torch.empty((out_features, in_features), dtype=FP8_DTYPE, device=device)
        scale = torch.empty((-(-out_features // rows), -(-in_features // columns)), dtype=torch.float32, device=device)
        return cls(Fp8Weight(q, scale, block))

    def fp8(self) -> Fp8Weight:
        return Fp8Weight(self.weight, self.weight_scale_inv, self.block)

    def repoint(self, weight: Fp8Weight) -> None:
        """Become a view of `weight` (its rows fused into a larger weight elsewhere)."""
        self.weight = nn.Parameter(weight.q, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(weight.scale, requires_grad=False)
        self.block = weight.block

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.fp8().dequantize(x.dtype))

    def _apply(self, fn, recurse=True):
        # model.to(dtype) would cast the float8 values as if they were weights: moves only.
        if fn(torch.empty(0, dtype=FP8_DTYPE, device=self.weight.device)).dtype != FP8_DTYPE:
            raise ValueError("an FP8 model's weights do not change dtype (--dtype is the activations')")
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 blocks={list(self.block)}"


def _projections(model: nn.Module):
    """(parent, attribute, full name, module) of every bias-free nn.Linear of the model (a list:
    callers replace them as they go)."""
    return [(parent, name, f"{parent_name}.{name}" if parent_name else name, child)
            for parent_name, parent in list(model.named_modules()) for name, child in list(parent.named_children())
            if type(child) is nn.Linear and child.bias is None]


def keep_fp8(model: nn.Module, stored_fp8: set[str], block: tuple[int, int]) -> None:
    """Make every projection whose weight's name (module name + ".weight") `stored_fp8` holds an
    unfilled Fp8Linear on its device (on the meta device: before anything is allocated)."""
    for parent, name, full, child in _projections(model):
        if f"{full}.weight" in stored_fp8:
            setattr(parent, name, Fp8Linear.empty(child.out_features, child.in_features, block, child.weight.device))


# Projections the fused forwards concatenate into one matrix (shared.model.layers.fuse_linear_rows):
# a checkpoint's FP8 weights stay FP8 only where a whole group is FP8 (else it is dequantised).
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("mlp.gate", "mlp.shared_expert_gate"),
                ("in_proj_qkvz", "in_proj_ba"), ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))


def whole_groups(fp8_weights: set[str], all_weights: set[str]) -> set[str]:
    """The weight names of `fp8_weights` whose fused group (FUSED_GROUPS, siblings under one
    module) is FP8 throughout; `all_weights` holds every weight name of the model."""
    kept = set(fp8_weights)
    for name in fp8_weights:
        stem = name.removesuffix(".weight")
        for group in FUSED_GROUPS:
            member = next((m for m in group if stem.endswith("." + m) or stem == m), None)
            if member is None:
                continue
            parent = stem[: len(stem) - len(member)]
            siblings = {f"{parent}{m}.weight" for m in group} & all_weights
            if not siblings <= fp8_weights:
                kept -= siblings
    return kept


def weight_of(module: nn.Module) -> Weight:
    """A projection's weight as the fused kernels take it: FP8 (Fp8Weight) or a tensor."""
    return module.fp8() if isinstance(module, Fp8Linear) else module.weight


def fuse_fp8_rows(linears: list[Fp8Linear]) -> Fp8Weight:
    """The projections' FP8 weights concatenated by rows (one GEMV for several), each module
    re-pointed at its rows (nothing kept twice): blocks kept where every part's rows are whole
    blocks, else one scale per row (kernels.fused.fp8.cat_rows)."""
    fused = cat_rows([m.fp8() for m in linears])
    start = 0
    for m in linears:
        rows = m.out_features
        m.repoint(row_slice(fused, start, start + rows))
        start += rows
    return fused


def is_fp8(model: nn.Module) -> bool:
    """Whether some of the model's weights are FP8."""
    return any(isinstance(m, Fp8Linear) for m in model.modules()) or any(
        getattr(getattr(m, "store", None), "fp8", False) for m in model.modules())


@torch.inference_mode()
def quantize_model(model: nn.Module, block: tuple[int, int] = FP8_BLOCK) -> nn.Module:
    """Make the model's projections and routed experts block-scaled FP8 in place (KEPT stay),
    module by module, so at most one module's full-precision copy is alive beside the FP8 ones."""
    from shared.model.moe import MoeBlock  # (a sibling module: the import stays within shared/model)

    for parent, name, full, child in _projections(model):
        if not full.endswith(KEPT):
            setattr(parent, name, Fp8Linear(quantize(child.weight.detach(), block)))
    for module in model.modules():
        if isinstance(module, MoeBlock) and module.experts is not None:
            module.experts.quantize(block)  # (an ExpertStore, or the hybrid family's Experts module over one)
    if any(p.is_cuda for p in model.parameters()):
        torch.cuda.empty_cache()  # (the full-precision weights' blocks back to the device)
    return model


def fp8_unsupported(model: nn.Module) -> str | None:
    """Why the fused kernels cannot read this model's FP8 weights on its device (None: they can,
    or it has none): a block's columns must hold whole K tiles (a multiple of 16)."""
    if model.device.type != "cuda":
        return None  # (the references dequantise any block)
    for module in model.modules():
        store = getattr(module, "store", None)
        weights = [module.fp8()] if isinstance(module, Fp8Linear) else (
            [store.gate_up, store.down] if getattr(store, "fp8", False) else [])
        for weight in weights:
            if not weight.kernel_ready():
                return f"FP8 blocks of {list(weight.block)}: the kernels need block columns that are a multiple of 16"
    return None

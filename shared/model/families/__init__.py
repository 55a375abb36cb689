"""The model families tandem serves, and the one place that tells them apart.

- `qwen3_moe`: Qwen3-MoE trunks (`shared.model.model`, fused path `shared.model.fast`);
- `hybrid`: Qwen3-Next / Qwen3.5-MoE (Gated DeltaNet + gated attention, shared expert; reference
  modules `shared.model.qwen3_next`, fused path `shared.model.families.hybrid.fused`).

Services ask here whether a loaded model runs the fused path and build its fused forward; they
never test a model's class themselves.
"""

from __future__ import annotations

from torch import nn


def family_name(model: nn.Module) -> str:
    from shared.model.qwen3_next import Qwen3NextModel

    return "hybrid" if isinstance(model, Qwen3NextModel) else "qwen3_moe"


def fused_unsupported(model: nn.Module) -> str | None:
    """Why the fused path cannot run this model (None when it can)."""
    if family_name(model) == "hybrid":
        from shared.model.families.hybrid.fused import unsupported_reason
    else:
        from shared.model.fast import unsupported_reason
    return unsupported_reason(model)


def fused_wanted(model: nn.Module, setting: str) -> bool:
    """Whether to run the fused path for a `fused` setting (auto | on | off)."""
    reason = fused_unsupported(model)
    if setting == "on" and reason is not None:
        raise ValueError(f"fused = on, but {reason}")
    return setting == "on" or (setting == "auto" and model.device.type == "cuda" and reason is None)


def build_fused(model: nn.Module, *, max_rows: int, max_length: int, num_state_slots: int = 0,
                pdl: bool | None = None, invariant: bool = True, expert_prefetch: bool = False):
    """The model's fused forward: FusedModel (qwen3_moe) or HybridFused. num_state_slots: the KV
    pool slots whose linear-attention states the hybrid family keeps (0: an MTP layer alone);
    expert_prefetch: qwen3_moe's offloaded experts (see FusedModel)."""
    if family_name(model) == "hybrid":
        from shared.model.families.hybrid.fused import HybridFused

        return HybridFused(model, max_rows=max_rows, max_length=max_length, num_state_slots=num_state_slots, pdl=pdl,
                           invariant=invariant)
    from shared.model.fast import FusedModel

    return FusedModel(model, max_rows=max_rows, max_length=max_length, pdl=pdl, invariant=invariant,
                      expert_prefetch=expert_prefetch)

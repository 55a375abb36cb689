"""The model families tandem serves, one folder each, and the one place that tells them apart.

A family's folder holds its config, its reference modules (the CPU path and the tests' oracle),
its fused forward (the GPU's decode/verify windows, batches and prefill over the paged KV pool)
and its loader, and registers one `Family` here:

- `qwen3_moe`: Qwen3-MoE trunks (`families/qwen3_moe/`), with an MTP layer where the checkpoint
  has one;
- `hybrid`: Qwen3-Next / Qwen3.5-MoE (`families/hybrid/`): Gated DeltaNet and gated attention,
  routed experts plus a shared one, the `mtp.*` layer; per-sequence linear-attention states.

Both keep their routed experts in ExpertStores (device slots: EXPERT_SLOTS) and route draft
rows with MoCE (MOCE); both offloaded forwards replay as graph segments on CUDA. Their fused
forwards share one shape (shared.model.fused.FusedForward).

Services ask the registry (never a model's class) whether a model runs the fused path, what it
can do, and build its fused forward. Adding a family is adding a folder and an entry below.
Imports inside the entries are lazy: loading one family never imports another's modules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

EXPERT_SLOTS = "expert_slots"  # experts in host memory with device slots (offloading)
MOCE = "moce"  # residency-aware routing of draft rows (needs expert slots' residency map)
PARALLEL = "parallel"  # a verifier's trunk split over processes (shared.model.parallel)


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # config.json's model_type values it loads
    config_class: Callable[[], type]  # its parsed config's class (imported when called)
    model_class: Callable[[], type]  # the reference model's class (imported when called)
    load: Callable[..., nn.Module]  # shared.model.loader.load_model's work for this family
    fused: Callable[..., object]  # (model, max_rows=, max_length=, num_state_slots=, pdl=, invariant=, expert_prefetch=)
    unsupported: Callable[[nn.Module], str | None]  # why the fused path cannot run a model (None: it can)
    capabilities: frozenset[str]

    def owns(self, model: nn.Module) -> bool:
        return isinstance(model, self.model_class())


def _qwen3_moe_config() -> type:
    from shared.model.families.qwen3_moe.config import ModelConfig

    return ModelConfig


def _qwen3_moe_class() -> type:
    from shared.model.families.qwen3_moe.model import Qwen3MoeModel

    return Qwen3MoeModel


def _qwen3_moe_load(*args, **kwargs):
    from shared.model.families.qwen3_moe.loader import load_qwen3_moe

    return load_qwen3_moe(*args, **kwargs)


def _qwen3_moe_fused(model, *, max_rows, max_length, num_state_slots=0, pdl=None, invariant=True,
                     expert_prefetch=False, group=None):
    from shared.model.families.qwen3_moe.fused import FusedModel

    return FusedModel(model, max_rows=max_rows, max_length=max_length, pdl=pdl, invariant=invariant,
                      expert_prefetch=expert_prefetch, group=group)


def _qwen3_moe_unsupported(model):
    from shared.model.families.qwen3_moe.fused import unsupported_reason

    return unsupported_reason(model)


def _hybrid_config() -> type:
    from shared.model.families.hybrid.config import NextConfig

    return NextConfig


def _hybrid_class() -> type:
    from shared.model.families.hybrid.modules import Qwen3NextModel

    return Qwen3NextModel


def _hybrid_load(*args, **kwargs):
    from shared.model.families.hybrid.loader import load_hybrid

    return load_hybrid(*args, **kwargs)


def _hybrid_fused(model, *, max_rows, max_length, num_state_slots=0, pdl=None, invariant=True, expert_prefetch=False,
                  group=None):
    from shared.model.families.hybrid.fused import HybridFused

    if expert_prefetch:
        raise ValueError("expert prefetch is built for the qwen3_moe family's segmented forward only")
    # (invariant is not asked of this family: its rows are row-invariant whatever is asked)
    return HybridFused(model, max_rows=max_rows, max_length=max_length, num_state_slots=num_state_slots, pdl=pdl,
                       group=group)


def _hybrid_unsupported(model):
    from shared.model.families.hybrid.fused import unsupported_reason

    return unsupported_reason(model)


FAMILIES = (
    Family("qwen3_moe", ("qwen3_moe",), _qwen3_moe_config, _qwen3_moe_class, _qwen3_moe_load, _qwen3_moe_fused, _qwen3_moe_unsupported,
           frozenset({EXPERT_SLOTS, MOCE, PARALLEL})),
    Family("hybrid", ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text"), _hybrid_config, _hybrid_class, _hybrid_load, _hybrid_fused,
           _hybrid_unsupported, frozenset({EXPERT_SLOTS, MOCE, PARALLEL})),
)


def family_for(model_type: str) -> Family:
    """The family loading config.json's model_type (a ValueError naming the known ones if none)."""
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    known = ", ".join(t for family in FAMILIES for t in family.model_types)
    raise ValueError(f"config.json model_type {model_type!r} is not supported (tandem serves: {known})")


def family_of_config(config: object) -> Family:
    """The family whose parsed config `config` is (a ModelConfig, a NextConfig)."""
    for family in FAMILIES:
        if isinstance(config, family.config_class()):
            return family
    raise ValueError(f"{type(config).__name__} is not the config of any family tandem serves")


def family_of(model: nn.Module) -> Family:
    for family in FAMILIES:
        if family.owns(model):
            return family
    raise ValueError(f"{type(model).__name__} is not a model of any family tandem serves")


def family_name(model: nn.Module) -> str:
    return family_of(model).name


def fused_unsupported(model: nn.Module) -> str | None:
    """Why the fused path cannot run this model (None when it can)."""
    return family_of(model).unsupported(model)


def fused_wanted(model: nn.Module, setting: str) -> bool:
    """Whether to run the fused path for a `fused` setting (auto | on | off). auto: where the
    family's fused path runs the model, on CUDA or the CPU (whose rows keep their one-row bits
    there too, DESIGN §11)."""
    reason = fused_unsupported(model)
    if setting == "on" and reason is not None:
        raise ValueError(f"fused = on, but {reason}")
    return setting == "on" or (setting == "auto" and model.device.type in ("cuda", "cpu") and reason is None)


def build_fused(model: nn.Module, *, max_rows: int, max_length: int, num_state_slots: int = 0,
                pdl: bool | None = None, invariant: bool = True, expert_prefetch: bool = False, group=None):
    """The model's fused forward: FusedModel (qwen3_moe) or HybridFused. num_state_slots: the KV
    pool slots whose linear-attention states the hybrid family keeps (0: an MTP layer alone);
    expert_prefetch: qwen3_moe's offloaded experts (see FusedModel); group: the ranks of a model
    split over processes (shared.model.parallel.group.ModelGroup; the model is this rank's share)."""
    return family_of(model).fused(model, max_rows=max_rows, max_length=max_length, num_state_slots=num_state_slots,
                                  pdl=pdl, invariant=invariant, expert_prefetch=expert_prefetch, group=group)

"""Model configuration parsed from a Hugging Face `config.json` (model_type `qwen3_moe`).

Both spellings in the wild are accepted: `num_experts` / `num_local_experts` and
`rope_theta` / `rope_parameters.rope_theta`. `mtp_num_hidden_layers` (Qwen3-Next naming)
says whether the checkpoint carries an MTP layer.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shared.model.config_fields import eos_token_ids, require_positive

SUPPORTED_MODEL_TYPES = ("qwen3_moe",)
REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "moe_intermediate_size",
    "num_experts_per_tok",
)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP layers (mlp_only_layers, sparse step)
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mtp_num_hidden_layers: int = 0
    initializer_range: float = 0.02
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        require_positive(self, (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "moe_intermediate_size", "num_experts", "num_experts_per_tok", "decoder_sparse_step",
            "max_position_embeddings"))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config num_attention_heads = {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads = {self.num_key_value_heads}"
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"config num_experts_per_tok = {self.num_experts_per_tok} exceeds num_experts = {self.num_experts}"
            )
        if self.mtp_num_hidden_layers not in (0, 1):
            raise ValueError(f"config mtp_num_hidden_layers = {self.mtp_num_hidden_layers}: only 0 or 1 is supported")
        if self.head_dim % 2:
            raise ValueError(f"config head_dim = {self.head_dim} must be even (rotary embedding)")
        if not self.rope_theta > 0:
            raise ValueError(f"config rope_theta = {self.rope_theta!r} must be > 0")
        if any(self.is_dense_layer(i) for i in range(self.num_hidden_layers)) and self.intermediate_size < 1:
            raise ValueError("config intermediate_size is required for dense (mlp_only / sparse-step) layers")

    def is_dense_layer(self, layer: int) -> bool:
        """Whether trunk layer `layer` uses a dense SwiGLU MLP instead of the MoE block."""
        return layer in self.mlp_only_layers or (layer + 1) % self.decoder_sparse_step != 0

    @property
    def has_mtp(self) -> bool:
        return self.mtp_num_hidden_layers > 0

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}")
        missing = [key for key in REQUIRED_KEYS if key not in raw]
        if "num_experts" not in raw and "num_local_experts" not in raw:
            missing.append("num_experts (or num_local_experts)")
        rope = raw.get("rope_parameters") or {}
        if "rope_theta" not in raw and "rope_theta" not in rope:
            missing.append("rope_theta (or rope_parameters.rope_theta)")
        if missing:
            raise ValueError(f"config is missing required keys: {', '.join(missing)}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config hidden_act {raw['hidden_act']!r} is not supported (silu only)")
        if raw.get("use_sliding_window"):
            raise ValueError("config use_sliding_window = true is not supported")
        rope_type = rope.get("rope_type", "default")
        scaling = raw.get("rope_scaling")
        if rope_type != "default" or (scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default")):
            raise ValueError(f"config rope type {rope_type!r} / rope_scaling {scaling!r} is not supported (default RoPE only)")
        heads = raw["num_attention_heads"]
        eos_ids = eos_token_ids(raw)
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            intermediate_size=raw.get("intermediate_size") or 0,
            moe_intermediate_size=raw["moe_intermediate_size"],
            num_experts=raw.get("num_experts", raw.get("num_local_experts")),
            num_experts_per_tok=raw["num_experts_per_tok"],
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            decoder_sparse_step=raw.get("decoder_sparse_step") or 1,
            mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", rope.get("rope_theta", 10000.0))),
            max_position_embeddings=raw.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            mtp_num_hidden_layers=raw.get("mtp_num_hidden_layers", 0) or 0,
            initializer_range=float(raw.get("initializer_range", 0.02)),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json at {path}")
        return cls.from_dict(json.loads(path.read_text()))

    def to_dict(self) -> dict[str, Any]:
        """A Hugging Face style config dict (what `from_dict` reads back)."""
        raw = asdict(self)
        raw["model_type"] = "qwen3_moe"
        raw["architectures"] = ["Qwen3MoeForCausalLM"]
        raw["mlp_only_layers"] = list(self.mlp_only_layers)
        eos = raw.pop("eos_token_ids")
        raw["eos_token_id"] = list(eos) if len(eos) > 1 else (eos[0] if eos else None)
        raw["hidden_act"] = "silu"
        return raw

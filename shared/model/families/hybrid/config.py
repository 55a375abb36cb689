"""The hyperparameters of a Qwen3-Next / Qwen3.5-MoE trunk, read from config.json (DESIGN §6)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from shared.model.config_fields import eos_token_ids, require_positive


@dataclass(frozen=True)
class NextConfig:
    """The hyperparameters of a Qwen3-Next trunk, by the checkpoints' config.json names."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    layer_types: tuple[str, ...]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    linear_projection: str = "grouped"  # Qwen3-Next's fused projections; "split": Qwen3.5's
    tie_word_embeddings: bool = False
    mtp_num_hidden_layers: int = 0  # the loader builds the MTP layer when the checkpoint has mtp.* tensors
    eos_token_ids: tuple[int, ...] = ()  # config.json's eos_token_id (one id or a list)

    def __post_init__(self) -> None:
        require_positive(self, (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts",
            "num_experts_per_tok", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim", "linear_conv_kernel_dim", "max_position_embeddings", "decoder_sparse_step"),
            zero_ok=("num_experts", "shared_expert_intermediate_size", "intermediate_size"))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"config num_attention_heads = {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads = {self.num_key_value_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"config linear_num_value_heads = {self.linear_num_value_heads} is not a multiple of "
                             f"linear_num_key_heads = {self.linear_num_key_heads}")
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"config num_experts_per_tok = {self.num_experts_per_tok} exceeds "
                             f"num_experts = {self.num_experts}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"config layer_types has {len(self.layer_types)} entries for "
                             f"num_hidden_layers = {self.num_hidden_layers}")
        unknown = set(self.layer_types) - {"linear_attention", "full_attention"}
        if unknown:
            raise ValueError(f"config layer_types: unknown layer type(s) {sorted(unknown)}")
        if not 0 < self.partial_rotary_factor <= 1 or int(self.head_dim * self.partial_rotary_factor) % 2:
            raise ValueError(f"config partial_rotary_factor {self.partial_rotary_factor} must leave an even "
                             f"rotary width of head_dim {self.head_dim}")
        if self.mtp_num_hidden_layers not in (0, 1):
            raise ValueError(f"config mtp_num_hidden_layers {self.mtp_num_hidden_layers}: one MTP layer (chained) "
                             "is what tandem drafts with")

    @classmethod
    def from_dict(cls, raw: dict, **overrides) -> NextConfig:
        """From config.json: Qwen3-Next's, or Qwen3.5-MoE's (its text config, nested in the
        composite config as the checkpoints have it); rope settings flat or under rope_parameters.
        overrides: fields set whatever the file says (the loader's mtp_num_hidden_layers)."""
        composite, raw = raw, raw.get("text_config") or raw
        values = dict(raw)
        values["eos_token_ids"] = eos_token_ids(raw, composite)
        if str(raw.get("model_type") or composite.get("model_type", "")).startswith("qwen3_5"):
            values["linear_projection"] = "split"
        values.update({k: v for k, v in (raw.get("rope_parameters") or {}).items()
                       if k in ("rope_theta", "partial_rotary_factor")})
        values.update(overrides)
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in values.items() if k in names}
        for name in ("layer_types", "mlp_only_layers"):
            if name in values:
                values[name] = tuple(values[name])
        try:
            return cls(**values)
        except TypeError as error:
            raise ValueError(f"config.json: {error}") from None

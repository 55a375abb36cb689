"""Model code shared by both services: the Qwen3-MoE trunk, its MTP layer, loading, experts."""

from shared.model.families.qwen3_moe.config import ModelConfig
from shared.model.kv_cache import KVCache
from shared.model.layers import FULL_ROUTING, RoutingOptions
from shared.model.families.qwen3_moe.loader import save_checkpoint
from shared.model.loader import DTYPES, load_model, resident_bytes
from shared.model.families.qwen3_moe.model import Qwen3MoeModel

__all__ = ["DTYPES", "FULL_ROUTING", "KVCache", "ModelConfig", "Qwen3MoeModel", "RoutingOptions", "load_model", "resident_bytes", "save_checkpoint"]

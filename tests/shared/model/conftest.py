"""Tiny checkpoints built in the tests: Hugging Face `save_pretrained` ones and our own (with MTP)."""

import pytest
import torch

from shared.model import ModelConfig, load_model, save_checkpoint

TINY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=256,
)


def make_hf_checkpoint(path, seed=0, **overrides):
    """A random Qwen3MoeForCausalLM saved with save_pretrained; returns (path, hf_model)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**(TINY | overrides))
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():  # non-trivial norm weights, so a norm mix-up cannot hide
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
            elif "experts" in name or "mlp.gate" in name:
                param.mul_(10.0)  # spread the router so top-k is not a coin toss
    model.save_pretrained(path)
    return path, model


def make_mtp_checkpoint(path, seed=0, **overrides):
    """A random qwen3_moe checkpoint with an MTP layer, written by our own save_checkpoint."""
    raw = {"model_type": "qwen3_moe", "rope_theta": 10000.0, "mtp_num_hidden_layers": 1, "norm_topk_prob": True} | TINY | overrides
    config = ModelConfig.from_dict(raw)
    model = load_model(config=config, random_weights=True, seed=seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    save_checkpoint(model, path)
    return path


@pytest.fixture(scope="session")
def mtp_checkpoint(tmp_path_factory):
    return make_mtp_checkpoint(tmp_path_factory.mktemp("mtp"))

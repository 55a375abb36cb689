"""Shared test configuration."""

import os
from pathlib import Path

# gRPC's C core logs routine connection events (a peer's GOAWAY when a test stops a server)
# at INFO; errors only, set before grpc is first imported.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import pytest
import torch

# Without a GPU the fused Triton kernels run in Triton's interpreter (numpy on the CPU), so the
# suite exercises the kernels' own code, not only their torch references. Set before any
# kernel module imports Triton (they import it lazily, at first use).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shared.model import ModelConfig, load_model

TESTS = Path(__file__).resolve().parent
# Test folders that run the fused kernels' own code (in the interpreter without a GPU); the rest
# drive the services, which on a CPU run the fused ops' torch code, as a deployed service does.
KERNEL_CODE = ("kernels", "shared/model")


@pytest.fixture(autouse=True)
def _service_ops(request, monkeypatch):
    """Outside KERNEL_CODE, no Triton interpreter (child processes inherit the environment too)."""
    if not Path(request.node.path).resolve().relative_to(TESTS).as_posix().startswith(KERNEL_CODE):
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture(autouse=True, scope="session")
def _single_threaded_torch():
    """Most tests run many tiny tensor ops, where intra-op thread wake-ups cost more than the
    work on a busy 2-core machine; one thread keeps the suite fast and its timing stable."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


TINY_MTP = dict(
    model_type="qwen3_moe", vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
    num_experts_per_tok=2, max_position_embeddings=256, rope_theta=10000.0, norm_topk_prob=True,
    initializer_range=0.5, mtp_num_hidden_layers=1,
)


@pytest.fixture(scope="session")
def tiny_mtp_model():
    return load_model(config=ModelConfig.from_dict(TINY_MTP), random_weights=True, seed=2)


@pytest.fixture(scope="session")
def tiny_fp8_model():
    """tiny_mtp_model's shapes with its projections and experts block-scaled FP8 (--quantize fp8)."""
    return load_model(config=ModelConfig.from_dict(TINY_MTP), random_weights=True, seed=2, quantize="fp8")

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

from shared.model import ModelConfig, load_model, save_checkpoint

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


# The Qwen3-Next / Qwen3.5-MoE family at tiny sizes (tests/shared/model, and the hybrid tests of
# both services): transformers' model and ours on the same random weights.
NEXT_CONFIGS = {
    # linear and full attention interleaved (every 2nd layer full), every layer MoE
    "hybrid": dict(vocab_size=97, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                   num_experts=8, num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                   max_position_embeddings=128, full_attention_interval=2, rope_theta=10000.0,
                   partial_rotary_factor=0.25, rms_norm_eps=1e-6),
    # three linear layers before a full one, a dense MLP layer, full rotary width
    "dense layer": dict(vocab_size=97, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=16, intermediate_size=40, moe_intermediate_size=12,
                        shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16,
                        linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=128,
                        full_attention_interval=4, mlp_only_layers=[1], partial_rotary_factor=1.0, rms_norm_eps=1e-6),
}


NEXT_CONFIGS["qwen3.5"] = {k: v for k, v in NEXT_CONFIGS["hybrid"].items() if k != "full_attention_interval"} | dict(
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"])


def next_pair(name, **overrides):
    """(transformers' model, ours with the same weights) for NEXT_CONFIGS[name] | overrides."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from shared.model.families.hybrid.config import NextConfig
    from shared.model.families.hybrid.modules import Qwen3NextModel

    torch.manual_seed(0)
    if name == "qwen3.5":
        reference = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**NEXT_CONFIGS[name] | overrides)).eval()
    else:
        reference = Qwen3NextForCausalLM(Qwen3NextConfig(**NEXT_CONFIGS[name] | overrides)).eval()
    with torch.no_grad():
        for key, parameter in reference.named_parameters():
            parameter.normal_(0, 0.02 if "proj" in key or "embed" in key or "lm_head" in key else 0.2)
        for layer in reference.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.uniform_(-1, 1)
    ours = Qwen3NextModel(NextConfig.from_dict(reference.config.to_dict()))
    state = {key.removeprefix("model."): value for key, value in reference.state_dict().items()}
    ours.load_state_dict(state)
    return reference, ours


@pytest.fixture(name="next_configs", scope="session")
def next_configs_fixture():
    """NEXT_CONFIGS: the tiny Qwen3-Next / Qwen3.5-MoE configs by name."""
    return NEXT_CONFIGS


@pytest.fixture(name="next_pair", scope="session")
def next_pair_fixture():
    """next_pair(name): (transformers' model, ours with the same weights)."""
    return next_pair


TARGET_LAW_PROMPT = (3, 14, 15, 92, 65)


def target_law_two_tokens(model, params, prompt=TARGET_LAW_PROMPT):
    """Exact law of the first two generated tokens after `prompt` under plain sampling."""
    from kernels.sampling import process_logits

    def p_fn(prefix):
        logits, _ = model.score(torch.tensor([*prompt, *prefix]))
        row = process_logits(logits[-1:], params).row(0)
        dense = [0.0] * model.config.vocab_size
        for t, p in row.items():
            dense[t] = p
        return dense
    law = {}
    first = p_fn(())
    for x, px in enumerate(first):
        if px > 0:
            for y, py in enumerate(p_fn((x,))):
                if py > 0:
                    law[(x, y)] = px * py
    return law, p_fn


@pytest.fixture(name="target_law_two_tokens", scope="session")
def target_law_two_tokens_fixture():
    """target_law_two_tokens(model, params, prompt=TARGET_LAW_PROMPT): (law, p_fn); the prompt is
    [3, 14, 15, 92, 65] unless given."""
    return target_law_two_tokens


SPLIT_TINY = dict(
    model_type="qwen3_moe", vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
    num_experts_per_tok=2, max_position_embeddings=256, rope_theta=10000.0, norm_topk_prob=True,
    initializer_range=0.5, mlp_only_layers=[1],
)


@pytest.fixture(scope="session")
def split_checkpoint(tmp_path_factory):
    """(path, config dict): a tiny qwen3_moe checkpoint for splitting over ranks (shared.model.
    parallel): layer 1 dense, norms perturbed."""
    path = tmp_path_factory.mktemp("split")
    model = load_model(config=ModelConfig.from_dict(SPLIT_TINY), random_weights=True, seed=3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    save_checkpoint(model, path)
    return path, SPLIT_TINY


@pytest.fixture(scope="session")
def split_hybrid_checkpoints(tmp_path_factory):
    """{name: path}: transformers-saved tiny Qwen3-Next ("hybrid") and Qwen3.5-MoE ("qwen3.5")
    checkpoints the fused path runs (the shared expert no wider than a routed one), for
    splitting over ranks."""
    paths = {}
    for name in ("hybrid", "qwen3.5"):
        reference, _ = next_pair(name, shared_expert_intermediate_size=16)
        paths[name] = tmp_path_factory.mktemp(name.replace(".", "_"))
        reference.save_pretrained(paths[name])
    return paths


def _frames_on(conn, count: int) -> list[tuple[int, bytes]]:
    """`count` frames (shared.local_stream's) read from a plain blocking socket: what reached it."""
    from shared.local_stream import HEADER

    def exactly(size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = conn.recv(size - len(data))
            assert chunk, "the stream ended early"
            data += chunk
        return data

    frames = []
    for _ in range(count):
        length, kind = HEADER.unpack(exactly(HEADER.size))
        frames.append((kind, exactly(length)))
    return frames


@pytest.fixture(name="frames_on")
def frames_on_fixture():
    """frames_on(conn, count): the next `count` local-stream frames a bare socket peer received."""
    return _frames_on

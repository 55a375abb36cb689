"""Constants and small helpers shared by the pair_speedup modules."""

from __future__ import annotations

import os
import socket
import statistics
import sys
from pathlib import Path

SETUPS = ("cpu-embedded", "gpu-embedded", "cpu-synthetic", "gpu-synthetic")
PROMPTS = (
    "import os\n\n\ndef read_lines(path):",
    "class Stack:\n    def __init__(self):",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "import json\n\n\ndef load_config(path):\n    with open(path) as f:",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
    "class Node:\n    def __init__(self, value, children=None):",
    "def merge_sort(items):\n    if len(items) <= 1:",
    "import re\n\n\ndef tokenize(text):",
)
QWEN3_30B_A3B = dict(  # bench/model_baseline.py's shapes (no eos: fixed-length completions)
    vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
    norm_topk_prob=True, max_position_embeddings=4096, rope_theta=1e6, model_type="qwen3_moe",
)
QWEN3_5_35B_A3B = dict(  # transformers' Qwen3_5MoeTextConfig defaults (the 35B-A3B checkpoint's text model)
    vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
    head_dim=256, intermediate_size=512, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    num_experts=256, num_experts_per_tok=8, linear_num_key_heads=16, linear_num_value_heads=32,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, rope_theta=10000.0,
    partial_rotary_factor=0.25, norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=4096,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 10,
    mtp_num_hidden_layers=1, eos_token_id=[], model_type="qwen3_5_moe_text",
)
QWEN3_NEXT_80B_A3B = QWEN3_5_35B_A3B | dict(  # Qwen3-Next-80B-A3B's config.json: 48 layers, 512 experts, top 10
    vocab_size=151936, num_hidden_layers=48, num_experts=512, num_experts_per_tok=10, rope_theta=1e7,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 12, model_type="qwen3_next",
)
QWEN3_235B_A22B = QWEN3_30B_A3B | dict(  # Qwen3-235B-A22B's config.json (issue 40's 4-GPU shapes)
    hidden_size=4096, num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
    intermediate_size=12288, moe_intermediate_size=1536, num_experts=128, num_experts_per_tok=8,
)
SHAPES = {
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "qwen3-235b-a22b": QWEN3_235B_A22B,
    "qwen3-next-80b-a3b": QWEN3_NEXT_80B_A3B,
    "qwen3.5-35b-a3b": QWEN3_5_35B_A3B,
    # a few-MB model of the same family: smoke-tests the random-weights path anywhere
    "smoke": QWEN3_30B_A3B | dict(vocab_size=4096, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=64, intermediate_size=512, moe_intermediate_size=128,
                                  num_experts=16, num_experts_per_tok=2),
    "smoke-hybrid": QWEN3_5_35B_A3B | dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=64, moe_intermediate_size=128,
                                           shared_expert_intermediate_size=128, num_experts=16, num_experts_per_tok=2,
                                           linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                                           linear_value_head_dim=32, layer_types=["linear_attention"] * 3 + ["full_attention"]),
}
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


def request_spec(prompt: list[int], new_tokens: int, *, temperature: float = 0.0, seed: int = 0,
                 request_id: str = "bench", max_draft_tokens: int = 4):
    """An exact-mode RequestSpec for benchmarks that drive the Engine directly (top-p 0.95 when
    sampled; max_draft_tokens 0: a request that never drafts)."""
    from kernels.retention import RetentionPolicy
    from kernels.sampling import SamplingParams
    from kernels.speculative import Gate, Mode
    from verifier_service.requests import RequestSpec

    sampling = SamplingParams(temperature=temperature, top_p=0.95 if temperature else 1.0)
    return RequestSpec(
        request_id=request_id, prompt_ids=tuple(prompt), max_new_tokens=new_tokens, sampling=sampling, seed=seed,
        mode=Mode.EXACT, gate=Gate.TOP, speculate=max_draft_tokens > 0, coupled=False,
        max_draft_tokens=max_draft_tokens, retention=RetentionPolicy(), retention_schedule="", retention_min_cum=0.0,
        eos_token_ids=frozenset(), stop_sequences=(),
    )


def cpu_seconds(pid: int, thread: int | None = None) -> float:
    """The process's CPU time so far, every thread's (or one thread's), user and system, with its
    live child processes' (a verifier's front processes and ranks: the service's work too)
    (Linux: /proc; else 0)."""
    try:
        stat = Path(f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat")
        fields = stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return own if thread is not None else own + sum(cpu_seconds(child) for child in _children(pid))


def _children(pid: int) -> list[int]:
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []
    children = []
    for task in tasks:
        try:
            children += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            pass
    return children


def log(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mean(values) -> float | None:
    values = list(values)
    return statistics.fmean(values) if values else None


def median(values) -> float | None:
    values = list(values)
    return statistics.median(values) if values else None


def fmt(value, spec: str = ".2f", none: str = "n/a") -> str:
    return none if value is None else format(value, spec)


class ServiceError(RuntimeError):
    """A child service that did not start or died (the message carries its log's tail)."""

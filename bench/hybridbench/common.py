"""What the parts of bench/hybrid_fast.py share: the device, the small shapes of --small, the
bytes a decode step must move, request specs, timing helpers."""

from __future__ import annotations

import time

import torch

STARTED = time.perf_counter()
CHUNK = 2048  # prefill chunk (the service's default)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (the CPU: --small, a smoke test of the correctness parts)
SMALL = dict(vocab_size=512, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
             moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=16, num_experts_per_tok=4,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def elapsed() -> float:
    return time.perf_counter() - STARTED


def step_bytes(model, context: int, *, num_seqs: int = 1, experts_read: float | None = None) -> int:
    """Bytes one decode step of num_seqs sequences must move: weights read once (routed experts:
    experts_read a layer, default top_k), the linear layers' float32 states read and written,
    the KV rows read, one embedding row each."""
    c, item = model.config, model.embed_tokens.weight.element_size()
    per_expert = 3 * c.moe_intermediate_size * c.hidden_size * item
    experts_read = c.num_experts_per_tok if experts_read is None else experts_read
    total = 0
    for name, param in model.named_parameters():
        if name.startswith(("embed_tokens", "mtp.")) or ".mlp.experts." in name:
            continue
        total += param.numel() * item
    num_moe = sum(1 for layer in model.layers if hasattr(layer.mlp, "experts"))
    total += num_moe * int(experts_read * per_expert)
    total += num_seqs * c.hidden_size * item
    state = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    conv = (2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim) \
        * (c.linear_conv_kernel_dim - 1) * item
    num_linear = sum(1 for layer in model.layers if layer.linear)
    total += num_seqs * num_linear * 2 * (state + conv)
    total += num_seqs * model.num_kv_layers * context * 2 * c.num_key_value_heads * c.head_dim * item
    return total


def expected_distinct(num_experts: int, top_k: int, rows: int) -> float:
    """Distinct experts `rows` rows select under uniform routing (a random router's stand-in)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** rows)


def replay_ms(graph, steps: int) -> float:
    """ms per replay of a captured graph, `steps` back to back (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(steps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))

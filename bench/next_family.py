"""The Qwen3.5-MoE family at Qwen3.5-35B-A3B shapes, random bf16 weights (issue 17).

The family runs the reference modules (eager torch; the fused, graph-captured path is built
for qwen3_moe only), so these are the numbers a user gets today, against the floor:
- the weights each service holds: the verifier's trunk and a lean drafter's MTP layer,
  embeddings and lm_head (shared.model.resident_bytes, built on the device);
- through the service, from the client: `tandem verifier --model DIR --random-weights`
  (config.json only), one greedy request of `--new-tokens` after a `--context`-token prompt,
  decode tokens/s = tokens after the first / (last arrival - first arrival); `--blocks`
  requests;
- the raw eager step in this process on the same shapes (after the service stopped: two
  copies of 35B weights do not fit one GPU): decode ms/token, and verify windows of T rows
  with the rollback's kept states (time(T)/time(1)), each the median of `--steps` steps;
- the floor: bytes a decode step must move (active weights: attention / linear-attention
  projections, router, shared expert, 8 routed experts per layer, lm_head; the linear
  layers' float32 states read and written; the KV rows read) / measured copy bandwidth;
- on CUDA the MoE blocks of windows up to 64 rows run qwen3_moe's fused expert kernels: their
  output against the per-expert loop is printed; `--profile`: torch.profiler of 3 steps.

    python bench/next_family.py [--layers 40] [--context 512] [--new-tokens 64] [--blocks 2] [--skip-service] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pairbench.common import QWEN3_5_35B_A3B, free_port, log  # noqa: E402  (puts the repo and protocol modules on sys.path)
from pairbench.services import Children  # noqa: E402

from bench.serve_decode import client_decode  # noqa: E402
from shared.client import GenerationConfig  # noqa: E402
from shared.model import resident_bytes  # noqa: E402
from shared.model.families.hybrid.loader import random_next  # noqa: E402
from shared.model.families.hybrid.config import NextConfig  # noqa: E402

LAYER_PATTERN = ["linear_attention"] * 3 + ["full_attention"]


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth, bytes/s (read + write counted), median of 10."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / statistics.median(times)


def step_bytes(model, context: int) -> int:
    """Bytes one decode step must move: active weights, linear states (read + write), KV rows."""
    c, item = model.config, model.embed_tokens.weight.element_size()
    total = 0
    for name, param in model.named_parameters():
        if name.startswith(("embed_tokens", "mtp.")):
            continue
        numel = param.numel()
        if ".mlp.experts." in name:
            numel = numel * c.num_experts_per_tok // c.num_experts
        total += numel * item
    total += c.hidden_size * item  # the token's embedding row
    num_linear = sum(1 for layer in model.layers if layer.linear)
    state = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    conv = (2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim) \
        * (c.linear_conv_kernel_dim - 1) * item
    total += num_linear * 2 * (state + conv)
    total += model.num_kv_layers * context * 2 * c.num_key_value_heads * c.head_dim * item
    return total


def timed_ms(fn, steps: int) -> float:
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def raw_steps(model, context: int, windows: list[int], steps: int) -> dict[int, float]:
    """ms of a window of T rows after a `context`-token prompt, rolled back after each step."""
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (context,), generator=gen).to("cuda")
    cache = model.new_cache(context + max(windows) + 1)
    for start in range(0, context, 2048):
        model.prefill(prompt[start : start + 2048], cache)
    out = {}
    for rows in windows:
        ids = torch.randint(0, model.config.vocab_size, (rows,), generator=gen).to("cuda")

        def step():  # (bound per window size: rows, ids)
            model(ids, cache, keep_states=rows > 1)
            if rows > 1:
                cache.truncate(context + 1)  # a rollback: the head's row kept, none of the drafts
            cache.kv.truncate(context)  # the next step starts where this one did (states: timing only)

        out[rows] = timed_ms(step, steps)
        log(f"  raw step: T = {rows}: {out[rows]:.2f} ms")
    return out


def check_fused_experts(model) -> float:
    """The MoE block on CUDA (fused expert kernels) against its per-expert loop on the same
    rows: the largest difference relative to the output's scale (bf16 noise ~1e-2)."""
    mlp = next(layer.mlp for layer in model.layers if hasattr(layer.mlp, "experts"))
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(3)).to("cuda", model.dtype)
    with torch.inference_mode():
        weights, expert_ids = torch.topk(torch.softmax(mlp.gate(x), dim=-1, dtype=torch.float32), mlp.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        loop = mlp.experts(x, expert_ids, weights.to(x.dtype)) + torch.sigmoid(mlp.shared_expert_gate(x)) * mlp.shared_expert(x)
        fused = mlp(x)
    return float((fused.float() - loop.float()).abs().max() / loop.float().abs().max())


def profile_decode(model, context: int) -> None:
    """torch.profiler over 3 decode steps: the ops by their own CUDA and CPU time (stderr)."""
    cache = model.new_cache(context + 8)
    model.prefill(torch.randint(0, model.config.vocab_size, (context,)).to("cuda"), cache)
    ids = torch.tensor([1], device="cuda")
    model(ids, cache, keep_states=False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            model(ids, cache, keep_states=False)
        torch.cuda.synchronize()
    log(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    log(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=40, help="trunk layers (40: the real depth)")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=2, help="requests through the service")
    parser.add_argument("--windows", default="1,2,5")
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--skip-service", action="store_true")
    parser.add_argument("--profile", action="store_true", help="torch.profiler of 3 decode steps (stderr)")
    args = parser.parse_args()
    layer_types = (LAYER_PATTERN * args.layers)[: args.layers]
    shapes = QWEN3_5_35B_A3B | dict(num_hidden_layers=args.layers, layer_types=layer_types,
                                    max_position_embeddings=max(4096, args.context + args.new_tokens + 64))
    config = NextConfig.from_dict(shapes)
    print(f"### the Qwen3.5-MoE family, reference path: {time.strftime('%Y-%m-%d')}, {torch.cuda.get_device_name()}, "
          f"Qwen3.5-35B-A3B shapes ({args.layers} layers), bf16, random weights\n")
    bandwidth = copy_bandwidth()
    log(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")

    service = []
    if not args.skip_service:
        workdir = Path(tempfile.mkdtemp(prefix="next-family-"))
        model_dir = workdir / "model"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(shapes))
        children = Children(workdir)
        port = free_port()
        try:
            children.start("verifier", [sys.executable, "-m", "shared.cli", "verifier", "--model", str(model_dir),
                                        "--random-weights", "--device", "cuda", "--dtype", "bfloat16", "--port",
                                        str(port), "--max-sessions", "1", "--grace-s", "2"])
            address = f"127.0.0.1:{port}"
            asyncio.run(children.wait_serving("verifier", address, timeout=900))
            prompt = torch.randint(0, config.vocab_size, (args.context,),
                                   generator=torch.Generator().manual_seed(1)).tolist()
            client_decode(address, prompt[:32], GenerationConfig(max_new_tokens=4))  # warm-up
            for block in range(args.blocks):
                result = client_decode(address, prompt, GenerationConfig(max_new_tokens=args.new_tokens,
                                                                          temperature=0.0, speculation=False))
                service.append(result)
                log(f"  service block {block + 1}: {result['decode_tokens_per_s']:.2f} tokens/s, "
                    f"TTFT {result['ttft_ms']:.0f} ms")
        finally:
            children.stop()
        torch.cuda.empty_cache()

    log("building the trunk (the verifier's part) ...")
    trunk = random_next(replace(config, mtp_num_hidden_layers=0), dtype=torch.bfloat16, device="cuda", parts="trunk")
    trunk_bytes = resident_bytes(trunk)
    experts_diff = check_fused_experts(trunk)
    windows = [int(w) for w in args.windows.split(",")]
    raw = raw_steps(trunk, args.context, windows, args.steps)
    if args.profile:
        profile_decode(trunk, args.context)
    floor_ms = step_bytes(trunk, args.context) / bandwidth * 1e3
    del trunk
    torch.cuda.empty_cache()
    lean = random_next(config, dtype=torch.bfloat16, device="cuda", parts="mtp")
    lean_bytes = resident_bytes(lean)
    del lean

    print(f"Copy bandwidth {bandwidth / 1e12:.2f} TB/s; floor {floor_ms:.3f} ms/token "
          f"({step_bytes.__doc__.split(':')[0].lower()} at context {args.context}). The MoE block's "
          f"fused experts against its per-expert loop: max difference {experts_diff:.2e} of the output's scale.\n")
    print("| arm | tokens/s | ms/token | fraction of the floor |")
    print("| --- | ---: | ---: | ---: |")
    if service:
        rate = statistics.median(r["decode_tokens_per_s"] for r in service)
        print(f"| service, from the client (median of {len(service)}) | {rate:.2f} | {1e3 / rate:.2f} "
              f"| {floor_ms / (1e3 / rate):.3f} |")
    print(f"| raw eager step (median of {args.steps}) | {1e3 / raw[1]:.2f} | {raw[1]:.2f} | {floor_ms / raw[1]:.3f} |")
    print("\n| window rows T | ms | time(T)/time(1) |")
    print("| ---: | ---: | ---: |")
    for rows in windows:
        print(f"| {rows} | {raw[rows]:.2f} | {raw[rows] / raw[1]:.2f} |")
    print("\n| service part | resident GiB |")
    print("| --- | ---: |")
    print(f"| verifier (trunk, {args.layers} layers) | {trunk_bytes / 2**30:.2f} |")
    print(f"| lean drafter (MTP layer, embeddings, lm_head) | {lean_bytes / 2**30:.2f} |")


if __name__ == "__main__":
    main()

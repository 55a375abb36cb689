"""The captured decode-batch step on the GPU (issue 11): B sequences, one row each, one forward.

Random bf16 weights at Qwen3-30B-A3B shapes (or --small); every sequence has its own KV slot
filled to --context positions (stand-in values: attention cost does not depend on them).
Reports per batch size the graph replay time (CUDA events, median), the time per sequence,
the throughput of the raw step, the ratio to B = 1 and the distinct experts per MoE layer
the batch's random tokens select, against the bandwidth floor (weights of the distinct
experts + dense weights + KV read, over the measured copy bandwidth). Comparing it with
bench/serve_load.py's time per output token at the same concurrency gives the service's
host overhead per step.

`--moe-table-ab`: instead, the expert kernels finding their groups by comparing routes
against reading them from the route table (kernels/fused/moe.py, TABLE_MIN_ROUTES), each
captured in its own graphs on the same weights and KV, timed interleaved (pairs of medians,
the median of the paired ratios), and their logits compared bit for bit.

Usage: python bench/batch_step.py [--small] [--batches 1,2,4,8,16,32,64] [--context 512] [--moe-table-ab]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from bench.fused_step import distinct_experts_seen, kv_bytes, weight_bytes_per_token
from bench.model_baseline import QWEN3_30B_A3B, SMALL, copy_bandwidth, cuda_time
from shared.model import ModelConfig, load_model
from shared.model.families.qwen3_moe.fused import FusedModel
from shared.model.graphs import FusedRunner
from shared.model.kv_cache import KVPool


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=64, help="KV block size (0: one block per sequence)")
    parser.add_argument("--moe-table-ab", action="store_true", help="group lookup by comparison vs the route table, paired")
    parser.add_argument("--pairs", type=int, default=7)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    largest = max(batches)
    length = args.context + 64
    config = ModelConfig.from_dict((SMALL if args.small else QWEN3_30B_A3B) | dict(max_position_embeddings=4096))
    model = load_model(config=config, random_weights=True, dtype=torch.bfloat16, device="cuda", seed=0)
    c = config
    pool = KVPool(num_layers=c.num_hidden_layers, num_slots=largest + 1, max_length=length,
                  num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype=torch.bfloat16, device="cuda",
                  block_size=args.block_size or None)
    gen = torch.Generator(device="cuda").manual_seed(3)
    pool.keys.normal_(0, 1, generator=gen)
    pool.values.normal_(0, 1, generator=gen)
    slots = [pool.acquire(length)[0] for _ in range(largest)]
    scratch, _ = pool.acquire(1)
    token_gen = torch.Generator().manual_seed(5)

    def random_tokens(n):
        return torch.randint(0, c.vocab_size, (n,), generator=token_gen).tolist()

    if args.moe_table_ab:
        table_ab(model, pool, slots, scratch, batches, args.context, random_tokens, length, args.pairs)
        return
    fused = FusedModel(model, max_rows=max(largest, 2), max_length=length)
    runner = FusedRunner(fused, pool, max_rows=1, max_batch_rows=max(largest, 2), scratch_slot=scratch)
    runner.capture([1], progress=lambda what, s: print(f"  captured {what} in {s:.2f}s", file=sys.stderr, flush=True))

    bandwidth = copy_bandwidth()
    dense = weight_bytes_per_token(model)  # with 8 experts per layer
    expert_bytes = model.layers[0].mlp.experts.expert_bytes
    moe_layers = sum(1 for layer in model.layers if hasattr(layer.mlp, "experts"))
    print(f"\ncopy bandwidth {bandwidth / 1e12:.2f} TB/s, context {args.context}, KV block size "
          f"{args.block_size or 'one per sequence'}\n")
    print("| batch B | step ms (graph) | ms per sequence | raw tokens/s | × B = 1 | distinct experts/layer | floor ms | of floor |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    base = None
    for b in batches:
        windows = [(slot, [t], args.context) for slot, t in zip(slots[:b], random_tokens(b))]
        runner.run(windows)
        graph = runner.last_graph()
        ms = statistics.median(cuda_time(graph.replay, 30))
        base = base or ms
        experts = distinct_with_batch(runner, windows) if b > 1 else 8.0
        floor_bytes = dense + moe_layers * (experts - c.num_experts_per_tok) * expert_bytes + b * kv_bytes(model, args.context)
        floor = floor_bytes / bandwidth * 1e3
        print(f"| {b} | {ms:.3f} | {ms / b:.3f} | {b * 1e3 / ms:.0f} | {b * base / ms:.2f} | {experts:.1f} | {floor:.3f} "
              f"| {floor / ms:.2f} |")


def table_ab(model, pool, slots, scratch, batches, context, random_tokens, length, pairs) -> None:
    from kernels.fused import moe

    default = moe.TABLE_MIN_ROUTES
    largest = max(batches)
    runners = {}
    for name, threshold in (("compare", 1 << 30), ("table", 1)):
        moe.TABLE_MIN_ROUTES = threshold  # read while the graphs are captured
        try:
            runner = FusedRunner(FusedModel(model, max_rows=max(largest, 2), max_length=length), pool, max_rows=1,
                                  max_batch_rows=max(largest, 2), scratch_slot=scratch)
            runner.capture([1])
        finally:
            moe.TABLE_MIN_ROUTES = default
        runners[name] = runner
        print(f"  captured the {name} graphs", file=sys.stderr, flush=True)
    top_k = model.config.num_experts_per_tok
    print(f"\nexpert groups: by comparing routes vs from the route table (default from {default} routes); "
          f"context {context}, {pairs} pairs of 10-replay medians\n")
    print("| rows | routes | compare ms | table ms | table / compare | logits identical |")
    print("| ---: | ---: | ---: | ---: | ---: | --- |")
    for b in batches:
        windows = [(slot, [t], context) for slot, t in zip(slots[:b], random_tokens(b))]
        graphs, logits = {}, {}
        for name, runner in runners.items():
            out = runner.run(windows)
            graphs[name] = runner.last_graph()
            logits[name] = out.logits[:b].clone()
        times = {name: [] for name in graphs}
        ratios = []
        for _ in range(pairs):
            for name, graph in graphs.items():
                times[name].append(statistics.median(cuda_time(graph.replay, 10)))
            ratios.append(times["table"][-1] / times["compare"][-1])
        same = torch.equal(logits["compare"], logits["table"])
        print(f"| {b} | {b * top_k} | {statistics.median(times['compare']):.3f} | {statistics.median(times['table']):.3f} "
              f"| {statistics.median(ratios):.3f} | {same} |", flush=True)


def distinct_with_batch(runner, windows) -> float:
    """Mean distinct experts per MoE layer of one eager decode batch."""
    captured = runner.use_graphs
    runner.use_graphs = False  # eager: the Python-level route call runs
    try:
        with distinct_experts_seen() as seen:
            runner.run(windows)
    finally:
        runner.use_graphs = captured
    return statistics.mean(seen)

if __name__ == "__main__":
    main()

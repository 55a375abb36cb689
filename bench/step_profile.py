"""Where the captured decode step's time goes, kernel by kernel, inside the graph (issue 10).

Per-kernel times measured alone miss how kernels overlap under programmatic dependent launch,
so this bench profiles replays of the captured window graphs themselves (torch.profiler, CUPTI
kernel records) and reads the chain: kernels in the order they ran, and for each kind its
mean duration and its mean *chain cost* = its end minus the end of the kernel before it (what
it adds to the step; durations overlap under PDL, chain costs add up to the step). Random bf16
weights at Qwen3-30B-A3B shapes, or (--family hybrid) Qwen3.5-35B-A3B's.

Usage: python bench/step_profile.py [--family qwen3_moe|hybrid] [--layers 48] [--windows 1,5] [--contexts 512,4096] [--replays 20]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from bench.fused_step import replay_time
from bench.model_baseline import QWEN3_30B_A3B
from bench.pairbench.common import QWEN3_5_35B_A3B
from shared.model import ModelConfig, load_model
from shared.model.families import build_fused
from shared.model.graphs import FusedRunner
from shared.model.kv_cache import KVPool


def log(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def short_name(name: str) -> str:
    """A kernel's readable kind (Triton kernels by their function name)."""
    name = re.sub(r"_\d+d\d*.*$", "", name)  # Triton's specialisation suffixes
    return name[:60]


def chain_table(events: list[tuple[str, float, float]], num_replays: int) -> list[tuple[str, int, float, float]]:
    """[(kind, launches per replay, mean duration µs, mean chain cost µs)] from (name, start, end)
    kernel records in start order."""
    durations: dict[str, list[float]] = defaultdict(list)
    chain: dict[str, list[float]] = defaultdict(list)
    previous_end, previous_kind = None, ""
    for name, start, end in events:
        kind = short_name(name)
        if kind.startswith("linear"):  # one kernel for every projection: named by what ran before it
            kind = f"{kind} after {previous_kind.split(' ')[0]}"
        previous_kind = kind
        durations[kind].append(end - start)
        if previous_end is not None:
            chain[kind].append(max(0.0, end - previous_end) if end - previous_end < 200 else end - start)
        previous_end = end if previous_end is None else max(previous_end, end)
    rows = []
    for kind, values in durations.items():
        costs = chain.get(kind, [0.0])
        rows.append((kind, round(len(values) / num_replays), statistics.mean(values), statistics.mean(costs)))
    return sorted(rows, key=lambda r: -r[1] * r[3])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", choices=("qwen3_moe", "hybrid"), default="qwen3_moe")
    parser.add_argument("--layers", type=int, default=None, help="default: the real depth (48, 40)")
    parser.add_argument("--windows", default="1,5")
    parser.add_argument("--contexts", default="512,4096")
    parser.add_argument("--replays", type=int, default=20)
    args = parser.parse_args()
    windows = [int(w) for w in args.windows.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    max_length = max(contexts) + max(windows) + 8
    if args.family == "hybrid":
        from dataclasses import replace

        from shared.model.families.hybrid.loader import random_next
        from shared.model.families.hybrid.config import NextConfig

        args.layers = args.layers or 40
        shapes = QWEN3_5_35B_A3B | dict(num_hidden_layers=args.layers, max_position_embeddings=max(max_length, 4160),
                                        layer_types=QWEN3_5_35B_A3B["layer_types"][: args.layers])
        config = replace(NextConfig.from_dict(shapes), mtp_num_hidden_layers=0)
        model = random_next(config, dtype=torch.bfloat16, device="cuda", parts="trunk")
    else:
        args.layers = args.layers or 48
        config = ModelConfig.from_dict(QWEN3_30B_A3B | dict(num_hidden_layers=args.layers,
                                                            max_position_embeddings=max(max_length, 4096 + 64)))
        model = load_model(config=config, random_weights=True, dtype=torch.bfloat16, device="cuda", seed=0)
    pool = KVPool(num_layers=model.num_kv_layers, num_slots=1, max_length=max_length,
                  num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim, dtype=torch.bfloat16,
                  device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(3)
    pool.keys.normal_(0, 1, generator=gen)
    pool.values.normal_(0, 1, generator=gen)
    fused = build_fused(model, max_rows=max(windows), max_length=max_length, num_state_slots=1)
    runner = FusedRunner(fused, pool, max_rows=max(windows))
    runner.capture(windows)
    for context in contexts:
        for rows in windows:
            step_ms = replay_time(runner, rows, context)
            runner.run([(0, [1] * rows, context)])
            graph, _ = runner.graphs[rows]
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.replays):
                    graph.replay()
                torch.cuda.synchronize()
            events = sorted(((e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                             if e.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in e.name.lower()
                             and "memset" not in e.name.lower()), key=lambda e: e[1])
            table = chain_table(events, args.replays)
            total_chain = sum(n * cost for _, n, _, cost in table)
            print(f"\n### T={rows}, context {context}: step {step_ms:.3f} ms (replay alone), "
                  f"{len(events) / args.replays:.0f} kernels a replay, chain sum {total_chain / 1000:.3f} ms "
                  f"({args.layers} layers)\n")
            print("| kernel | per step | mean µs | chain µs (each) | chain ms (all) | per layer µs |")
            print("| --- | ---: | ---: | ---: | ---: | ---: |")
            for kind, n, duration, cost in table:
                print(f"| {kind} | {n} | {duration:.2f} | {cost:.2f} | {n * cost / 1000:.3f} | "
                      f"{n * cost / args.layers:.2f} |")
            sys.stdout.flush()


if __name__ == "__main__":
    main()

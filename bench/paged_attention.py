"""The decode/verify attention kernel by KV layout: contiguous (one block per sequence) against
paged blocks of 16, 64 and 256 positions scattered over the pool (issue 11's paged KV).

Qwen3-30B-A3B attention shapes (32 query heads, 4 KV heads, head_dim 128), bf16, one layer's
cache; per context and window size, each layout's kernel time by CUDA events (48 launches
captured as one graph, µs per launch, median of `--repeats` replays), the layouts interleaved
`--pairs` times; ratios are medians of paired
ratios against the contiguous layout. Outputs are checked bit for bit against the contiguous
layout's (same keys, same order of reduction).
With --baseline PATH (the kernels/fused/attention.py of a tree before paging, e.g. from
`git archive`), that kernel on the contiguous layout joins the comparison ("before").
Usage:
  python bench/paged_attention.py [--contexts 512,4096,32768] [--rows 1,5] [--pairs 7] [--repeats 20] [--baseline PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kernels.fused import cdiv  # noqa: E402
from kernels.fused.attention import AttentionWorkspace, decode_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 4, 128
BLOCK_SIZES = (16, 64, 256)


LAUNCHES = 48  # per graph: one attention per layer of a decode step, back to back


def captured(fn) -> torch.cuda.CUDAGraph:
    """LAUNCHES calls of fn as one CUDA graph (device time, without Python's launch overhead)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAUNCHES):
            fn()
    return graph


def cuda_us(graph: torch.cuda.CUDAGraph, repeats: int) -> float:
    """µs per call: median over `repeats` replays of the graph."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / LAUNCHES)
    return statistics.median(times)


def layouts(context: int, generator: torch.Generator) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(keys, values, block_tables) of one sequence's cache of `context` + 16 positions per layout,
    slot 0 holding the same keys in each."""
    length = context + 16
    keys = torch.randn(length, KV_HEADS, HEAD_DIM, generator=generator, device="cuda").to(torch.bfloat16)
    values = torch.randn(length, KV_HEADS, HEAD_DIM, generator=generator, device="cuda").to(torch.bfloat16)
    out = {"contiguous": (keys[None], values[None], torch.zeros((1, 1), dtype=torch.int32, device="cuda"))}
    for size in BLOCK_SIZES:
        num = cdiv(length, size)
        pool_blocks = 2 * num  # the sequence's blocks scattered over a pool twice its size
        order = torch.randperm(pool_blocks, generator=generator, device="cuda")[:num]
        paged_keys = torch.zeros(pool_blocks, size, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        paged_values = torch.zeros_like(paged_keys)
        padded = num * size
        paged_keys[order] = torch.nn.functional.pad(keys, (0, 0, 0, 0, 0, padded - length)).view(num, size, KV_HEADS,
                                                                                                  HEAD_DIM)
        paged_values[order] = torch.nn.functional.pad(values, (0, 0, 0, 0, 0, padded - length)).view(num, size,
                                                                                                      KV_HEADS, HEAD_DIM)
        out[f"paged {size}"] = (paged_keys, paged_values, order.to(torch.int32)[None])
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", default="512,4096,32768")
    parser.add_argument("--rows", default="1,5")
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--baseline", type=Path, default=None, help="attention.py of a tree before paging")
    args = parser.parse_args()
    generator = torch.Generator(device="cuda").manual_seed(0)
    names = ["contiguous", *(f"paged {s}" for s in BLOCK_SIZES)]
    before = None
    if args.baseline is not None:
        spec = importlib.util.spec_from_file_location("attention_before_paging", args.baseline)
        before = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(before)
        names.append("before")
    print(f"### paged attention: {time.strftime('%Y-%m-%d')}, {torch.cuda.get_device_name()}, "
          f"{HEADS} q heads / {KV_HEADS} KV heads x {HEAD_DIM}, bf16\n")
    print("| context | rows | " + " | ".join(f"{n} µs" for n in names) + " | "
          + " | ".join(f"{n} / contiguous" for n in names[1:]) + " | bits equal |")
    print("| ---: | ---: |" + " ---: |" * (2 * len(names) - 1) + " --- |")
    for context in (int(c) for c in args.contexts.split(",")):
        caches = layouts(context, generator)
        workspace = AttentionWorkspace(17, HEADS, HEAD_DIM, context + 16 + 256, "cuda")
        for rows in (int(r) for r in args.rows.split(",")):
            q = torch.randn(rows, HEADS, HEAD_DIM, generator=generator, device="cuda").to(torch.bfloat16)
            positions = torch.arange(context - rows + 1, context + 1, device="cuda")
            slots = torch.zeros(rows, dtype=torch.int64, device="cuda")
            starts = torch.tensor([0, rows], dtype=torch.int32, device="cuda")

            def run(name):
                if name == "before":  # the earlier kernel: [slots, max_length, ...] caches, no tables
                    keys, values, _ = caches["contiguous"]
                    return before.decode_attention(q, keys, values, positions, slots, starts, slots[:1], rows,
                                                   workspace, pdl=False)
                keys, values, tables = caches[name]
                return decode_attention(q, keys, values, tables, positions, slots, starts, slots[:1], rows, workspace,
                                        pdl=False)

            outs = {name: run(name).clone() for name in names}
            equal = all(torch.equal(outs[name], outs["contiguous"]) for name in names)
            graphs = {name: captured(lambda name=name: run(name)) for name in names}
            times = {name: [] for name in names}
            for pair in range(args.pairs):
                for name in names[pair % len(names):] + names[: pair % len(names)]:
                    times[name].append(cuda_us(graphs[name], args.repeats))
            ratios = [statistics.median(t / c for t, c in zip(times[name], times["contiguous"])) for name in names[1:]]
            print(f"| {context} | {rows} | " + " | ".join(f"{statistics.median(times[n]):.2f}" for n in names)
                  + " | " + " | ".join(f"{r:.3f}" for r in ratios) + f" | {equal} |")
            sys.stdout.flush()


if __name__ == "__main__":
    main()

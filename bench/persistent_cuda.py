"""Does a persistent step pay in CUDA C++? Issue 39's second probe, against today's kernels.

The `layer` chain of bench/persistent_probe.py (Qwen3-30B-A3B shapes: qkv [4096, 2048], o_proj
[2048, 4096] with its norm, the router [128, 2048], 8 of 128 experts with gate/up [1536, 2048] and
down [2048, 768], the combine and its norm; no attention), `--layers` layers of random bf16
weights (well past L2), run two ways on the same weights:
- today: the service's kernels, captured in one CUDA graph (persistent_probe.today_ops);
- cuda: kernels.fused.persistent_cuda.LayerChain — one persistent kernel, weights streamed into
  shared memory by a producer warp with bulk copies, stage boundaries as counters — its products
  on tensor cores (mma) with `--slots` ring slots (1: no weight prefetch across a boundary; the
  most that fit: the design), on CUDA cores (fma), and streaming alone (every tile taken, no
  products: what the ring and the stage boundaries cost without arithmetic).
First, the ring alone (`stream_ring`, no stages): the grid streams 2 GiB in tiles of bulk copies
of several sizes through several slots — the rate this design can reach at all.
Also the `tiny` chain (H = Q = 256, I = 64): a layer's five stage boundaries with no bytes to
speak of, i.e. what the counters and the stage starts cost.

Before timing, the CUDA chain is checked: against the torch reference (kernels.fused.persistent_cuda.
reference) on the first two layers (same routes; largest difference relative to the largest
value), every row alone bit-equal to the row in the batch, and the bits unchanged by the slots.

Per rows and way: µs a layer (median of graph replays), the weights' GB/s (each expert the rows
route to counted once), the fraction of the floor (those bytes at the device-to-device copy's
rate measured in this run), and the paired ratio today / way (> 1: faster than today), the
median over `--blocks` blocks that alternate the ways.

Usage: python bench/persistent_cuda.py [--blocks 5] [--reps 10] [--rows 1,5] [--layers 8]
       [--slots 1,2,max]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.fused_step import graph_time  # noqa: E402
from bench.model_baseline import copy_bandwidth, cuda_time  # noqa: E402
from bench.persistent_probe import chain, today_ops  # noqa: E402
from kernels.fused.persistent_cuda import (ChainLayer, LayerChain, barrier_chain, reference, rms,  # noqa: E402
                                           stream_ring)


def launch_seconds(launch, repeats: int = 5) -> float:
    """Median seconds of one launch, after one untimed."""
    launch()
    return statistics.median(cuda_time(launch, repeats)) / 1e3


def log(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def chain_layers(stages) -> list[ChainLayer]:
    return [ChainLayer(stages[i].weight, stages[i + 1].weight, stages[i + 2].weight, stages[i + 3].gate_up,
                       stages[i + 3].down) for i in range(0, len(stages), 4)]


def tiny_layers(layers: int, generator: torch.Generator) -> list[ChainLayer]:
    def w(*shape):
        return torch.empty(shape, device="cuda", dtype=torch.bfloat16).normal_(0, shape[-1] ** -0.5, generator=generator)
    return [ChainLayer(w(256, 256), w(256, 256), w(128, 256), w(128, 128, 256), w(128, 256, 64)) for _ in range(layers)]


def weight_bytes(layers: list[ChainLayer], routes: list[torch.Tensor]) -> int:
    total = 0
    for layer, ids in zip(layers, routes):
        total += sum(t.numel() * 2 for t in (layer.qkv, layer.o, layer.router))
        total += ids.unique().numel() * (layer.gate_up[0].numel() + layer.down[0].numel()) * 2
    return total


def check(layers: list[ChainLayer], x: torch.Tensor, slots: list[int]) -> str:
    """The CUDA chain (both ways of its products) against the reference and itself; exits on a
    failure; returns a summary."""
    rows = x.shape[0]
    two = layers[:2]
    want, routes = reference(two, x)
    summary = [f"{rows} rows:"]
    for use_mma in (True, False):
        way = "mma" if use_mma else "fma"
        got = LayerChain(two, rows, use_mma=use_mma).run(x).float().clone()
        torch.cuda.synchronize()
        error = float((got - want).abs().max() / want.abs().max())
        if not error < 0.05:
            sys.exit(f"persistent_cuda: {way}, {rows} rows differ from the reference by {error:.3g} of the largest value")
        for r in range(rows):
            alone = LayerChain(two, 1, use_mma=use_mma).run(x[r:r + 1]).float()
            if not torch.equal(alone[0], got[r]):
                sys.exit(f"persistent_cuda: {way}, row {r} alone differs from the row among {rows} (row invariance)")
        for s in slots:
            other = LayerChain(two, rows, slots=s, use_mma=use_mma).run(x).float()
            if not torch.equal(other, got):
                sys.exit(f"persistent_cuda: {way}, {s} slots changed the bits")
        summary.append(f"{way} reference difference {error:.2e} of the largest value, rows alone and slots {slots} "
                       f"bit-equal;")
    return " ".join(summary)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--reps", type=int, default=10, help="graph replays a way a block")
    parser.add_argument("--rows", default="1,5")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--slots", default="1,2,max", help="ring slots of the CUDA ways ('max': as many as fit)")
    parser.add_argument("--no-tiny", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("persistent_cuda: needs a CUDA GPU")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    log(f"{torch.cuda.get_device_name()} ({sms} SMs), torch {torch.__version__}; compiling the chain ...")
    bandwidth = copy_bandwidth()
    log(f"copy: {bandwidth / 1e12:.2f} TB/s")
    print(f"# persistent_cuda, {datetime.date.today()}, {torch.cuda.get_device_name()}, bf16, {args.layers} layers, "
          f"floor at the copy's {bandwidth / 1e12:.2f} TB/s; µs a layer, paired ratio today / way")
    small = torch.zeros(256, device="cuda")
    graph_us = graph_time(lambda: [small.add_(1) for _ in range(200)], calls=1, repeats=10) * 1e3 / 200
    print(f"\nA stage boundary: the chain's barrier (a word's round trip through it) "
          f"{launch_seconds(barrier_chain(200)) / 200 * 1e6:.2f} µs; a kernel boundary (200 tiny torch kernels in a CUDA graph) "
          f"{graph_us:.2f} µs")
    print("\n| the ring alone: copy bytes × copies a tile | slots | TB/s | of the copy's rate |")
    print("| --- | ---: | ---: | ---: |")
    for copy_bytes, copies in ((32768, 1), (16384, 2), (4096, 8), (1536, 16)):
        for slots in (2, 4, 6):
            launch, nbytes = stream_ring(2 << 30, copy_bytes, copies, slots)
            rate = nbytes / launch_seconds(launch)
            print(f"| {copy_bytes} × {copies} | {slots} | {rate / 1e12:.2f} | {rate / bandwidth:.3f} |")
    sys.stdout.flush()
    print()
    print("| chain | rows | way | µs a layer | GB/s | of the floor | today / way (range) |")
    print("| --- | ---: | --- | ---: | ---: | ---: | --- |")
    g = torch.Generator(device="cuda").manual_seed(0)
    stages = chain("layer", args.layers, g)
    layers = chain_layers(stages)
    chains = [("layer", layers)] + ([] if args.no_tiny else [("tiny", tiny_layers(args.layers, g))])
    for name, chain_of in chains:
        for rows in [int(v) for v in args.rows.split(",")]:
            x = torch.empty(rows, chain_of[0].qkv.shape[1], device="cuda", dtype=torch.bfloat16).normal_(generator=g)
            most = LayerChain(chain_of[:1], rows).slots
            slots = sorted({most if s == "max" else min(int(s), most) for s in args.slots.split(",")})
            log(check(chain_of, x, slots))
            _, routes = reference(chain_of, x)
            nbytes = weight_bytes(chain_of, routes)
            ways = {}
            if name == "layer":
                ways["today"] = today_ops(stages, x)
                today_out = ways["today"]().float()
            for s in slots:
                plan = LayerChain(chain_of, rows, slots=s)
                ways[f"cuda mma, {s} slots"] = lambda plan=plan: plan.run(x)
            for label, plan in (("cuda fma", LayerChain(chain_of, rows, use_mma=False)),
                                ("cuda mma + L2 prefetch", LayerChain(chain_of, rows, l2_prefetch=True)),
                                ("cuda stream only", LayerChain(chain_of, rows, stream_only=True))):
                ways[f"{label}, {plan.slots} slots"] = lambda plan=plan: plan.run(x)
            if name == "layer":
                cuda_out = rms(ways[f"cuda mma, {slots[-1]} slots"]())
                log(f"{name}, {rows} rows: cuda against today's kernels (other roundings), largest difference "
                    f"{float((cuda_out - today_out).abs().max() / today_out.abs().max()):.3g} of the largest value")
            times: dict[str, list[float]] = {way: [] for way in ways}
            for block in range(args.blocks):
                for way in (list(ways) if block % 2 == 0 else list(reversed(ways))):
                    times[way].append(graph_time(ways[way], calls=1, repeats=args.reps) * 1e3)
                log(f"{name}, {rows} rows: block {block + 1}/{args.blocks}")
            floor_us = nbytes / bandwidth * 1e6
            base = "today" if "today" in times else f"cuda mma, {slots[-1]} slots"
            for way, samples in times.items():
                us = statistics.median(samples)
                ratios = [t / s for t, s in zip(times[base], samples)]
                print(f"| {name} | {rows} | {way} | {us / len(chain_of):.2f} | {nbytes / us / 1e3:,.0f} | "
                      f"{floor_us / us:.3f} | {statistics.median(ratios):.3f} ({min(ratios):.3f}–{max(ratios):.3f}) |")
            sys.stdout.flush()


if __name__ == "__main__":
    main()

"""Does a persistent step pay in Triton on this GPU? Issue 39's first measurement.

Chains of dependent one-row products, run two ways on the same random weights:
- today: each stage as the service runs it — `linear` for a stage without K splits;
  `linear_partials`, then `add_rmsnorm` adding its partials in split order (as o_proj's are: the
  norm is today's extra work), for one with — every kernel captured in one CUDA graph (PDL off, as the step runs these GEMVs);
- persistent: the whole chain in one cooperative launch (kernels.fused.persistent.ChainPlan),
  `--programs-per-sm` programs a multiprocessor, with each way of prefetching the next stage's
  weights into L2 (none, before the barrier, at the stage's start), also captured in a graph.

Chains (`--chains`):
- `attention`: `--layers` × (qkv-like [4096, 2048], then o_proj-like [2048, 4096] in its 4 K
  splits, as the service splits it) at Qwen3-30B-A3B's dense shapes: weights 3 × L2 and more, so every stage reads HBM;
- `tiny`: 48 stages of [256, 256]: no bytes to speak of — a stage's time is the barrier's (or, in
  today's graph, a launch's) own.

Per chain, rows and way: µs a stage (median of graph replays), the weights' GB/s, the fraction
of the bandwidth floor (the weights' bytes at the rate of a device-to-device copy measured in this
run), and the paired ratio today / this way (> 1: faster than today), the median over `--blocks`
blocks that alternate the ways. Every way's last partials are checked equal to the persistent
one-program run first (the chain changes no bit: tests/kernels/fused/test_persistent.py).

Usage: python bench/persistent_probe.py [--blocks 5] [--reps 10] [--rows 1,5] [--layers 12]
       [--chains attention,tiny] [--programs-per-sm 1,2]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.fused_step import graph_time  # noqa: E402  (device ms of calls captured in one graph)
from bench.model_baseline import copy_bandwidth  # noqa: E402
from kernels.fused.linear import linear, linear_partials, split_k  # noqa: E402
from kernels.fused.norm import add_rmsnorm  # noqa: E402
from kernels.fused.persistent import PREFETCH_WAYS, ChainPlan  # noqa: E402

H, Q_OUT, O_IN = 2048, 4096, 4096


def log(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def chain(name: str, layers: int) -> tuple[list[tuple[int, int]], list[int]]:
    """(weight shapes, splits) of a chain."""
    if name == "attention":
        return [(Q_OUT, H), (H, O_IN)] * layers, [1, split_k(H, O_IN)] * layers
    if name == "tiny":
        return [(256, 256)] * 48, [1] * 48
    raise ValueError(f"--chains: {name!r} is not attention or tiny")


def today_ops(weights: list[torch.Tensor], splits: list[int], x: torch.Tensor):
    """The chain as today's kernels run it; returns a callable (for capture)."""
    ones = {w.shape[0]: torch.ones(w.shape[0], device=x.device, dtype=x.dtype) for w in weights}
    zeros = {w.shape[0]: torch.zeros(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype) for w in weights}

    def run():
        source = x
        for weight, num_splits in zip(weights, splits):
            if num_splits == 1:
                source = linear(source, weight)
            else:
                partials = linear_partials(source, weight, num_splits)  # [rows, splits, N]
                _, source = add_rmsnorm(partials, zeros[weight.shape[0]], ones[weight.shape[0]], 1e-6)
        return source
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--reps", type=int, default=10, help="graph replays a way a block")
    parser.add_argument("--rows", default="1,5")
    parser.add_argument("--layers", type=int, default=12, help="layers of the attention chain")
    parser.add_argument("--chains", default="attention,tiny")
    parser.add_argument("--programs-per-sm", default="1,2")
    parser.add_argument("--no-cooperative", action="store_true",
                        help="launch the chain as a plain grid (if the driver refuses a cooperative one in a graph)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("persistent_probe: needs a CUDA GPU (the chain's barrier needs its programs resident at once)")
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    log(f"{torch.cuda.get_device_name()} ({sms} SMs), torch {torch.__version__}")
    log("measuring the copy bandwidth ...")
    bandwidth = copy_bandwidth()  # bytes/s, read + write counted
    log(f"copy: {bandwidth / 1e12:.2f} TB/s")
    per_sm = [int(v) for v in args.programs_per_sm.split(",")]
    rows_list = [int(v) for v in args.rows.split(",")]
    print(f"# persistent_probe, {datetime.date.today()}, {torch.cuda.get_device_name()}, floor at the copy's "
          f"{bandwidth / 1e12:.2f} TB/s; µs a stage (GB/s, fraction of the floor), paired ratio today / way")
    print("| chain | rows | way | µs a stage | GB/s | of the floor | today / way (range) |")
    print("| --- | ---: | --- | ---: | ---: | ---: | --- |")
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in args.chains.split(","):
        shapes, splits = chain(name, args.layers)
        weights = [torch.empty(s, device=device, dtype=torch.bfloat16).normal_(0, s[1] ** -0.5, generator=g)
                   for s in shapes]
        weight_bytes = sum(w.numel() * w.element_size() for w in weights)
        for rows in rows_list:
            x = torch.empty(rows, shapes[0][1], device=device, dtype=torch.bfloat16).normal_(generator=g)
            check = ChainPlan(weights, splits, rows, programs=1, cooperative=not args.no_cooperative).run(x).clone()
            ways = {"today": today_ops(weights, splits, x)}
            for programs in per_sm:
                for prefetch in PREFETCH_WAYS:
                    try:
                        plan = ChainPlan(weights, splits, rows, programs=programs * sms, prefetch=prefetch,
                                         cooperative=not args.no_cooperative)
                        out = plan.run(x)
                        torch.cuda.synchronize()
                    except Exception as error:  # (a grid the GPU cannot hold at once, shared memory): reported, skipped
                        log(f"{name}, rows {rows}: {programs}/SM, prefetch {prefetch}: {type(error).__name__}: {error}")
                        print(f"| {name} | {rows} | persistent {programs}/SM, prefetch {prefetch} | failed: "
                              f"{type(error).__name__} | | | |")
                        continue
                    if not torch.equal(out, check):
                        sys.exit(f"{name}, rows {rows}: {programs}/SM, prefetch {prefetch} changed the chain's bits")
                    ways[f"persistent {programs}/SM, prefetch {prefetch}"] = lambda plan=plan: plan.run(x)
            times: dict[str, list[float]] = {way: [] for way in ways}
            for block in range(args.blocks):
                order = list(ways) if block % 2 == 0 else list(reversed(ways))
                for way in order:
                    times[way].append(graph_time(ways[way], calls=1, repeats=args.reps) * 1e3)  # µs a chain
                log(f"{name}, rows {rows}: block {block + 1}/{args.blocks} done")
            floor_us = weight_bytes / bandwidth * 1e6  # (a copy of n bytes moves 2n: its rate is a stream's)
            for way, samples in times.items():
                us = statistics.median(samples)
                ratios = [t / s for t, s in zip(times["today"], samples)]
                print(f"| {name} | {rows} | {way} | {us / len(weights):.2f} | {weight_bytes / us / 1e3:,.0f} | "
                      f"{floor_us / us:.2f} | {statistics.median(ratios):.3f} ({min(ratios):.3f}–{max(ratios):.3f}) |")
            sys.stdout.flush()


if __name__ == "__main__":
    main()

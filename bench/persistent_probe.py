"""Does a persistent step pay in Triton on this GPU? Issue 39's first measurement.

Chains of dependent one-row products, run two ways on the same random weights:
- today: each stage as the service runs it — `linear` for a stage without K splits;
  `linear_partials`, then `add_rmsnorm` adding its partials in split order (as o_proj's are: the
  norm is today's extra work), for one with; a router's partials into `route`, then
  `fused_experts` and `combine_add_rmsnorm` — every kernel captured in one CUDA graph (PDL off);
- persistent: the whole chain in one cooperative launch (kernels.fused.persistent.ChainPlan),
  `--programs-per-sm` programs a multiprocessor, each of `--tiles`, with each way of prefetching
  the next stage's weights into L2 (none, before the barrier, at the stage's start), also
  captured in a graph.

Chains (`--chains`), at Qwen3-30B-A3B's shapes, `--layers` layers (weights well past L2, so every
stage reads HBM):
- `attention`: qkv-like [4096, 2048], then o_proj-like [2048, 4096] in its K splits;
- `moe`: the router [128, 2048] (its K splits) and 8 of 128 experts (gate/up [1536, 2048], down
  [2048, 768]): the experts' weights are known only once the router's stage has passed;
- `layer`: both (attention's products, then the MoE block): a layer without attention's own
  kernels and the norms;
- `tiny`: 48 stages of [256, 256]: no bytes to speak of — a stage's time is the barrier's (or, in
  today's graph, a launch's) own.

Per chain, rows and way: µs a stage (median of graph replays), the weights' GB/s (the experts
the rows route to counted once each), the fraction of the bandwidth floor (those bytes at the rate
of a device-to-device copy measured in this run), and the paired ratio today / this way (> 1:
faster than today), the median over `--blocks` blocks that alternate the ways. Every persistent
way's output is checked equal to the one-program run first (programs and prefetch change no bit:
tests/kernels/fused/test_persistent.py).

Usage: python bench/persistent_probe.py [--blocks 5] [--reps 10] [--rows 1,5] [--layers 8]
       [--chains attention,moe,layer,tiny] [--programs-per-sm 1] [--tiles "64,128,8,3;32,128,4,3"]
       [--fp8] [--no-cooperative]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.fused_step import graph_time  # noqa: E402  (device ms of calls captured in one graph)
from bench.model_baseline import copy_bandwidth  # noqa: E402
from kernels.fused.fp8 import Fp8Weight, quantize  # noqa: E402
from kernels.fused.linear import linear, linear_partials, split_k  # noqa: E402
from kernels.fused.moe import combine_add_rmsnorm, fused_experts  # noqa: E402
from kernels.fused.norm import add_rmsnorm  # noqa: E402
from kernels.fused.persistent import PREFETCH_WAYS, ChainPlan, Dense, Experts, sum_partials  # noqa: E402
from kernels.fused.router import route  # noqa: E402

H, Q_OUT, O_IN, E, I, TOP_K = 2048, 4096, 4096, 128, 768, 8


def log(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def chain(name: str, layers: int, generator: torch.Generator, dtype: torch.dtype = torch.bfloat16,
          fp8: bool = False) -> list[Dense | Experts]:
    """A chain's stages, random weights on the generator's device; fp8: block-scaled FP8 in blocks
    of 128 × 128 but the routers (as `--quantize fp8` converts a model)."""
    def w(*shape, quantized=fp8):
        weight = torch.empty(shape, device=generator.device, dtype=dtype).normal_(0, shape[-1] ** -0.5,
                                                                                  generator=generator)
        return quantize(weight, (128, 128)) if quantized else weight

    def attention():
        return [Dense(w(Q_OUT, H)), Dense(w(H, O_IN), split_k(H, O_IN))]

    def moe():
        return [Dense(w(E, H, quantized=False), split_k(E, H)), Experts(w(E, 2 * I, H), w(E, H, I), TOP_K)]

    if name == "tiny":
        return [Dense(w(256, 256)) for _ in range(48)]
    parts = {"attention": attention, "moe": moe, "layer": lambda: attention() + moe()}
    if name not in parts:
        raise ValueError(f"--chains: {name!r} is not attention, moe, layer or tiny")
    return [stage for _ in range(layers) for stage in parts[name]()]


def nbytes(weight) -> int:
    """A weight's bytes (FP8: its values and block scales)."""
    return weight.nbytes if isinstance(weight, Fp8Weight) else weight.numel() * weight.element_size()


def bytes_read(stages: list[Dense | Experts], plan: ChainPlan) -> int:
    """Weight bytes a pass reads: dense weights whole, each expert the rows route to once."""
    total = 0
    for index, stage in enumerate(stages):
        if isinstance(stage, Dense):
            total += nbytes(stage.weight)
            continue
        logits = sum_partials(plan.outputs[index - 1]).to(torch.bfloat16).float()
        experts = torch.softmax(logits, -1).topk(stage.top_k, -1).indices.unique().numel()
        total += experts * (nbytes(stage.gate_up[0]) + nbytes(stage.down[0]))
    return total


def today_ops(stages: list[Dense | Experts], x: torch.Tensor):
    """The chain as today's kernels run it; returns a callable (for capture)."""
    rows = x.shape[0]
    ones = torch.ones(max(H, Q_OUT, O_IN, 256), device=x.device, dtype=x.dtype)
    zeros = torch.zeros(rows, max(H, Q_OUT, O_IN, 256), device=x.device, dtype=x.dtype)

    def run():
        source = x
        for index, stage in enumerate(stages):
            if isinstance(stage, Experts):
                continue
            router = index + 1 < len(stages) and isinstance(stages[index + 1], Experts)
            width = stage.weight.shape[0]
            if stage.splits == 1:
                out = linear(source, stage.weight)
                if router:
                    ids, weights = route(out, TOP_K, normalize=True)
            else:
                partials = linear_partials(source, stage.weight, stage.splits)  # [rows, splits, N]
                if router:
                    ids, weights = route(partials, TOP_K, round_to=x.dtype, normalize=True)
                else:
                    _, out = add_rmsnorm(partials, zeros[:, :width], ones[:width], 1e-6)
            if router:
                experts = stages[index + 1]
                per_route = fused_experts(source, ids, experts.gate_up, experts.down)
                _, out = combine_add_rmsnorm(per_route, weights, zeros[:, :H], ones[:H], 1e-6)
            source = out
        return source
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--reps", type=int, default=10, help="graph replays a way a block")
    parser.add_argument("--rows", default="1,5")
    parser.add_argument("--layers", type=int, default=8, help="layers of the attention, moe and layer chains")
    parser.add_argument("--chains", default="attention,moe,layer,tiny")
    parser.add_argument("--programs-per-sm", default="1",
                        help="programs per multiprocessor, e.g. 0.25,0.5,1 (the barrier's cost by how many arrive)")
    parser.add_argument("--tiles", default="64,128,8,3;32,128,4,3",
                        help="the chain's tiles to compare: BLOCK_N,BLOCK_K,warps,stages separated by ;")
    parser.add_argument("--fp8", action="store_true",
                        help="the chains' weights block-scaled FP8 (routers full precision), both ways")
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
    per_sm = [float(v) for v in args.programs_per_sm.split(",")]
    tiles = [tuple(int(v) for v in tile.split(",")) for tile in args.tiles.split(";")]
    rows_list = [int(v) for v in args.rows.split(",")]
    print(f"# persistent_probe, {datetime.date.today()}, {torch.cuda.get_device_name()}, "
          f"{'FP8' if args.fp8 else 'bf16'} weights, floor at the copy's "
          f"{bandwidth / 1e12:.2f} TB/s; µs a stage (GB/s, fraction of the floor), paired ratio today / way")
    print("| chain | rows | way | µs a stage | GB/s | of the floor | today / way (range) |")
    print("| --- | ---: | --- | ---: | ---: | ---: | --- |")
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in args.chains.split(","):
        stages = chain(name, args.layers, g, fp8=args.fp8)
        for rows in rows_list:
            x = torch.empty(rows, H if name != "tiny" else 256, device=device, dtype=torch.bfloat16).normal_(generator=g)
            one = ChainPlan(stages, rows, programs=1, cooperative=not args.no_cooperative)
            check = one.run(x).clone()
            weight_bytes = bytes_read(stages, one)
            ways = {"today": today_ops(stages, x)}
            for per, tile, prefetch in itertools.product(per_sm, tiles, PREFETCH_WAYS):
                programs = max(1, round(per * sms))
                way = f"persistent {programs} programs, tile {','.join(map(str, tile))}, prefetch {prefetch}"
                try:
                    plan = ChainPlan(stages, rows, programs=programs, prefetch=prefetch, tile=tile,
                                     cooperative=not args.no_cooperative)
                    out = plan.run(x)
                    torch.cuda.synchronize()
                except Exception as error:  # (a grid the GPU cannot hold at once, shared memory): reported, skipped
                    log(f"{name}, rows {rows}, {way}: {type(error).__name__}: {error}")
                    print(f"| {name} | {rows} | {way} | failed: {type(error).__name__} | | | |")
                    continue
                if plan.tile[:3] == one.tile[:3] and not torch.equal(out, check):
                    sys.exit(f"{name}, rows {rows}, {way}: the chain's bits changed with the programs or prefetch")
                if plan.tile[:3] != one.tile[:3]:  # another order of sums: rounding apart, compounded over the stages
                    log(f"{name}, rows {rows}, {way}: max difference from the one-program run "
                        f"{float((out - check).abs().max() / check.abs().max()):.3g} (relative to its largest value)")
                ways[way] = lambda plan=plan: plan.run(x)
            for way in [w for w in ways if w != "today"]:  # each way captured once first: one that fails is reported
                try:
                    graph_time(ways[way], calls=1, repeats=1)
                except Exception as error:  # (a cooperative launch the driver will not capture, say)
                    log(f"{name}, rows {rows}, {way}: capture failed: {type(error).__name__}: {error}")
                    print(f"| {name} | {rows} | {way} | capture failed: {type(error).__name__} (--no-cooperative?) "
                          f"| | | |")
                    del ways[way]
                    torch.cuda.synchronize()
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
                print(f"| {name} | {rows} | {way} | {us / len(stages):.2f} | {weight_bytes / us / 1e3:,.0f} | "
                      f"{floor_us / us:.2f} | {statistics.median(ratios):.3f} ({min(ratios):.3f}–{max(ratios):.3f}) |")
            sys.stdout.flush()


if __name__ == "__main__":
    main()

"""The fused kernels on FP8 weights against bf16 (issue 36): one op at a time, paired.

For each projection of a Qwen3-30B-A3B layer (and its lm_head) and the routed experts at 1
and 8 rows, times the bf16 kernel and the FP8 kernel on the same (random) weights, alternating
in blocks (GPU time: each op's repetitions captured in a CUDA graph, as the service runs its
step, so the host's launch cost is not counted), and prints each op's median
time, its weight bytes per microsecond (the rate of the bytes it must read: weights, plus FP8
scales) and the paired FP8 / bf16 speed-up. The bytes floor of a decode step is those bytes at
the GPU's bandwidth: an op near it gains ~2x from FP8.

Usage: python bench/fp8_kernels.py [--blocks 5] [--reps 20] [--rows 1,8] [--widen N] [--wide-n N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.fused_step import graph_time  # noqa: E402  (device time of calls captured in one graph)
from kernels.fused.fp8 import cat_rows, quantize  # noqa: E402
from kernels.fused.linear import linear, linear_partials, split_k  # noqa: E402
import kernels.fused.linear as linear_module  # noqa: E402
from kernels.fused.moe import fused_experts  # noqa: E402

H, I, E, K_ROUTES, VOCAB = 2048, 768, 128, 8, 151936
BLOCK = (128, 128)


def cases(rows: int):
    g = torch.Generator(device="cuda").manual_seed(0)

    def w(*shape):
        return torch.empty(shape, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02, generator=g)

    x = w(rows, H).mul_(50)
    qkv, o, lm_head = w((32 + 8) * 128, H), w(H, 32 * 128), w(VOCAB, H)
    attn = w(rows, 32 * 128).mul_(50)
    gate_up, down = w(E, 2 * I, H), w(E, H, I)
    ids = torch.randint(0, E, (rows, K_ROUTES), device="cuda", generator=g)
    fp8 = {name: quantize(t, BLOCK) for name, t in (("qkv", qkv), ("o", o), ("lm_head", lm_head))}
    fp8_gate_up = cat_rows([quantize(gate_up[:, :I], BLOCK), quantize(gate_up[:, I:], BLOCK)])
    fp8_down = quantize(down, BLOCK)
    experts_bytes = len(set(ids.view(-1).tolist())) * 3 * H * I  # the distinct routed experts' weights (FP8 bytes)
    splits = split_k(*o.shape)
    yield ("qkv", qkv.numel(), lambda: linear(x, qkv), lambda: linear(x, fp8["qkv"]))
    yield ("o_proj (split-K)", o.numel(), lambda: linear_partials(attn, o, splits),
           lambda: linear_partials(attn, fp8["o"], splits))
    yield ("experts", experts_bytes, lambda: fused_experts(x, ids, gate_up, down),
           lambda: fused_experts(x, ids, fp8_gate_up, fp8_down))
    yield ("lm_head (--quantize keeps it bf16)", lm_head.numel(), lambda: linear(x, lm_head, out_dtype=torch.float32),
           lambda: linear(x, fp8["lm_head"], out_dtype=torch.float32))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--widen", type=int, default=None, help="FP8_WIDEN for this run (default: the tree's)")
    parser.add_argument("--wide-n", type=int, default=None, help="FP8_WIDE_N for this run (default: the tree's)")
    args = parser.parse_args()
    if args.widen is not None:  # (the expert kernels read theirs from kernels.fused.linear too)
        linear_module.FP8_WIDEN = linear_module.EXPERT_FP8_WIDEN = args.widen
    if args.wide_n is not None:
        linear_module.FP8_WIDE_N = args.wide_n
    print(f"FP8_WIDEN {linear_module.FP8_WIDEN} (experts {linear_module.EXPERT_FP8_WIDEN}), "
          f"FP8_WIDE_N {linear_module.FP8_WIDE_N}\n")
    print(f"| rows | op | bf16 µs | FP8 µs | bf16 GB/s | FP8 GB/s | FP8 / bf16 speed (median of {args.blocks} paired blocks) |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for rows in [int(r) for r in args.rows.split(",")]:
        for name, fp8_bytes, bf16_op, fp8_op in cases(rows):
            pairs = []
            for block in range(args.blocks):
                order = [bf16_op, fp8_op] if block % 2 == 0 else [fp8_op, bf16_op]
                times = {id(op): graph_time(op, calls=args.reps, repeats=5) * 1e3 for op in order}  # µs a call
                pairs.append((times[id(bf16_op)], times[id(fp8_op)]))
            bf16 = statistics.median(p[0] for p in pairs)
            fp8 = statistics.median(p[1] for p in pairs)
            speed = statistics.median(p[0] / p[1] for p in pairs)
            print(f"| {rows} | {name} | {bf16:.1f} | {fp8:.1f} | {2 * fp8_bytes / bf16 / 1e3:.0f} | "
                  f"{fp8_bytes / fp8 / 1e3:.0f} | {speed:.2f} |", flush=True)


if __name__ == "__main__":
    main()

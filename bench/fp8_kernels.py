"""The fused kernels on FP8 weights against bf16 (issue 36): one op at a time, paired.

For each projection of a Qwen3-30B-A3B layer (and its lm_head) and the routed experts at 1
and 8 rows, times the bf16 kernel and the FP8 kernel on the same (random) weights, alternating
in blocks (GPU time: one pass over a pool of weights that L2 cannot hold, captured in a CUDA
graph as the service runs its step, so neither the host's launch cost nor L2 hits are counted:
20 calls of one 10 MB weight would read it from L2), and prints each op's median
time, its weight bytes per microsecond (the rate of the bytes it must read: weights, plus FP8
scales) and the paired FP8 / bf16 speed-up. The bytes floor of a decode step is those bytes at
the GPU's bandwidth: an op near it gains ~2x from FP8.

Usage: python bench/fp8_kernels.py [--blocks 5] [--reps 5] [--rows 1,8] [--fp8-way exact|dequant]
       [--widen N] [--block-n N]
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


L2_BYTES = 50 << 20  # the H200's L2: an op's pool of weights is made 3 × this, as a step reads each layer's once


def pool_size(nbytes: int) -> int:
    """Copies of a weight of nbytes (bf16) so that one pass over them cannot be served from L2."""
    return max(1, -(-3 * L2_BYTES // nbytes))


def cases(rows: int):
    """(name, FP8 bytes an op reads, bf16 ops, FP8 ops): each list one op per weight of a pool that
    L2 cannot hold, so an op reads its weights from HBM, as in a step."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def w(*shape):
        return torch.empty(shape, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02, generator=g)

    x = w(rows, H).mul_(50)
    attn = w(rows, 32 * 128).mul_(50)
    qkv_shape, o_shape = ((32 + 8) * 128, H), (H, 32 * 128)
    qkvs = [w(*qkv_shape) for _ in range(pool_size(2 * qkv_shape[0] * H))]
    os_ = [w(*o_shape) for _ in range(pool_size(2 * H * o_shape[1]))]
    lm_head = w(VOCAB, H)
    splits = split_k(*o_shape)
    fp8_qkvs = [quantize(t, BLOCK) for t in qkvs]
    fp8_os = [quantize(t, BLOCK) for t in os_]
    yield ("qkv", qkvs[0].numel(), [lambda t=t: linear(x, t) for t in qkvs],
           [lambda t=t: linear(x, t) for t in fp8_qkvs])
    yield ("o_proj (split-K)", os_[0].numel(), [lambda t=t: linear_partials(attn, t, splits) for t in os_],
           [lambda t=t: linear_partials(attn, t, splits) for t in fp8_os])
    del qkvs, os_, fp8_qkvs, fp8_os
    # experts: one stack a layer; each layer's routes are its own draw (a token reads distinct experts per layer)
    stacks = []
    for _ in range(4):
        gate_up, down = w(E, 2 * I, H), w(E, H, I)
        fp8_gate_up = cat_rows([quantize(gate_up[:, :I], BLOCK), quantize(gate_up[:, I:], BLOCK)])
        ids = torch.randint(0, E, (rows, K_ROUTES), device="cuda", generator=g)
        stacks.append((ids, gate_up, down, fp8_gate_up, quantize(down, BLOCK)))
    experts_bytes = statistics.mean(len(set(s[0].view(-1).tolist())) for s in stacks) * 3 * H * I  # distinct routed experts (FP8 bytes)
    yield ("experts", experts_bytes, [lambda s=s: fused_experts(x, s[0], s[1], s[2]) for s in stacks],
           [lambda s=s: fused_experts(x, s[0], s[3], s[4]) for s in stacks])
    del stacks
    fp8_lm_head = quantize(lm_head, BLOCK)
    yield ("lm_head (--quantize keeps it bf16)", lm_head.numel(), [lambda: linear(x, lm_head, out_dtype=torch.float32)],
           [lambda: linear(x, fp8_lm_head, out_dtype=torch.float32)])


def pool_time(ops: list, repeats: int = 5) -> float:
    """Device µs per op: one call of each op in the pool captured in one graph, median of replays."""
    def one_pass():
        for op in ops:
            op()
    return graph_time(one_pass, calls=1, repeats=repeats) * 1e3 / len(ops)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--reps", type=int, default=5, help="graph replays a block")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--widen", type=int, default=None, help="FP8_WIDEN for this run (default: the tree's)")
    parser.add_argument("--block-n", type=int, default=None, help="FP8_BLOCK_N for this run (default: the tree's)")
    parser.add_argument("--fp8-way", choices=("exact", "dequant"), default=None,
                        help="both ops' FP8 way for this run (LINEAR_ / EXPERT_FP8_EXACT; default: the tree's)")
    args = parser.parse_args()
    if args.fp8_way is not None:
        linear_module.LINEAR_FP8_EXACT = linear_module.EXPERT_FP8_EXACT = args.fp8_way == "exact"
    if args.widen is not None:  # (the expert kernels read theirs from kernels.fused.linear too)
        linear_module.FP8_WIDEN = linear_module.EXPERT_FP8_WIDEN = args.widen
    if args.block_n is not None:
        linear_module.FP8_BLOCK_N = args.block_n
    print(f"projections: exact {linear_module.LINEAR_FP8_EXACT}, FP8_WIDEN {linear_module.FP8_WIDEN}, FP8_BLOCK_N "
          f"{linear_module.FP8_BLOCK_N}; experts: exact {linear_module.EXPERT_FP8_EXACT}, EXPERT_FP8_WIDEN "
          f"{linear_module.EXPERT_FP8_WIDEN}\n")
    print(f"| rows | op | bf16 µs | FP8 µs | bf16 GB/s | FP8 GB/s | FP8 / bf16 speed (median of {args.blocks} paired blocks) |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for rows in [int(r) for r in args.rows.split(",")]:
        for name, fp8_bytes, bf16_op, fp8_op in cases(rows):
            pairs = []
            for block in range(args.blocks):
                order = [bf16_op, fp8_op] if block % 2 == 0 else [fp8_op, bf16_op]
                times = {id(op): pool_time(op, repeats=args.reps) for op in order}  # µs an op
                pairs.append((times[id(bf16_op)], times[id(fp8_op)]))
            bf16 = statistics.median(p[0] for p in pairs)
            fp8 = statistics.median(p[1] for p in pairs)
            speed = statistics.median(p[0] / p[1] for p in pairs)
            print(f"| {rows} | {name} | {bf16:.1f} | {fp8:.1f} | {2 * fp8_bytes / bf16 / 1e3:.0f} | "
                  f"{fp8_bytes / fp8 / 1e3:.0f} | {speed:.2f} |", flush=True)


if __name__ == "__main__":
    main()

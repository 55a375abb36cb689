"""Does programmatic dependent launch shorten a chain of small kernels? (issue 10)

A CUDA graph of N back-to-back fused kernels (add+RMSNorm on one row, and the 1-row qkv
GEMV), captured once with PDL launches and once without, timed by CUDA events and
interleaved; prints µs per kernel for each and the median of paired ratios. Usage:
  python bench/pdl_chain.py [--kernels 480] [--pairs 9]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.fused_step import graph_time
from kernels.fused import pdl_supported
from kernels.fused.linear import linear
from kernels.fused.norm import add_rmsnorm


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kernels", type=int, default=480)
    parser.add_argument("--pairs", type=int, default=9)
    args = parser.parse_args()
    print(f"PDL supported here: {pdl_supported('cuda')}")
    hidden = 2048
    x = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    norm = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    qkv = torch.randn(5120, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    down = torch.randn(hidden, 5120, device="cuda", dtype=torch.bfloat16) * 0.02

    def norms(pdl: bool):
        def body():
            h, r = x, residual
            for _ in range(args.kernels):
                h, r = add_rmsnorm(h, r, norm, 1e-6, pdl=pdl)
        return body

    def gemvs(pdl: bool):
        def body():
            h = x
            for _ in range(args.kernels // 2):
                h = linear(linear(h, qkv, pdl=pdl), down, pdl=pdl)
        return body

    print("\n| chain | µs/kernel, PDL | µs/kernel, plain | plain/PDL (median of paired ratios) |")
    print("| --- | ---: | ---: | ---: |")
    for chain, make in (("add+rmsnorm, 1 row", norms), ("qkv GEMV → down GEMV, 1 row", gemvs)):
        on, off = [], []
        for _ in range(args.pairs):
            on.append(graph_time(make(True), calls=1, repeats=5) * 1e3 / args.kernels)
            off.append(graph_time(make(False), calls=1, repeats=5) * 1e3 / args.kernels)
        ratio = statistics.median(b / a for a, b in zip(on, off))
        print(f"| {chain} | {statistics.median(on):.2f} | {statistics.median(off):.2f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()

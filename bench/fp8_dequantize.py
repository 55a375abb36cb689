"""What prefill pays to read FP8 weights (issue 36): a layer's experts dequantised for prompt rows.

Prompt rows take full-precision weights (kernels.fused.linear.dense: compute-bound products,
torch's grouped GEMM): an FP8 weight is dequantised for the call, every expert of the layer at
once. Two ways, on the same random block-scaled weights at Qwen3-30B-A3B shapes (a layer's
gate_up [E, 2I, H] and down [E, H, I], bf16 out), alternating in blocks (order reversed each
block), GPU time by CUDA events:
- `reference`: Fp8Weight.dequantize's torch ops (q to float32, times the broadcast scales,
  rounded to bf16: float32 copies of the whole weight);
- `kernel`: kernels.fused.fp8.dequantize_fast (one Triton kernel: a value read as its byte and
  written once as bf16).
Both give the same bits (checked here once). Reported: median ms a layer, the bytes each must
move at least (FP8 values and scales read, bf16 written) over its time, and kernel / reference
paired (median of the blocks' ratios). × 48 layers is what a prompt's prefill pays for it.

Usage: python bench/fp8_dequantize.py [--blocks 5] [--reps 10] [--experts 128]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.model_baseline import cuda_time  # noqa: E402  (per-call ms by CUDA events)
from kernels.fused.fp8 import Fp8Weight, dequantize_fast, quantize  # noqa: E402

H, I, BLOCK = 2048, 768, (128, 128)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--experts", type=int, default=128)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fp8_dequantize.py times GPU kernels: it needs a CUDA device")
    torch.manual_seed(0)
    weights: dict[str, Fp8Weight] = {}
    for name, shape in (("gate_up", (args.experts, 2 * I, H)), ("down", (args.experts, H, I))):
        print(f"making {name} {list(shape)} ...", file=sys.stderr, flush=True)
        weights[name] = quantize(torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 0.02, BLOCK)
    ways = {"reference": lambda w: w.dequantize(torch.bfloat16), "kernel": lambda w: dequantize_fast(w, torch.bfloat16)}
    for name, w in weights.items():
        if not torch.equal(ways["reference"](w).view(torch.int16), ways["kernel"](w).view(torch.int16)):
            sys.exit(f"{name}: the kernel's values differ from the reference's")
    ms: dict[tuple[str, str], list[float]] = {}
    for block in range(args.blocks):
        order = list(ways) if block % 2 == 0 else list(ways)[::-1]
        for name, w in weights.items():
            for way in order:
                ways[way](w)  # (warm: the allocator's blocks, the kernel's compile)
                ms.setdefault((name, way), []).append(statistics.median(cuda_time(lambda: ways[way](w), args.reps)))
        print(f"  block {block + 1}/{args.blocks}", file=sys.stderr, flush=True)
    print(f"\n{torch.cuda.get_device_name()}: a layer's experts dequantised to bf16 ({args.experts} experts, "
          f"H {H}, I {I}, blocks {list(BLOCK)}; median of {args.blocks} blocks × {args.reps} calls)\n")
    print("| weight | bytes moved at least | reference ms | kernel ms | kernel GB/s | kernel / reference time |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    total = {"reference": 0.0, "kernel": 0.0}
    for name, w in weights.items():
        moved = w.nbytes + 2 * w.q.numel()
        ref, ker = statistics.median(ms[name, "reference"]), statistics.median(ms[name, "kernel"])
        ratio = statistics.median(k / r for k, r in zip(ms[name, "kernel"], ms[name, "reference"]))
        total["reference"] += ref
        total["kernel"] += ker
        print(f"| {name} | {moved / 1e9:.2f} GB | {ref:.2f} | {ker:.2f} | {moved / ker / 1e6:.0f} | {ratio:.3f} |")
    print(f"\na layer: reference {total['reference']:.2f} ms, kernel {total['kernel']:.2f} ms; × 48 layers: "
          f"{48 * total['reference']:.0f} against {48 * total['kernel']:.0f} ms a prompt's prefill")


if __name__ == "__main__":
    main()

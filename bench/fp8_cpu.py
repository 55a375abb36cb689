"""FP8 weights on the CPU (issue 36): the embedded model's decode through the Engine (the fused
CPU path the verifier runs), full precision against `quantize="fp8"`, paired blocks.

On the CPU an FP8 model dequantises each weight per op, which is why `--quantize auto` (the
default) dequantises an FP8 checkpoint on load there. Prints decode tokens/s of each and the
median of the paired FP8 / full-precision ratios.

Usage: python bench/fp8_cpu.py [--blocks 6] [--new-tokens 48] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pairbench.common import request_spec  # noqa: E402  (puts the repo on sys.path)

from shared.model import load_model  # noqa: E402
from verifier_service.engine import Engine  # noqa: E402


def decode(engine: Engine, prompt: list[int], new_tokens: int) -> float:
    """Decode tokens/s of one request (the tokens after the first)."""
    session = engine.open(request_spec(prompt, new_tokens, max_draft_tokens=0))
    emitted: list[int] = []
    start = time.perf_counter()
    while len(emitted) < new_tokens:
        emitted += engine.run_round(session, [], None).emitted
    seconds = time.perf_counter() - start
    engine.close(session)
    return (new_tokens - 1) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engines = {q: Engine(load_model(None, quantize=q), max_context=512, prefill_chunk=256, fused="auto")
               for q in ("none", "fp8")}
    prompt = list(range(5, 69))
    for engine in engines.values():
        decode(engine, prompt, 8)  # warm-up
    blocks = []
    for block in range(args.blocks):
        order = list(engines) if block % 2 == 0 else list(reversed(engines))
        blocks.append({q: decode(engines[q], prompt, args.new_tokens) for q in order})
        print(f"block {block}: " + ", ".join(f"{q} {blocks[-1][q]:.1f} tok/s" for q in engines), file=sys.stderr)
    print(f"| weights | decode tokens/s (median of {args.blocks}) | FP8 / full precision (median of paired blocks) |")
    print("| --- | ---: | ---: |")
    ratio = statistics.median(b["fp8"] / b["none"] for b in blocks)
    for q, label in (("none", "float32"), ("fp8", "FP8 (dequantised per op)")):
        print(f"| {label} | {statistics.median(b[q] for b in blocks):.1f} | {ratio if q == 'fp8' else 1.0:.3f} |")


if __name__ == "__main__":
    main()

"""The Qwen3.5-MoE family on the fused, captured path (issue 34): correctness and speed on the GPU.

Random bf16 weights at Qwen3.5-35B-A3B shapes (40 layers: 30 Gated DeltaNet + 10 gated
attention, 256 experts top-8 plus a shared expert). Two parts, each its own process (two
copies of the weights do not fit one GPU):

`--part raw` — in this process, one trunk, the verifier's Engine on it (fused path, CUDA
graphs: exactly what the service runs) and the reference modules on the same weights:
- correctness: fused windows of 1..9 rows against the reference modules (eager, keep_states)
  after a prompt of each `--contexts` (relative error of the logits, argmax agreement);
  bit-identity: a 9-row window rolled back to row 4 against one-row steps of the kept rows
  (and the step after), a decode batch and a verify batch against the same rows alone; exact
  mode through the Engine (decode-ahead, windows, rollback, batches): speculative rounds with
  drafts taken from the plain continuation (every third chain spoiled) give the plain tokens,
  greedy and sampled, alone and as a batch (run_rounds);
- speed: the captured window of T rows replayed (CUDA events, back to back), T = 1..9, at each
  context; ms and the fraction of the floor (bytes a step must move / measured copy bandwidth);
  the distinct experts a T-row window routes to per MoE layer (recorded from an eager run);
  the reference path's eager step on the same weights (paired in this process); decode
  batches of 8 and 32 sequences against their own floor (distinct experts read); prefill
  tokens/s of a `--prefill` prompt (chunks of 2,048, as the service).
`--part accuracy` — why the fused and the reference logits of the 40-layer model differ: with
random weights the family is ill-conditioned in bf16 (the reference modules in bf16 stray
from the same weights in float32 by as much), so each path is compared with the float32
reference on models of 1 linear-attention layer, 1 full-attention layer and 4 layers (real
widths): fused bf16 vs float32 beside reference bf16 vs float32.
`--part service` — `tandem verifier --random-weights` on those shapes in a child process,
from the client: greedy requests after a 512-token prompt (`--blocks`), a sampled one, and
one after the longest context; decode tokens/s = tokens after the first / (last arrival -
first arrival).

    python bench/hybrid_fast.py --part raw [--contexts 512,4096,32768] [--budget-s 330]
    python bench/hybrid_fast.py --part service [--new-tokens 128] [--long-context 32768]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pairbench import REPO  # noqa: E402,F401  (puts the repository and protocol modules on sys.path)
from hybridbench.accuracy import run_accuracy  # noqa: E402
from hybridbench.common import DEVICE  # noqa: E402
from hybridbench.raw import report_raw, run_raw  # noqa: E402
from hybridbench.service import run_service  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", choices=("raw", "accuracy", "service"), required=True)
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--contexts", default="512,4096,32768")
    parser.add_argument("--windows", default="1,2,3,5,9")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prefill", type=int, default=32768)
    parser.add_argument("--exact-tokens", type=int, default=24)
    parser.add_argument("--budget-s", type=float, default=330.0, help="raw: skip the optional sections past this")
    parser.add_argument("--sections", default="", help="raw: only these sections (comma-separated names)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--long-context", type=int, default=32768)
    parser.add_argument("--small", action="store_true", help="raw: small shapes (a smoke test; on a CPU box too)")
    parser.add_argument("--bf16", action="store_true", help="raw on the CPU: bfloat16 weights (the GPU always is)")
    parser.add_argument("--shapes", default="qwen3.5-35b-a3b", help="service: the random model's shapes "
                        "(bench/pairbench/common.py SHAPES: qwen3.5-35b-a3b, qwen3-next-80b-a3b, smoke-hybrid)")
    parser.add_argument("--verifier-args", default="", help='service: extra verifier flags, e.g. "--quantize fp8"')
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU"
    shapes = args.shapes if args.part == "service" else "qwen3.5-35b-a3b"
    print(f"### hybrid fused path, {args.part}: {time.strftime('%Y-%m-%d')}, {device}, "
          f"{shapes} shapes, bf16 activations {args.verifier_args}, random weights\n")
    if args.part == "raw":
        res = run_raw(args)
        if args.out:
            args.out.write_text(json.dumps(res, indent=1, default=str))
        report_raw(res)
    elif args.part == "accuracy":
        res = run_accuracy(args)
        print("| model (real widths, window of 5 after 512 tokens) | fused bf16 vs float32 | reference bf16 vs float32 "
              "| fused vs reference |")
        print("| --- | ---: | ---: | ---: |")
        for r in res:
            print(f"| {r['model']} | {r['fused_vs_float32']:.2e} | {r['reference_vs_float32']:.2e} "
                  f"| {r['fused_vs_reference']:.2e} |")
    else:
        res = run_service(args)
        if args.out:
            args.out.write_text(json.dumps(res, indent=1, default=str))
        print(json.dumps(res, indent=1, default=str))
    gc.collect()


if __name__ == "__main__":
    main()

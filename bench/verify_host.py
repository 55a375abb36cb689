"""Verification of draft chains on the host: the verdict's cost per round (issues 10 and 11).

The verifier verifies a sampled request's chain on the host (`kernels.speculative`) from the
processed rows of its window. This times `verify_chain` (one chain, as the engine calls it
per session) and `verify_chains` (a batch of chains with per-chain seeds) at width 64,
exact and probabilistic mode, point-mass drafts and q rows, k = 1, 4, 8 — this tree against
another checkout (`--against DIR`, e.g. the code before a change), each arm in a fresh
process, interleaved block by block (order reversed each block); the ratio is the median of
the per-block ratios. Torch runs one thread, as the services' engine does on a busy host.

Usage: python bench/verify_host.py [--against DIR] [--blocks 5] [--calls 100]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CASES = [(mode, q, k, batch) for mode in ("exact", "probabilistic") for q in (False, True)
         for k in (1, 4, 8) for batch in (1, 32)]


def worker(tree: Path, calls: int) -> dict[str, float]:
    """ms per call of every case, with `kernels` imported from `tree`."""
    sys.path.insert(0, str(tree))
    import torch

    from kernels.sampling import SamplingParams, SparseRows, process_logits
    from kernels.speculative import Mode, verify_chain, verify_chains

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.8, top_p=0.95)
    out = {}
    for mode, with_q, k, batch in CASES:
        target = process_logits(torch.randn(batch * (k + 1), 4096, generator=generator), params)
        q = process_logits(torch.randn(batch * k, 4096, generator=generator), params) if with_q else None
        drafts = target.token_ids.view(batch, k + 1, -1)[:, :k, 0].contiguous()  # likely tokens: some accepted
        mode_ = Mode(mode)
        if batch == 1:
            call = lambda i: verify_chain(target, drafts[0].tolist(), q, mode=mode_, seed=i, base_position=100,  # noqa: E731
                                          accept_seed=i + 1)
        else:
            seeds = torch.arange(batch, dtype=torch.int64)
            bases = torch.full((batch,), 100, dtype=torch.int64)
            nums = torch.full((batch,), k, dtype=torch.int64)
            call = lambda i: verify_chains(target, drafts, nums, q, mode=mode_, seed=seeds + i,  # noqa: E731
                                           base_positions=bases, accept_seed=seeds + i + 1)
        call(0)
        started = time.perf_counter()
        for i in range(calls):
            call(i)
        out[f"{mode}|{with_q}|{k}|{batch}"] = (time.perf_counter() - started) / calls * 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--against", type=Path, default=None, help="another checkout, timed beside this one")
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args.worker, args.calls)))
        return
    trees = {"this tree": REPO} | ({"other": args.against.resolve()} if args.against else {})
    blocks = []
    for block in range(args.blocks):
        order = list(trees) if block % 2 == 0 else list(reversed(trees))
        row = {}
        for name in order:
            done = subprocess.run([sys.executable, __file__, "--worker", str(trees[name]), "--calls", str(args.calls)],
                                  capture_output=True, text=True, check=True)
            row[name] = json.loads(done.stdout.strip().splitlines()[-1])
        blocks.append(row)
        print(f"  block {block + 1}/{args.blocks} done", file=sys.stderr, flush=True)
    other = f" | `{args.against}` ms | that / this (median of paired blocks)" if args.against else ""
    print(f"\n| mode | drafts | k | chains | this tree ms{other} |")
    print("| --- | --- | ---: | ---: | ---:" + (" | ---: | ---:" if args.against else "") + " |")
    for mode, with_q, k, batch in CASES:
        key = f"{mode}|{with_q}|{k}|{batch}"
        this = statistics.median(b["this tree"][key] for b in blocks)
        cells = f"| {mode} | {'q rows' if with_q else 'point masses'} | {k} | {batch} | {this:.3f}"
        if args.against:
            that = statistics.median(b["other"][key] for b in blocks)
            ratio = statistics.median(b["other"][key] / b["this tree"][key] for b in blocks)
            cells += f" | {that:.3f} | {ratio:.2f}"
        print(cells + " |")


if __name__ == "__main__":
    main()

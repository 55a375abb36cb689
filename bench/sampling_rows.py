"""The processed rows of sampled requests: selecting candidates against sorting whole rows,
and (on the CPU) the native rows.

`kernels.sampling.process_logits` turns logits [rows, vocab] into p's sparse rows (DESIGN §2).
It used to sort every row whole (float64, stable); torch now selects the max(width, top_k)
candidates (`_candidates`: two top-k selections and a sort of the candidates) and sorts rows
whole only when the candidates are not much fewer than the vocabulary; on the CPU a native pass
(kernels/_sampling_rows.c) does it a row at a time. The routes run here on the same logits,
interleaved block by block (order reversed each block): device time per call (CUDA events over
`--calls` back-to-back calls; on the CPU the wall) and host time to enqueue one call; the ratios
are medians of the per-block ratios. The rows must agree: same ids, probs within 1e-12
(relative).

Usage: python bench/sampling_rows.py [--vocab 151936] [--rows 1,5,17] [--blocks 5] [--calls 50] [--device cuda]
       (the embedded model's rows on the CPU: --device cpu --vocab 4096 --rows 1,8,40)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels.sampling as sampling  # noqa: E402
from kernels.sampling import SamplingParams, process_logits  # noqa: E402

PARAMS = {
    "T 0.8, top-p 0.95": SamplingParams(temperature=0.8, top_p=0.95),
    "T 1.0, top-k 50": SamplingParams(temperature=1.0, top_k=50),
    "T 0.7, min-p 0.05": SamplingParams(temperature=0.7, min_p=0.05),
}


def timed(logits: torch.Tensor, params: SamplingParams, route: str, calls: int) -> tuple[float, float]:
    """(device ms per call, host ms to enqueue one call) of one route."""
    limit, on_cuda, native = sampling.MAX_CANDIDATES, sampling.SELECT_ON_CUDA, sampling._native
    sampling.MAX_CANDIDATES = limit if route == "candidates" else 0  # 0: every row sorted whole
    sampling.SELECT_ON_CUDA = route == "candidates"
    if route != "native":
        sampling._native = lambda: None
    try:
        cuda = logits.device.type == "cuda"
        process_logits(logits, params)  # warm
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        host = time.perf_counter()
        for _ in range(calls):
            process_logits(logits, params)
        host = (time.perf_counter() - host) / calls * 1e3
        if not cuda:
            return host, host
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls, host
    finally:
        sampling.MAX_CANDIDATES, sampling.SELECT_ON_CUDA, sampling._native = limit, on_cuda, native


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--rows", default="1,5,17")
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    print(f"device {args.device} ({torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}), "
          f"vocab {args.vocab}, {args.blocks} paired blocks of {args.calls} calls", file=sys.stderr)
    native = args.device == "cpu" and sampling._native() is not None
    all_routes = ["sorted", "candidates"] + (["native"] if native else [])
    print("\n| rows | params | sorted whole: device ms / host ms | candidates: device ms / host ms "
          "| sorted / candidates, device (median of paired blocks) | same rows |"
          + (" native ms | candidates / native |" if native else ""))
    print("| ---: | --- | ---: | ---: | ---: | --- |" + (" ---: | ---: |" if native else ""))
    for num_rows in [int(r) for r in args.rows.split(",")]:
        # logits as a bf16 model makes them (ties included), in float32
        logits = (torch.randn(num_rows, args.vocab, generator=generator) * 4).to(torch.bfloat16).float().to(args.device)
        for name, params in PARAMS.items():
            kept_native, sampling._native = sampling._native, lambda: None
            sampling.MAX_CANDIDATES, limit = 0, sampling.MAX_CANDIDATES
            whole = process_logits(logits, params)
            sampling.MAX_CANDIDATES, sampling.SELECT_ON_CUDA = limit, True
            rows = [process_logits(logits, params)]
            sampling.SELECT_ON_CUDA, sampling._native = False, kept_native
            if native:
                rows.append(process_logits(logits, params))
            same = all(torch.equal(whole.token_ids, r.token_ids) and torch.allclose(whole.probs, r.probs, rtol=1e-12)
                       for r in rows)
            blocks = []
            for block in range(args.blocks):
                routes = all_routes if block % 2 == 0 else all_routes[::-1]
                blocks.append({route: timed(logits, params, route, args.calls) for route in routes})
                print(f"  rows {num_rows}, {name}, block {block}: " + ", ".join(
                    f"{r} {d:.3f} ms" for r, (d, _) in blocks[-1].items()), file=sys.stderr)
            med = {r: [statistics.median(b[r][i] for b in blocks) for i in (0, 1)] for r in all_routes}
            ratio = statistics.median(b["sorted"][0] / b["candidates"][0] for b in blocks)
            line = (f"| {num_rows} | {name} | {med['sorted'][0]:.3f} / {med['sorted'][1]:.3f} | "
                    f"{med['candidates'][0]:.3f} / {med['candidates'][1]:.3f} | {ratio:.2f} | {same} |")
            if native:
                line += (f" {med['native'][0]:.3f} | "
                         f"{statistics.median(b['candidates'][0] / b['native'][0] for b in blocks):.2f} |")
            print(line)


if __name__ == "__main__":
    main()

"""Prefill's expert products with FP8 weights (issue 36): a dequantised copy, or the FP8 tiles read.

One MoE layer's routed experts over a prompt chunk of T tokens (random block-scaled weights at
Qwen3-30B-A3B shapes: 128 experts, H 2048, I 768, top 8, blocks [128, 128]; random routes of 8
distinct experts a token), GPU time by CUDA events, the ways alternating in blocks (order
reversed each block):
- `dequant + grouped_mm` (the tree before): every expert dequantised to bf16
  (kernels.fused.fp8.dequantize_fast), then torch._grouped_mm over the routes sorted by expert;
- `fp8 grouped` (kernels.fused.grouped.grouped_experts): the FP8 tiles read by the products;
- `bf16 grouped_mm`: bf16 weights (what the bf16 service's prefill runs), for scale.
Reported: median ms a layer (× 48 = a chunk's prefill share), the FP8 way's time over the
tree before's (median of the blocks' paired ratios), its relative difference from the tree
before's outputs, and whether a prompt's routes keep their bits beside another prompt's.
`--sweep` times candidate tiles of the FP8 way first (its tile is fixed for every route count:
row invariance), at the largest T. `--model` then times what a request's first token waits for:
the whole FP8 model's prefill (`FusedModel.prefill`, random weights at those shapes, 48 layers,
`--quantize fp8`) of one prompt and of 8 prompts together in chunks of 2,048 tokens (the
verifier's default), with the FP8 way on and off (`expert_paths.GROUPED_FP8`), alternating.

Usage: python bench/fp8_grouped.py [--tokens 512,2048,4096] [--blocks 5] [--reps 5] [--sweep] [--model]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.model_baseline import cuda_time  # noqa: E402  (per-call ms by CUDA events)
from kernels.fused import grouped as grouped_module  # noqa: E402
from kernels.fused.fp8 import dequantize_fast, quantize  # noqa: E402
from kernels.fused.grouped import grouped_experts  # noqa: E402
from kernels.fused.moe import silu_mul  # noqa: E402

E, H, I, TOP_K, BLOCK, LAYERS = 128, 2048, 768, 8, (128, 128), 48
SWEEP_GATE_UP = [(64, 64, 128, 4, 3), (64, 64, 128, 4, 4), (64, 128, 128, 8, 3), (128, 64, 128, 8, 3),
                 (128, 128, 128, 8, 3), (64, 64, 64, 4, 4)]
SWEEP_DOWN = [(64, 128, 128, 4, 3), (64, 128, 128, 4, 4), (128, 128, 128, 8, 3), (64, 64, 128, 4, 4),
              (128, 64, 128, 4, 3), (64, 128, 64, 4, 4)]


def sorted_routes(num_tokens: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [T*k], counts [E]) of random routes, sorted as shared.model.expert_paths sorts them."""
    ids = torch.rand(num_tokens, E, generator=generator).topk(TOP_K, dim=1).indices.cuda()  # [T, k]
    keys = ids.reshape(-1)
    return torch.argsort(keys, stable=True), torch.bincount(keys, minlength=E)


def grouped_mm(x, order, counts, gate_up, down):
    """The tree before's products on full-precision weights: torch._grouped_mm over sorted rows."""
    rows = x[order // TOP_K]
    ends = torch.cumsum(counts, dim=0).to(torch.int32)
    act = silu_mul(torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=ends))
    return torch._grouped_mm(act, down.transpose(1, 2), offs=ends)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="512,2048,4096", help="chunk sizes, comma separated")
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--sweep", action="store_true", help="time candidate tiles of the FP8 way first")
    parser.add_argument("--model", action="store_true", help="then the whole FP8 model's prefill, the way on and off")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fp8_grouped.py times GPU kernels: it needs a CUDA device")
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    print("making the layer's experts ...", file=sys.stderr, flush=True)
    gate_up_bf16 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02
    down_bf16 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.02
    gate_up, down = quantize(gate_up_bf16, BLOCK), quantize(down_bf16, BLOCK)
    tokens = [int(t) for t in args.tokens.split(",")]
    chunks = {t: (torch.randn(t, H, device="cuda", dtype=torch.bfloat16), *sorted_routes(t, g)) for t in tokens}
    ways = {
        "dequant + grouped_mm": lambda x, o, c: grouped_mm(x, o, c, dequantize_fast(gate_up, torch.bfloat16),
                                                           dequantize_fast(down, torch.bfloat16)),
        "fp8 grouped": lambda x, o, c: grouped_experts(x, o, c, TOP_K, gate_up, down),
        "bf16 grouped_mm": lambda x, o, c: grouped_mm(x, o, c, gate_up_bf16, down_bf16),
    }
    if args.sweep:
        sweep(chunks[max(tokens)], ways["fp8 grouped"], args.reps)
    ms: dict[tuple[int, str], list[float]] = {}
    for block in range(args.blocks):
        order = list(ways) if block % 2 == 0 else list(ways)[::-1]
        for t, (x, o, c) in chunks.items():
            for way in order:
                ways[way](x, o, c)  # (warm: the allocator's blocks, the kernels' compile)
                ms.setdefault((t, way), []).append(statistics.median(cuda_time(lambda: ways[way](x, o, c), args.reps)))
        print(f"  block {block + 1}/{args.blocks}", file=sys.stderr, flush=True)
    print(f"\n{torch.cuda.get_device_name()}: one layer's routed experts over a chunk ({E} experts, H {H}, I {I}, "
          f"top {TOP_K}, blocks {list(BLOCK)}; median of {args.blocks} blocks × {args.reps} calls; "
          f"tiles gate_up {grouped_module.GATE_UP_TILE}, down {grouped_module.DOWN_TILE})\n")
    print("| tokens | dequant + grouped_mm ms | fp8 grouped ms | bf16 grouped_mm ms | fp8 grouped / before (paired) "
          "| × 48 layers, before → fp8 ms | fp8 TFLOP/s | rel. diff from before | a prompt's bits beside another |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for t, (x, o, c) in chunks.items():
        before, fp8, bf16 = (statistics.median(ms[t, w]) for w in ways)
        ratio = statistics.median(f / b for f, b in zip(ms[t, "fp8 grouped"], ms[t, "dequant + grouped_mm"]))
        ref, out = ways["dequant + grouped_mm"](x, o, c).float(), ways["fp8 grouped"](x, o, c).float()
        diff = float((out - ref).norm() / ref.norm())
        flops = 2 * t * TOP_K * 3 * H * I
        print(f"| {t} | {before:.3f} | {fp8:.3f} | {bf16:.3f} | {ratio:.3f} | {LAYERS * before:.0f} → {LAYERS * fp8:.0f} "
              f"| {flops / fp8 / 1e9:.0f} | {diff:.2e} | {beside(x, t, g, gate_up, down)} |")
    if args.model:
        del gate_up_bf16, down_bf16, gate_up, down, chunks
        model_prefill(args)


def beside(x: torch.Tensor, num_tokens: int, g: torch.Generator, gate_up, down) -> str:
    """A prompt of a quarter of the chunk alone, then between other tokens: its routes' bits equal?"""
    mine = max(1, num_tokens // 4)
    ids = torch.rand(num_tokens, E, generator=g).topk(TOP_K, dim=1).indices.cuda()

    def by_route(rows, route_ids):
        keys = route_ids.reshape(-1)
        order = torch.argsort(keys, stable=True)
        out = grouped_experts(rows, order, torch.bincount(keys, minlength=E), TOP_K, gate_up, down)
        return out[torch.argsort(order)]

    alone = by_route(x[:mine], ids[:mine])
    others = num_tokens // 2
    together = by_route(torch.cat([x[mine:mine + others], x[:mine]]), torch.cat([ids[mine:mine + others], ids[:mine]]))
    return "yes" if torch.equal(alone, together[others * TOP_K:]) else "NO"


def sweep(chunk, fp8_way, reps: int) -> None:
    x, o, c = chunk
    print(f"\ntiles of the FP8 way at {x.shape[0]} tokens (median ms of {reps} calls, 2 rounds):\n", flush=True)
    print("| gate_up tile (M, N, K, warps, stages) | down tile | ms |")
    print("| --- | --- | ---: |")
    saved = grouped_module.GATE_UP_TILE, grouped_module.DOWN_TILE
    results = []
    for gate_up_tile, down_tile in itertools.chain(((t, saved[1]) for t in SWEEP_GATE_UP),
                                                   ((saved[0], t) for t in SWEEP_DOWN)):
        grouped_module.GATE_UP_TILE, grouped_module.DOWN_TILE = gate_up_tile, down_tile
        try:
            fp8_way(x, o, c)
            took = min(statistics.median(cuda_time(lambda: fp8_way(x, o, c), reps)) for _ in range(2))
        except Exception as error:  # (a tile the GPU refuses: shared memory, registers)
            print(f"| {gate_up_tile} | {down_tile} | failed: {type(error).__name__} |", flush=True)
            continue
        results.append((took, gate_up_tile, down_tile))
        print(f"| {gate_up_tile} | {down_tile} | {took:.3f} |", flush=True)
    grouped_module.GATE_UP_TILE, grouped_module.DOWN_TILE = saved
    if results:
        print(f"\nfastest: {min(results)[1:]} ({min(results)[0]:.3f} ms)\n")


def model_prefill(args) -> None:
    """The FP8 model's prefill, one prompt and 8 together (chunks of 2,048 tokens), the FP8 way on
    and off, alternating; ms by synchronised wall time, median of the blocks."""
    import time

    import shared.model.expert_paths as expert_paths
    from bench.model_baseline import QWEN3_30B_A3B
    from shared.model import ModelConfig, load_model
    from shared.model.families.qwen3_moe.fused import FusedModel
    from shared.model.kv_cache import KVPool

    length, num_prompts, chunk = args.prompt_tokens, 8, 2048
    print("making the FP8 model (Qwen3-30B-A3B shapes, random weights) ...", file=sys.stderr, flush=True)
    model = load_model(config=ModelConfig.from_dict(QWEN3_30B_A3B | dict(max_position_embeddings=4096)),
                       random_weights=True, dtype=torch.bfloat16, device="cuda", seed=0, quantize="fp8")
    c = model.config
    pool = KVPool(num_layers=c.num_hidden_layers, num_slots=num_prompts, max_length=length,
                  num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype=torch.bfloat16, device="cuda")
    for _ in range(num_prompts):
        pool.acquire(length)
    fused = FusedModel(model, max_rows=1, max_length=length)
    gen = torch.Generator(device="cuda").manual_seed(1)
    prompts = [torch.randint(0, c.vocab_size, (length,), device="cuda", generator=gen) for _ in range(num_prompts)]
    per_chunk = max(1, chunk // length)

    def one() -> None:
        fused.prefill(prompts[0], [(0, length, 0)], pool.paged())

    def together() -> None:
        for first in range(0, num_prompts, per_chunk):
            group = range(first, min(num_prompts, first + per_chunk))
            fused.prefill(torch.cat([prompts[i] for i in group]), [(0, length, i) for i in group], pool.paged())

    def timed(fn) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - start)

    ms: dict[tuple[str, bool], list[float]] = {}
    for block in range(args.blocks + 1):  # (block 0 warms both ways: compiles, allocator)
        for way in (True, False) if block % 2 else (False, True):
            expert_paths.GROUPED_FP8 = way
            for name, fn in (("one prompt", one), (f"{num_prompts} prompts", together)):
                took = timed(fn)
                if block:
                    ms.setdefault((name, way), []).append(took)
    expert_paths.GROUPED_FP8 = True
    print(f"\nthe FP8 model's prefill ({c.num_hidden_layers} layers, {length}-token prompts, chunks of {chunk} "
          f"tokens; median ms of {args.blocks} blocks)\n")
    print("| prompts | dequantised copy + grouped_mm (before) | FP8 tiles read | FP8 / before (paired) |")
    print("| --- | ---: | ---: | ---: |")
    for name in ("one prompt", f"{num_prompts} prompts"):
        before, after = ms[name, False], ms[name, True]
        ratio = statistics.median(a / b for a, b in zip(after, before))
        print(f"| {name} | {statistics.median(before):.1f} | {statistics.median(after):.1f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()

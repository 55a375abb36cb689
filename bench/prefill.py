"""Prefill of a long prompt on the GPU (issues 10 and 11): tokens/s by chunk size, against the
compute and weight-read floors, with the earlier path side by side.

Random bf16 weights at Qwen3-30B-A3B shapes (or --small). Three paths over the same weights,
interleaved in rotating order (median of paired ratios against the first):
- `logits+mask`: the path before this change: the reference modules' eager window forward
  with a materialised [T, keys] causal mask and [T, vocab] float32 logits (its grouped experts
  share the current `ExpertStore`, so they use the `silu_mul` kernel too);
- `modules`: `Qwen3MoeModel.prefill`: the same modules with flash attention (bottom-right
  causal alignment) and no logits (prompt rows need only their hidden state);
- `fused`: `FusedModel.prefill`, what the verifier runs on CUDA: cuBLAS, grouped expert GEMMs
  and flash attention, with the fused per-row kernels (norms, RoPE + KV write, routing,
  combine) between them.
Each chunk of T tokens reads every expert's weights once (T * top_k routes over all experts),
so the floor of a chunk is the larger of its FLOPs at the dense bf16 peak and its weight bytes
at the copy bandwidth. `--profile` prints the top device kernels of one prompt per path.

A second table: N prompts arriving together (the verifier's PrefillBatcher), one forward per
prompt against shared forwards under a token budget, paired.

Usage: python bench/prefill.py [--small] [--length 4096] [--chunks 512,2048,4096] [--pairs 5] [--profile]
       [--sessions 8,32] [--session-length 512] [--budgets 2048,4096]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch.nn.attention import SDPBackend

import shared.model.rows as step_rows
import shared.model.families.qwen3_moe.layers as layers
from bench.model_baseline import QWEN3_30B_A3B, SMALL, copy_bandwidth
from shared.model import ModelConfig, load_model
from shared.model.families.qwen3_moe.fused import FusedModel
from shared.model.kv_cache import KVPool
from verifier_service.prefill import plan_chunks

PEAK_BF16_FLOPS = 989e12  # H200 dense bf16 (the data sheet's figure without sparsity)


def log(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def masked_causal(num_rows: int, visible: int):
    """The earlier eager mask: key position <= row position, materialised."""
    rows = torch.arange(visible - num_rows, visible, device="cuda").unsqueeze(1)
    return torch.arange(visible, device="cuda").unsqueeze(0) <= rows


PATHS = ("logits+mask", "modules", "fused")


def run_prompt(model, prompt, chunk: int, path: str, fused: FusedModel, pool: KVPool) -> torch.Tensor:
    cache = model.new_cache(prompt.shape[0]) if path != "fused" else None
    hidden = []
    for start in range(0, prompt.shape[0], chunk):
        ids = prompt[start : start + chunk]
        if path == "fused":
            hidden.append(fused.prefill(ids, [(start, ids.shape[0], 0)], pool.paged()))
        elif path == "modules":
            hidden.append(model.prefill(ids, cache))
        else:
            original = layers.causal_lower_right
            layers.causal_lower_right = masked_causal
            try:
                hidden.append(model(ids, cache)[1])
            finally:
                layers.causal_lower_right = original
    return torch.cat(hidden)


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def distinct_experts(model, run) -> float:
    """Mean distinct experts per layer and chunk in one run() of the fused path (a counting pass)."""
    counts = []
    for layer in model.layers:
        store = layer.mlp.experts
        store.grouped_sorted = (lambda original: lambda hidden, ids: (
            counts.append(torch.unique(ids).numel()), original(hidden, ids))[1])(store.grouped_sorted)
    try:
        run()
    finally:
        for layer in model.layers:
            del layer.mlp.experts.grouped_sorted  # back to the class's method
    return sum(counts) / len(counts)


def floors(model, length: int, chunk: int, bandwidth: float, experts: float) -> tuple[float, float]:
    """(compute floor s, weight-read floor s) of a `length`-token prompt in chunks of `chunk`,
    each chunk reading `experts` distinct experts per layer."""
    c = model.config
    layer = model.layers[0]
    attn = sum(p.numel() for p in layer.self_attn.parameters())
    active = c.num_hidden_layers * (attn + c.num_experts * c.hidden_size
                                    + c.num_experts_per_tok * layer.mlp.experts.expert_bytes // 2)
    attention_flops = 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * (length * length / 2)
    compute = (2 * active * length + attention_flops) / PEAK_BF16_FLOPS
    num_chunks = -(-length // chunk)
    per_chunk = sum(p.numel() * p.element_size() for p in model.layers.parameters())
    per_chunk += c.num_hidden_layers * experts * layer.mlp.experts.expert_bytes
    return compute, num_chunks * per_chunk / bandwidth


def prefill_sessions(fused, prompts, pool, budget: int | None) -> None:
    """Each prompt (all but its last token) into its own slot: one forward per prompt and chunk
    (budget None), or shared forwards planned as the verifier's PrefillBatcher plans them."""
    lefts = [p.shape[0] - 1 for p in prompts]
    done = [0] * len(prompts)
    while any(d < n for d, n in zip(done, lefts)):
        if budget is None:
            i = next(i for i, (d, n) in enumerate(zip(done, lefts)) if d < n)
            counts = [0] * len(prompts)
            counts[i] = lefts[i] - done[i]
        else:
            counts = plan_chunks([n - d for d, n in zip(done, lefts)], budget)
        ids = torch.cat([prompts[i][done[i] : done[i] + c] for i, c in enumerate(counts) if c])
        fused.prefill(ids, [(done[i], c, i) for i, c in enumerate(counts) if c], pool.paged())
        done = [d + c for d, c in zip(done, counts)]


def fresh_lengths_table(model, args) -> None:
    """The first prompt of a new length against the same prompt again, with cuDNN's attention
    allowed (it builds a plan per shape) and without (the default), then the two paired on
    repeated lengths. Prompts shorter than the 2,048-token budget are one chunk whose query and
    key lengths are the prompt's (use --length below 2,048 to see the per-shape cost)."""
    c = model.config
    pool = KVPool(num_layers=c.num_hidden_layers, num_slots=1, max_length=args.length, num_kv_heads=c.num_key_value_heads,
                  head_dim=c.head_dim, dtype=torch.bfloat16, device="cuda")
    fused = FusedModel(model, max_rows=1, max_length=args.length)
    gen = torch.Generator(device="cuda").manual_seed(3)
    with_cudnn = (SDPBackend.CUDNN_ATTENTION, *step_rows.PREFILL_ATTENTION)
    default = step_rows.PREFILL_ATTENTION

    def prefill(length, backends):
        prompt = torch.randint(0, c.vocab_size, (length,), device="cuda", generator=gen)
        step_rows.PREFILL_ATTENTION = backends
        try:
            return timed(lambda: prefill_sessions(fused, [prompt], pool, 2048))
        finally:
            step_rows.PREFILL_ATTENTION = default

    print("\n| prompt tokens | attention backends | first prompt of this length ms | same length again ms |")
    print("| ---: | --- | ---: | ---: |")
    lengths = iter(range(args.length - 101, 0, -7))  # never seen before in this process
    prefill(next(lengths), default)  # the process's first prefill: kernels compile, libraries load
    for name, backends in (("with cuDNN", with_cudnn), ("without cuDNN (default)", default)):
        for _ in range(2):
            length = next(lengths)
            first, again = prefill(length, backends), prefill(length, backends)
            print(f"| {length} | {name} | {first * 1e3:.0f} | {again * 1e3:.0f} |")
    length = next(lengths)
    prefill(length, with_cudnn), prefill(length, default)
    times = {name: [] for name in ("with", "without")}
    for i in range(args.pairs):
        for name in (("with", "without") if i % 2 == 0 else ("without", "with")):
            times[name].append(prefill(length, with_cudnn if name == "with" else default))
    ratio = statistics.median(a / b for a, b in zip(times["with"], times["without"]))
    print(f"\nrepeated {length}-token prompt, with cuDNN / without (median of {args.pairs} pairs): {ratio:.3f} "
          f"({statistics.median(times['with']) * 1e3:.1f} / {statistics.median(times['without']) * 1e3:.1f} ms)")


def sessions_table(model, args) -> None:
    """Prompts arriving together: one forward each (before) against shared forwards (paired)."""
    c = model.config
    budgets = [int(b) for b in args.budgets.split(",")]
    print(f"\n| prompts of {args.session_length} tokens arriving together | one forward each s | "
          + " | ".join(f"shared, budget {b} s | one each / shared {b}" for b in budgets) + " |")
    print("| ---: " * (2 + 2 * len(budgets)) + "|")
    gen = torch.Generator(device="cuda").manual_seed(2)
    for num in (int(n) for n in args.sessions.split(",")):
        prompts = [torch.randint(0, c.vocab_size, (args.session_length,), device="cuda", generator=gen)
                   for _ in range(num)]
        pool = KVPool(num_layers=c.num_hidden_layers, num_slots=num, max_length=args.session_length,
                      num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype=torch.bfloat16, device="cuda")
        for _ in range(num):  # slot i holds block i: prompt i prefills into slot i
            pool.acquire(args.session_length)
        fused = FusedModel(model, max_rows=1, max_length=args.session_length)
        arms = [None, *budgets]
        for arm in arms:  # warm-up
            prefill_sessions(fused, prompts, pool, arm)
        times = {arm: [] for arm in arms}
        for i in range(args.pairs):
            for arm in arms[i % len(arms):] + arms[: i % len(arms)]:
                times[arm].append(timed(lambda: prefill_sessions(fused, prompts, pool, arm)))
            log(f"  {num} prompts round {i + 1}/{args.pairs}: " + " / ".join(f"{times[a][-1]:.3f}" for a in arms))
        cells = [f"{statistics.median(times[None]):.3f}"]
        for b in budgets:
            ratio = statistics.median(o / n for o, n in zip(times[None], times[b]))
            cells += [f"{statistics.median(times[b]):.3f}", f"{ratio:.2f}"]
        print(f"| {num} | " + " | ".join(cells) + " |")
        del pool


def layouts_table(model, args) -> None:
    """Prompts arriving together into a contiguous pool (a block per sequence) against a paged
    pool (blocks of --block-size), shared forwards at the first budget; paired."""
    c = model.config
    budget = int(args.budgets.split(",")[0])
    print(f"\n| prompts of {args.session_length} tokens, budget {budget} | contiguous s | paged {args.block_size} s "
          "| paged / contiguous |")
    print("| ---: | ---: | ---: | ---: |")
    gen = torch.Generator(device="cuda").manual_seed(2)
    for num in (int(n) for n in args.sessions.split(",")):
        prompts = [torch.randint(0, c.vocab_size, (args.session_length,), device="cuda", generator=gen)
                   for _ in range(num)]
        pools = {}
        for name, block_size in (("contiguous", None), ("paged", args.block_size)):
            pool = KVPool(num_layers=c.num_hidden_layers, num_slots=num, max_length=args.session_length,
                          num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype=torch.bfloat16,
                          device="cuda", block_size=block_size)
            for _ in range(num):  # slot i: prompt i
                pool.acquire(args.session_length)
            pools[name] = pool
        fused = FusedModel(model, max_rows=1, max_length=args.session_length)
        for pool in pools.values():  # warm-up
            prefill_sessions(fused, prompts, pool, budget)
        times = {name: [] for name in pools}
        for i in range(args.pairs):
            for name in (list(pools) if i % 2 == 0 else list(pools)[::-1]):
                times[name].append(timed(lambda: prefill_sessions(fused, prompts, pools[name], budget)))
        ratio = statistics.median(p / q for p, q in zip(times["paged"], times["contiguous"]))
        print(f"| {num} | {statistics.median(times['contiguous']):.4f} | {statistics.median(times['paged']):.4f} "
              f"| {ratio:.3f} |")
        del pools


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--chunks", default="512,2048,4096")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--sessions", default="8,32", help="prompts arriving together (the batched-prefill table)")
    parser.add_argument("--session-length", type=int, default=512)
    parser.add_argument("--budgets", default="2048,4096", help="token budgets of the batched-prefill table")
    parser.add_argument("--skip-chunks", action="store_true", help="skip the chunk-size table")
    parser.add_argument("--skip-sessions", action="store_true", help="skip the batched-prefill table")
    parser.add_argument("--layouts", action="store_true", help="only the KV layout table (contiguous vs paged)")
    parser.add_argument("--block-size", type=int, default=64, help="paged block size of the layout table")
    args = parser.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]
    shapes = (SMALL if args.small else QWEN3_30B_A3B) | dict(max_position_embeddings=max(args.length + 64, 4096))
    t0 = time.perf_counter()
    model = load_model(config=ModelConfig.from_dict(shapes), random_weights=True, dtype=torch.bfloat16,
                       device="cuda", seed=0)
    torch.cuda.synchronize()
    log(f"model built in {time.perf_counter() - t0:.1f}s")
    if args.layouts:
        layouts_table(model, args)
        return
    bandwidth = copy_bandwidth()
    prompt = torch.randint(0, model.config.vocab_size, (args.length,), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(1))
    c = model.config
    pool = KVPool(num_layers=c.num_hidden_layers, num_slots=1, max_length=args.length, num_kv_heads=c.num_key_value_heads,
                  head_dim=c.head_dim, dtype=torch.bfloat16, device="cuda")
    fused = FusedModel(model, max_rows=1, max_length=args.length)

    def run(chunk: int, path: str) -> torch.Tensor:
        return run_prompt(model, prompt, chunk, path, fused, pool)

    if not args.skip_chunks:
        # Hidden rows against the earlier path, next to that path's own spread between chunk sizes
        # (the bf16 noise floor of these random 48-layer weights).
        def rel(a, b):
            return ((a.float() - b.float()).norm(dim=-1) / a.float().norm(dim=-1)).max().item()

        base = run(chunks[0], "logits+mask")
        log(f"hidden rows, max relative difference to logits+mask at chunk {chunks[0]}: "
            f"logits+mask at chunk {chunks[-1]} {rel(base, run(chunks[-1], 'logits+mask')):.2e}, "
            + ", ".join(f"{path} {rel(base, run(chunks[0], path)):.2e}" for path in PATHS[1:]))

        print(f"\n| {args.length}-token prompt, chunk | " + " | ".join(f"{p} s" for p in PATHS)
              + " | fused tokens/s | " + " | ".join(f"logits+mask / {p}" for p in PATHS[1:])
              + " | distinct experts/layer | compute floor s | weight-read floor s | fused of max(floors) |")
        print("| ---: " * (2 * len(PATHS) + 5) + "|")
        for chunk in chunks:
            for path in PATHS:  # warm-up
                run(chunk, path)
            times = {path: [] for path in PATHS}
            for i in range(args.pairs):
                for path in PATHS[i % len(PATHS):] + PATHS[: i % len(PATHS)]:
                    times[path].append(timed(lambda: run(chunk, path)))
                log(f"  chunk {chunk} round {i + 1}/{args.pairs}: " + " / ".join(f"{times[p][-1]:.3f}" for p in PATHS))
            ratios = [statistics.median(o / n for o, n in zip(times[PATHS[0]], times[p])) for p in PATHS[1:]]
            experts = distinct_experts(model, lambda: run(chunk, "fused"))
            compute, weights = floors(model, args.length, chunk, bandwidth, experts)
            fused_s = statistics.median(times["fused"])
            print(f"| {chunk} | " + " | ".join(f"{statistics.median(times[p]):.3f}" for p in PATHS)
                  + f" | {args.length / fused_s:,.0f} | " + " | ".join(f"{r:.3f}" for r in ratios)
                  + f" | {experts:.1f} | {compute:.4f} | {weights:.4f} | {max(compute, weights) / fused_s:.2f} |")

    if not args.skip_sessions:
        sessions_table(model, args)
    fresh_lengths_table(model, args)

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for chunk in chunks:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run(chunk, "fused")
                torch.cuda.synchronize()
            print(f"\nfused, chunk {chunk}: top device time")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()

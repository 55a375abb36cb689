"""Launch settings of the fused decode step, each measured on the whole captured step (issue 10).

Per-kernel timings in isolation miss how kernels overlap under programmatic dependent
launch, so each variant here (module constants or config functions of kernels.fused,
patched before capture) gets fresh window graphs of a 12-layer model at Qwen3-30B-A3B
shapes, or with `--family hybrid` Qwen3.5-35B-A3B's (its first 12 layers: 9 Gated DeltaNet, 3
gated attention), the full vocabulary, timed against the default graphs on the same weights and
KV pool: interleaved pairs, median of paired ratios, at 1 and 5 rows and contexts 512 and 4,096.
Ratio < 1: the variant is faster. Rows print as they finish (a long sweep that is cut short
still reports).

Usage: python bench/config_sweep.py [--family qwen3_moe|hybrid] [--layers 12] [--pairs 9] [--only SUBSTRING] [--set tune|previous]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import kernels.fused as fused_package
import kernels.fused.attention as attention
import kernels.fused.deltanet as deltanet
import kernels.fused.linear as linear
import kernels.fused.moe as moe
import kernels.fused.norm as norm
import kernels.fused.router as router
import shared.model.families.hybrid.fused as hybrid_fast
import shared.model.families.qwen3_moe.fused as fast
from bench.fused_step import replay_time
from bench.model_baseline import SMALL
from bench.pairbench.common import QWEN3_5_35B_A3B
from shared.model import ModelConfig, load_model
from shared.model.families import build_fused
from shared.model.graphs import FusedRunner
from shared.model.kv_cache import KVPool

WINDOWS = (1, 5)


def log(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def for_shape(original, shape: tuple[int, int], value):
    """A config function that answers `value` for one weight shape and defers to `original` otherwise."""
    return lambda n, k, *rest: value if (n, k) == shape else original(n, k, *rest)


def variants(model) -> dict[str, list[tuple[object, str, object]]]:
    """name → [(module, attribute, value)] patches, each one step from today's defaults."""
    c = model.config
    o_shape = (c.hidden_size, c.num_attention_heads * c.head_dim)
    router_shape = (c.num_experts, c.hidden_size)
    qkv_shape = ((c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim, c.hidden_size)
    lm_shape = (c.vocab_size, c.hidden_size)
    gate_up_shape = (2 * c.moe_intermediate_size, c.hidden_size)
    down_shape = (c.hidden_size, c.moe_intermediate_size)
    lin, moe_cfg, splits = linear.linear_config, moe.moe_config, fast.split_k
    out: dict[str, list] = {}
    out["per-row kernels: inputs after the wait (session 14's kernels)"] = [(fused_package, "EARLY_READS", False)]
    out["experts down: plain launch, routes and first tile after the wait (session 14's)"] = [
        (moe, "DOWN_PDL", False), (moe, "DOWN_PRELOAD", False)]
    out["experts down: dependent launch, routes and first tile after the wait"] = [(moe, "DOWN_PRELOAD", False)]
    out["router top-k: 2 warps"] = [(router, "ROUTE_WARPS", 2)]
    out["combine: 16 warps"] = [(moe, "COMBINE_WARPS", 16)]
    out["add + rmsnorm: 16 warps"] = [(norm, "NORM_WARPS", 16)]
    out["q/k norm + rope: 4 warps"] = [(norm, "QK_ROPE_WARPS", 4)]
    out["attention merge: slice 64"] = [(attention, "MERGE_SLICE", 64)]
    out["attention merge: 2 warps"] = [(attention, "MERGE_WARPS", 2)]
    out["attention: 128 keys per step"] = [(attention, "BLOCK_N", 128), (attention, "SPLIT_STAGES", 2)]
    out["attention: 64-key splits"] = [(attention, "SPLIT", 64)]
    out["attention split: 8 warps"] = [(attention, "SPLIT_WARPS", 8)]
    out["o_proj: 8 K splits"] = [(fast, "split_k", for_shape(splits, o_shape, 8))]
    out["o_proj: 2 K splits"] = [(fast, "split_k", for_shape(splits, o_shape, 2))]
    out["router: 32 K splits (BK 64)"] = [(fast, "split_k", for_shape(splits, router_shape, 32)),
                                          (linear, "linear_config", for_shape(lin, router_shape, (32, 64, 4, 3)))]
    out["router: 8 K splits (BK 256)"] = [(fast, "split_k", for_shape(splits, router_shape, 8)),
                                          (linear, "linear_config", for_shape(lin, router_shape, (32, 256, 4, 3)))]
    for shape, name in ((qkv_shape, "qkv"), (o_shape, "o_proj"), (lm_shape, "lm_head")):
        for config in ((64, 256, 4, 5), (64, 256, 4, 6), (128, 256, 4, 4), (64, 512, 4, 3), (64, 256, 4, 4),
                       (32, 256, 4, 4)):
            if config != lin(*shape):
                out[f"{name}: BN {config[0]} BK {config[1]} warps {config[2]} stages {config[3]}"] = [
                    (linear, "linear_config", for_shape(lin, shape, config))]
    for shape, name in ((gate_up_shape, "experts gate_up"), (down_shape, "experts down")):
        for config in ((64, 128, 4, 5), (32, 128, 4, 5), (128, 128, 4, 4), (64, 256, 4, 3), (64, 128, 2, 4),
                       (32, 128, 2, 4), (64, 64, 4, 6)):
            if config != moe_cfg(*shape):
                out[f"{name}: BN {config[0]} BK {config[1]} warps {config[2]} stages {config[3]}"] = [
                    (moe, "moe_config", for_shape(moe_cfg, shape, config))]
    return out


def hybrid_variants(model) -> dict[str, list[tuple[object, str, object]]]:
    """The hybrid family's own shapes: narrow experts (512 wide, 9 routes with the shared one), the
    257-column router, the linear layers' out-projection; one setting changed at a time."""
    c = model.config
    gate_up_shape = (2 * c.moe_intermediate_size, c.hidden_size)
    down_shape = (c.hidden_size, c.moe_intermediate_size)
    out_shape = (c.hidden_size, c.linear_num_value_heads * c.linear_value_head_dim)
    o_shape = (c.hidden_size, c.num_attention_heads * c.head_dim)
    router_shape = (c.num_experts + 1, c.hidden_size)
    moe_cfg, splits = moe.moe_config, hybrid_fast.split_k
    out: dict[str, list] = {}
    for parts in (1, 2, 8):
        if parts != deltanet.V_SPLITS:
            out[f"gated delta step: {parts} programs a value head"] = [(deltanet, "V_SPLITS", parts)]
    out["router top-k: 2 warps"] = [(router, "ROUTE_WARPS", 2)]
    out["router top-k: 4 warps"] = [(router, "ROUTE_WARPS", 4)]
    lin = linear.linear_config
    in_shape = (2 * c.linear_num_key_heads * c.linear_key_head_dim + 2 * c.linear_num_value_heads * c.linear_value_head_dim
                + 2 * c.linear_num_value_heads, c.hidden_size)
    qkv_shape = ((2 * c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim, c.hidden_size)
    for shape, name in ((in_shape, "linear in_proj"), (qkv_shape, "attention qkv"), ((c.vocab_size, c.hidden_size), "lm_head")):
        for config in ((32, 256, 4, 4), (32, 256, 4, 5), (128, 256, 4, 3), (128, 128, 8, 4), (64, 128, 4, 6),
                       (64, 512, 4, 3), (64, 256, 8, 4)):
            if config != lin(*shape):
                out[f"{name}: BN {config[0]} BK {config[1]} warps {config[2]} stages {config[3]}"] = [
                    (linear, "linear_config", for_shape(lin, shape, config))]
    out["router top-k: argmax and probability in two reductions (before)"] = [(router, "MAX_WITH_INDEX", False)]
    for shape, name in ((out_shape, "linear out_proj"), (o_shape, "attention o_proj"), (router_shape, "router")):
        for count in (1, 2, 4, 8, 16):
            if count != splits(*shape):
                out[f"{name}: {count} K splits"] = [(hybrid_fast, "split_k", for_shape(splits, shape, count))]
    for shape, name in ((gate_up_shape, "experts gate_up"), (down_shape, "experts down")):
        for config in ((16, 128, 4, 4), (16, 256, 4, 3), (16, 128, 2, 4), (32, 256, 4, 3), (32, 64, 4, 6),
                       (32, 128, 2, 4), (32, 128, 8, 4), (64, 128, 4, 4), (64, 64, 4, 6), (128, 64, 4, 4)):
            if config != moe_cfg(*shape):
                out[f"{name}: BN {config[0]} BK {config[1]} warps {config[2]} stages {config[3]}"] = [
                    (moe, "moe_config", for_shape(moe_cfg, shape, config))]
    return out


def _linear_config_before(num_out: int, num_in: int, element_size: int = 2) -> tuple[int, int, int, int]:
    """linear_config before this sweep (2026-12-01, session 3)."""
    return 64 if num_out >= 4096 else 32, min(256, max(16, 1 << (num_in - 1).bit_length())), 4, 3


def _moe_config_before(num_out: int, num_in: int, element_size: int = 2) -> tuple[int, int, int, int]:
    return 32, min(128, max(16, 1 << (num_in - 1).bit_length())), 4, 4


def previous(model) -> dict[str, list[tuple[object, str, object]]]:
    """The settings before this sweep, all together and one at a time (each against today's defaults)."""
    single = {
        "linear (BN, BK, stages; o_proj and router K splits)": [(linear, "linear_config", _linear_config_before)],
        "experts (down BN 32)": [(moe, "moe_config", _moe_config_before)],
        "combine 4 warps": [(moe, "COMBINE_WARPS", 4)],
        "add + rmsnorm 4 warps": [(norm, "NORM_WARPS", 4)],
        "attention merge slice 32": [(attention, "MERGE_SLICE", 32)],
        "attention split 2 stages": [(attention, "SPLIT_STAGES", 2)],
    }
    return {"all previous settings": [p for patches in single.values() for p in patches]} | {
        f"previous {name}": patches for name, patches in single.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", choices=("qwen3_moe", "hybrid"), default="qwen3_moe")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--pairs", type=int, default=9)
    parser.add_argument("--only", default="",
                        help="run the variants whose name contains this (or one of these, comma-separated)")
    parser.add_argument("--set", choices=["tune", "previous"], default="tune",
                        help="tune: one setting changed at a time; previous: the settings before this sweep")
    parser.add_argument("--contexts", default="512,4096")
    parser.add_argument("--max-length", type=int, default=0, help="KV positions per slot (0: the largest context + 16)")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    max_length = max(args.max_length, max(contexts) + max(WINDOWS) + 8)
    if args.family == "hybrid":
        from dataclasses import replace

        from shared.model.families.hybrid.config import NextConfig
        from shared.model.families.hybrid.loader import random_next

        shapes = QWEN3_5_35B_A3B | dict(num_hidden_layers=args.layers, max_position_embeddings=max_length + 64,
                                        layer_types=QWEN3_5_35B_A3B["layer_types"][: args.layers])
        config = replace(NextConfig.from_dict(shapes), mtp_num_hidden_layers=0)
        model = random_next(config, dtype=torch.bfloat16, device="cuda", parts="trunk")
    else:
        shapes = SMALL | dict(num_hidden_layers=args.layers, vocab_size=151936, max_position_embeddings=max_length + 64)
        config = ModelConfig.from_dict(shapes)
        model = load_model(config=config, random_weights=True, dtype=torch.bfloat16, device="cuda", seed=0)
    pool = KVPool(num_layers=model.num_kv_layers, num_slots=1, max_length=max_length,
                  num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(3)
    pool.keys.normal_(0, 1, generator=gen)
    pool.values.normal_(0, 1, generator=gen)

    def runner() -> FusedRunner:
        fused = build_fused(model, max_rows=max(WINDOWS), max_length=max_length, num_state_slots=1)
        graphs = FusedRunner(fused, pool, max_rows=max(WINDOWS))
        graphs.capture(list(WINDOWS))
        return graphs

    base = runner()
    header = " | ".join(f"T={t} ctx {c}" for c in contexts for t in WINDOWS)
    print(f"\n{args.family}, {args.layers} layers; default step ms: " + ", ".join(
        f"T={t} ctx {c}: {replay_time(base, t, c):.3f}" for c in contexts for t in WINDOWS), flush=True)
    print(f"\n| variant | variant/default: {header} | mean |")
    print("| --- | " + "---: | " * (len(contexts) * len(WINDOWS) + 1), flush=True)
    sets = {"tune": hybrid_variants if args.family == "hybrid" else variants, "previous": previous}
    for name, patches in sets[args.set](model).items():
        if args.only and not any(part in name for part in args.only.split(",")):
            continue
        saved = [(module, attr, getattr(module, attr)) for module, attr, _ in patches]
        t0 = time.perf_counter()
        try:
            for module, attr, value in patches:
                setattr(module, attr, value)
            other = runner()
            ratios = []
            for context in contexts:
                for rows in WINDOWS:
                    pairs = [(replay_time(base, rows, context, repeats=20), replay_time(other, rows, context, repeats=20))
                             for _ in range(args.pairs)]
                    ratios.append(statistics.median(b / a for a, b in pairs))
            print(f"| {name} | " + " | ".join(f"{r:.3f}" for r in ratios) + f" | {statistics.mean(ratios):.3f} |",
                  flush=True)
            del other
        except Exception as error:  # report, go on
            print(f"| {name} | failed: {type(error).__name__}: {str(error)[:80]} |", flush=True)
        finally:
            for module, attr, value in saved:
                setattr(module, attr, value)
        log(f"  {name}: {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()

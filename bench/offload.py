"""Experts offloaded to host memory, with and without prefetch hints, against all resident (issues 18, 34).

Random bf16 weights at Qwen3-30B-A3B shapes (--family qwen3_moe) or Qwen3.5-35B-A3B shapes
(--family hybrid: Gated DeltaNet and gated attention, 256 experts and a shared one; its first
--layers layers; no prefetch arms) (every MoE layer is alike, so times scale with the count), on a GPU. Arms on the same weights: every expert resident,
and a model keeping --fractions of each layer's experts in device slots (the rest in pinned
host memory), run without and with the routing-memory prefetch (shared.model.offload; at most
--prefetch-limits copies a layer), each
through the service's window runner (shared.model.graphs: one CUDA graph per window when all
resident; graph segments between the host's route reads when offloaded). Each
block gives every arm, in a rotating order, the same text: a prompt (prefilled, untimed, so
the routing memory and the slots start alike) then --steps windows of T rows over the text
that follows (teacher-forced), timed from the host (a synchronisation per MoE layer is part
of what offloading costs). Text: Python standard-library sources through the embedded
model's tokenizer (a 4,096-token vocabulary: tokens repeat more often than under Qwen's).

Reported per slot fraction and T: ms per window (median over blocks), tokens/s at T = 1,
misses and copied MiB per window, the copy time those bytes take at the measured pinned
host-to-device bandwidth, the time offloading adds over all resident (median of paired
differences), the share of the no-prefetch arm's copy time (its bytes at the bandwidth, all of
which the compute waits for) that prefetching takes off the window's time ("hidden", median of
paired differences), the hints' precision and recall,
and whether every arm's logits were bit-identical to all resident.

Usage: python bench/offload.py [--family qwen3_moe|hybrid] [--layers 12] [--fractions 0.25,0.5] [--windows 1,5] [--blocks 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

from bench.model_baseline import QWEN3_30B_A3B
from bench.pairbench.common import QWEN3_5_35B_A3B
from shared.model import ModelConfig, load_model
from shared.model.families import build_fused
from shared.model.families.hybrid.config import NextConfig
from shared.model.fused import FusedForward
from shared.model.graphs import FusedRunner
from shared.model.kv_cache import KVPool
from shared.model.offload import RoutingMemory

TOKENIZER = Path(__file__).resolve().parent.parent / "models" / "tandem-demo-moe" / "tokenizer.json"


def log(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def text_tokens(count: int) -> list[int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    ids: list[int] = []
    for path in sorted(stdlib.glob("*.py")):
        ids += tokenizer.encode(path.read_text(errors="replace")).ids
        if len(ids) >= count:
            return ids[:count]
    raise SystemExit(f"only {len(ids)} tokens of text found under {stdlib}")


def h2d_bandwidth() -> float:
    """Pinned host-to-device copy bandwidth in bytes/s (1 GiB, median of 5)."""
    n = 1 << 30
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return n / (statistics.median(times[1:]) / 1e3)


class Arm:
    """One model behind the service's window runner (whole-window graphs when all resident,
    graph segments between route reads when offloaded), with its own KV pool."""

    def __init__(self, name: str, fused: FusedForward, prefetch: int, max_rows: int, use_graphs: bool = True) -> None:
        """prefetch: the most copies a layer's prefetch starts (0: none); use_graphs=False: the
        offloaded forward eagerly (no graph segments)."""
        self.name, self.fused, self.prefetch = name, fused, prefetch
        c = fused.model.config
        num_kv_layers = getattr(fused.model, "num_kv_layers", c.num_hidden_layers)  # (the hybrid's attention layers)
        pool = KVPool(num_layers=num_kv_layers, num_slots=1, max_length=c.max_position_embeddings,
                      num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype=fused.model.dtype, device="cuda")
        self.runner = FusedRunner(fused, pool, max_rows, use_graphs=use_graphs)
        self.runner.capture()
        self.slot, _ = pool.acquire(c.max_position_embeddings)
        self.stores = [layer.store for layer in fused.layers if layer.moe]
        self.prefill_ms: list[float] = []  # the untimed prompt's prefill, each run (logged at the end)

    def totals(self) -> dict[str, int]:
        out = {key: sum(getattr(s.counters, key) for s in self.stores)
               for key in ("misses", "bytes_moved", "prefetched", "prefetch_hits")}
        if self.fused.offload is not None:
            c = self.fused.offload.counters
            out |= {"predicted": c.predicted, "correct": c.correct, "needed": c.needed}
        return out

    def run(self, prompt: list[int], text: list[int], window: int, steps: int) -> tuple[float, dict, torch.Tensor]:
        """(ms per window, counter deltas, the last window's logits)."""
        offload = self.fused.offload
        if offload is not None:
            offload.memory = RoutingMemory(len(offload.stores)) if self.prefetch else None
            offload.prefetch_limit = max(1, self.prefetch)
        if self.fused.states is not None:  # (linear-attention states: the hybrid family)
            self.fused.states.reset(self.slot)
        torch.cuda.synchronize()
        started = time.perf_counter()
        self.fused.prefill(torch.tensor(prompt, device="cuda"), [(0, len(prompt), self.slot)], self.runner.kv)
        torch.cuda.synchronize()
        self.prefill_ms.append((time.perf_counter() - started) * 1e3)
        self.runner.run([(self.slot, text[:window], len(prompt))])  # (a shape's first run captures its segments)
        torch.cuda.synchronize()
        before = self.totals()
        start = time.perf_counter()
        for step in range(steps):
            out = self.runner.run([(self.slot, text[step * window : (step + 1) * window], len(prompt) + step * window)])
            self.runner.settle(self.slot)  # (every row kept)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - start) * 1e3 / steps
        after = self.totals()
        return ms, {key: after[key] - before[key] for key in after}, out.logits.clone()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", choices=("qwen3_moe", "hybrid"), default="qwen3_moe")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--fractions", default="0.25,0.5")
    parser.add_argument("--windows", default="1,5")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--eager-arm", action="store_true", help="also the offloaded forward run eagerly (no graph segments)")
    parser.add_argument("--prefetch-limits", default=None,
                        help="prefetch arms: the most copies a layer's prefetch starts (default 1,4; none for hybrid)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/offload.py needs a CUDA GPU")
    fractions = [float(f) for f in args.fractions.split(",")]
    windows = [int(w) for w in args.windows.split(",")]
    if args.family == "hybrid":
        config = NextConfig.from_dict(QWEN3_5_35B_A3B | dict(num_hidden_layers=args.layers, mtp_num_hidden_layers=0,
                                                             layer_types=QWEN3_5_35B_A3B["layer_types"][: args.layers]))
        if args.prefetch_limits:
            raise SystemExit("--prefetch-limits: the hybrid family's offloaded forward has no prefetch")
    else:
        config = ModelConfig.from_dict(QWEN3_30B_A3B | dict(num_hidden_layers=args.layers))
    span = args.prompt + args.steps * max(windows)
    tokens = text_tokens(span * args.blocks * len(windows))
    bandwidth = h2d_bandwidth()
    log(f"pinned host-to-device copies: {bandwidth / 1e9:.1f} GB/s")

    def build(slots: int | None) -> FusedForward:
        started = time.perf_counter()
        model = load_model(config=config, random_weights=True, device="cuda", dtype=torch.bfloat16, seed=0,
                           num_expert_slots=slots, parts="trunk")
        log(f"built {args.layers} layers, slots {slots or 'all'} in {time.perf_counter() - started:.1f}s")
        return build_fused(model, max_rows=max(windows), max_length=config.max_position_embeddings, num_state_slots=1)

    max_rows = max(windows)
    resident = Arm("all resident", build(None), prefetch=0, max_rows=max_rows)
    limits = [int(n) for n in (args.prefetch_limits or ("" if args.family == "hybrid" else "1,4")).split(",") if n]
    expert_bytes = resident.stores[0].expert_bytes
    rows = []
    all_arms: list[Arm] = [resident]
    for fraction in fractions:
        slots = max(config.num_experts_per_tok, round(fraction * config.num_experts))
        offloaded = build(slots)
        arms = [resident, Arm("offloaded", offloaded, 0, max_rows),
                *(Arm(f"offloaded + prefetch <= {n}", offloaded, n, max_rows) for n in limits),
                *([Arm("offloaded, eager", offloaded, 0, max_rows, use_graphs=False)] if args.eager_arm else [])]
        all_arms += arms[1:]
        for window in windows:
            times = {arm.name: [] for arm in arms}
            deltas = {arm.name: [] for arm in arms}
            identical = {arm.name: True for arm in arms}
            for block in range(args.blocks):
                base = (block * len(windows) + windows.index(window)) * span
                prompt = tokens[base : base + args.prompt]
                text = tokens[base + args.prompt : base + args.prompt + args.steps * window]
                last = {}
                for arm in arms[block % len(arms) :] + arms[: block % len(arms)]:  # rotate the order
                    ms, delta, last[arm.name] = arm.run(prompt, text, window, args.steps)
                    times[arm.name].append(ms)
                    deltas[arm.name].append(delta)
                for arm in arms[1:]:
                    identical[arm.name] &= bool(torch.equal(last[arm.name], last[resident.name]))
                log(f"slots {slots}, T={window}, block {block}: " +
                    ", ".join(f"{name} {values[-1]:.2f} ms" for name, values in times.items()))
            base_ms = times["all resident"]
            windows_run = args.steps * args.blocks
            exposed_copy_ms = sum(x["bytes_moved"] for x in deltas["offloaded"]) / windows_run / bandwidth * 1e3
            for arm in arms:
                removed = [a - p for a, p in zip(times["offloaded"], times[arm.name])]
                d = deltas[arm.name]
                total = {key: sum(x[key] for x in d) for key in d[0]}
                copy_ms = total["bytes_moved"] / windows_run / bandwidth * 1e3
                rows.append(dict(
                    slots=slots, fraction=fraction, window=window, arm=arm.name,
                    ms=statistics.median(times[arm.name]),
                    tokens_s=window / statistics.median(times[arm.name]) * 1e3 if window == 1 else None,
                    misses=total["misses"] / windows_run / len(arm.stores),
                    mib=total["bytes_moved"] / windows_run / 2**20, copy_ms=copy_ms,
                    added=statistics.median([t - r for t, r in zip(times[arm.name], base_ms)]),
                    hidden=(statistics.median(removed) / exposed_copy_ms if arm.prefetch and exposed_copy_ms else None),
                    precision=total["correct"] / total["predicted"] if total.get("predicted") else None,
                    recall=total["correct"] / total["needed"] if arm.prefetch and total.get("needed") else None,
                    identical=identical[arm.name],
                ))
        del arms, offloaded
        torch.cuda.empty_cache()
    for arm in {id(a): a for a in all_arms}.values():
        log(f"prefill of the {args.prompt}-token prompt, {arm.name} ({arm.stores[0].num_slots} slots): median {statistics.median(arm.prefill_ms):.1f} ms "
            f"over {len(arm.prefill_ms)}")
    print(f"\nexpert: {expert_bytes / 2**20:.1f} MiB; pinned host-to-device {bandwidth / 1e9:.1f} GB/s; "
          f"{args.layers} layers, prompt {args.prompt}, {args.steps} windows x {args.blocks} blocks\n")
    print(f"| slots (of {config.num_experts}) | T | arm | ms per window | tokens/s | misses per layer | MiB copied | copy ms at bandwidth "
          "| added over all resident, ms | copy time hidden by prefetch | hint precision | hint recall | logits = all resident |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    fmt = lambda v, spec: "" if v is None else format(v, spec)  # noqa: E731
    for r in rows:
        print(f"| {r['slots']} ({r['fraction']:.0%}) | {r['window']} | {r['arm']} | {r['ms']:.2f} | {fmt(r['tokens_s'], '.1f')} "
              f"| {r['misses']:.2f} | {r['mib']:.0f} | {r['copy_ms']:.2f} | {r['added']:.2f} | {fmt(r['hidden'], '.1%')} "
              f"| {fmt(r['precision'], '.2f')} | {fmt(r['recall'], '.2f')} | {'yes' if r['identical'] else 'NO'} |")


if __name__ == "__main__":
    main()

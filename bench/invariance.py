"""Row invariance of the verifier's forward, measured directly, and what it costs (issue 16).

Random bf16 weights at Qwen3-30B-A3B shapes on the GPU (`--small`: 4 layers; `--tiny --device
cpu`: a smoke test of the code paths). Every sequence has its own KV slot; the context before
each window is stand-in values (the bits compared are the window's own).

1. Windows: every row of a window of T = 1..17 rows against the one-row step at its position.
2. Batch compositions: random batches of 2-8 sequences (decode batches of one-row windows,
   verify batches of 1-5-row windows, and batches with a longer window, which run eagerly),
   each at its own context, up to 64 rows: every row against its one-row step.
3. Prefill: prompts of 7, 40 and 300 tokens prefilled (all but the last token, as the
   verifier does) alone in one chunk, in one forward with other prompts, in chunks of 128,
   and decoded row by row; their KV rows and the first token's logits (the one-row step of
   the last token) compared with the lone prefill's.
4. Cost: the invariant graphs against a yardstick that is not invariant (`FusedModel(...,
   invariant=False)`: cuBLAS projections for windows of several rows, which pick their
   kernel by the row count) — the same tables 1 and 2 for the yardstick, then both timed
   interleaved (median of paired ratios): single-stream windows, and batches of 8 sequences
   (decode, and verify windows of 3 and 5 rows: concurrency 8).

5. `--cpu-cost`: the CPU path's price — the embedded model's reference forward, a window run
   as its rows' one-row steps (row_invariant, the CPU verifier's default for exact mode)
   against one batched forward.

    python bench/invariance.py [--small] [--pairs 9] [--trials 24]
    python bench/invariance.py --cpu-cost
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

from bench.model_baseline import QWEN3_30B_A3B, SMALL, cuda_time, log
from shared.model import ModelConfig, load_model
from shared.model.families.qwen3_moe.fused import FusedModel
from shared.model.graphs import FusedRunner
from shared.model.kv_cache import KVPool

TINY = dict(model_type="qwen3_moe", vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
            num_experts_per_tok=2, max_position_embeddings=4096, rope_theta=10000.0, norm_topk_prob=True)
NUM_SEQS = 8
MAX_WINDOW = 17
VERIFY_WINDOW = 5  # max draft tokens 4 + the bonus row: captured verify batches


class Bench:
    def __init__(self, args) -> None:
        shapes = TINY if args.tiny else SMALL if args.small else QWEN3_30B_A3B
        self.config = c = ModelConfig.from_dict(shapes | dict(max_position_embeddings=4096))
        self.device = args.device
        dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
        started = time.perf_counter()
        self.model = load_model(config=c, random_weights=True, dtype=dtype, device=args.device, seed=0)
        log(f"model built in {time.perf_counter() - started:.1f}s")
        self.length = 1024 + 64
        self.pool = KVPool(num_layers=c.num_hidden_layers, num_slots=NUM_SEQS + 1, max_length=self.length,
                           num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype=dtype, device=args.device,
                           block_size=args.block_size or None)
        gen = torch.Generator(device=args.device).manual_seed(3)
        self.pool.keys.normal_(0, 1, generator=gen)  # stand-in context
        self.pool.values.normal_(0, 1, generator=gen)
        self.slots = [self.pool.acquire(self.length)[0] for _ in range(NUM_SEQS)]
        self.scratch, _ = self.pool.acquire(1)
        self.tokens = torch.Generator().manual_seed(5)
        self.rng = random.Random(7)
        self.runners = {name: self._runner(invariant) for name, invariant in (("invariant", True), ("yardstick", False))}

    def _runner(self, invariant: bool) -> FusedRunner:
        fused = FusedModel(self.model, max_rows=64, max_length=self.length, invariant=invariant)
        runner = FusedRunner(fused, self.pool, MAX_WINDOW, max_batch_rows=64, scratch_slot=self.scratch,
                              verify_window=VERIFY_WINDOW)
        started = time.perf_counter()
        runner.capture()
        log(f"{'invariant' if invariant else 'yardstick'} graphs captured in {time.perf_counter() - started:.1f}s")
        return runner

    def random_tokens(self, n: int) -> list[int]:
        return torch.randint(0, self.config.vocab_size, (n,), generator=self.tokens).tolist()

    # -- 1 and 2: rows against their one-row steps ------------------------------------------

    def rows_match(self, runner: FusedRunner, windows: list[tuple[int, list[int], int]], logits) -> tuple[int, float]:
        """Rows of `logits` (the windows' rows in order) bit-identical to the one-row step at
        their position, and the largest absolute difference. Each window's one-row steps run
        after it, so a row reads the KV rows its window wrote before it."""
        same, worst, row = 0, 0.0, 0
        for slot, ids, start in windows:
            for j, token in enumerate(ids):
                single = runner.run([(slot, [token], start + j)]).logits[0]
                same += int(torch.equal(single, logits[row]))
                worst = max(worst, float((single - logits[row]).abs().max()))
                row += 1
        return same, worst

    def windows_table(self) -> None:
        print("\n| path | window rows T | rows bit-identical to the one-row step | largest logit difference |")
        print("| --- | --- | ---: | ---: |")
        for name, runner in self.runners.items():
            total, same, worst = 0, 0, 0.0
            for rows in range(1, MAX_WINDOW + 1):
                window = [(self.slots[0], self.random_tokens(rows), 512)]
                logits = runner.run([window[0]]).logits[:rows].clone()
                s, w = self.rows_match(runner, window, logits)
                total, same, worst = total + rows, same + s, max(worst, w)
            print(f"| {name} | 1..{MAX_WINDOW} | {same}/{total} | {worst:.3g} |")

    def compositions(self, trials: int) -> list[list[tuple[int, list[int], int]]]:
        """Random batches: a third decode batches, a third verify batches (captured), a third with
        one longer window (eager); each sequence at its own context."""
        batches = []
        for trial in range(trials):
            num_seqs = self.rng.randint(2, NUM_SEQS)
            longest = (1, VERIFY_WINDOW, 9)[trial % 3]
            sizes = [self.rng.randint(1, longest) for _ in range(num_seqs)]
            if trial % 3 == 2:
                sizes[0] = longest
            batches.append([(slot, self.random_tokens(n), self.rng.randint(64, 1000))
                            for slot, n in zip(self.rng.sample(self.slots, num_seqs), sizes)])
        return batches

    def batches_table(self, trials: int) -> None:
        print("\n| path | batches | kind | rows | rows bit-identical to the one-row step | largest logit difference |")
        print("| --- | ---: | --- | ---: | ---: | ---: |")
        batches = self.compositions(trials)
        for name, runner in self.runners.items():
            for kind, chosen in (("decode (captured)", batches[0::3]), ("verify (captured)", batches[1::3]),
                                 ("with a 9-row window (eager)", batches[2::3])):
                total, same, worst = 0, 0, 0.0
                for windows in chosen:
                    rows = sum(len(ids) for _, ids, _ in windows)
                    logits = runner.run(windows).logits[:rows].clone()
                    s, w = self.rows_match(runner, windows, logits)
                    total, same, worst = total + rows, same + s, max(worst, w)
                print(f"| {name} | {len(chosen)} | {kind} | {total} | {same}/{total} | {worst:.3g} |")

    # -- 3: prefill ----------------------------------------------------------------------------

    def prefill_table(self) -> None:
        runner = self.runners["invariant"]
        fused, kv = runner.fused, self.pool.paged()
        other, other2 = self.slots[6:8]
        big, small = self.random_tokens(1000), self.random_tokens(200)

        def prefill(parts: list[tuple[list[int], int, int]]) -> None:  # (tokens, start, slot) in one forward
            ids = torch.tensor([t for tokens, _, _ in parts for t in tokens], device=self.device)
            fused.prefill(ids, [(start, len(tokens), slot) for tokens, start, slot in parts], kv)

        print("\n| prompt tokens | prefilled | KV rows bit-identical to the prompt prefilled alone | largest KV difference "
              "| first token's logits bit-identical | same first token |")
        print("| ---: | --- | ---: | ---: | --- | --- |")
        for length in (7, 40, 300):
            prompt = self.random_tokens(length)
            body = length - 1  # the verifier prefills all but the last token
            a, b, c, d, e = self.slots[:5]
            arms = [("alone, one chunk", a), ("one forward, after a 1,000-token prompt, before a 200-token one", b),
                    ("one forward, before a 200-token prompt", c)]
            prefill([(prompt[:body], 0, a)])
            prefill([(big, 0, other), (prompt[:body], 0, b), (small, 0, other2)])
            prefill([(prompt[:body], 0, c), (small, 0, other2)])
            if length > 128:
                arms.append(("in chunks of 128", d))
                for start in range(0, body, 128):
                    prefill([(prompt[start : min(start + 128, body)], start, d)])
            arms.append(("decoded row by row (one-row steps)", e))
            for j in range(body):
                runner.run([(e, [prompt[j]], j)])
            first = {slot: runner.run([(slot, [prompt[body]], body)]).logits[0].clone() for _, slot in arms}
            keys, values = zip(*(self.pool.read(slot, body) for slot in self.slots[:5]))  # [layers, body, kv_heads, D]
            for label, slot in arms:
                i, j = self.slots.index(slot), 0  # (a is self.slots[0])
                same_rows = sum(int(torch.equal(keys[i][:, p], keys[j][:, p]) and torch.equal(values[i][:, p], values[j][:, p]))
                                for p in range(body))
                worst = max(float((keys[i] - keys[j]).abs().max()), float((values[i] - values[j]).abs().max()))
                print(f"| {length} | {label} | {same_rows}/{body} | {worst:.3g} | {torch.equal(first[slot], first[a])} "
                      f"| {int(first[slot].argmax()) == int(first[a].argmax())} |")

    # -- 4: cost ---------------------------------------------------------------------------

    def cost_table(self, pairs: int, repeats: int) -> None:
        print(f"\n| what runs | invariant ms | yardstick ms | invariant / yardstick (median of {pairs} paired ratios) |")
        print("| --- | ---: | ---: | ---: |")
        cases = [(f"one sequence, a {t}-row window", [(self.slots[0], self.random_tokens(t), 512)])
                 for t in (1, 2, 3, 5, 9, 17)]
        for rows in (1, 3, 5):
            label = f"{NUM_SEQS} sequences × {rows} row{'s' if rows > 1 else ''} (concurrency {NUM_SEQS})"
            cases.append((label, [(slot, self.random_tokens(rows), 512) for slot in self.slots]))
        for label, windows in cases:
            graphs = {name: self._graph(runner, windows) for name, runner in self.runners.items()}
            times = {name: [] for name in graphs}
            for _ in range(pairs):
                for name, graph in graphs.items():
                    times[name].append(statistics.median(cuda_time(graph.replay, repeats)))
            ratio = statistics.median(i / y for i, y in zip(times["invariant"], times["yardstick"]))
            print(f"| {label} | {statistics.median(times['invariant']):.3f} | {statistics.median(times['yardstick']):.3f} "
                  f"| {ratio:.3f} |")

    @staticmethod
    def _graph(runner: FusedRunner, windows) -> torch.cuda.CUDAGraph:
        """The captured graph that runs `windows`, its inputs set."""
        runner.run(windows)
        return runner.last_graph()


def cpu_cost_table(pairs: int, repeats: int) -> None:
    """The CPU path's price: the embedded model's reference forward (what a CPU verifier runs),
    windows with row_invariant on and off, interleaved, after a 300-token prompt."""
    model = load_model(None, dtype=torch.float32, device="cpu")
    prompt = torch.randint(0, model.config.vocab_size, (300,), generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, model.config.vocab_size, (17,), generator=torch.Generator().manual_seed(2))
    cache = model.new_cache(400)
    model.prefill(prompt, cache)

    def window_ms(rows: int, row_invariant: bool) -> float:
        times = []
        for _ in range(repeats):
            cache.length = 300
            started = time.perf_counter()
            model(ids[:rows], cache, row_invariant=row_invariant)
            times.append((time.perf_counter() - started) * 1e3)
        return statistics.median(times)

    print(f"\nCPU ({torch.get_num_threads()} threads), the embedded model in float32, reference path, context 300:")
    print(f"\n| window rows | row-invariant ms | batched ms | row-invariant / batched (median of {pairs} paired ratios) |")
    print("| ---: | ---: | ---: | ---: |")
    for rows in (1, 2, 3, 5, 9, 17):
        on, off = [], []
        for _ in range(pairs):
            on.append(window_ms(rows, True))
            off.append(window_ms(rows, False))
        ratio = statistics.median(a / b for a, b in zip(on, off))
        print(f"| {rows} | {statistics.median(on):.2f} | {statistics.median(off):.2f} | {ratio:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="4 layers at 30B-A3B widths")
    parser.add_argument("--tiny", action="store_true", help="a toy model (with --device cpu: a smoke test)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--trials", type=int, default=24, help="random batch compositions")
    parser.add_argument("--pairs", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--block-size", type=int, default=0, help="KV block size (0: one block per sequence)")
    parser.add_argument("--cpu-cost", action="store_true", help="only the CPU path's price (embedded model)")
    args = parser.parse_args()
    if args.cpu_cost:
        cpu_cost_table(args.pairs, args.repeats)
        return
    bench = Bench(args)
    name = "tiny" if args.tiny else "4 layers at Qwen3-30B-A3B widths" if args.small else "Qwen3-30B-A3B shapes"
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"### invariance: {time.strftime('%Y-%m-%d')}, {gpu}, {name}, random weights, "
          f"{bench.model.dtype}".replace("torch.", ""))
    for step, table in (("windows", bench.windows_table), ("batches", lambda: bench.batches_table(args.trials)),
                        ("prefill", bench.prefill_table)):
        log(f"{step} ...")
        table()
        sys.stdout.flush()
    if args.device == "cuda":
        log("cost ...")
        bench.cost_table(args.pairs, args.repeats)


if __name__ == "__main__":
    main()

"""The CPU step's own scaling with rows: N sessions' rows in one native step against one row
(issue 35's CPU bar: what together / one could be with no host work at all).

The embedded model (or --model) on the CPU as the verifier's engine runs it: the fused model's
native step (kernels/fused/cpu_step.py) over a paged KV cache, every session a slot filled with
--context positions of a code prompt. Each call cycle runs one row, then each N rows, back to
back (interleaved, so a drift of the machine's load lands on every size), at each thread count;
reported per size: the median µs of a step, the median of the paired ratios to one row's step,
and N rows' tokens/s over one row's (N / that ratio) — the ratio of 8 requests together to one
alone if neither paid any host, drafting or sampling work. Greedy rows (the step's forward and
its logits); sampled rows' processing after the step is not in it.

    python bench/step_rows.py [--rows 1,2,4,8] [--threads 1,2] [--context 64] [--calls 2000]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pairbench import REPO  # noqa: E402,F401  (puts the repository on sys.path)
from pairbench.common import log  # noqa: E402
from pairbench.setups import code_prompts  # noqa: E402

import torch  # noqa: E402

from shared.model import load_model  # noqa: E402
from shared.model.families.qwen3_moe.fused import FusedModel  # noqa: E402
from shared.model.graphs import FusedRunner  # noqa: E402
from shared.model.kv_cache import KVPool  # noqa: E402
from shared.model.registry import resolve_model  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--rows", default="1,2,4,8", help="sessions a step (one row each), comma separated")
    parser.add_argument("--threads", default="1,2", help="the step's threads, comma separated (0: torch's count)")
    parser.add_argument("--context", type=int, default=64, help="positions each session's cache holds")
    parser.add_argument("--calls", type=int, default=2000, help="call cycles a thread count (the first tenth warm up)")
    args = parser.parse_args()
    sizes = sorted({int(n) for n in args.rows.split(",")} | {1})
    thread_counts = [int(t) or torch.get_num_threads() for t in args.threads.split(",")]
    model_dir = resolve_model(args.model)
    log(f"loading {model_dir.name} ...")
    model = load_model(model_dir, dtype=torch.float32)
    config = model.config
    max_length = args.context + 64
    pool = KVPool(num_layers=config.num_hidden_layers, num_slots=max(sizes) + 1, max_length=max_length,
                  num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim, dtype=torch.float32,
                  device="cpu", block_size=16)
    fused = FusedModel(model, max_rows=32, max_length=max_length)
    runner = FusedRunner(fused, pool, max(sizes), max_batch_rows=32)
    slots = [pool.acquire(max_length)[0] for _ in range(max(sizes))]
    prompts = code_prompts(model_dir, len(slots))
    for slot, prompt in zip(slots, prompts):
        ids = (prompt * (args.context // max(len(prompt), 1) + 1))[: args.context]
        runner.prefill([(slot, ids, 0)])
    plan = fused.step_plan(pool.paged())
    if plan is None:
        log("this model has no native CPU step here (see FusedModel.step_plan)")
        return 1
    gen = torch.Generator().manual_seed(0)
    cases = {n: (torch.randint(0, config.vocab_size, (n,), generator=gen), torch.full((n,), args.context),
                 torch.tensor(slots[:n])) for n in sizes}
    print(f"### step_rows: {datetime.date.today()}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} torch threads, {model_dir.name}, context {args.context}, {args.calls} call cycles\n")
    print("| threads | rows | step µs (median) | / one row's step (median of paired) | tokens/s / one row's |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for threads in thread_counts:
        times: dict[int, list[int]] = {n: [] for n in sizes}
        for _ in range(args.calls):
            for n in sizes:
                started = time.perf_counter_ns()
                plan.run(*cases[n], None, threads=threads)
                times[n].append(time.perf_counter_ns() - started)
        warm = args.calls // 10
        for n in sizes:
            ratio = statistics.median(b / a for a, b in zip(times[1][warm:], times[n][warm:]))
            print(f"| {threads} | {n} | {statistics.median(times[n][warm:]) / 1e3:.0f} | {ratio:.2f} | {n / ratio:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

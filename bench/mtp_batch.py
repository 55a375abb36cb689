"""Batched MTP drafting (issue 11): the chains of N sessions drafted one session after another
against all of them in shared forwards (the drafter's batcher job), in one process.

The embedded model (`--model embedded`, its trained MTP layer) or the MTP layer at
Qwen3-30B-A3B shapes with random weights (`--model 30b`; one trunk layer, which drafting
never runs), or Qwen3.5-35B-A3B's lean drafter (`--model 35b-hybrid`: embeddings, the gated
attention + shared-expert MoE MTP layer, lm_head; random weights). Each round every session commits 3 rows (random hidden rows, deferred as the
drafter defers them) and drafts `--drafts` tokens; the two arms run on separate states fed
the same inputs, alternating round by round. Reported per session count: ms per round of
all sessions (wall clock, synchronised: the drafter's kernels run eagerly, so host work is
part of the cost), the median of paired ratios, and whether every chain was the same in
both arms.

    python bench/mtp_batch.py [--device cuda] [--model embedded|30b|35b-hybrid] [--sessions 1,4,16,32] [--rounds 20] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.model_baseline import QWEN3_30B_A3B  # noqa: E402
from drafter_service.proposers.mtp import DraftJob, MTPProposer  # noqa: E402
from kernels.retention import RetentionPolicy  # noqa: E402
from kernels.sampling import SamplingParams  # noqa: E402
from kernels.speculative import Gate, Mode  # noqa: E402
from shared.model import ModelConfig, load_model  # noqa: E402
from shared.model.families import build_fused  # noqa: E402

PROMPT = 256
COMMIT = 3


def log(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="embedded", choices=["embedded", "30b", "35b-hybrid"])
    parser.add_argument("--sessions", default="1,4,16,32")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--drafts", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--graphs-ab", action="store_true",
                        help="arms: the batched path run eagerly against its chain steps replayed as CUDA graphs")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the batched arm's rounds (host time by function, on stderr)")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    if args.model == "embedded":
        model = load_model(device=args.device, dtype=dtype)
    elif args.model == "35b-hybrid":
        from bench.pairbench.common import QWEN3_5_35B_A3B
        from shared.model.families.hybrid.loader import random_next
        from shared.model.families.hybrid.config import NextConfig

        model = random_next(NextConfig.from_dict(QWEN3_5_35B_A3B), dtype=dtype, device=args.device, parts="mtp")
    else:
        config = ModelConfig.from_dict(QWEN3_30B_A3B | dict(num_hidden_layers=1, mtp_num_hidden_layers=1))
        model = load_model(config=config, random_weights=True, device=args.device, dtype=dtype, seed=0)
    length = PROMPT + args.rounds * COMMIT + args.drafts + 8
    c = model.config
    print(f"### batched MTP drafting: {time.strftime('%Y-%m-%d')}, "
          f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}, {args.model} model, {dtype}, "
          f"{args.drafts} drafts a chain, temperature {args.temperature}\n".replace("torch.", ""))
    first, second = ("eager", "graphs") if args.graphs_ab else ("one after another", "batched")
    print(f"| sessions | {first} ms/round | {second} ms/round | {second} / {first} | chains identical |")
    print("| ---: | ---: | ---: | ---: | --- |")
    sampling = SamplingParams(temperature=args.temperature)
    profiles: dict[int, pstats.Stats] = {}
    for num in (int(n) for n in args.sessions.split(",")):
        gen = torch.Generator().manual_seed(num)
        prompts = [(torch.randn(PROMPT - 1, c.hidden_size, generator=gen), torch.randint(0, c.vocab_size, (PROMPT - 1,),
                                                                                          generator=gen).tolist())
                   for _ in range(num)]
        arms = {}
        names = ("eager", "graphs") if args.graphs_ab else ("one", "batched")
        for arm in names:
            proposer = MTPProposer(model, None, build_fused(model, max_rows=64, max_length=c.max_position_embeddings),
                                   use_graphs=arm == "graphs" if args.graphs_ab else False)
            states = [proposer.new_state(length) for _ in range(num)]
            for state, (hidden, ids) in zip(states, prompts):
                proposer.catch_up(state, hidden, ids)
            arms[arm] = (proposer, states)
        times = {arm: [] for arm in arms}
        same = True
        for round_id in range(args.rounds):
            commits = [(torch.randn(COMMIT, c.hidden_size, generator=gen),
                        torch.randint(0, c.vocab_size, (COMMIT,), generator=gen).tolist()) for _ in range(num)]
            chains = {}
            for arm in (names if round_id % 2 == 0 else names[::-1]):
                proposer, states = arms[arm]
                jobs = [DraftJob(state, args.drafts, sampling, s, PROMPT + round_id * COMMIT, Mode.EXACT, Gate.TOP,
                                 False, RetentionPolicy()) for s, state in enumerate(states)]
                for state, (hidden, ids) in zip(states, commits):
                    proposer.defer(state, hidden, ids)
                sync(args.device)
                profiler = cProfile.Profile() if args.profile and arm == names[1] and round_id else None
                if profiler is not None:
                    profiler.enable()
                started = time.perf_counter()
                if arm == "one":  # (the --graphs-ab arms both run the batched path)
                    out = []
                    for job in jobs:
                        proposer.settle(job.state)
                        out += proposer.draft_batch([job])
                else:
                    proposer.settle_batch(states)
                    out = proposer.draft_batch(jobs)
                sync(args.device)
                if profiler is not None:
                    profiler.disable()
                    profiles.setdefault(num, pstats.Stats(profiler, stream=sys.stderr)).add(profiler)
                if round_id:  # the first round warms up
                    times[arm].append((time.perf_counter() - started) * 1e3)
                chains[arm] = [p.token_ids for p in out]
            same = same and chains[names[0]] == chains[names[1]]
        ratio = statistics.median(b / o for b, o in zip(times[names[1]], times[names[0]]))
        print(f"| {num} | {statistics.median(times[names[0]]):.2f} | {statistics.median(times[names[1]]):.2f} "
              f"| {ratio:.3f} | {same} |")
        sys.stdout.flush()
        log(f"  {num} sessions done")
    for num, stats in profiles.items():
        log(f"\n### host time of the batched arm, {num} sessions, {args.rounds - 1} rounds (cProfile, top 30 by own time)")
        stats.sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()

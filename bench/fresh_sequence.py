"""What a newcomer's requests get from a fresh service pair, one request at a time (issue 35's
CPU path: the governor's decisions, the drafter's index of outputs).

Each arm starts a fresh pair (default flags, the embedded model), sends `--requests` mixed
requests one after another — even indices greedy, odd ones sampled (temperature 0.8, top-p
0.95, seed = index) over the built-in code prompts, each made distinct by a numbered comment
— `--passes` times over (the same prompts and seeds again: exact mode emits the same tokens,
so from the second pass the drafter may have seen every output), then stops the pair. Arms:

- `default`: this tree's services, default flags;
- `always`: this tree with `--no-governor` (every round asks the drafter);
- `plain`: this tree, every request with speculation off;
- `baseline`: the services of `--baseline-tree` (another checkout), default flags.

Arms alternate order from pair to pair; one pair runs at a time (the machine's cores are
the services'). Reported per arm: the median over pairs of tokens/s (each pair's tokens over
its requests' summed walls) for all requests, the greedy ones and the sampled ones, and per
pass; the first arm against each other, the median of the pairs' ratios; per request, the share of rounds that waited for a chain and the tokens those rounds
committed (stderr).

    python bench/fresh_sequence.py [--pairs 3] [--requests 40] [--passes 1] [--max-new-tokens 64]
        [--arms default,plain,always] [--baseline-tree /tmp/base --arms default,baseline]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pairbench import REPO  # noqa: E402,F401  (puts the repository and protocol modules on sys.path)
from pairbench.common import log  # noqa: E402
from pairbench.services import Children, ServicePair  # noqa: E402
from pairbench.setups import code_prompts  # noqa: E402

ARMS = ("default", "always", "plain", "baseline")


async def run_pair(arm: str, index: int, args, model_dir: Path, prompts: list[list[int]]) -> dict:
    """One fresh pair of `arm`: tokens and walls by kind and by pass, and each request's rounds."""
    from shared.client import AsyncVerifierClient, GenerationConfig

    children = Children(Path(tempfile.mkdtemp(prefix="fresh-sequence-")))
    pair = ServicePair(f"{arm}{index}", children, model_dir, args.device,
                       Path(args.baseline_tree) if arm == "baseline" else None,
                       ["--no-governor"] if arm == "always" else [])
    out = {"greedy": [0, 0.0], "sampled": [0, 0.0], "passes": [[0, 0.0] for _ in range(args.passes)], "requests": []}
    try:
        await pair.ready()
        async with AsyncVerifierClient(f"127.0.0.1:{pair.v_port}", timeout=600) as client:
            for n in range(args.requests * args.passes):
                i = n % args.requests
                sampled = i % 2 == 1
                config = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=0.8 if sampled else 0.0,
                                          top_p=0.95 if sampled else 1.0, seed=i, speculation=arm != "plain",
                                          request_id=f"{arm}{index}-r{n}")
                started = time.perf_counter()
                g = await client.generate(prompts[i], config)
                wall = time.perf_counter() - started
                for bucket in (out["sampled" if sampled else "greedy"], out["passes"][n // args.requests]):
                    bucket[0] += len(g.token_ids)
                    bucket[1] += wall
                speculative = g.stats.get("speculative_rounds", 0)
                out["requests"].append((speculative / max(1, g.stats.get("rounds", 1)),
                                        (g.stats.get("accepted", 0) + speculative) / speculative if speculative else 0.0))
                children.check_alive()
    finally:
        children.stop()
    return out


def rate(bucket: list) -> float:
    return bucket[0] / bucket[1] if bucket[1] else 0.0


def overall(run: dict) -> float:
    """A pair's tokens/s over all its requests."""
    return rate([run["greedy"][0] + run["sampled"][0], run["greedy"][1] + run["sampled"][1]])


async def main_async(args) -> None:
    from shared.model.registry import resolve_model

    model_dir = resolve_model(args.model)
    prompts = code_prompts(model_dir, args.requests)
    results: dict[str, list[dict]] = {arm: [] for arm in args.arms}
    for index in range(args.pairs):
        for arm in args.arms if index % 2 == 0 else args.arms[::-1]:
            log(f"pair {index + 1}/{args.pairs}, {arm} ...")
            out = await run_pair(arm, index, args, model_dir, prompts)
            results[arm].append(out)
            log(f"pair {index + 1} {arm}: {overall(out):.1f} tokens/s (greedy {rate(out['greedy']):.1f}, sampled "
                f"{rate(out['sampled']):.1f}; by pass {' '.join(f'{rate(p):.0f}' for p in out['passes'])}); per "
                "request, rounds that waited for a chain / tokens such a round committed: "
                + " ".join(f"{share:.0%}/{tokens:.1f}" for share, tokens in out["requests"]))
    print(f"\n### fresh_sequence: {datetime.date.today()}, {platform.node()}, device {args.device}, model "
          f"{model_dir.name}, {args.requests} requests (greedy and sampled alternating) x {args.passes} passes, "
          f"{args.max_new_tokens} new tokens, {args.pairs} fresh pairs per arm"
          + (f", baseline {args.baseline_tree}" if "baseline" in args.arms else "") + "\n")
    passes = " | ".join(f"pass {p + 1}" for p in range(args.passes))
    print(f"| arm | all, tokens/s | greedy | sampled | {passes} | pairs (all) |")
    print("| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in range(args.passes)) + " | --- |")
    for arm in args.arms:
        runs = results[arm]
        alls = [overall(r) for r in runs]
        by_pass = " | ".join(f"{statistics.median(rate(r['passes'][p]) for r in runs):.1f}" for p in range(args.passes))
        print(f"| {arm} | {statistics.median(alls):.1f} | {statistics.median(rate(r['greedy']) for r in runs):.1f} "
              f"| {statistics.median(rate(r['sampled']) for r in runs):.1f} | {by_pass} | "
              + ", ".join(f"{a:.0f}" for a in alls) + " |")
    print("\n(medians over the pairs)")
    first = args.arms[0]
    for arm in args.arms[1:]:  # (pair i of each arm ran back to back, in alternating order)
        paired = [overall(a) / overall(b) for a, b in zip(results[first], results[arm]) if overall(b)]
        print(f"{first} / {arm}, all requests' tokens/s: median of paired ratios {statistics.median(paired):.2f} "
              f"({min(paired):.2f}-{max(paired):.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--pairs", type=int, default=3, help="fresh pairs per arm")
    parser.add_argument("--requests", type=int, default=40, help="distinct requests in a pass")
    parser.add_argument("--passes", type=int, default=1, help="times the same requests run (the drafter may learn them)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--arms", default="default,plain,always", help=f"comma separated, of {', '.join(ARMS)}")
    parser.add_argument("--baseline-tree", default=None, help="another checkout (the baseline arm)")
    args = parser.parse_args()
    args.arms = args.arms.split(",")
    if unknown := [a for a in args.arms if a not in ARMS]:
        parser.error(f"unknown arms {unknown}; choose from {', '.join(ARMS)}")
    if "baseline" in args.arms and not args.baseline_tree:
        parser.error("the baseline arm needs --baseline-tree")
    if args.pairs < 1 or args.requests < 2 or args.passes < 1 or args.max_new_tokens < 1:
        parser.error("--pairs >= 1, --requests >= 2, --passes >= 1 and --max-new-tokens >= 1")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()

"""Speculation behind a far drafter (issue 38): a drafter whose every message reaches the
verifier `--delay-ms` late must not slow requests down.

Services (child processes, the embedded model on the CPU by default): the tandem drafter;
a delaying proxy in front of it (bench/pairbench/services.Tap with delay_s: each message from
the drafter is held that long, in order); verifier "spec" dialling the drafter through the
proxy, with its default governor; verifier "plain" with no drafter; with `--baseline-tree`,
verifier "spec-base", the spec one run from another checkout (the code before a change). Each
block sends the same `--requests` requests (`--concurrency` at a time) to each verifier, each
arm first in turn; a block's ratio is the spec verifier's tokens/s over the plain
one's (client wall time, all the block's requests). Reported per block (the first includes
what the spec verifier learns about its drafter; it keeps that for the next blocks, as a
server does) and the median, with the spec verifier's rounds that waited for a chain,
and detaches (from the requests' final stats).

    python bench/far_drafter.py [--delay-ms 25] [--requests 8] [--concurrency 8] [--max-new-tokens 64] [--blocks 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pairbench  # noqa: E402,F401  (puts the repository and protocol modules on sys.path)
from pairbench.common import free_port, log  # noqa: E402
from pairbench.services import Children, Tap  # noqa: E402
from pairbench.setups import text_prompts  # noqa: E402


async def batch(client, prompts: list[list[int]], config_for, concurrency: int) -> dict:
    """All prompts, `concurrency` at a time: tokens, wall seconds and summed final stats."""
    gate = asyncio.Semaphore(concurrency)
    totals = {"tokens": 0, "rounds": 0, "speculative_rounds": 0, "detaches": 0, "accepted": 0, "proposed": 0}

    async def one(index: int) -> None:
        async with gate:
            generation = await client.generate(prompts[index], config_for(index))
        stats = generation.stats
        totals["tokens"] += len(generation.token_ids)
        totals["rounds"] += stats["rounds"]
        totals["speculative_rounds"] += stats["speculative_rounds"]
        totals["detaches"] += stats["drafter_detaches"]
        totals["accepted"] += stats["accepted"]
        totals["proposed"] += stats["proposed"]

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(len(prompts))))
    totals["wall_s"] = time.perf_counter() - started
    return totals


async def main(args: argparse.Namespace) -> None:
    from shared.client import AsyncVerifierClient, GenerationConfig
    from shared.model.registry import resolve_model

    model_dir = resolve_model(args.model)
    base = text_prompts(model_dir, min(args.requests, 8), args.prompt_set)
    prompts = [base[i % len(base)] for i in range(args.requests)]
    workdir = Path(tempfile.mkdtemp(prefix="far-drafter-"))
    children = Children(workdir, threads=args.threads)
    d_port, t_port, s_port, p_port, b_port = free_port(), free_port(), free_port(), free_port(), free_port()
    common = ["--model", str(model_dir), "--device", args.device, "--dtype", args.dtype]
    verifier = [sys.executable, "-m", "shared.cli", "verifier", *common, "--max-draft-tokens",
                str(args.max_draft_tokens), "--grace-s", "2", *args.verifier_arg]
    children.start("drafter", [sys.executable, "-m", "shared.cli", "drafter", *common, "--port", str(d_port)])
    children.start("spec", [*verifier, "--port", str(s_port), "--drafter", f"127.0.0.1:{t_port}"])
    children.start("plain", [*verifier, "--port", str(p_port)])
    arms = {"spec": s_port, "plain": p_port}
    if args.baseline_tree:  # the same spec verifier from another checkout (the code before a change)
        children.start("spec-base", [*verifier, "--port", str(b_port), "--drafter", f"127.0.0.1:{t_port}"],
                       tree=Path(args.baseline_tree))
        arms["spec-base"] = b_port
    tap = Tap(f"127.0.0.1:{d_port}", delay_s=args.delay_ms / 1e3)
    await tap.start(t_port)
    rows = []
    try:
        await asyncio.gather(children.wait_serving("drafter", f"127.0.0.1:{d_port}", 120),
                             *(children.wait_serving(arm, f"127.0.0.1:{port}", 120) for arm, port in arms.items()))
        clients = {arm: AsyncVerifierClient(f"127.0.0.1:{port}", timeout=600) for arm, port in arms.items()}
        for client in clients.values():
            await client.__aenter__()
        try:
            def config_for(arm: str, block: int):
                return lambda i: GenerationConfig(
                    max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                    seed=args.seed + 1000 * block + i,  # (sampled outputs differ between blocks)
                    max_draft_tokens=args.max_draft_tokens, request_id=f"{arm}-b{block}-p{i}")

            log("warm-up: one plain request on each verifier (the spec verifiers' governors learn nothing from it)")
            for client in clients.values():
                await client.generate(prompts[0], GenerationConfig(max_new_tokens=8, speculation=False))
            names = list(arms)
            for block in range(args.blocks):
                order = names[block % len(names):] + names[: block % len(names)]  # each arm first in turn
                result = {}
                for arm in order:
                    children.check_alive()
                    result[arm] = await batch(clients[arm], prompts, config_for(arm, block), args.concurrency)
                rows.append((block, order[0], result))
                log(f"block {block + 1}/{args.blocks} ({order[0]} first): " + ", ".join(
                    f"{arm}/plain {tps(result[arm]) / tps(result['plain']):.3f}" for arm in names if arm != "plain"))
        finally:
            for client in clients.values():
                await client.__aexit__(None, None, None)
    finally:
        await tap.stop()
        children.stop()
    print(f"\n## far drafter: {args.delay_ms:g} ms a drafter message, {args.requests} requests x "
          f"{args.max_new_tokens} tokens, {args.concurrency} at a time ({args.device}, {model_dir.name})\n")
    print("| block | first | arm | arm/plain tokens/s | arm's rounds | rounds that waited | detaches | acceptance |")
    print("| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    spec_arms = [arm for arm in arms if arm != "plain"]
    for block, first, result in rows:
        for arm in spec_arms:
            r = result[arm]
            acceptance = f"{r['accepted'] / r['proposed']:.2f}" if r["proposed"] else "-"
            print(f"| {block + 1} | {first} | {arm} | {tps(r) / tps(result['plain']):.3f} | {r['rounds']} | "
                  f"{r['speculative_rounds']} | {r['detaches']} | {acceptance} |")
    print()
    for arm in spec_arms:
        ratios = [tps(result[arm]) / tps(result["plain"]) for _, _, result in rows]
        pooled = sum(result[arm]["tokens"] for _, _, result in rows) / sum(result[arm]["wall_s"] for _, _, result in rows)
        pooled_plain = sum(result["plain"]["tokens"] for _, _, result in rows) / sum(
            result["plain"]["wall_s"] for _, _, result in rows)
        print(f"{arm}/plain: median of blocks {statistics.median(ratios):.3f}, first block {ratios[0]:.3f}, "
              f"all blocks pooled {pooled / pooled_plain:.3f}")


def tps(result: dict) -> float:
    return result["tokens"] / result["wall_s"]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--delay-ms", type=float, default=25.0, help="each drafter message's extra delay")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-draft-tokens", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="sampled by default: new outputs each block (greedy ones repeat, and the drafter's "
                        "cross-request index then drafts them)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-set", default="code", choices=["code", "repeat"])
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per service")
    parser.add_argument("--verifier-arg", action="append", default=[], help="extra verifier flags (every verifier)")
    parser.add_argument("--baseline-tree", default=None,
                        help="another checkout of tandem: a third arm, its spec verifier run from there (before/after)")
    asyncio.run(main(parser.parse_args()))

"""Exact mode is token-identical to plain decoding, alone and batched (issue 16).

One verifier (child process) and a drafter: by default random weights at Qwen3-30B-A3B
shapes in bf16 on the GPU (or `--small`) with the synthetic replay drafter
(`bench/replay_drafter.py`, α = `--alpha`) on random prompts; with `--drafter real` the
embedded model with tandem's drafter (MTP and suffix drafts) on the built-in code prompts.
Two sets of `--prompts` prompts: one decoded greedily, one sampled (temperature
`--temperature`, top-p 0.95, seed = the request's index). Phases:

1. reference: every request alone, without speculation (plain decoding, the definition);
2. speculative, alone: every request with the drafter, one at a time;
3. mixed, concurrency `--concurrency`: every request once with the drafter and once without,
   in a shuffled order (fixed seed), `--concurrency` at a time — rows of different requests,
   greedy and sampled, with and without drafts, share the verifier's batched forwards.

Reported: requests whose tokens equal the reference exactly, per set and phase (and, for a
mismatch, where it starts), rounds that verified drafts, output tokens/s of each phase. The
verifier runs without the governor, so every round asks the drafter.

    python bench/exact_identity.py [--small | --shapes qwen3.5-35b-a3b] [--device cuda] [--prompts 64] [--new-tokens 256] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pairbench import REPO  # noqa: E402  (puts the repository and protocol modules on sys.path)
from pairbench.common import SHAPES, free_port, log  # noqa: E402
from pairbench.services import Children  # noqa: E402
from pairbench.setups import code_prompts, random_prompts  # noqa: E402

from shared.client import AsyncVerifierClient, GenerationConfig  # noqa: E402
from shared.model.registry import resolve_model  # noqa: E402

SETS = ("greedy", "sampled")


def config(kind: str, index: int, args, speculation: bool, tag: str) -> GenerationConfig:
    sampled = kind == "sampled"
    return GenerationConfig(
        max_new_tokens=args.new_tokens, temperature=args.temperature if sampled else 0.0,
        top_p=0.95 if sampled else None, seed=index, speculation=speculation,
        max_draft_tokens=args.max_draft_tokens, request_id=f"{tag}-{kind}-{index}",
    )


def first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


async def main_async(args) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="exact-identity-"))
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    r_port, v_port = free_port(), free_port()
    children = Children(workdir)
    if args.drafter == "real":  # the embedded model (or --model), tandem's drafter on it, started first
        model_dir = resolve_model(args.model)
        shapes = model_dir.name
        model_args = ["--model", str(model_dir)]
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        prompts = {kind: code_prompts(model_dir, args.prompts, offset) for offset, kind in enumerate(SETS)}
        children.start("drafter", [sys.executable, "-m", "shared.cli", "drafter", *model_args, "--device", args.device,
                                   "--dtype", dtype, "--port", str(r_port), "--global-index-mb", "0"])
        await children.wait_serving("drafter", f"127.0.0.1:{r_port}", timeout=900)
    else:
        shapes = "smoke shapes" if args.small else f"{args.shapes} shapes (random weights)"
        model_dir = workdir / "random-shapes"
        model_dir.mkdir()
        config_json = SHAPES["smoke" if args.small else args.shapes] | {"max_position_embeddings": 4096}
        (model_dir / "config.json").write_text(json.dumps(config_json, indent=1))
        model_args = ["--model", str(model_dir), "--random-weights"]
        vocab = config_json["vocab_size"]
        prompts = {kind: random_prompts(vocab, args.prompts, args.prompt_length, seed)
                   for seed, kind in enumerate(SETS, start=1)}
        if args.drafter == "random-mtp":  # tandem's drafter, its MTP layer random too: real costs, noise drafts
            children.start("drafter", [sys.executable, "-m", "shared.cli", "drafter", *model_args, "--device",
                                       args.device, "--dtype", dtype, "--port", str(r_port), "--planner", "mtp",
                                       "--global-index-mb", "0"])
            await children.wait_serving("drafter", f"127.0.0.1:{r_port}", timeout=900)
    max_prompt = max(len(p) for ps in prompts.values() for p in ps)
    children.start("verifier", [sys.executable, "-m", "shared.cli", "verifier", *model_args,
                                "--device", args.device, "--dtype", dtype, "--port", str(v_port),
                                "--drafter", f"127.0.0.1:{r_port}", "--max-sessions", str(args.concurrency),
                                "--max-context", str(max_prompt + args.new_tokens + 32),
                                "--max-draft-tokens", str(args.max_draft_tokens), "--no-governor", "--grace-s", "2",
                                *args.verifier_arg])
    results: dict[str, dict[str, list[dict]]] = {}
    walls: dict[str, float] = {}
    try:
        await children.wait_serving("verifier", f"127.0.0.1:{v_port}", timeout=900)
        async with AsyncVerifierClient(f"127.0.0.1:{v_port}", timeout=600) as client:
            async def run(kind: str, index: int, speculation: bool, tag: str) -> dict:
                g = await client.generate(prompts[kind][index], config(kind, index, args, speculation, tag))
                return {"kind": kind, "index": index, "speculation": speculation, "token_ids": g.token_ids,
                        "drafted": sum(1 for r in g.rounds if r["retained"] > 0), "rounds": len(g.rounds),
                        "proposed": sum(r["proposed"] for r in g.rounds), "faults": g.stats["drafter_faults"],
                        "waits_ms": [round(r["draft_wait_ms"], 3) for r in g.rounds]}

            jobs = [(kind, index) for kind in SETS for index in range(args.prompts)]
            log(f"reference: {len(jobs)} requests alone, without speculation ...")
            started = time.perf_counter()
            reference = {(r["kind"], r["index"]): r for r in [await run(k, i, False, "ref") for k, i in jobs]}
            walls["reference"] = time.perf_counter() - started
            if args.drafter == "replay":  # it replays the reference: started now
                reference_path = workdir / "reference.json"
                reference_path.write_text(json.dumps({"label": "synthetic", "vocab_size": vocab, "references": [
                    {"prompt_ids": prompts[k][i], "token_ids": reference[(k, i)]["token_ids"]} for k, i in jobs]}))
                children.start("replay-drafter", [sys.executable, str(REPO / "bench" / "replay_drafter.py"),
                                                  "--port", str(r_port), "--reference", str(reference_path),
                                                  "--alpha", str(args.alpha), "--seed", "0",
                                                  "--max-drafts", str(args.max_draft_tokens)])
                await children.wait_serving("replay-drafter", f"127.0.0.1:{r_port}", timeout=120)
            for _ in range(120):  # until the verifier reaches the drafter (its channel may be backing off)
                if (await run(*jobs[0], True, "reach"))["drafted"]:
                    break
                await asyncio.sleep(0.5)
            log(f"speculative, alone: {len(jobs)} requests ...")
            started = time.perf_counter()
            results["speculative, alone"] = {"spec": [await run(k, i, True, "alone") for k, i in jobs]}
            walls["speculative, alone"] = time.perf_counter() - started
            mixed = [(k, i, s) for k, i in jobs for s in (True, False)]
            random.Random(0).shuffle(mixed)
            limit = asyncio.Semaphore(args.concurrency)

            async def limited(k, i, s):
                async with limit:
                    return await run(k, i, s, "mixed")
            log(f"mixed, concurrency {args.concurrency}: {len(mixed)} requests ...")
            started = time.perf_counter()
            done = await asyncio.gather(*(limited(k, i, s) for k, i, s in mixed))
            walls[f"mixed, concurrency {args.concurrency}"] = time.perf_counter() - started
            results[f"mixed, concurrency {args.concurrency}"] = {
                "spec": [r for r in done if r["speculation"]], "plain": [r for r in done if not r["speculation"]]}
    finally:
        children.stop()
    if args.out is not None:
        args.out.write_text(json.dumps({"reference": list(reference.values()), "phases": results, "walls": walls}))
    ref_tokens = sum(len(r["token_ids"]) for r in reference.values())
    drafter = {"real": "tandem's drafter", "random-mtp": "tandem's drafter, random MTP layer"}.get(
        args.drafter, f"synthetic drafter alpha {args.alpha}")
    prompt_kind = "code prompts" if args.drafter == "real" else f"{args.prompt_length}-token random prompts"
    print(f"### exact_identity: {time.strftime('%Y-%m-%d')}, device {args.device}, {dtype}, {shapes}, "
          f"{args.prompts} greedy + {args.prompts} sampled (T {args.temperature}, top-p 0.95) requests, "
          f"{prompt_kind}, {args.new_tokens} new tokens, {drafter}, k = {args.max_draft_tokens}, governor off\n")
    print(f"reference (plain, alone): {ref_tokens / walls['reference']:.1f} tokens/s\n")
    print("| phase | requests | greedy identical | sampled identical | rounds that verified drafts | tokens/s | first mismatch (set, index, token) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for phase, arms in results.items():
        for arm, rows in arms.items():
            same = {kind: 0 for kind in SETS}
            mismatches = []
            for r in rows:
                ref = reference[(r["kind"], r["index"])]["token_ids"]
                if r["token_ids"] == ref:
                    same[r["kind"]] += 1
                else:
                    mismatches.append(f"{r['kind']} {r['index']} @{first_difference(r['token_ids'], ref)}")
            drafted = sum(r["drafted"] for r in rows) / max(sum(r["rounds"] for r in rows), 1)
            tokens = sum(len(r["token_ids"]) for rs in arms.values() for r in rs)  # the phase's, both arms
            per_kind = {kind: sum(1 for r in rows if r["kind"] == kind) for kind in SETS}
            print(f"| {phase} | {arm} | {same['greedy']}/{per_kind['greedy']} | {same['sampled']}/{per_kind['sampled']} | "
                  f"{drafted:.2f} | {tokens / walls[phase]:.1f}{' (the phase)' if len(arms) > 1 else ''} | "
                  f"{', '.join(mismatches[:3]) or '—'} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", default="replay", choices=("replay", "real", "random-mtp"),
                        help="replay: random weights at --shapes and the synthetic drafter; real: the embedded model "
                             "(or --model) with tandem's drafter, on code prompts; random-mtp: random weights at "
                             "--shapes for both services, tandem's drafter (MTP only: its drafts are noise)")
    parser.add_argument("--model", default=None, help="with --drafter real: the checkpoint (default: the embedded one)")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--small", action="store_true", help="a tiny random model of the same family (a smoke test)")
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="qwen3-30b-a3b",
                        help="with the replay drafter: the random model's shapes")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompts", type=int, default=64, help="requests per set (greedy, sampled)")
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--alpha", type=float, default=0.8)
    parser.add_argument("--max-draft-tokens", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None, help="every request's record (JSON)")
    parser.add_argument("--verifier-arg", action="append", default=[],
                        help="one more argument for the verifier (repeat; e.g. --verifier-arg=--num-expert-slots=64)")
    asyncio.run(main_async(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

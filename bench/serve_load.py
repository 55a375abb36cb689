"""Serving load on the verifier, in the manner of vLLM's benchmark_serving (issue 11).

One verifier service (child process; random weights at Qwen3-30B-A3B shapes, or --small) and
many concurrent clients in this process. Each arm is measured from the client:
- closed loop at each --concurrency C: C clients each send --requests-per-client requests
  back to back (greedy, or sampled with --temperature; --prompt-tokens random prompt tokens,
  --new-tokens new tokens);
- open loop at each --rates R (requests/s): --num-requests requests with Poisson arrivals.
Reported per arm: aggregate output tokens/s (tokens / wall time of the arm), the ratio to
concurrency 1 of the same run, TTFT, time per output token (TPOT: (last − first token) /
(tokens − 1) per request) and inter-token latency (gaps between token events; a round that
commits several tokens is one event) at p50/p95/p99, and the verifier's mean batch size.

With --alpha A a synthetic replay drafter (bench/replay_drafter.py: the verifier's own
continuation — greedy, or sampled with the request's seed (its prompt's index) — each draft corrupted with probability 1 − A) joins the same verifier;
each concurrency, and each arrival rate (the same arrival times), then runs plain and
speculative requests in alternating blocks on that one service (plain requests ask for no
speculation), and reports speculative / plain. An open loop's arrivals are steady; a closed
loop's clients start and end together, and their prompts prefill in bursts.

With --against-tree DIR a second verifier, started from another checkout (the code before a
change) on the same weights and drafter, runs every closed-loop arm too, the two services
alternating block by block (order reversed each block); the report adds this / that per arm
(median of per-block ratios of output tokens/s, and of TPOT p50). --other-arg FLAG (repeatable)
gives the second verifier flags of its own, from this tree when no --against-tree is given
(e.g. `--other-arg=--quantize --other-arg=fp8`: FP8 against the defaults at each concurrency);
with --alpha, `--other-link local` pairs the drafter link over the replay drafter's Unix socket
against gRPC (`--drafter-socket`, DESIGN §9); `--other-client-link local` pairs clients on the
verifier's `--local-socket` against clients on its gRPC port.
`--traced this|other|both` makes that verifier export every trace to an OTLP sink the bench runs
(`this` or `other` alone pairs a traced verifier of this tree against an untraced one).
With --one-at-a-time only one of the two is up at a time (each block starts and stops each, in
alternating order: two 30B verifiers do not fit an 80 GB GPU together).

Usage: python bench/serve_load.py [--small | --shapes qwen3.5-35b-a3b] [--concurrency 1,8,32,64] [--rates ...] [--alpha 0.8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pairbench.common import SHAPES, free_port, log  # noqa: E402  (puts the repo and protocol modules on sys.path)
from pairbench.load import Load, request_config  # noqa: E402
from pairbench.services import Children, link_flags  # noqa: E402
from pairbench.trace_sink import TraceSink  # noqa: E402

from bench.model_baseline import SMALL  # noqa: E402

from shared.client import AsyncVerifierClient  # noqa: E402


def row(label: str, s: dict, base: float | None) -> str:
    ratio = f"{s['tokens_per_s'] / base:.2f}" if base else "–"
    if s.get("refused"):
        label += f" ({s['refused']} refused for capacity)"
    return (f"| {label} | {s['requests']} | {s['tokens_per_s']:.1f} | {ratio} | {s['mean_batch']:.1f} | "
            + " | ".join(f"{s[m]['p50']:.1f} / {s[m]['p95']:.1f} / {s[m]['p99']:.1f}" for m in ("ttft_ms", "tpot_ms", "itl_ms"))
            + " |")


HEADER = ("| arm | requests | output tokens/s | × concurrency 1 | mean batch | TTFT ms p50/p95/p99 "
          "| TPOT ms p50/p95/p99 | ITL ms p50/p95/p99 |\n| --- | ---: | ---: | ---: | ---: | --- | --- | --- |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="qwen3-30b-a3b",
                        help="the random model's shapes (--small: a tiny one)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--rates", default="", help="open-loop arrival rates, requests/s (comma separated)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampled requests at this temperature (top-p 0.95, a seed per prompt); 0 = greedy")
    parser.add_argument("--alpha", type=float, default=None, help="add a synthetic replay drafter at this acceptance")
    parser.add_argument("--link", default="grpc", choices=("grpc", "local"),
                        help="with --alpha: the verifier's Draft streams over gRPC or the drafter's Unix socket")
    parser.add_argument("--other-link", default="grpc", choices=("grpc", "local"),
                        help="the same for the second verifier (--other-link local alone pairs the two links)")
    parser.add_argument("--client-link", default="grpc", choices=("grpc", "local"),
                        help="how the clients reach the verifier: grpc (its port) or local (its --local-socket)")
    parser.add_argument("--other-client-link", default="grpc", choices=("grpc", "local"),
                        help="the same for the second verifier (local needs a tree with --local-socket)")
    parser.add_argument("--draft-tokens", type=int, default=4, help="max_draft_tokens of the speculative requests")
    parser.add_argument("--blocks", type=int, default=1, help="repeats of the whole concurrency sweep")
    parser.add_argument("--max-position-embeddings", type=int, default=0,
                        help="the random model's context (0: 4,096 or what the requests need)")
    parser.add_argument("--verifier-arg", action="append", default=[], help="extra verifier flag (repeatable)")
    parser.add_argument("--against-tree", type=Path, default=None, metavar="DIR",
                        help="also run a verifier from this checkout (the code before a change), paired block by block")
    parser.add_argument("--other-arg", action="append", default=[],
                        help="a flag of the second verifier only (repeatable; without --against-tree it runs from "
                             "this tree: e.g. --other-arg=--quantize --other-arg=fp8 pairs FP8 with the defaults)")
    parser.add_argument("--one-at-a-time", action="store_true",
                        help="with --against-tree / --other-arg: one verifier up at a time (each block starts and stops "
                             "each, in alternating order), for two that do not fit the GPU together")
    parser.add_argument("--traced", default="none", choices=("none", "this", "other", "both"),
                        help="that verifier exports every trace (OTLP/gRPC) to a sink this bench runs, the other none "
                             "(this / other alone pairs a traced verifier of this tree with an untraced one)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    rates = [float(r) for r in args.rates.split(",") if r]
    shapes = (SMALL if args.small else SHAPES[args.shapes]) | dict(
        max_position_embeddings=args.max_position_embeddings or max(4096, args.prompt_tokens + args.new_tokens + 64))
    workdir = Path(tempfile.mkdtemp(prefix="serve-load-"))
    (workdir / "model").mkdir()
    (workdir / "model" / "config.json").write_text(json.dumps(shapes))
    rng = random.Random(0)
    prompts = [[rng.randrange(shapes["vocab_size"]) for _ in range(args.prompt_tokens)] for _ in range(2 * max(levels))]
    children = Children(workdir)
    port, metrics_port = free_port(), free_port()
    address = f"127.0.0.1:{port}"
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"

    def argv_for(port: int, metrics_port: int) -> list[str]:
        return [sys.executable, "-m", "shared.cli", "verifier", "--model", str(workdir / "model"), "--random-weights",
                "--device", args.device, "--dtype", dtype, "--port", str(port), "--metrics-port", str(metrics_port),
                "--max-sessions", str(max(levels)), "--max-context", str(args.prompt_tokens + args.new_tokens + 32),
                "--grace-s", "2", *args.verifier_arg]

    sockets = {"": workdir / "clients.sock" if args.client_link == "local" else None,
               "before:": workdir / "other-clients.sock" if args.other_client_link == "local" else None}
    verifier_argv = argv_for(port, metrics_port) + (["--local-socket", str(sockets[""])] if sockets[""] else [])
    other_port, other_metrics_port = free_port(), free_port()
    other_argv = argv_for(other_port, other_metrics_port) + args.other_arg \
        + (["--local-socket", str(sockets["before:"])] if sockets["before:"] else [])
    paired = (args.against_tree is not None or bool(args.other_arg) or args.other_link != args.link
              or args.other_client_link != args.client_link or args.traced in ("this", "other"))
    if args.other_link != args.link and args.alpha is None:
        parser.error("--link / --other-link choose the replay drafter's link: give --alpha")
    if args.one_at_a_time and not paired:
        parser.error("--one-at-a-time pairs two verifiers: give --against-tree or --other-arg")
    if args.one_at_a_time and rates:
        parser.error("--one-at-a-time runs closed loops only (no --rates)")
    results: dict = {"args": vars(args) | {"out": str(args.out)}, "closed": {}, "open": {}}
    sink = TraceSink() if args.traced != "none" else None
    try:
        if args.alpha is not None:
            results["references"] = asyncio.run(references(children, verifier_argv, address, prompts, args))
            reference_path = workdir / "references.json"
            reference_path.write_text(json.dumps({"references": results.pop("references"),
                                                  "vocab_size": shapes["vocab_size"]}))
            drafter_port = free_port()
            link = workdir / "replay.sock"  # (its Draft streams on a Unix socket too: --link / --other-link local)
            children.start("replay-drafter", [sys.executable, str(Path(__file__).parent / "replay_drafter.py"),
                                              "--port", str(drafter_port), "--reference", str(reference_path),
                                              "--alpha", str(args.alpha), "--vocab-size", str(shapes["vocab_size"]),
                                              *link_flags("local", link)[1]])
            asyncio.run(children.wait_serving("replay-drafter", f"127.0.0.1:{drafter_port}", timeout=120))
            verifier_argv += ["--drafter", f"127.0.0.1:{drafter_port}", *link_flags(args.link, link)[0]]
            other_argv += ["--drafter", f"127.0.0.1:{drafter_port}", *link_flags(args.other_link, link)[0]]
        # key prefix -> (child name, argv, tree, port, metrics port)
        verifiers = {"": ("verifier", verifier_argv, None, port, metrics_port)}
        if paired:
            verifiers["before:"] = ("other-verifier", other_argv, args.against_tree, other_port, other_metrics_port)
        if sink is not None:
            sink.start()

        def env(prefix: str) -> dict[str, str] | None:  # (a traced verifier exports to the sink; an other none)
            return None if sink is None else sink.env(args.traced in ("both", "other" if prefix else "this"))

        def start(prefix: str) -> Load:
            name, argv, tree, at_port, at_metrics = verifiers[prefix]
            children.start(name, argv, tree=tree, env=env(prefix))
            asyncio.run(children.wait_serving(name, f"127.0.0.1:{at_port}", timeout=900))
            drafter = children.procs.get("replay-drafter")
            service = Load(f"127.0.0.1:{at_port}", prompts, args.new_tokens, at_metrics, args.temperature,
                           args.draft_tokens, (children.procs[name][0].pid, drafter[0].pid if drafter else None),
                           str(sockets[prefix]) if sockets[prefix] else None)
            asyncio.run(service.closed_loop(1, 1, False))  # warm-up
            return service

        services = {} if args.one_at_a_time else {prefix: start(prefix) for prefix in verifiers}
        arms = [False, True] if args.alpha is not None else [False]

        def measure(prefix: str, c: int, speculation: bool, block: int) -> None:
            key = f"{prefix}{'spec' if speculation else 'plain'}@{c}"
            s = asyncio.run(services[prefix].closed_loop(c, args.requests_per_client, speculation))
            results["closed"].setdefault(key, []).append(s)
            log(f"  block {block} {key}: {s['tokens_per_s']:.1f} tok/s, mean batch {s['mean_batch']:.1f}, "
                f"TPOT p50 {s['tpot_ms']['p50']:.2f} ms, speculative rounds {s['speculative_share']:.0%}, "
                f"{s['tokens_per_round']:.2f} tokens a round, {s['detaches']:.0f} detaches"
                + (f"; phases: {s['phases']}" if s['phases'] else "")
                + (f"; engine loop: {s['engine']}" if s['engine'] else "")
                + f"; CPU of a core: the verifier's event loop {s['event_loop_cpu']:.0%}"
                + (f", the replay drafter {s['drafter_cpu']:.0%}" if speculation else ""))

        for block in range(args.blocks):
            order = list(verifiers) if block % 2 == 0 else list(verifiers)[::-1]
            if args.one_at_a_time:  # each verifier in turn, alone on the GPU, every arm
                for prefix in order:
                    services[prefix] = start(prefix)
                    for c in levels:
                        for speculation in (arms if block % 2 == 0 else arms[::-1]):
                            measure(prefix, c, speculation, block)
                    children.stop(verifiers[prefix][0])
                continue
            for c in levels:
                for speculation in (arms if block % 2 == 0 else arms[::-1]):
                    for prefix in order:
                        measure(prefix, c, speculation, block)
        load = services.get("")
        for i, rate in enumerate(rates):
            for speculation in (arms if i % 2 == 0 else arms[::-1]):  # (the same arrival times for both)
                key = f"{'spec' if speculation else 'plain'}@{rate:g}/s"
                s = asyncio.run(load.open_loop(rate, args.num_requests, seed=int(rate * 1000), speculation=speculation))
                results["open"][key] = s
                log(f"  {key}: {s['tokens_per_s']:.1f} tok/s, mean batch {s['mean_batch']:.1f}, "
                    f"TTFT p50 {s['ttft_ms']['p50']:.0f} ms, TPOT p50 {s['tpot_ms']['p50']:.2f} ms, "
                    f"refused {s['refused']}")
    finally:
        children.stop()
        if sink is not None:
            sink.stop()
            results["traces"] = {"spans": sink.spans, "bytes": sink.bytes}
            log(f"traces ({args.traced}): {sink.spans:,} spans, {sink.bytes / 1e6:.1f} MB received")
    report(results, levels, rates, args)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1, default=str))


async def references(children, verifier_argv, address, prompts, args) -> list[dict]:
    """The verifier's plain continuation of every prompt, greedy or sampled as the load's
    requests are (what the replay drafter proposes)."""
    children.start("reference-verifier", verifier_argv)
    try:
        await children.wait_serving("reference-verifier", address, timeout=900)
        sessions = asyncio.Semaphore(max(int(c) for c in args.concurrency.split(",")))  # its max_sessions

        async def generate(client, index, prompt):
            async with sessions:
                return await client.generate(prompt, request_config(args.new_tokens, args.temperature, index, False))

        async with AsyncVerifierClient(address, timeout=1800) as client:
            outs = await asyncio.gather(*(generate(client, i, p) for i, p in enumerate(prompts)))
        return [{"prompt_ids": p, "token_ids": list(o.token_ids)} for p, o in zip(prompts, outs)]
    finally:
        children.stop("reference-verifier")


def report(results: dict, levels: list[int], rates: list[float], args) -> None:
    def median_arm(key):
        runs = results["closed"].get(key, [])
        if not runs:
            return None
        best = sorted(runs, key=lambda s: s["tokens_per_s"])[len(runs) // 2]
        return best

    print(f"\nclosed loop: {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, "
          f"{f'sampled (T {args.temperature}, top-p 0.95)' if args.temperature else 'greedy'}, "
          f"{args.requests_per_client} requests per client, {args.blocks} block(s) (median block shown)\n")
    print(HEADER)
    base = median_arm("plain@1")
    for c in levels:
        for kind in ("plain", "spec"):
            s = median_arm(f"{kind}@{c}")
            if s is not None:
                print(row(f"{kind}, concurrency {c}", s, base["tokens_per_s"] if base else None))
    if args.alpha is not None:
        print(f"\nspeculative / plain at the same concurrency (synthetic drafter, alpha {args.alpha}; output tokens/s,"
              " prefill in, and from the first token on: TPOT p50, plain / speculative — with one request a client"
              " the prompts prefill at the start, not among the other requests' decode steps):")
        for c in levels:
            plain, spec = median_arm(f"plain@{c}"), median_arm(f"spec@{c}")
            if plain and spec:
                print(f"- concurrency {c}: {spec['tokens_per_s'] / plain['tokens_per_s']:.2f}x, "
                      f"TPOT p50 plain / spec {plain['tpot_ms']['p50'] / spec['tpot_ms']['p50']:.2f}x")
    if any(key.startswith("before:") for key in results["closed"]):
        that = [str(args.against_tree or ""), *args.other_arg,
                f"--link {args.other_link}" if args.other_link != args.link else "",
                {"this": "untraced", "other": "traced (this one untraced)"}.get(args.traced, "")]
        print(f"\nthis verifier against the other (`{' '.join(filter(None, that))}`) "
              f"(median of per-block ratios, {args.blocks} blocks):\n")
        print("| arm | tokens/s, this | tokens/s, that | this / that | TPOT p50 that / this | TTFT p50 ms, this / that |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for c in levels:
            for kind in ("plain", "spec"):
                this, that = results["closed"].get(f"{kind}@{c}"), results["closed"].get(f"before:{kind}@{c}")
                if not this or not that:
                    continue
                ratio = statistics.median(a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(this, that))
                tpot = statistics.median(b["tpot_ms"]["p50"] / a["tpot_ms"]["p50"] for a, b in zip(this, that))
                ttft = [statistics.median(arm["ttft_ms"]["p50"] for arm in runs) for runs in (this, that)]
                print(f"| {kind}, concurrency {c} | {statistics.median(a['tokens_per_s'] for a in this):.1f} | "
                      f"{statistics.median(b['tokens_per_s'] for b in that):.1f} | {ratio:.3f} | {tpot:.3f} | "
                      f"{ttft[0]:.0f} / {ttft[1]:.0f} |")
        if args.alpha is not None:
            print("\nspeculative / plain, the other verifier:")
            for c in levels:
                plain, spec = median_arm(f"before:plain@{c}"), median_arm(f"before:spec@{c}")
                if plain and spec:
                    print(f"- concurrency {c}: {spec['tokens_per_s'] / plain['tokens_per_s']:.2f}x")
    if rates:
        print(f"\nopen loop (Poisson arrivals), {args.num_requests} requests per rate\n")
        print(HEADER)
        for rate in rates:
            for kind in ("plain", "spec"):
                s = results["open"].get(f"{kind}@{rate:g}/s")
                if s is not None:
                    print(row(f"{kind}, {rate:g} requests/s", s, base["tokens_per_s"] if base else None))
        if args.alpha is not None:
            print("\nspeculative / plain at the same arrival rate (output tokens/s: what the load offers, so the")
            print("ratio of TPOT p50, plain / speculative, says more when the server keeps up):")
            for rate in rates:
                plain, spec = results["open"][f"plain@{rate:g}/s"], results["open"][f"spec@{rate:g}/s"]
                print(f"- {rate:g} requests/s: tokens/s {spec['tokens_per_s'] / plain['tokens_per_s']:.2f}x, "
                      f"TPOT p50 plain / spec {plain['tpot_ms']['p50'] / spec['tpot_ms']['p50']:.2f}x")


if __name__ == "__main__":
    main()

"""What the OpenAI HTTP edge adds per token (issue 19): the same streamed request straight to
the verifier over gRPC and through `tandem gateway` with the official `openai` client.

Starts `tandem verifier` (embedded model, plain decoding so both arms do identical work) and
`tandem gateway` as child processes, then alternates the two arms request by request
(interleaved pairs, same seed, so both stream the same tokens). Per request it records when
each token arrived; per pair it takes the difference of the mean inter-token gap and of the
time to the first token. Reports the median and p95 of the paired differences and each arm's
inter-token gap p50/p95.

Usage: python bench/gateway_latency.py [--pairs 20] [--tokens 32]
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
from pairbench.common import free_port, log  # noqa: E402  (puts the repo and protocol modules on sys.path)
from pairbench.services import Children  # noqa: E402

from shared.client import AsyncVerifierClient, GenerationConfig  # noqa: E402

PROMPT = "def read_lines(path):"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def direct(client: AsyncVerifierClient, tokens: int, seed: int) -> list[float]:
    config = GenerationConfig(max_new_tokens=tokens, temperature=0.8, seed=seed, speculation=False)
    started, times = time.perf_counter(), []
    async for event in client.stream(PROMPT, config):
        times += [time.perf_counter() - started] * len(event.token_ids)
    return times


async def through_gateway(client, model: str, tokens: int, seed: int) -> list[float]:
    started, times = time.perf_counter(), []
    stream = await client.completions.create(model=model, prompt=PROMPT, max_tokens=tokens, temperature=0.8, seed=seed,
                                             stream=True, extra_body={"speculation": False})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter() - started)
    return times


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


async def run(args, verifier: str, gateway: str) -> None:
    import openai

    http = openai.AsyncOpenAI(base_url=f"http://{gateway}/v1", api_key="none", max_retries=0)
    model = (await http.models.list()).data[0].id
    async with AsyncVerifierClient(verifier) as grpc_client:
        for seed in range(2):  # warm-up: connections, caches
            await direct(grpc_client, args.tokens, seed)
            await through_gateway(http, model, args.tokens, seed)
        arms = {"gRPC": [], "gateway": []}
        gap_diffs, ttft_diffs = [], []
        for pair in range(args.pairs):
            seed = 100 + pair
            order = ("gRPC", "gateway") if pair % 2 == 0 else ("gateway", "gRPC")
            times = {}
            for arm in order:
                times[arm] = await (direct(grpc_client, args.tokens, seed) if arm == "gRPC"
                                    else through_gateway(http, model, args.tokens, seed))
                arms[arm] += gaps(times[arm])
            gap_diffs.append(statistics.mean(gaps(times["gateway"])) - statistics.mean(gaps(times["gRPC"])))
            ttft_diffs.append(times["gateway"][0] - times["gRPC"][0])
            log(f"  pair {pair + 1}/{args.pairs}: gap +{gap_diffs[-1] * 1e3:.3f} ms, first token +{ttft_diffs[-1] * 1e3:.2f} ms")
    print(f"\n| arm ({args.pairs} interleaved requests each, {args.tokens} tokens) | inter-token p50 (ms) | p95 (ms) |")
    print("| --- | ---: | ---: |")
    for arm, values in arms.items():
        print(f"| {arm} | {percentile(values, 0.5) * 1e3:.2f} | {percentile(values, 0.95) * 1e3:.2f} |")
    print("\n| added by the gateway (paired) | median (ms) | p95 (ms) |")
    print("| --- | ---: | ---: |")
    print(f"| per token (mean inter-token gap) | {statistics.median(gap_diffs) * 1e3:.3f} | {percentile(gap_diffs, 0.95) * 1e3:.3f} |")
    print(f"| first token | {statistics.median(ttft_diffs) * 1e3:.2f} | {percentile(ttft_diffs, 0.95) * 1e3:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    children = Children(Path(tempfile.mkdtemp(prefix="gateway-bench-")), threads=1)
    v_port, g_port = free_port(), free_port()
    verifier, gateway = f"127.0.0.1:{v_port}", f"127.0.0.1:{g_port}"
    children.start("verifier", [sys.executable, "-m", "shared.cli", "verifier", "--port", str(v_port)])
    children.start("gateway", [sys.executable, "-m", "shared.cli", "gateway", "--port", str(g_port), "--verifier", verifier])
    try:
        asyncio.run(children.wait_serving("verifier", verifier, 120))
        log("verifier serving; streaming pairs ...")
        asyncio.run(run(args, verifier, gateway))
        children.check_alive()
    finally:
        children.stop()


if __name__ == "__main__":
    main()

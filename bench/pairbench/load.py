"""A closed or open loop of requests against one verifier, measured from the client
(bench/serve_load.py's arms): token arrival times, TTFT / TPOT / ITL percentiles, and what the
verifier's counters, its engine loop's states and the CPU of its event loop (and of a replay
drafter) say about each arm."""

from __future__ import annotations

import asyncio
import random
import time
from urllib.request import urlopen

import grpc

from .common import cpu_seconds
from shared.client import AsyncVerifierClient, GenerationConfig, VerifierError


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


async def one_request(client: AsyncVerifierClient, prompt: list[int], config: GenerationConfig) -> dict:
    """A request's token arrival times; `refused` when the verifier turned it away for capacity
    (an open loop faster than the server: counted, as benchmark_serving counts failures)."""
    sent = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    try:
        async for event in client.stream(prompt, config):
            if event.token_ids:
                arrivals.append(time.perf_counter())
                tokens += len(event.token_ids)
    except VerifierError as error:
        if error.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise
        return {"sent": sent, "arrivals": [], "tokens": 0, "refused": True}
    return {"sent": sent, "arrivals": arrivals, "tokens": tokens}


def summarise(records: list[dict], wall_s: float) -> dict:
    ttft = [(r["arrivals"][0] - r["sent"]) * 1e3 for r in records if r["arrivals"]]
    tpot = [(r["arrivals"][-1] - r["arrivals"][0]) * 1e3 / (r["tokens"] - 1) for r in records if r["tokens"] > 1]
    itl = [(b - a) * 1e3 for r in records for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    tokens = sum(r["tokens"] for r in records)
    refused = sum(bool(r.get("refused")) for r in records)
    out = {"requests": len(records) - refused, "refused": refused, "tokens": tokens, "wall_s": wall_s,
           "tokens_per_s": tokens / wall_s}
    for name, values in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl)):
        out[name] = {f"p{q}": percentile(values, q) for q in (50, 95, 99)}
    return out


def request_config(new_tokens: int, temperature: float, prompt_index: int, speculation: bool,
                   draft_tokens: int = 4) -> GenerationConfig:
    """A request's settings. A sampled request's seed is its prompt's index, so a prompt always
    continues the same way, alone or speculated (exact mode), and the replay drafter's
    reference for it is that continuation."""
    return GenerationConfig(max_new_tokens=new_tokens, temperature=temperature, top_p=0.95 if temperature else 1.0,
                            seed=prompt_index + 1, speculation=speculation, max_draft_tokens=draft_tokens if speculation else 0)


# The verifier's counters an arm reads (Prometheus text names; the tree before exports them too).
SPECULATIVE_ROUNDS = 'tandem_verifier_rounds_total{kind="speculative"}'
PLAIN_ROUNDS = 'tandem_verifier_rounds_total{kind="plain"}'
DETACHES = "tandem_verifier_drafter_detaches_total"  # (counted as each request ends)
PHASES = 'tandem_verifier_governor_phases_total{why="'  # (by why; counted as each request ends; not in older trees)
ENGINE = 'tandem_verifier_engine_seconds_total{state="'  # (the engine loop's wall by what it did; not in older trees)
ROUND_COUNTERS = ("tandem_verifier_batch_rounds_sum", "tandem_verifier_batch_rounds_count", SPECULATIVE_ROUNDS,
                  PLAIN_ROUNDS, "tandem_verifier_accepted_length_sum", "tandem_verifier_accepted_length_count", DETACHES,
                  PHASES, ENGINE)


def label_of(name: str, prefix: str) -> str:
    """The label value of a counter's name that starts with `prefix` (PHASES: the why, ENGINE: the state)."""
    return name[len(prefix):].rstrip('"}')


def engine_shares(arm: dict, wall: float) -> dict:
    """The arm with its engine loop's seconds as a line of shares of its wall (`engine`, e.g.
    "step 58%, job 18%, gather 3%, idle 17%, other 4%"; empty for a tree without the metric)."""
    return arm | {"engine": ", ".join(f"{state} {seconds / wall:.0%}" for state, seconds in arm["engine_s"].items())}


class Load:
    def __init__(self, address: str, prompts: list[list[int]], new_tokens: int, metrics_port: int,
                 temperature: float = 0.0, draft_tokens: int = 4, pids: tuple[int, int | None] = (0, None),
                 local_socket: str | None = None) -> None:
        self.address = address
        self.local_socket = local_socket  # (the verifier's --local-socket: the clients' streams go there)
        # (the verifier's process, whose main thread runs its event loop, and the replay drafter's:
        # their CPU shares of an arm's wall say whether either is saturated)
        self.pids = pids
        self.draft_tokens = draft_tokens
        self.prompts = prompts
        self.new_tokens = new_tokens
        self.metrics_port = metrics_port
        self.temperature = temperature
        self.next_prompt = 0

    def request(self, speculation: bool) -> tuple[list[int], GenerationConfig]:
        index = self.next_prompt % len(self.prompts)
        self.next_prompt += 1
        return self.prompts[index], request_config(self.new_tokens, self.temperature, index, speculation, self.draft_tokens)

    def metrics(self) -> list[str]:
        return urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode().splitlines()

    def round_counts(self) -> dict[str, float]:
        """The verifier's counters an arm reads as differences (ROUND_COUNTERS): rounds per batched
        forward (sum, count), rounds by kind, tokens committed a round (sum, count), detaches."""
        values = {}
        for line in self.metrics():
            if line.startswith(ROUND_COUNTERS):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    def arm_rounds(self, before: dict[str, float]) -> dict[str, float]:
        """An arm's mean batch, share of speculative rounds, tokens a round, its requests'
        detaches (the governor judged speculation slower), their phases by why (`phases`, e.g.
        "verdict 8, explore 2") and the engine loop's seconds by state (`engine_s`), from
        round_counts before and after it."""
        after = self.round_counts()
        d = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
        speculative, plain = d.get(SPECULATIVE_ROUNDS, 0.0), d.get(PLAIN_ROUNDS, 0.0)
        return dict(mean_batch=d.get("tandem_verifier_batch_rounds_sum", 0.0) / max(d.get("tandem_verifier_batch_rounds_count", 0.0), 1),
                    speculative_share=speculative / max(speculative + plain, 1),
                    tokens_per_round=d.get("tandem_verifier_accepted_length_sum", 0.0)
                    / max(d.get("tandem_verifier_accepted_length_count", 0.0), 1),
                    detaches=d.get(DETACHES, 0.0),
                    phases=", ".join(f"{label_of(name, PHASES)} {n:.0f}" for name, n in d.items()
                                     if name.startswith(PHASES) and n > 0),
                    engine_s={label_of(name, ENGINE): n for name, n in d.items() if name.startswith(ENGINE)})

    def cpu(self) -> tuple[float, float]:
        """CPU seconds so far of the verifier's event loop (its main thread) and of the replay drafter."""
        verifier, drafter = self.pids
        return cpu_seconds(verifier, verifier) if verifier else 0.0, cpu_seconds(drafter) if drafter else 0.0

    async def closed_loop(self, concurrency: int, per_client: int, speculation: bool) -> dict:
        before, cpu_before = self.round_counts(), self.cpu()
        async with AsyncVerifierClient(self.address, timeout=1800, local_socket=self.local_socket) as client:
            async def worker() -> list[dict]:
                return [await one_request(client, *self.request(speculation)) for _ in range(per_client)]

            started = time.perf_counter()
            results = await asyncio.gather(*(worker() for _ in range(concurrency)))
            wall = time.perf_counter() - started
        cpu = [(after - before) / wall for before, after in zip(cpu_before, self.cpu())]
        return (summarise([r for rs in results for r in rs], wall) | engine_shares(self.arm_rounds(before), wall)
                | dict(event_loop_cpu=cpu[0], drafter_cpu=cpu[1]))

    async def open_loop(self, rate: float, num_requests: int, seed: int, speculation: bool = False) -> dict:
        rng = random.Random(seed)
        before = self.round_counts()
        async with AsyncVerifierClient(self.address, timeout=1800, local_socket=self.local_socket) as client:
            started = time.perf_counter()
            tasks = []
            for _ in range(num_requests):
                tasks.append(asyncio.create_task(one_request(client, *self.request(speculation))))
                await asyncio.sleep(rng.expovariate(rate))
            records = await asyncio.gather(*tasks)
            wall = time.perf_counter() - started
        return summarise(records, wall) | engine_shares(self.arm_rounds(before), wall)

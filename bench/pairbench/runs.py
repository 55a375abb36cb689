"""Requests and interleaved paired blocks: the arms, one request's record, the block loop."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from shared.client import AsyncVerifierClient, GenerationAccumulator, GenerationConfig, VerifierError

from .common import ServiceError, log
from .services import Children


@dataclass(frozen=True)
class Arm:
    name: str  # "plain", "spec", "spec@alpha=0.8"
    speculation: bool
    alpha: float | None = None
    tag: str = ""  # appended to the request id (the replay drafter reads "@no-ahead")


@dataclass
class Run:
    args: argparse.Namespace
    prompts: list[list[int]]
    records: list[dict] = field(default_factory=list)

    def config(self, arm: Arm, index: int, request_id: str) -> GenerationConfig:
        a = self.args
        return GenerationConfig(
            max_new_tokens=a.max_new_tokens, temperature=a.temperature, seed=a.seed + index, mode=a.mode,
            max_draft_tokens=a.max_draft_tokens, speculation=arm.speculation, request_id=request_id,
        )

    @staticmethod
    def request_id(arm: Arm, tag: str, index: int) -> str:
        rid = f"{'spec' if arm.speculation else 'plain'}-{tag}-p{index}"
        return rid + (f"@alpha={arm.alpha:g}" if arm.alpha is not None else "") + arm.tag

    async def request(self, client: AsyncVerifierClient, arm: Arm, index: int, tag: str) -> dict:
        rid = self.request_id(arm, tag, index)
        accumulator = GenerationAccumulator()
        first_s, first_tokens = None, 0  # when the first tokens arrived (the prompt's prefill and its token)
        started = time.perf_counter()
        try:
            async for event in client.stream(self.prompts[index], self.config(arm, index, rid)):
                if first_s is None and event.token_ids:
                    first_s, first_tokens = time.perf_counter() - started, len(event.token_ids)
                accumulator.add(event)
        except VerifierError as error:
            raise ServiceError(f"request {rid} failed: {error}") from error
        wall = time.perf_counter() - started
        generation = accumulator.result()
        return {
            "request_id": rid, "arm": arm.name, "speculation": arm.speculation, "alpha": arm.alpha, "prompt": index,
            "wall_s": wall, "first_s": first_s, "first_tokens": first_tokens,
            "token_ids": generation.token_ids, "tokens": len(generation.token_ids),
            "finish_reason": generation.finish_reason, "stats": generation.stats, "rounds": generation.rounds,
        }

    async def warm_up(self, client: AsyncVerifierClient, arms: list[Arm]) -> float:
        started = time.perf_counter()
        for arm in arms:
            await self.request(client, arm, 0, "warmup")
        return time.perf_counter() - started

    async def blocks(self, client: AsyncVerifierClient, arms: list[Arm], children: Children) -> None:
        n = self.args.blocks
        started = time.perf_counter()
        for block in range(n):
            order = arms if block % 2 == 0 else arms[::-1]
            log(f"block {block + 1}/{n}: per prompt {' -> '.join(arm.name for arm in order)}")
            for index in range(len(self.prompts)):
                for arm in order:  # arms back to back per prompt: slow drifts of machine load hit both
                    children.check_alive()
                    record = await self.request(client, arm, index, f"b{block}")
                    record["block"] = block
                    record["position"] = order.index(arm)
                    self.records.append(record)
            done = block + 1
            elapsed = time.perf_counter() - started
            mine = [r for r in self.records if r["block"] == block]
            tps = {arm.name: sum(r["tokens"] for r in mine if r["arm"] == arm.name)
                   / max(sum(r["wall_s"] for r in mine if r["arm"] == arm.name), 1e-9) for arm in arms}
            plain = next((arm.name for arm in arms if not arm.speculation), None)
            ratios = ", ".join(f"{name} {value / tps[plain]:.3f}" for name, value in tps.items() if name != plain and plain)
            log(f"  block {done}/{n} done ({elapsed / done:.1f}s per block, about {elapsed / done * (n - done):.0f}s left); "
                f"tokens/s ratio vs plain: {ratios}")
            if self.args.out:  # partial records survive a run cut off at a time limit
                Path(self.args.out).write_text(json.dumps({"partial": True, "blocks_done": done, "records": self.records}))

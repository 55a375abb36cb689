"""Continuous batching at round granularity: concurrent sessions' rounds run as one forward.

Every request's coroutine submits its round (drafts to verify, or none) and awaits its
outcome. One runner task takes what is pending and runs it as one `Engine.run_rounds` job on
the model worker; rounds submitted meanwhile wait for the next job. So a batch forms from
whatever is ready when the device frees up, and a session joins or leaves between steps.

Right after a batch, its sessions are still streaming their tokens and will submit again in
a moment; the runner waits for them (at most `gather_s`, and never for a session that has
left) so that the batch does not split into a straggler and the rest. A session waiting for
its drafter's chain comes back later than that and simply joins a later batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from shared.batching import answer
from shared.worker import ModelWorker
from verifier_service.rounds import RoundOutcome, RoundRequest


@dataclass(frozen=True)
class BatchSettings:
    max_rounds: int  # sessions per batch
    gather_s: float  # how long the runner waits for the last batch's sessions to come back

    def __post_init__(self) -> None:
        if self.max_rounds < 1:
            raise ValueError(f"max_rounds {self.max_rounds} must be >= 1")
        if not 0 <= self.gather_s < 1:
            raise ValueError(f"gather_s {self.gather_s} must lie in [0, 1)")


class RoundBatcher:
    def __init__(self, worker: ModelWorker, run_rounds: Callable[[list[RoundRequest]], list[RoundOutcome]],
                 settings: BatchSettings, on_batch: Callable[[int], None] | None = None) -> None:
        self.worker = worker
        self.run_rounds = run_rounds
        self.settings = settings
        self.on_batch = on_batch  # called with each batch's size (metrics)
        self._pending: list[tuple[RoundRequest, asyncio.Future]] = []
        self._expected: set[int] = set()  # ids of the last batch's sessions that have not come back
        self._wake: asyncio.Event | None = None
        self._runner: asyncio.Task | None = None

    async def submit(self, request: RoundRequest) -> RoundOutcome:
        """Run one round of request.session in the next batch; returns its outcome."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append((request, future))
        self._expected.discard(id(request.session))
        self._poke()
        return await future

    def leave(self, session: object) -> None:
        """The session submits no more rounds (it finished or failed): stop waiting for it."""
        if id(session) in self._expected:
            self._expected.discard(id(session))
            self._poke()

    def _poke(self) -> None:
        if self._wake is None:
            self._wake = asyncio.Event()
        self._wake.set()
        if self._runner is None or self._runner.done():
            self._runner = asyncio.get_running_loop().create_task(self._run(), name="round-batcher")

    async def close(self) -> None:
        if self._runner is not None:
            self._runner.cancel()
            await asyncio.gather(self._runner, return_exceptions=True)

    async def _gather(self) -> None:
        """Wait (bounded) until every session of the last batch has submitted again or left."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.gather_s
        while self._expected and (left := deadline - loop.time()) > 0:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except TimeoutError:
                break
        self._expected.clear()

    async def _run(self) -> None:
        while True:
            self._pending = [(r, f) for r, f in self._pending if not f.done()]  # cancelled callers drop out
            if not self._pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._gather()
            self._pending = [(r, f) for r, f in self._pending if not f.done()]
            batch = self._pending[: self.settings.max_rounds]
            self._pending = self._pending[self.settings.max_rounds :]
            if not batch:
                continue
            self._expected = {id(r.session) for r, _ in batch}
            if self.on_batch is not None:
                self.on_batch(len(batch))
            await answer([future for _, future in batch], self.worker.run(self.run_rounds, [r for r, _ in batch]))

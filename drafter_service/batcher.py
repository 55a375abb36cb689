"""The drafter's MTP work of all sessions in shared forwards (issue 11: batched drafting).

Each stream's handler submits its session's MTP work — a plan's drafts, or the rows its
commit left (plan None) — and awaits the outcome. One runner takes everything pending and
runs it as one model-worker job (`Drafter.mtp_batch`), while later submissions queue for the
next job: with many sessions on one drafter, their chains run as one batched forward per
draft step instead of one session after another. No batch waits for stragglers: a drafter
answers as soon as it can, and a batch forms from what queued while the last job ran.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from drafter_service.planner import Plan
from drafter_service.proposers import Proposal
from drafter_service.session import DraftSession
from shared.batching import answer

Item = tuple[DraftSession, Plan | None]
RunBatch = Callable[[list[Item]], Awaitable[tuple[list[Proposal | None], float]]]


class MtpBatcher:
    def __init__(self, run_batch: RunBatch, on_batch: Callable[[int], None] | None = None) -> None:
        """run_batch(items) -> (one result per item, the job's ms)."""
        self.run_batch = run_batch
        self.on_batch = on_batch  # called with each batch's size (metrics)
        self._pending: list[tuple[Item, asyncio.Future]] = []
        self._runner: asyncio.Task | None = None

    async def submit(self, session: DraftSession, plan: Plan | None) -> tuple[Proposal | None, float]:
        """The session's MTP drafts for `plan` (None: only its deferred rows), and the ms of the
        job that computed them. Cancelled callers drop out before their batch forms."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append(((session, plan), future))
        if self._runner is None or self._runner.done():
            self._runner = asyncio.get_running_loop().create_task(self._run(), name="mtp-batcher")
        return await future

    async def close(self) -> None:
        if self._runner is not None:
            self._runner.cancel()
            await asyncio.gather(self._runner, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            batch = [(item, future) for item, future in self._pending if not future.done()]
            self._pending = []
            if not batch:
                return
            if self.on_batch is not None:
                self.on_batch(len(batch))
            await answer([future for _, future in batch], self._job([item for item, _ in batch]))

    async def _job(self, items: list[Item]) -> list[tuple[Proposal | None, float]]:
        results, job_ms = await self.run_batch(items)
        return [(result, job_ms) for result in results]

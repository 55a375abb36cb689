"""Batched, chunked prefill: the prompts of every session waiting to start share each forward.

A request's coroutine hands its session over and awaits the end of its prefill. One runner
task plans a job from the waiting sessions — oldest first, each its next chunk, all under
one token budget (`--prefill-chunk`), a prompt cut only at multiples of it — and runs it as
a single `Engine.prefill` job on the model worker, then plans the next. Rounds of decoding
sessions queue on the same worker between the jobs, so no stream stalls for longer than one
budget's forward, and requests that arrive together prefill together (one weight read for
all their rows, instead of a forward each).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from shared.worker import ModelWorker
from verifier_service.rounds import Session


def plan_chunks(lefts: list[int], budget: int) -> list[int]:
    """Tokens each waiting session prefills in the next job, oldest first: each its next whole
    chunk (the budget's worth, or the rest of its prompt) while it fits in what is left of the
    budget. A prompt is thus always cut at the same positions (multiples of the budget),
    whatever shares its jobs: a chunk's rows depend on the chunk's shape (cuBLAS picks kernels
    by the row count), so a cut that followed the other prompts would make a request's KV, and
    so its output, depend on what else runs (DESIGN §11)."""
    if budget < 1:
        raise ValueError(f"prefill token budget {budget} must be >= 1")
    counts, room = [], budget
    for left in lefts:
        chunk = min(max(left, 0), budget)
        counts.append(chunk if chunk <= room else 0)
        room -= counts[-1]
    return counts


@dataclass
class _Waiting:
    session: Session
    future: asyncio.Future
    jobs: int = 0  # jobs this session's chunks ran in


class PrefillBatcher:
    def __init__(self, worker: ModelWorker, run_prefill: Callable[[list[tuple[Session, int]]], None],
                 token_budget: int, on_job: Callable[[int, int], None] | None = None) -> None:
        if token_budget < 1:
            raise ValueError(f"prefill token budget {token_budget} must be >= 1")
        self.worker = worker
        self.run_prefill = run_prefill
        self.token_budget = token_budget
        self.on_job = on_job  # called with each job's (sessions, tokens) (metrics)
        self._waiting: list[_Waiting] = []
        self._runner: asyncio.Task | None = None

    async def prefill(self, session: Session) -> int:
        """Prefill the session's prompt (all but its last token); returns the jobs it took."""
        if session.prefill_left <= 0:
            return 0
        waiting = _Waiting(session, asyncio.get_running_loop().create_future())
        self._waiting.append(waiting)
        if self._runner is None or self._runner.done():
            self._runner = asyncio.get_running_loop().create_task(self._run(), name="prefill-batcher")
        return await waiting.future

    async def close(self) -> None:
        if self._runner is not None:
            self._runner.cancel()
            await asyncio.gather(self._runner, return_exceptions=True)
        for waiting in self._waiting:
            if not waiting.future.done():
                waiting.future.cancel()
        self._waiting.clear()

    async def _run(self) -> None:
        while True:
            # A request that went away (its awaiting coroutine cancelled) is dropped here.
            self._waiting = [w for w in self._waiting if not w.future.done()]
            if not self._waiting:
                return
            counts = plan_chunks([w.session.prefill_left for w in self._waiting], self.token_budget)
            job = [(w, count) for w, count in zip(self._waiting, counts) if count > 0]
            try:
                await self.worker.run(self.run_prefill, [(w.session, count) for w, count in job])
            except Exception as error:  # the job's sessions fail; the others go on
                for w, _ in job:
                    if not w.future.done():
                        w.future.set_exception(error)
                continue
            if self.on_job is not None:
                self.on_job(len(job), sum(count for _, count in job))
            for w, _ in job:
                w.jobs += 1
                if w.session.prefill_left <= 0 and not w.future.done():
                    w.future.set_result(w.jobs)

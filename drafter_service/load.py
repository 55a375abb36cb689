"""The drafter's load shedding (issue 13): answer at once rather than late.

The model worker runs one job at a time. With many sessions on one drafter its queue (MTP
chains, each commit's deferred MTP rows, opens) can grow past what the verifiers wait for a
chain; an MTP chain computed after its verifier's deadline is dropped there, and the round
has waited the whole deadline for nothing. Each commit now says how long its verifier will
wait (`DraftCommit.wait_ms`). Before queueing MTP drafts the drafter estimates when they
would be done: the jobs ahead of them (the worker's backlog, at the measured mean job
time of their kind; of the running job, what is left) plus the drafts themselves (at the
planner's measured time per MTP draft). When that exceeds SHED_SHARE of the wait — the rest
is left for the hop back — it plans without MTP: a suffix chain, or an empty chain, both made
on the event loop and sent at once, so the verifier runs a plain round without waiting. The state stays on the loop (no locks): `begin`/`end`
around each awaited job, job times measured on the worker.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

SHED_SHARE = 0.8  # of the verifier's wait that queued MTP drafts may take (the rest: the hop back)
EMA = 0.2


@dataclass
class WorkerLoad:
    """The model worker's backlog as the event loop sees it, by kind of job ("open", "mtp",
    "settle"): an open's long catch-up must not make every short job look long. The worker runs
    jobs one at a time in submission order, so the oldest pending job is the one running, since
    it was submitted or since the job before it ended; only what is left of it counts (with
    batched drafting one "mtp" job runs most of the time, and counting it whole made a chain
    look twice as late as it would be)."""

    job_ms: dict[str, float] = field(default_factory=dict)  # EMA of a job's duration on the worker
    clock: Callable[[], float] = time.monotonic
    _queue: deque = field(default_factory=deque)  # jobs submitted, not finished: (kind, submitted at), oldest first
    _last_end: float = 0.0

    def begin(self, kind: str) -> None:
        self._queue.append((kind, self.clock()))

    def end(self, kind: str, job_ms: float | None) -> None:
        """A job finished (job_ms None: it failed, its time tells nothing)."""
        for index, (queued, _) in enumerate(self._queue):
            if queued == kind:
                del self._queue[index]
                break
        self._last_end = self.clock()
        if job_ms is not None:
            self.job_ms[kind] = _ema(self.job_ms.get(kind, 0.0), job_ms)

    @property
    def jobs(self) -> int:
        """Jobs submitted and not finished (the running one included)."""
        return len(self._queue)

    def backlog_ms(self) -> float:
        """Expected wait before a job submitted now starts: what is left of the running job, and
        the jobs queued behind it."""
        if not self._queue:
            return 0.0
        (kind, submitted), *queued = self._queue
        running_ms = (self.clock() - max(submitted, self._last_end)) * 1e3
        left = max(0.0, self.job_ms.get(kind, 0.0) - running_ms)
        return left + sum(self.job_ms.get(kind, 0.0) for kind, _ in queued)

    def sheds(self, num_drafts: int, draft_ms: float, wait_ms: float) -> bool:
        """Whether `num_drafts` MTP drafts of `draft_ms` each (the planner's measured cost per
        draft), queued now, would miss SHED_SHARE of `wait_ms` (0: no deadline known, never shed)."""
        if wait_ms <= 0:
            return False
        return self.backlog_ms() + num_drafts * draft_ms > SHED_SHARE * wait_ms


def _ema(old: float, new: float) -> float:
    return new if old == 0 else (1 - EMA) * old + EMA * new

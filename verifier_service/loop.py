"""The engine loop: one thread owns the model, runs its jobs and steps every running session.

Request coroutines feed it and read from it; nothing on the event loop sits between two steps
of the device (DESIGN §9, "The engine loop"):

- jobs (`run`, `submit`): loading, a session's begin and close, prefill chunks — run between
  steps, in the order they came;
- lanes (`join`): a session's rounds. A lane's next round is either a turn its coroutine hands
  in (`Lane.turn`: drafts to verify, or none) or, where the coroutine granted it plain rounds
  (`Lane.grant`: rounds its governor already knows will be plain), one the loop runs on its
  own as soon as the last one is committed — with the step after it enqueued on the device
  before this one's tokens are read (decode-ahead). Outcomes wait in the lane, in round
  order, until its coroutine reads them (`Lane.outcome`); a lane runs at most `max_lead`
  rounds ahead of its reader, so a reader that falls behind holds its lane instead of the
  device decoding tokens nobody streams yet;
- a step: the lanes with a round ready (at most `max_rounds`) as one `run_rounds` call (one
  session's round is a batch of one). After a step the loop waits, at most `gather_s`, for
  that step's lanes to be ready again, never for one that left, so that a batch does not
  split into a straggler and the rest; a lane waiting for its drafter's chain comes back
  later and joins a later step. Where the device already computed a step ahead for some
  lanes' plain rounds and another lane's verify round is ready too, the computed step is
  taken first rather than thrown away. Where steps compute on this host (`host_steps`: a CPU
  model) a step's outcomes go to the event loop when the next step starts, or before the loop
  waits or runs a job: the wake-up hands the event loop the interpreter lock, and it reads them
  while the next step computes outside it, not while this thread still runs Python between
  steps;
- a follower (`Lane.follow`): the round after a round in flight, valid only if that round
  emits exactly the tokens it assumes (a chain the drafter drafted ahead, assuming every draft
  accepted and its guess of the bonus). When the round commits and emitted them, the loop
  hands the follower in as the lane's next turn at once — it runs in the next step, without
  waiting for the coroutine or the drafter's round trip; otherwise it is dropped. The
  coroutine knows which by the same comparison (`Lane.follow` said whether it was in time).
  Only a lane alone in the loop follows: in a batch the other lanes keep the device busy;
- threads: `on_drafting` hears, on the loop's thread before a step, when whether some lane's
  drafter works (its last round verified drafts, until a granted plain round) changed — the
  verifier then yields a drafter on its host a core (shared/threads.py);
- costs: each step's rows, seconds and whether it ran on the threads left beside a working
  drafter (`on_drafting` wired: a CPU verifier with its drafter on this host) feed a fit
  (verifier_service.step_costs); a round carries what it cost the other lanes
  (`RoundOutcome.cost_to_others_s`, which its governor counts as its own cost): its draft rows'
  share of a step shared with them, its share of what the working drafter added to the rounds
  of the lanes without drafts, and
  the time they waited, ready, for this lane before its step (the gather: a lane waiting for
  its drafter's chain holds the batch up to `gather_s`); and what they added to it
  (`RoundOutcome.cost_from_others_s`, which its governor takes off its own cost): their draft
  rows, the working drafter's addition to a round without drafts, its wait for them, and the
  jobs that ran between its steps (other sessions' prefills: the same for either kind of round);
- time: the loop's thread accounts its wall time by what it did (`LoopTime`: stepping, running
  jobs, gathering a step's lanes, idle; the rest is its own bookkeeping between them) — the
  verifier's metric tandem_verifier_engine_seconds{state}: whether the loop is busy stepping or
  waits for the host (request coroutines, the drafter).

A plain round run ahead is the round the coroutine would have asked for (its drafts: none), so
running it early changes no token: the output law is the rounds' (DESIGN §2–3).
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Protocol

from verifier_service.lane import Lane, deliver_all
from verifier_service.rounds import RoundOutcome, RoundRequest
from verifier_service.step_costs import StepCosts


@dataclass(frozen=True)
class BatchSettings:
    max_rounds: int  # sessions per step
    gather_s: float  # how long a step waits for the last step's lanes to be ready again
    max_lead: int = 3  # granted plain rounds a lane may run ahead of its reader

    def __post_init__(self) -> None:
        if self.max_rounds < 1:
            raise ValueError(f"max_rounds {self.max_rounds} must be >= 1")
        if not 0 <= self.gather_s < 1:
            raise ValueError(f"gather_s {self.gather_s} must lie in [0, 1)")
        if self.max_lead < 1:
            raise ValueError(f"max_lead {self.max_lead} must be >= 1")


class LoopTime(Enum):
    """What the loop's thread spent its time on (`EngineLoop.seconds`)."""

    STEP = "step"  # a step's run_rounds (the model's work, and its wait for the device's results)
    JOB = "job"  # jobs between steps (prefill chunks, begins, closes)
    GATHER = "gather"  # waiting, bounded, for the last step's lanes to be ready again
    IDLE = "idle"  # nothing to run: waiting for a lane's round or a job
    OTHER = "other"  # the rest: planning steps, charging rounds, delivering outcomes


class Stepper(Protocol):
    """What the loop steps: verifier_service.engine.Engine."""

    def run_rounds(self, rounds: list[RoundRequest]) -> list[RoundOutcome]: ...

    def computed_ahead(self) -> list[Any]:
        """The sessions whose next plain round the device already computed (decode-ahead)."""
        ...


class LoopClosed(RuntimeError):
    """The engine loop stopped (the service is shutting down)."""


class RoundsExhausted(RuntimeError):
    """A lane's granted plain rounds will not run: its session decodes no more (its cache is
    full, it reached max_new_tokens or an end-of-sequence token)."""


@dataclass
class _Job:
    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    future: asyncio.Future | None
    aloop: asyncio.AbstractEventLoop | None


class EngineLoop:
    """The model thread: `run`/`submit` jobs, `join` lanes; `start` after the engine exists."""

    def __init__(self, name: str, settings: BatchSettings, on_step: Callable[[int], None] | None = None,
                 step_costs: StepCosts | None = None, on_drafting: Callable[[bool], None] | None = None,
                 host_steps: bool = False) -> None:
        self.settings = settings
        # Steps computed on this host's cores (a CPU model): a step's outcomes go to the event
        # loop when the next step starts, so it reads them while that step computes outside the
        # interpreter lock. On a GPU they go at once (not measured to pay there).
        self.host_steps = host_steps
        self.on_step = on_step  # called (on the loop's thread) with each step's number of rounds
        # called on the loop's thread before a step when whether some lane's drafter works
        # changed (its last round verified drafts; shared/threads.py yields it a core then)
        self.on_drafting = on_drafting
        self._drafting = False  # (what on_drafting last said)
        self._drafting_next = False  # (set by _plan under the lock, read by _step)
        self.step_costs = step_costs or StepCosts()  # (touched on the loop's thread only)
        self._cond = threading.Condition()
        self._jobs: deque[_Job] = deque()
        self._lanes: dict[int, Lane] = {}
        self._stepper: Stepper | None = None
        self._closed = False
        # outcomes of steps run, by event loop (host steps: sent when the next step starts, or
        # before the loop waits or runs a job)
        self._undelivered: dict[asyncio.AbstractEventLoop, list[tuple[Lane, Any]]] = {}
        # the loop thread's wall time by what it did (LoopTime.OTHER: the rest, read by `time_spent`)
        self.seconds = dict.fromkeys(LoopTime, 0.0)
        self._born = time.perf_counter()
        self._waiting: tuple[LoopTime, float] | None = None  # (the wait in progress, since when)
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        # Stopped before the interpreter finalises (as concurrent.futures' workers are): a
        # daemon thread still inside torch then aborts the process.
        stop = weakref.WeakMethod(self.shutdown)
        threading._register_atexit(lambda: (method := stop()) is not None and method(wait=True))

    # -- from the event loop --

    async def run(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """Run fn(*args, **kwargs) on the loop's thread, between steps; its result."""
        aloop = asyncio.get_running_loop()
        future = aloop.create_future()
        self._queue_job(_Job(fn, args, kwargs, future, aloop))
        return await future

    def submit(self, fn: Callable[..., Any], *args) -> None:
        """Queue fn(*args) behind the jobs already queued, without waiting for it (housekeeping
        that must not race the model code, e.g. from a `finally` that cannot await)."""
        self._queue_job(_Job(fn, args, {}, None, None))

    def start(self, stepper: Stepper) -> None:
        """Step lanes through `stepper` from now on."""
        with self._cond:
            self._stepper = stepper
            self._cond.notify()

    def join(self, session: Any) -> Lane:
        """The session's lane (its rounds run from now on)."""
        lane = Lane(self, session, asyncio.get_running_loop())
        with self._cond:
            if id(session) in self._lanes:
                raise ValueError("the session already has a lane")
            self._lanes[id(session)] = lane
        return lane

    def time_spent(self) -> dict[LoopTime, float]:
        """The loop thread's seconds so far by what it did (any thread; a moment's snapshot)."""
        now, waiting, spent = time.perf_counter(), self._waiting, dict(self.seconds)
        if waiting is not None:  # (a long idle wait is idle time before it ends)
            spent[waiting[0]] += now - waiting[1]
        spent[LoopTime.OTHER] = max(now - self._born - sum(spent.values()), 0.0)
        return spent

    @property
    def num_lanes(self) -> int:
        return len(self._lanes)

    def shutdown(self, wait: bool = False) -> None:
        """Stop after the job or step in hand; jobs and rounds not yet run fail with LoopClosed.
        wait: until the loop's thread has ended."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def _queue_job(self, job: _Job) -> None:
        with self._cond:
            if self._closed:
                raise LoopClosed("the engine loop is stopped")
            self._jobs.append(job)
            self._cond.notify()

    # -- the loop's thread --

    def _main(self) -> None:
        expected: list[Lane] = []  # the last step's lanes, waited for (bounded) before the next
        after_job = False
        while True:
            with self._cond:
                job, rounds, expected = self._next_work(expected, after_job)
                if job is None and rounds is None:  # closed
                    break
            after_job = job is not None
            if job is not None:
                self._deliver()
                started = time.perf_counter()
                self._run_job(job)
                seconds = time.perf_counter() - started
                self.seconds[LoopTime.JOB] += seconds
                self._stalled(seconds)
            else:
                expected = self._step(rounds)
        self._deliver()
        self._fail_pending()

    def _next_work(self, expected: list[Lane], after_job: bool
                   ) -> tuple[_Job | None, list[tuple[Lane, RoundRequest]] | None, list[Lane]]:
        """Under the lock: the next job, else the next step's rounds (waiting for either). Jobs
        and steps alternate while both are waiting: a long prompt's prefill jobs, queued one
        after another, stall the decoding lanes for one job at a time, not for all of them."""
        gather_until: float | None = None
        gather_from, waited_for = 0.0, []  # (when the gather began, the lanes it waited for)
        while True:
            if self._closed:
                return None, None, []
            ready = []
            if self._stepper is not None:
                self._end_exhausted()
                ready = [lane for lane in self._lanes.values() if lane._ready(self.settings.max_lead)]
            if self._jobs and not (after_job and ready):
                return self._jobs.popleft(), None, expected
            if self._stepper is not None:
                lead = self.settings.max_lead
                waiting = [lane for lane in expected if not lane.left and not lane._ready(lead)]
                if ready and waiting:  # the last step's lanes not back yet: wait for them, bounded
                    now = time.monotonic()
                    if gather_until is None:
                        gather_until = now + self.settings.gather_s
                        gather_from, waited_for = now, waiting
                    if now < gather_until:
                        self._deliver()
                        self._wait(LoopTime.GATHER, gather_until - now)
                        continue
                if ready:
                    if waited_for:
                        _owe(waited_for, ready, time.monotonic() - gather_from)
                    return None, self._plan(ready), []
            self._deliver()
            self._wait(LoopTime.IDLE)

    def _wait(self, why: LoopTime, timeout: float | None = None) -> None:
        """Under the lock: wait for a notify (or the timeout), the time counted as `why`."""
        started = time.perf_counter()
        self._waiting = (why, started)
        self._cond.wait(timeout)
        self._waiting = None
        self.seconds[why] += time.perf_counter() - started

    def _end_exhausted(self) -> None:
        """Under the lock: a lane granted plain rounds its session cannot decode learns so (its
        reader, if it still reads, would otherwise wait for them)."""
        for lane in self._lanes.values():
            if lane._plain_left and not lane._turns and not lane.session.may_decode():
                lane._plain_left = 0
                # (behind the outcomes not yet sent: the round that ended the session comes first)
                self._undelivered.setdefault(lane._aloop, []).append((lane, RoundsExhausted("the session decodes no more")))

    def _plan(self, ready: list[Lane]) -> list[tuple[Lane, RoundRequest]]:
        """The step's rounds (under the lock): at most max_rounds, oldest lanes first; where
        the device computed some lanes' next plain round ahead and other lanes' rounds are
        ready too, those lanes' computed step alone (then the rest joins the next step)."""
        ready = ready[: self.settings.max_rounds]
        self._drafting_next = any(lane._drafting for lane in self._lanes.values())
        ahead = {id(s) for s in self._stepper.computed_ahead()}
        if ahead and len(ready) > len(ahead):
            computed = [lane for lane in ready if id(lane.session) in ahead and not lane._turns]
            if len(computed) == len(ahead):
                return [(lane, replace(lane._take(), decode_ahead=False)) for lane in computed]
        return [(lane, lane._take()) for lane in ready]

    def _run_job(self, job: _Job) -> None:
        try:
            result = job.fn(*job.args, **job.kwargs)
        except BaseException as error:  # noqa: BLE001 (it reaches the job's caller)
            if job.future is not None:
                _post(job.aloop, _settle, job.future, None, error)
            return
        if job.future is not None:
            _post(job.aloop, _settle, job.future, result, None)

    def _stalled(self, seconds: float) -> None:
        """A job ran for `seconds` between steps (another session's prefill chunk, a begin, a
        close): every lane's round in progress waited for it, drafting or not, so each is
        refunded it — else the lanes decoding during others' prefills (a fresh batch's first,
        its explorers) measured them as their own cost (docs/PERFORMANCE.md, session 43)."""
        with self._cond:
            lanes = [lane for lane in self._lanes.values() if not lane.left]
        for lane in lanes:
            lane._waited_s += seconds

    def _step(self, rounds: list[tuple[Lane, RoundRequest]]) -> list[Lane]:
        lanes = [lane for lane, _ in rounds]
        drafting = self._drafting_next or any(r.drafts for _, r in rounds)
        if self.on_drafting is not None and drafting != self._drafting:
            self._drafting = drafting
            self.on_drafting(drafting)
        if self.on_step is not None:
            self.on_step(len(rounds))
        self._deliver()
        started = time.perf_counter()
        try:
            results: list[RoundOutcome | BaseException] = list(self._stepper.run_rounds([r for _, r in rounds]))
            failed = False
        except Exception as error:  # every round of the step fails; the loop goes on
            results, failed = [error] * len(lanes), True
        seconds = time.perf_counter() - started  # (the account's and the cost fit's: one measure)
        self.seconds[LoopTime.STEP] += seconds
        if not failed:
            # The fit's second kind of step is one run on the threads left beside a drafter (a CPU
            # verifier with its drafter on this host). Where the threads never change (a GPU, a
            # drafter elsewhere) steps with a drafter at work are the steps with draft rows, whose
            # cost is far from linear in rows on a GPU: a fitted drafter term would be the draft
            # rows' cost read twice, and a lane drafting among 7 plain ones charged it 7-fold.
            yielded = drafting and self.on_drafting is not None
            results = self._charged(rounds, results, seconds, yielded)
        with self._cond:
            for lane, result in zip(lanes, results, strict=True):
                lane._ran(result)
        for lane, result in zip(lanes, results, strict=True):
            self._undelivered.setdefault(lane._aloop, []).append((lane, result))
        if not self.host_steps:
            self._deliver()
        return lanes

    def _deliver(self) -> None:
        """The outcomes of the steps run so far to their lanes' event loops, one wake-up each."""
        undelivered, self._undelivered = self._undelivered, {}
        for aloop, pairs in undelivered.items():
            _post(aloop, deliver_all, pairs)

    def _charged(self, rounds: list[tuple[Lane, RoundRequest]], results: list, seconds: float,
                 drafting: bool) -> list:
        """The step's outcomes, each round charged what it cost the other lanes: its draft rows'
        share of the step and of what the drafter at work added to it, and the time the other
        lanes waited for it before the step (the gather); the step's rows, time and whether a
        drafter worked go into the fit (verifier_service.step_costs)."""
        costs = self.step_costs
        costs.add(sum(len(r.drafts) + 1 for _, r in rounds), seconds, drafting)
        step = costs.charges(len(rounds), sum(len(r.drafts) for _, r in rounds), sum(1 for _, r in rounds if r.drafts))
        charged = []
        for (lane, r), result in zip(rounds, results, strict=True):
            cost = step.to_others_s(len(r.drafts)) + lane._owed_s
            refund = step.from_others_s(len(r.drafts)) + lane._waited_s
            if (cost or refund) and isinstance(result, RoundOutcome):
                lane._owed_s = lane._waited_s = 0.0
                result = replace(result, cost_to_others_s=cost, cost_from_others_s=refund)
            charged.append(result)
        return charged

    def _fail_pending(self) -> None:
        with self._cond:
            jobs, self._jobs = list(self._jobs), deque()
            lanes = list(self._lanes.values())
        closed = LoopClosed("the engine loop is stopped")
        for job in jobs:
            if job.future is not None:
                _post(job.aloop, _settle, job.future, None, closed)
        for lane in lanes:
            if lane._turns or lane._plain_left:
                _post(lane._aloop, deliver_all, [(lane, closed)])


def _owe(waited_for: list[Lane], ready: list[Lane], seconds: float) -> None:
    """The lanes a step waited for owe the ready lanes' wait (lane-seconds), shared among them;
    each ready lane is refunded its wait."""
    others = [lane for lane in ready if lane not in waited_for]
    if others and seconds > 0:
        share = seconds * len(others) / len(waited_for)
        for lane in waited_for:
            lane._owed_s += share
        for lane in others:
            lane._waited_s += seconds


def _post(aloop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args) -> None:
    try:
        aloop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the event loop is closed: nobody waits any more
        pass


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # (its caller was cancelled)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)

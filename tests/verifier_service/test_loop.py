"""The engine loop (verifier_service.loop): turns handed in while a step runs run together; the
last step's lanes are waited for (bounded), never leavers; granted plain rounds run without
their reader, at most max_lead ahead of it; a computed step ahead is taken first; jobs and steps
alternate; failures reach every lane of their step and the callers of their job."""

import asyncio
import threading
import time

import pytest

import torch

from verifier_service.loop import BatchSettings, EngineLoop, LoopClosed, LoopTime, RoundsExhausted
from verifier_service.rounds import RoundOutcome, RoundRequest
from verifier_service.step_costs import StepCosts


class Session:
    def __init__(self, name: str) -> None:
        self.name = name
        self.decodes = True

    def may_decode(self) -> bool:
        return self.decodes


class FakeEngine:
    """run_rounds records each step as [(session, drafts, decode_ahead)]; `gate` holds the loop's
    thread until set; `ahead` stands for the sessions of a step computed ahead."""

    def __init__(self) -> None:
        self.steps: list[list[tuple[str, int, bool]]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail_next = False
        self.ahead: list[Session] = []

    def run_rounds(self, rounds: list[RoundRequest]):
        self.ahead = []  # (a step computed ahead is used or dropped by the next step, as the engine's)
        self.gate.wait(5)
        self.steps.append([(r.session.name, len(r.drafts), r.decode_ahead) for r in rounds])
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("device fault")
        return [f"{r.session.name}:{len(self.steps)}" for r in rounds]

    def computed_ahead(self):
        return self.ahead

    def names(self) -> list[list[str]]:
        return [[name for name, _, _ in step] for step in self.steps]


@pytest.fixture
def engine():
    return FakeEngine()


@pytest.fixture(params=[False, True], ids=["outcomes-at-once", "host-steps"])
def make_loop(engine, request):
    # every behaviour holds whether a step's outcomes go out at once (a GPU) or when the next step
    # starts (steps on the host)
    loops = []

    def make(*, max_rounds=8, gather_s=0.5, max_lead=3):
        loop = EngineLoop("test-loop", BatchSettings(max_rounds=max_rounds, gather_s=gather_s, max_lead=max_lead),
                          host_steps=request.param)
        loop.start(engine)
        loops.append(loop)
        return loop

    yield make
    for loop in loops:
        loop.shutdown(wait=True)


async def wait_until(predicate, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.005)
    return True


async def round_of(lane, drafts=()):
    lane.turn(RoundRequest(lane.session, list(drafts)))
    return await lane.outcome()


async def test_turns_handed_in_while_a_step_runs_run_as_one_step(make_loop, engine):
    loop = make_loop()
    lanes = [loop.join(Session(n)) for n in "abcd"]
    engine.gate.clear()
    first = asyncio.create_task(round_of(lanes[0]))
    assert await wait_until(lambda: len(engine.steps) == 0 and loop.num_lanes == 4)
    await asyncio.sleep(0.05)  # "a" is on the loop's thread, held at the gate
    others = [asyncio.create_task(round_of(lane)) for lane in lanes[1:]]
    await asyncio.sleep(0.05)
    engine.gate.set()
    assert await first == "a:1"
    assert await asyncio.gather(*others) == ["b:2", "c:2", "d:2"]
    assert engine.names() == [["a"], ["b", "c", "d"]]


async def test_the_next_step_waits_for_the_last_ones_lanes_and_not_for_leavers(make_loop, engine):
    loop = make_loop(gather_s=0.9)
    a, b, c = (loop.join(Session(n)) for n in "abc")
    await asyncio.gather(*(round_of(lane) for lane in (a, b, c)))
    assert engine.names() == [["a", "b", "c"]]
    # "a" comes back at once, "b" a little later, "c" leaves: the next step is a and b together,
    # formed as soon as b is back (well before gather_s).
    started = asyncio.get_running_loop().time()
    task_a = asyncio.create_task(round_of(a))
    await asyncio.sleep(0.05)
    c.leave()
    await asyncio.sleep(0.05)
    task_b = asyncio.create_task(round_of(b))
    await asyncio.gather(task_a, task_b)
    assert engine.names()[1] == ["a", "b"]
    assert asyncio.get_running_loop().time() - started < 0.8  # b's return closed the gather, not the 0.9 s bound


async def test_max_rounds_caps_a_step(make_loop, engine):
    loop = make_loop(max_rounds=2, gather_s=0.0)
    engine.gate.clear()
    tasks = [asyncio.create_task(round_of(loop.join(Session(n)))) for n in "abcde"]
    await asyncio.sleep(0.05)
    engine.gate.set()
    await asyncio.gather(*tasks)
    assert [len(step) for step in engine.steps] == [2, 2, 1]


async def test_a_failed_step_fails_its_lanes_and_the_loop_goes_on(make_loop, engine):
    loop = make_loop(gather_s=0.0)
    engine.gate.clear()
    a, b = loop.join(Session("a")), loop.join(Session("b"))
    engine.fail_next = True
    tasks = [asyncio.create_task(round_of(lane)) for lane in (a, b)]
    await asyncio.sleep(0.05)
    engine.gate.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results)
    assert await round_of(loop.join(Session("c"))) == "c:2"


async def test_granted_rounds_run_unasked_at_most_max_lead_ahead_of_their_reader(make_loop, engine):
    loop = make_loop(gather_s=0.0, max_lead=3)
    lane = loop.join(Session("a"))
    lane.grant(10)
    assert await wait_until(lambda: len(engine.steps) == 3)
    await asyncio.sleep(0.05)
    assert len(engine.steps) == 3  # nobody read: the lane waits
    assert await lane.outcome() == "a:1"
    assert await wait_until(lambda: len(engine.steps) == 4)  # one read lets one more run
    assert [await lane.outcome() for _ in range(9)] == [f"a:{i}" for i in range(2, 11)]
    await asyncio.sleep(0.05)
    assert len(engine.steps) == 10  # the grant is spent
    # each granted round but the last enqueues the next one's step (decode-ahead)
    assert [step[0][2] for step in engine.steps] == [True] * 9 + [False]
    # a turn handed in after the grant runs after it, with its drafts
    assert await round_of(lane, [7, 8]) == "a:11" and engine.steps[-1] == [("a", 2, False)]


async def test_turns_run_before_granted_rounds(make_loop, engine):
    loop = make_loop(gather_s=0.0)
    engine.gate.clear()
    busy = asyncio.create_task(round_of(loop.join(Session("x"))))
    await asyncio.sleep(0.05)
    lane = loop.join(Session("a"))
    lane.turn(RoundRequest(lane.session, [1, 2, 3]))
    lane.grant(2)
    engine.gate.set()
    await busy
    assert [await lane.outcome() for _ in range(3)] == ["a:2", "a:3", "a:4"]
    assert engine.steps[1:] == [[("a", 3, False)], [("a", 0, True)], [("a", 0, False)]]


async def test_a_step_computed_ahead_runs_first_when_another_lane_s_verify_round_is_ready(make_loop, engine):
    loop = make_loop(gather_s=0.0)
    engine.gate.clear()
    busy = asyncio.create_task(round_of(loop.join(Session("x"))))
    await asyncio.sleep(0.05)  # the thread is held: what follows is all ready at the next step
    plain_a, plain_b = Session("a"), Session("b")
    a, b = loop.join(plain_a), loop.join(plain_b)
    a.grant(2)
    b.grant(2)
    v = loop.join(Session("v"))
    v.turn(RoundRequest(v.session, [5, 6]))
    engine.ahead = [plain_b, plain_a]  # the device computed a's and b's next plain step
    engine.gate.set()
    await busy
    assert await v.outcome() == "v:3"
    # the computed step alone (nothing enqueued behind it: the next step holds v's window)
    assert engine.steps[1] == [("a", 0, False), ("b", 0, False)]
    assert engine.steps[2] == [("a", 0, False), ("b", 0, False), ("v", 2, False)]


async def test_granted_rounds_a_session_cannot_decode_end_its_reader(make_loop, engine):
    loop = make_loop(gather_s=0.0)
    session = Session("a")
    lane = loop.join(session)
    lane.grant(5)
    assert await lane.outcome() == "a:1"
    session.decodes = False  # (on the engine: its cache filled, or it reached max_new_tokens or eos)
    outcomes = []
    with pytest.raises(RoundsExhausted):
        while True:
            outcomes.append(await lane.outcome())
    assert len(outcomes) <= 3  # those run before it could not decode any more


async def test_jobs_and_steps_alternate(make_loop, engine):
    """A stream of jobs (a long prompt's prefill chunks) does not stall a decoding lane for all of them."""
    loop = make_loop(gather_s=0.0)
    order: list[str] = []
    run_rounds = engine.run_rounds

    def logged(rounds):
        order.append("step")
        return run_rounds(rounds)

    engine.run_rounds = logged
    lane = loop.join(Session("a"))
    lane.grant(100)

    async def read():
        for _ in range(100):
            await lane.outcome()

    reader = asyncio.create_task(read())
    for _ in range(10):
        await loop.run(order.append, "job")
    await reader
    jobs = [i for i, what in enumerate(order) if what == "job"]
    assert len(jobs) == 10
    assert all(order[i + 1] == "step" for i in jobs[:-1])  # a step between any two jobs


async def test_jobs_run_in_order_and_fail_their_callers(make_loop):
    loop = make_loop()
    seen = []
    loop.submit(seen.append, 1)
    assert await loop.run(lambda: seen.append(2) or len(seen)) == 2
    with pytest.raises(ZeroDivisionError):
        await loop.run(lambda: 1 / 0)
    assert await loop.run(lambda: "still running") == "still running"


async def test_a_stopped_loop_refuses_jobs_and_fails_waiting_lanes(engine):
    loop = EngineLoop("test-loop", BatchSettings(max_rounds=4, gather_s=0.0))
    lane = loop.join(Session("a"))  # (no engine yet: the turn waits)
    lane.turn(RoundRequest(lane.session, []))
    loop.shutdown(wait=True)
    with pytest.raises(LoopClosed):
        await lane.outcome()
    with pytest.raises(LoopClosed):
        await loop.run(print)


class OutcomeEngine(FakeEngine):
    """Rounds end as RoundOutcomes (every draft accepted), as the engine's."""

    def run_rounds(self, rounds):
        super().run_rounds(rounds)
        return [RoundOutcome([1] * (len(r.drafts) + 1), len(r.drafts), torch.zeros(len(r.drafts) + 1, 4), 1.0, 0.0)
                for r in rounds]


class KnownCosts(StepCosts):
    """2 ms a row, whatever the steps measured (they are recorded all the same)."""

    def per_row_s(self, lo=None, hi=None):
        return 0.002


async def test_a_round_with_drafts_in_a_shared_step_carries_its_cost_to_the_other_lanes():
    engine = OutcomeEngine()
    costs = KnownCosts()
    loop = EngineLoop("test-loop", BatchSettings(max_rounds=8, gather_s=0.5), step_costs=costs)
    loop.start(engine)
    try:
        a, b, c = (loop.join(Session(n)) for n in "abc")
        engine.gate.clear()
        outcomes = [asyncio.create_task(round_of(a, [5, 6, 7])), asyncio.create_task(round_of(b)),
                    asyncio.create_task(round_of(c, [5]))]
        await asyncio.sleep(0.05)
        engine.gate.set()
        with_3, plain, with_1 = await asyncio.gather(*outcomes)
        assert engine.names() == [["a", "b", "c"]]
        assert with_3.cost_to_others_s == pytest.approx(0.002 * 3 * 2)  # 3 draft rows, 2 other lanes
        assert with_1.cost_to_others_s == pytest.approx(0.002 * 1 * 2) and plain.cost_to_others_s == 0.0
        # and each is refunded what the others' draft rows added to its own round
        assert plain.cost_from_others_s == pytest.approx(0.002 * 4)
        assert with_3.cost_from_others_s == pytest.approx(0.002 * 1)
        assert with_1.cost_from_others_s == pytest.approx(0.002 * 3)
        # (what the lanes charge and what they are refunded are the same seconds)
        assert sum(o.cost_to_others_s for o in (with_3, plain, with_1)) == pytest.approx(
            sum(o.cost_from_others_s for o in (with_3, plain, with_1)))
        assert list(costs.steps)[0][0] == 3 + 1 + 1 + 2  # the step's rows went into the fit
        b.leave(), c.leave()
        alone = await round_of(a, [5, 6])
        assert alone.cost_to_others_s == alone.cost_from_others_s == 0.0  # nobody else waited for its rows
    finally:
        loop.shutdown(wait=True)


class RecordingCosts(StepCosts):
    """StepCosts that also keeps the kind each step was fitted as."""

    def __init__(self):
        super().__init__()
        self.kinds = []

    def add(self, rows, seconds, drafting=False):
        self.kinds.append(drafting)
        super().add(rows, seconds, drafting)


@pytest.mark.parametrize("yields_threads", [False, True])
async def test_steps_count_as_beside_a_drafter_only_where_the_loop_yields_it_threads(yields_threads):
    # On a GPU (no on_drafting) the steps with a drafter at work are the steps with draft rows: a
    # drafter term fitted from them would be those rows' cost again, charged to a lane drafting
    # among plain ones once per plain lane. Only a loop that gives its drafter a core fits one.
    engine = OutcomeEngine()
    costs = RecordingCosts()
    heard = []
    loop = EngineLoop("test-loop", BatchSettings(max_rounds=8, gather_s=0.5), step_costs=costs,
                      on_drafting=heard.append if yields_threads else None)
    loop.start(engine)
    try:
        a, b = loop.join(Session("a")), loop.join(Session("b"))
        engine.gate.clear()
        outcomes = [asyncio.create_task(round_of(a, [5, 6, 7])), asyncio.create_task(round_of(b))]
        await asyncio.sleep(0.05)
        engine.gate.set()
        await asyncio.gather(*outcomes)
        await asyncio.gather(round_of(a), round_of(b))
        assert costs.kinds == ([True, True] if yields_threads else [False, False])  # (a's drafter works on)
        assert heard == ([True] if yields_threads else [])
    finally:
        loop.shutdown(wait=True)


async def test_a_lane_the_step_waited_for_owes_the_ready_lanes_their_wait():
    engine = OutcomeEngine()
    loop = EngineLoop("test-loop", BatchSettings(max_rounds=8, gather_s=0.5), step_costs=KnownCosts())
    loop.start(engine)
    try:
        a, b, c = (loop.join(Session(n)) for n in "abc")
        await asyncio.gather(*(round_of(lane) for lane in (a, b, c)))
        # a and b come back at once; c (waiting, say, for its drafter's chain) 0.2 s later: the
        # step waited for it while two lanes were ready
        first = [asyncio.create_task(round_of(lane)) for lane in (a, b)]
        await asyncio.sleep(0.2)
        late = await round_of(c)
        ready_a, ready_b = await asyncio.gather(*first)
        assert engine.names()[1] == ["a", "b", "c"]
        assert ready_a.cost_to_others_s == ready_b.cost_to_others_s == 0.0
        assert 2 * 0.15 <= late.cost_to_others_s <= 2 * 0.5 + 0.2  # two lanes waited about 0.2 s each
        # each ready lane is refunded its wait, the late one nothing: the same lane-seconds
        assert late.cost_from_others_s == 0.0
        assert ready_a.cost_from_others_s == ready_b.cost_from_others_s == pytest.approx(late.cost_to_others_s / 2)
        again = await round_of(c)
        assert again.cost_to_others_s == 0.0  # charged once
        # (c alone now: the step waited the gather for a and b, which owe it that wait)
        assert 0.4 <= again.cost_from_others_s <= 0.5 + 0.2
    finally:
        loop.shutdown(wait=True)


def test_batch_settings_are_validated():
    with pytest.raises(ValueError, match="max_rounds"):
        BatchSettings(max_rounds=0, gather_s=0.0)
    with pytest.raises(ValueError, match="gather_s"):
        BatchSettings(max_rounds=1, gather_s=-1.0)
    with pytest.raises(ValueError, match="max_lead"):
        BatchSettings(max_rounds=1, gather_s=0.0, max_lead=0)


async def test_a_job_between_steps_is_refunded_to_every_lane_it_held_up():
    # another session's prefill chunk runs between two steps of a and b: each one's next round
    # is refunded its time (it is the same whether the round drafts or not), a lane that left
    # before it is not
    engine = OutcomeEngine()
    loop = EngineLoop("test-loop", BatchSettings(max_rounds=8, gather_s=0.5), step_costs=KnownCosts())
    loop.start(engine)
    try:
        a, b, gone = (loop.join(Session(n)) for n in ("a", "b", "gone"))
        await asyncio.gather(*(round_of(lane) for lane in (a, b, gone)))
        gone.leave()
        await loop.run(time.sleep, 0.1)  # (the job: 0.1 s on the loop's thread)
        after_a, after_b = await asyncio.gather(round_of(a, [5]), round_of(b))
        assert 0.1 <= after_a.cost_from_others_s < 0.1 + 0.05
        assert 0.1 + 0.002 * 1 <= after_b.cost_from_others_s < 0.1 + 0.002 + 0.05  # (and a's draft row)
        again = await asyncio.gather(round_of(a), round_of(b))
        assert [o.cost_from_others_s for o in again] == [0.0, 0.0]  # refunded once
    finally:
        loop.shutdown(wait=True)


async def test_the_loop_accounts_its_threads_time_by_what_it_did(make_loop, engine):
    # a job of 0.1 s counts as job time, a step held 0.1 s on the device as step time, a lane the
    # step waits for as gather time, and the loop idle in between as idle time — while it waits,
    # before the wait ends; the states sum to the loop's age
    born = time.perf_counter()
    loop = make_loop(gather_s=0.08)
    await loop.run(time.sleep, 0.1)
    a, b = loop.join(Session("a")), loop.join(Session("b"))
    engine.gate.clear()
    a.turn(RoundRequest(a.session, []))
    b.turn(RoundRequest(b.session, []))
    await asyncio.sleep(0.1)
    engine.gate.set()
    await asyncio.gather(a.outcome(), b.outcome())
    await round_of(a)  # (b does not come back: the step waits for it, bounded)
    await asyncio.sleep(0.1)
    spent = loop.time_spent()
    assert spent[LoopTime.JOB] >= 0.1
    assert spent[LoopTime.STEP] >= 0.1
    assert spent[LoopTime.GATHER] >= 0.07
    assert spent[LoopTime.IDLE] >= 0.1  # (the wait still in progress included)
    assert spent[LoopTime.OTHER] >= 0
    # (no second is counted twice: the states sum to at most the loop's age; lower bounds only,
    # so a slow machine cannot fail it)
    assert sum(spent.values()) <= time.perf_counter() - born

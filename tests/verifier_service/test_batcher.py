"""RoundBatcher: rounds submitted while the worker is busy run together; the last batch's
sessions are waited for (bounded); failures reach every caller of their batch."""

import asyncio
import threading

import pytest

from shared.worker import ModelWorker
from verifier_service.batcher import BatchSettings, RoundBatcher
from verifier_service.rounds import RoundRequest


class Session:
    def __init__(self, name: str) -> None:
        self.name = name


class FakeEngine:
    """run_rounds records each batch's sessions; `gate` holds the worker until released."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail_next = False

    def run_rounds(self, rounds: list[RoundRequest]):
        self.gate.wait(5)
        self.batches.append([r.session.name for r in rounds])
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("device fault")
        return [f"{r.session.name}:{len(self.batches)}" for r in rounds]


@pytest.fixture
def worker():
    w = ModelWorker("test-batcher")
    yield w
    w.shutdown()


def batcher_for(worker, engine, *, max_rounds=8, gather_s=0.5):
    return RoundBatcher(worker, engine.run_rounds, BatchSettings(max_rounds=max_rounds, gather_s=gather_s))


async def test_rounds_that_arrive_while_the_worker_is_busy_run_as_one_batch(worker):
    engine = FakeEngine()
    batcher = batcher_for(worker, engine)
    engine.gate.clear()
    first = asyncio.create_task(batcher.submit(RoundRequest(Session("a"), [])))
    await asyncio.sleep(0.05)  # "a" is on the worker, held at the gate
    others = [asyncio.create_task(batcher.submit(RoundRequest(Session(n), []))) for n in "bcd"]
    await asyncio.sleep(0.05)
    engine.gate.set()
    assert await first == "a:1"
    assert await asyncio.gather(*others) == ["b:2", "c:2", "d:2"]
    assert engine.batches == [["a"], ["b", "c", "d"]]
    await batcher.close()


async def test_the_next_batch_waits_for_the_last_ones_sessions_and_not_for_leavers(worker):
    engine = FakeEngine()
    batcher = batcher_for(worker, engine, gather_s=0.9)
    a, b, c = Session("a"), Session("b"), Session("c")
    await asyncio.gather(*(batcher.submit(RoundRequest(s, [])) for s in (a, b, c)))
    assert engine.batches == [["a", "b", "c"]]
    # "a" comes back at once, "b" a little later, "c" leaves: the next batch is a and b together,
    # formed as soon as b is back (well before gather_s).
    loop = asyncio.get_running_loop()
    started = loop.time()
    task_a = asyncio.create_task(batcher.submit(RoundRequest(a, [])))
    await asyncio.sleep(0.05)
    batcher.leave(c)
    await asyncio.sleep(0.05)
    task_b = asyncio.create_task(batcher.submit(RoundRequest(b, [])))
    await asyncio.gather(task_a, task_b)
    assert engine.batches[1] == ["a", "b"]
    assert loop.time() - started < 0.8  # b's arrival closed the gather, not the 0.9 s bound
    await batcher.close()


async def test_max_rounds_caps_a_batch(worker):
    engine = FakeEngine()
    batcher = batcher_for(worker, engine, max_rounds=2, gather_s=0.0)
    engine.gate.clear()
    tasks = [asyncio.create_task(batcher.submit(RoundRequest(Session(n), []))) for n in "abcde"]
    await asyncio.sleep(0.05)
    engine.gate.set()
    await asyncio.gather(*tasks)
    assert [len(b) for b in engine.batches] == [2, 2, 1]
    await batcher.close()


async def test_a_failed_batch_fails_its_callers_and_the_batcher_goes_on(worker):
    engine = FakeEngine()
    batcher = batcher_for(worker, engine, gather_s=0.0)
    engine.fail_next = True
    results = await asyncio.gather(*(batcher.submit(RoundRequest(Session(n), [])) for n in "ab"),
                                   return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results)
    assert await batcher.submit(RoundRequest(Session("c"), [])) == "c:2"
    await batcher.close()


async def test_a_cancelled_caller_drops_out_before_its_batch_runs(worker):
    engine = FakeEngine()
    batcher = batcher_for(worker, engine, gather_s=0.0)
    engine.gate.clear()
    first = asyncio.create_task(batcher.submit(RoundRequest(Session("a"), [])))
    await asyncio.sleep(0.05)
    doomed = asyncio.create_task(batcher.submit(RoundRequest(Session("b"), [])))
    kept = asyncio.create_task(batcher.submit(RoundRequest(Session("c"), [])))
    await asyncio.sleep(0.01)
    doomed.cancel()
    engine.gate.set()
    await first
    assert await kept == "c:2"
    assert engine.batches == [["a"], ["c"]]
    await batcher.close()


def test_batch_settings_are_validated():
    with pytest.raises(ValueError, match="max_rounds"):
        BatchSettings(max_rounds=0, gather_s=0.0)
    with pytest.raises(ValueError, match="gather_s"):
        BatchSettings(max_rounds=1, gather_s=-1.0)

"""The prefill batcher's plan and runner (verifier_service.prefill), with a stand-in engine."""

import asyncio

import pytest

from shared.worker import ModelWorker
from verifier_service.prefill import PrefillBatcher, plan_chunks


def test_plan_gives_the_budget_to_the_oldest_first_in_whole_chunks():
    assert plan_chunks([5, 30, 7], 16) == [5, 0, 7]  # 30's next chunk (16) does not fit in the 11 left
    assert plan_chunks([40, 3], 16) == [16, 0]
    assert plan_chunks([0, 3, 2], 16) == [0, 3, 2]
    assert plan_chunks([20, 16], 16) == [16, 0]
    with pytest.raises(ValueError, match="budget"):
        plan_chunks([1], 0)


class FakeSession:
    def __init__(self, prompt_len: int, fail: bool = False) -> None:
        self.left = prompt_len - 1
        self.fail = fail

    @property
    def prefill_left(self) -> int:
        return self.left


def run_prefill(chunks):
    if any(session.fail for session, _ in chunks):
        raise RuntimeError("device fault")
    for session, count in chunks:
        assert 0 < count <= session.left
        session.left -= count


@pytest.fixture
def worker():
    w = ModelWorker()
    yield w
    w.shutdown()


async def test_sessions_waiting_together_share_jobs_and_learn_their_job_count(worker):
    jobs = []
    batcher = PrefillBatcher(worker, run_prefill, 8, on_job=lambda n, t: jobs.append((n, t)))
    sessions = [FakeSession(n) for n in (4, 12, 1, 6)]  # 3, 11, 0, 5 tokens to prefill
    counts = await asyncio.gather(*(batcher.prefill(s) for s in sessions))
    assert all(s.prefill_left == 0 for s in sessions)
    # Oldest first under 8 tokens a job, whole chunks: [3, 5], [8 of 11], [3 of 11].
    assert jobs == [(2, 8), (1, 8), (1, 3)]
    assert counts == [1, 2, 0, 1]
    await batcher.close()


async def test_a_prompt_is_cut_at_the_same_positions_whatever_shares_its_jobs(worker):
    """A chunk's rows depend on the chunk's shape, so a request's KV (and output) would depend
    on the other prompts if they moved its cuts: they never do."""
    def cuts_of(target):
        cuts = []

        def record(chunks):
            for session, count in chunks:
                if session is target:
                    cuts.append((target.prompt_len - 1 - session.left, count))
            run_prefill(chunks)
        return cuts, record

    async def run(others):
        target = FakeSession(45)
        target.prompt_len = 45
        cuts, record = cuts_of(target)
        batcher = PrefillBatcher(worker, record, 16)
        await asyncio.gather(*(batcher.prefill(s) for s in [*others[:1], target, *others[1:]]))
        await batcher.close()
        return cuts

    alone = await run([])
    assert alone == [(0, 16), (16, 16), (32, 12)]
    for others in ([FakeSession(10)], [FakeSession(30), FakeSession(5)], [FakeSession(3), FakeSession(60)]):
        assert await run(others) == alone


async def test_a_failed_job_fails_its_sessions_only(worker):
    batcher = PrefillBatcher(worker, run_prefill, 4)
    good, bad, later = FakeSession(3), FakeSession(3, fail=True), FakeSession(9)
    results = await asyncio.gather(batcher.prefill(good), batcher.prefill(bad), batcher.prefill(later),
                                   return_exceptions=True)
    assert isinstance(results[0], RuntimeError) and isinstance(results[1], RuntimeError)  # shared the failed job
    assert results[2] == 2 and later.prefill_left == 0
    await batcher.close()


async def test_a_request_that_goes_away_is_dropped_before_its_next_chunk(worker):
    seen = []

    def slow_prefill(chunks):
        seen.append([id(s) for s, _ in chunks])
        run_prefill(chunks)

    batcher = PrefillBatcher(worker, slow_prefill, 2)
    leaving, staying = FakeSession(20), FakeSession(5)
    task = asyncio.create_task(batcher.prefill(leaving))
    await asyncio.sleep(0)  # its first job is planned
    task.cancel()
    assert await batcher.prefill(staying) >= 1
    assert staying.prefill_left == 0 and leaving.prefill_left > 0
    assert all(id(leaving) not in job for job in seen[1:])
    await batcher.close()

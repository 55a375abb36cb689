"""The drafter's MTP batcher: work submitted while a job runs forms the next job together;
a failing job reaches every caller in it; a cancelled caller's work never runs."""

import asyncio

import pytest

from drafter_service.batcher import MtpBatcher


class FakeJobs:
    def __init__(self):
        self.batches = []
        self.release = asyncio.Event()
        self.fail = False

    async def __call__(self, items):
        self.batches.append([session for session, _ in items])
        await self.release.wait()
        if self.fail:
            raise RuntimeError("the job failed")
        return [f"{session}:{plan}" for session, plan in items], 2.5


async def test_work_queued_while_a_job_runs_runs_together_next():
    jobs = FakeJobs()
    sizes = []
    batcher = MtpBatcher(jobs, on_batch=sizes.append)
    first = asyncio.create_task(batcher.submit("a", "p1"))
    await asyncio.sleep(0.01)  # a's job is running
    later = [asyncio.create_task(batcher.submit(name, None)) for name in "bcd"]
    await asyncio.sleep(0.01)
    jobs.release.set()
    assert await first == ("a:p1", 2.5)
    assert [await task for task in later] == [("b:None", 2.5), ("c:None", 2.5), ("d:None", 2.5)]
    assert jobs.batches == [["a"], ["b", "c", "d"]] and sizes == [1, 3]


async def test_a_failed_job_reaches_every_caller_and_a_cancelled_one_drops_out():
    jobs = FakeJobs()
    batcher = MtpBatcher(jobs)
    running = asyncio.create_task(batcher.submit("a", None))
    await asyncio.sleep(0.01)
    gone = asyncio.create_task(batcher.submit("b", None))
    waiting = asyncio.create_task(batcher.submit("c", None))
    await asyncio.sleep(0.01)
    gone.cancel()
    jobs.fail = True
    jobs.release.set()
    for task in (running, waiting):
        with pytest.raises(RuntimeError, match="the job failed"):
            await task
    assert jobs.batches == [["a"], ["c"]]  # b's work never ran
    await batcher.close()

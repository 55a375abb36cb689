"""Load shedding (issue 13): MTP drafts that could not be done within the verifier's wait are
not queued; the drafter answers at once with what costs no model work."""

import asyncio
import threading

import grpc
import pytest

from drafter_service.load import SHED_SHARE, WorkerLoad
from drafter_service.server import DrafterServer
from drafter_service.settings import DrafterSettings
from shared.protocol import common_pb2, drafter_pb2_grpc


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_only_what_is_left_of_the_running_job_counts():
    """The oldest pending job runs since it was submitted, or since the job before it ended."""
    clock = Clock()
    load = WorkerLoad(clock=clock)
    load.job_ms.update(mtp=100.0, settle=10.0)
    load.begin("mtp")
    clock.now = 0.060
    assert load.backlog_ms() == pytest.approx(40.0)  # 60 of its 100 ms are done
    load.begin("settle")
    assert load.backlog_ms() == pytest.approx(50.0)  # and a whole settle queued behind it
    clock.now = 0.150  # it overran: nothing left of it is counted, the queued job whole
    assert load.backlog_ms() == pytest.approx(10.0)
    load.end("mtp", 150.0)
    clock.now = 0.154  # the settle started when the mtp job ended, 4 ms ago
    assert load.backlog_ms() == pytest.approx(6.0)
    load.end("settle", 10.0)
    assert load.backlog_ms() == 0.0 and load.jobs == 0


def test_a_deadline_the_backlog_would_miss_sheds():
    load = WorkerLoad(clock=Clock())  # (time stands still: each pending job counts whole)
    assert not load.sheds(4, 0.0, 10.0)  # nothing measured, nothing queued
    load.begin("open")
    load.end("open", 500.0)  # a long open, done: it no longer weighs
    for _ in range(3):
        load.begin("settle")
    load.end("settle", 10.0)  # 2 jobs left at 10 ms each
    assert load.backlog_ms() == 20.0 and load.jobs == 2
    assert SHED_SHARE == 0.8  # done in 20 + 4 × 2 = 28 ms: sheds below a 35 ms wait
    assert load.sheds(4, 2.0, 34.0) and not load.sheds(4, 2.0, 36.0)  # (2 ms a draft)
    assert not load.sheds(4, 2.0, 0.0)  # the verifier did not say: never shed
    load.end("settle", None)  # a failed job leaves the mean as it was
    assert load.job_ms["settle"] == 10.0 and load.backlog_ms() == 10.0
    load.begin("open")  # a pending open weighs its own kind's time
    assert load.backlog_ms() == 510.0


@pytest.mark.parametrize("shedding", [True, False])
async def test_a_busy_worker_answers_at_once_without_mtp(tiny_mtp_model, shedding, open_up, commit_up):
    """planner mtp (always MTP): with the worker held by a long job, a commit that gives 50 ms
    gets an empty chain while that job still runs; one that gives no deadline waits for MTP.
    With --no-load-shedding both wait."""
    server = DrafterServer(DrafterSettings(port=0, planner="mtp", draft_ahead=False, load_shedding=shedding),
                           model=tiny_mtp_model)
    port = await server.start()
    await server.wait_loaded()
    service = server.service
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    release = threading.Event()
    try:
        call = drafter_pb2_grpc.DrafterStub(channel).Draft()
        await call.write(open_up(tiny_mtp_model, [1, 2, 3, 4], max_draft_tokens=2))
        assert (await call.read()).chain.source == common_pb2.DRAFT_SOURCE_MTP
        while service.worker_load.jobs:  # the open's deferred work, if any
            await asyncio.sleep(0.01)
        blocker = asyncio.create_task(service._run("block", release.wait, 10.0))  # a job that holds the worker
        while not service.worker_load.jobs:
            await asyncio.sleep(0.001)
        service.worker_load.job_ms["block"] = 1000.0  # as measured: such jobs take a second

        await call.write(commit_up(tiny_mtp_model, round_id=0, emitted=[7], wait_ms=50.0))
        if shedding:
            shed = (await asyncio.wait_for(call.read(), 5.0)).chain
            assert not blocker.done()  # answered while the worker was still busy
            assert shed.round_id == 1 and shed.source == common_pb2.DRAFT_SOURCE_NONE and not shed.token_ids
            assert service.metrics.shed._value.get() == 1
        else:
            pending = asyncio.ensure_future(call.read())
            await asyncio.sleep(0.2)
            assert not pending.done()  # queued behind the long job
            release.set()
            assert (await asyncio.wait_for(pending, 5.0)).chain.source == common_pb2.DRAFT_SOURCE_MTP
            await blocker
            release.clear()
            blocker = asyncio.create_task(service._run("block", release.wait, 10.0))
            while not service.worker_load.jobs:
                await asyncio.sleep(0.001)

        await call.write(commit_up(tiny_mtp_model, round_id=1, emitted=[8]))  # wait_ms 0: no deadline said
        pending = asyncio.ensure_future(call.read())
        await asyncio.sleep(0.2)
        assert not pending.done()  # queued behind the long job, as before
        release.set()
        drafted = (await asyncio.wait_for(pending, 5.0)).chain
        assert drafted.round_id == 2 and drafted.source == common_pb2.DRAFT_SOURCE_MTP and drafted.token_ids
        assert service.metrics.shed._value.get() == int(shedding)
        await call.done_writing()
        await blocker
    finally:
        release.set()
        await channel.close()
        await server.stop(0)

"""Admission: max_sessions run within the KV pool's blocks, max_queued wait in arrival order
(each at most the timeout), the rest are refused with the limit named; what a finished
request held passes straight to the waiters."""

import asyncio

import pytest

from verifier_service.admission import Admission, AdmissionLimits, AdmissionRefused


async def test_sessions_then_queue_then_refusal():
    admission = Admission(AdmissionLimits(max_sessions=2, max_queued=1, timeout_s=5.0))
    assert await admission.acquire() == 0.0 and await admission.acquire() == 0.0
    waiting = asyncio.create_task(admission.acquire())
    await asyncio.sleep(0.01)
    assert admission.queued == 1 and not waiting.done()
    with pytest.raises(AdmissionRefused, match="max_queued = 1"):
        await admission.acquire()
    admission.release()  # the session passes to the waiter, not to the free pool
    queued_s = await waiting
    assert queued_s > 0 and admission.active == 2 and admission.queued == 0
    admission.release()
    admission.release()
    assert admission.active == 0


async def test_waiters_are_served_in_arrival_order():
    admission = Admission(AdmissionLimits(max_sessions=1, max_queued=3, timeout_s=5.0))
    await admission.acquire()
    order = []

    async def wait(name):
        await admission.acquire()
        order.append(name)

    tasks = []
    for name in "abc":
        tasks.append(asyncio.create_task(wait(name)))
        await asyncio.sleep(0.01)
    for _ in range(3):
        admission.release()
        await asyncio.sleep(0.01)
    await asyncio.gather(*tasks)
    assert order == ["a", "b", "c"]


async def test_a_wait_that_runs_out_is_refused_and_leaves_the_queue():
    admission = Admission(AdmissionLimits(max_sessions=1, max_queued=2, timeout_s=0.05))
    await admission.acquire()
    with pytest.raises(AdmissionRefused, match="within 0.05 s"):
        await admission.acquire()
    assert admission.queued == 0
    admission.release()
    assert admission.active == 0


async def test_a_cancelled_waiter_gives_up_its_place_and_any_session_it_was_handed():
    admission = Admission(AdmissionLimits(max_sessions=1, max_queued=2, timeout_s=5.0))
    await admission.acquire()
    gone = asyncio.create_task(admission.acquire())
    await asyncio.sleep(0.01)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert admission.queued == 0
    # handed a session and cancelled before it ran: the session goes on to the next waiter
    first = asyncio.create_task(admission.acquire())
    second = asyncio.create_task(admission.acquire())
    await asyncio.sleep(0.01)
    admission.release()  # first is handed the session...
    first.cancel()  # ...but gives up before it resumes
    with pytest.raises(asyncio.CancelledError):
        await first
    await second
    assert admission.active == 1


async def test_kv_blocks_bound_what_runs_and_a_request_larger_than_the_pool_is_refused():
    admission = Admission(AdmissionLimits(max_sessions=4, max_queued=4, timeout_s=5.0, kv_blocks=10, kv_block_size=16))
    with pytest.raises(AdmissionRefused, match=r"needs 11 KV blocks \(176 positions.*kv_cache_tokens = 160"):
        await admission.acquire(11)
    assert await admission.acquire(6) == 0.0 and await admission.acquire(4) == 0.0
    assert admission.active == 2 and admission.blocks_held == 10
    waiting = asyncio.create_task(admission.acquire(3))  # sessions free, blocks not: it waits
    await asyncio.sleep(0.01)
    assert not waiting.done() and admission.queued == 1
    admission.release(4)  # 4 blocks back: the waiter takes 3 of them
    assert await waiting > 0 and admission.blocks_held == 9 and admission.active == 2
    admission.release(6)
    admission.release(3)
    assert admission.active == 0 and admission.blocks_held == 0


async def test_a_large_waiter_is_not_overtaken_and_its_leaving_lets_the_next_in():
    admission = Admission(AdmissionLimits(max_sessions=4, max_queued=4, timeout_s=5.0, kv_blocks=10))
    await admission.acquire(8)
    large = asyncio.create_task(admission.acquire(9))
    await asyncio.sleep(0.01)
    small = asyncio.create_task(admission.acquire(1))  # would fit now, but arrives behind the large one
    await asyncio.sleep(0.01)
    assert not small.done() and admission.queued == 2
    large.cancel()  # the head gives up: the small one fits and goes in
    with pytest.raises(asyncio.CancelledError):
        await large
    await asyncio.wait_for(small, 1.0)
    assert admission.blocks_held == 9 and admission.queued == 0


def test_limits_are_validated():
    with pytest.raises(ValueError, match="max_sessions"):
        AdmissionLimits(max_sessions=0, max_queued=0, timeout_s=1.0)
    with pytest.raises(ValueError, match="max_queued"):
        AdmissionLimits(max_sessions=1, max_queued=-1, timeout_s=1.0)
    with pytest.raises(ValueError, match="timeout"):
        AdmissionLimits(max_sessions=1, max_queued=0, timeout_s=0.0)
    with pytest.raises(ValueError, match="kv_blocks"):
        AdmissionLimits(max_sessions=1, max_queued=0, timeout_s=1.0, kv_blocks=-1)

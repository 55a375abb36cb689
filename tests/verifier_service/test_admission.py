"""Admission: max_sessions run, max_queued wait in arrival order (each at most the timeout),
the rest are refused with the limit named; sessions pass straight to waiters."""

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


def test_limits_are_validated():
    with pytest.raises(ValueError, match="max_sessions"):
        AdmissionLimits(max_sessions=0, max_queued=0, timeout_s=1.0)
    with pytest.raises(ValueError, match="max_queued"):
        AdmissionLimits(max_sessions=1, max_queued=-1, timeout_s=1.0)
    with pytest.raises(ValueError, match="timeout"):
        AdmissionLimits(max_sessions=1, max_queued=0, timeout_s=0.0)

"""Malformed or oversized messages to the drafter are refused with INVALID_ARGUMENT before any
work (issue 12, item 4), and leave it serving everyone else at full speed."""

import asyncio
import gc
import types

import grpc
import pytest
import torch

from drafter_service.server import DrafterServer, DrafterService
from drafter_service.settings import DrafterSettings
from shared.protocol import drafter_pb2_grpc

# the builders themselves, not their fixtures: the module-level BAD table below builds its messages with them
from .conftest import commit_up, open_up


@pytest.fixture
async def drafter(tiny_mtp_model):
    server = DrafterServer(DrafterSettings(port=0), model=tiny_mtp_model)
    port = await server.start()
    await server.wait_loaded()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield drafter_pb2_grpc.DrafterStub(channel)
    await channel.close()
    await server.stop(0)


async def exchange(stub, messages):
    """Send messages one by one, reading the reply to each; returns the replies."""
    call = stub.Draft()
    replies = []
    for message in messages:
        await call.write(message)
        replies.append(await call.read())
    await call.done_writing()
    return replies


BAD = {
    "token out of the vocabulary": (lambda m: [open_up(m, [1, 2, 500])], "open.token_ids[2] = 500"),
    "more tokens than the model takes": (lambda m: [open_up(m, [1] * 4_000_000, hidden=torch.zeros(1, 32))],
                                         "open.token_ids has 4000000 tokens"),
    "hidden rows of the wrong size": (lambda m: [open_up(m, [1, 2, 3], hidden=torch.zeros(2, 7))], "open.hidden is 2 x 7"),
    "a 1 MB session id": (lambda m: [open_up(m, [1, 2, 3], session_id="x" * 1_000_000)], "open.session_id has 1000000"),
    "accepted more than verified": (lambda m: [open_up(m, [1, 2, 3]),
                                               commit_up(m, emitted=[5] * 7, num_accepted=1_000_000, num_verified=1_000_000)],
                                    "commit.num_verified 1000000"),
    "emitted count off": (lambda m: [open_up(m, [1, 2, 3]), commit_up(m, emitted=[5, 6], num_accepted=0)],
                          "commit.emitted_token_ids has 2 tokens"),
    "wrong round": (lambda m: [open_up(m, [1, 2, 3]), commit_up(m, round_id=9)], "commit.round_id 9"),
    "a wait that is no duration": (lambda m: [open_up(m, [1, 2, 3]), commit_up(m, wait_ms=float("nan"))],
                                   "commit.wait_ms nan"),
    "a negative verify time": (lambda m: [open_up(m, [1, 2, 3]), commit_up(m, verify_ms=-1.0)],
                               "commit.verify_ms -1.0"),
    "a resume from the wrong round": (lambda m: [open_up(m, [1, 2, 3]), commit_up(m, round_id=5, emitted=[5] * 3, num_rounds=3)],
                                      "commit.rounds 3..5"),
    "a resume that verified drafts": (lambda m: [open_up(m, [1, 2, 3]),
                                                 commit_up(m, round_id=2, emitted=[5] * 3, num_rounds=3, num_verified=1)],
                                      "commit.num_rounds 3"),
    "a resume with fewer tokens than rounds": (lambda m: [open_up(m, [1, 2, 3]),
                                                          commit_up(m, round_id=3, emitted=[5, 6], num_rounds=4)],
                                               "commit.num_rounds 4"),
}


async def test_a_resume_commit_covers_the_rounds_the_drafter_missed(drafter, tiny_mtp_model):
    """The verifier decoded rounds 0-2 without the drafter: one commit brings every token."""
    replies = await exchange(drafter, [open_up(tiny_mtp_model, [1, 2, 3]),
                                       commit_up(tiny_mtp_model, round_id=2, emitted=[5, 6, 7, 8], num_rounds=3),
                                       commit_up(tiny_mtp_model, round_id=3, emitted=[9])])
    assert [(r.chain.round_id, r.chain.base_length) for r in replies] == [(0, 3), (3, 7), (4, 8)]


@pytest.mark.parametrize("case", sorted(BAD))
async def test_bad_messages_are_invalid_argument_and_cost_nothing(drafter, tiny_mtp_model, case, worker_jobs):
    """Refused before any model work: the bad message (the last one sent) runs no job on the
    model worker."""
    make, fragment = BAD[case]
    messages = make(tiny_mtp_model)
    await exchange(drafter, messages[:-1])  # the good messages alone (no commit among them: nothing learned)
    good_jobs, worker_jobs[:] = list(worker_jobs), []
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await exchange(drafter, messages)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in error.value.details()
    # the jobs of the good messages before it, none for it (nor what a commit leaves for after
    # its chain went out)
    assert worker_jobs == good_jobs
    # and the drafter serves a good session as before
    replies = await exchange(drafter, [open_up(tiny_mtp_model, [1, 2, 3, 4]), commit_up(tiny_mtp_model)])
    assert all(r.HasField("chain") for r in replies) and replies[1].chain.round_id == 1


async def test_another_stream_cannot_take_over_a_session(drafter, tiny_mtp_model):
    """The hijack of issue 12 (item 5): re-opening the victim's session id from another stream
    used to replace the victim's session, so its commits failed. Now each stream keeps its own."""
    victim = drafter.Draft()
    await victim.write(open_up(tiny_mtp_model, [1, 2, 3, 4], session_id="victim"))
    assert (await victim.read()).HasField("chain")
    for _ in range(5):  # the intruder opens the same id, again and again
        await exchange(drafter, [open_up(tiny_mtp_model, [9, 9, 9], session_id="victim")])
    for round_id in range(3):
        await victim.write(commit_up(tiny_mtp_model, round_id=round_id))
        reply = await victim.read()
        assert reply.HasField("chain") and reply.chain.round_id == round_id + 1
    await victim.done_writing()


def test_peer_host_drops_the_port():
    from drafter_service.server import peer_host

    assert peer_host("ipv4:10.0.0.5:43210") == "ipv4:10.0.0.5"
    assert peer_host("ipv6:[::1]:5000") == "ipv6:[::1]"
    assert peer_host("unix:/tmp/socket") == "unix:/tmp/socket"


async def test_streams_per_peer_are_capped(tiny_mtp_model):
    server = DrafterServer(DrafterSettings(port=0, max_streams_per_peer=2), model=tiny_mtp_model)
    port = await server.start()
    await server.wait_loaded()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = drafter_pb2_grpc.DrafterStub(channel)
    try:
        held = []
        for i in range(2):
            call = stub.Draft()
            await call.write(open_up(tiny_mtp_model, [1, 2, 3], session_id=f"s{i}"))
            assert (await call.read()).HasField("chain")
            held.append(call)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await exchange(stub, [open_up(tiny_mtp_model, [1, 2, 3], session_id="third")])
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_streams_per_peer" in error.value.details()
        await held[0].done_writing()
        while await held[0].read() is not grpc.aio.EOF:  # the stream ends: its slot is freed
            pass
        replies = await exchange(stub, [open_up(tiny_mtp_model, [1, 2, 3], session_id="again")])  # a slot is free again
        assert replies[0].HasField("chain")
    finally:
        await channel.close()
        await server.stop(0)


async def test_callers_with_the_token_are_not_capped_by_address(tiny_mtp_model):
    """A verifier holding the drafter's token may hold more streams than max_streams_per_peer
    from one address (its sessions), so a neighbour on that address cannot starve it."""
    from shared import security

    server = DrafterServer(DrafterSettings(port=0, max_streams_per_peer=2, auth_token="secret"), model=tiny_mtp_model)
    port = await server.start()
    await server.wait_loaded()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = drafter_pb2_grpc.DrafterStub(channel)
    try:
        held = []
        for i in range(4):
            call = stub.Draft(metadata=security.bearer_metadata("secret"))
            await call.write(open_up(tiny_mtp_model, [1, 2, 3], session_id=f"s{i}"))
            assert (await call.read()).HasField("chain")
            held.append(call)
        for call in held:
            call.cancel()
    finally:
        await channel.close()
        await server.stop(0)


async def test_an_open_drafter_beyond_loopback_says_so_at_start(tiny_mtp_model):
    from structlog.testing import capture_logs

    for host, auth, warned in (("0.0.0.0", {}, True), ("127.0.0.1", {}, False), ("0.0.0.0", {"auth_token": "t"}, False)):
        with capture_logs() as logs:
            DrafterServer(DrafterSettings(host=host, port=0, **auth), model=tiny_mtp_model).preflight()
        assert any("accepts any client" in entry["event"] for entry in logs) == warned, (host, auth)


async def test_a_stopping_drafter_serves_its_open_streams_and_says_not_serving(tiny_mtp_model):
    """SIGTERM's drain: while a Draft stream is open the port stays open, health says
    NOT_SERVING and new streams get UNAVAILABLE; the open stream still gets its chains; the
    server stops once it ends (well before the grace period)."""
    import time

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    server = DrafterServer(DrafterSettings(port=0), model=tiny_mtp_model)
    port = await server.start()
    await server.wait_loaded()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = drafter_pb2_grpc.DrafterStub(channel)
    try:
        held = stub.Draft()
        await held.write(open_up(tiny_mtp_model, [1, 2, 3], session_id="held"))
        assert (await held.read()).HasField("chain")
        started = time.monotonic()
        stopping = asyncio.create_task(server.stop(30.0))
        await asyncio.sleep(0.2)
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service="tandem.v1.Drafter"))
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await exchange(stub, [open_up(tiny_mtp_model, [1, 2, 3], session_id="late")])
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.value.details()
        assert not stopping.done()
        await held.done_writing()
        while await held.read() is not grpc.aio.EOF:
            pass
        await asyncio.wait_for(stopping, 10)
        assert time.monotonic() - started < 10
    finally:
        await channel.close()


async def test_concurrent_opens_count_each_eviction_once(tiny_mtp_model):
    """300 concurrent opens once counted 990 evictions for 44 real ones (issue 15): each
    handler took a before/after difference of the store's counter across its await."""
    server = DrafterServer(DrafterSettings(port=0, max_sessions=2), model=tiny_mtp_model)
    port = await server.start()
    await server.wait_loaded()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = drafter_pb2_grpc.DrafterStub(channel)
    calls = [stub.Draft() for _ in range(12)]
    try:
        await asyncio.gather(*(call.write(open_up(tiny_mtp_model, [1, 2, 3], session_id=f"s{i}"))
                               for i, call in enumerate(calls)))
        replies = await asyncio.gather(*(call.read() for call in calls))
        assert all(reply.HasField("chain") for reply in replies)
        counted = server.metrics_registry.get_sample_value("tandem_drafter_session_evictions_total")
        assert server.service.sessions.evictions == 10  # 12 sessions held by a store of 2
        assert counted == 10
    finally:
        for call in calls:
            call.cancel()
        await channel.close()
        await server.stop(0)


def frames_of(function) -> list:
    """Live frames (garbage not yet collected included) running `function`'s code."""
    return [o for o in gc.get_objects() if type(o) is types.FrameType and o.f_code is function.__code__]


async def test_a_refused_message_is_not_kept_alive_by_the_abort(drafter, tiny_mtp_model):
    """After an abort the handler's frame lives on until Python's next full garbage
    collection (its traceback sits in a reference cycle). It once held the refused message
    there, so a flood of 4M-token opens grew the drafter by gigabytes (bench/flood.py)."""
    gc.collect()
    gc.disable()  # a full collection would hide what the frames hold
    try:
        for _ in range(3):
            with pytest.raises(grpc.aio.AioRpcError):
                await exchange(drafter, [open_up(tiny_mtp_model, [1, 2, 500])])
        frames = frames_of(DrafterService.Draft)
        assert frames  # the frames do outlive the call: the test sees what it should
        assert all("up" not in frame.f_locals for frame in frames)
    finally:
        gc.enable()

"""Front processes (shared/front.py) before a service of their own: a LocalStreamServer whose
handler streams, aborts or breaks off; what a gRPC client of the front sees, and the front's
life tied to its service's control pipe."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile

import grpc
import pytest

from shared.front import FrontConfig, FrontError, Fronts
from shared.local_stream import LocalStreamServer
from shared.protocol import verifier_pb2
from shared.service import MAX_MESSAGE_BYTES

SERVICE, METHOD = "tandem.v1.Verifier", "Generate"


class Scripted:
    """Generate's stand-in: the request's max_new_tokens picks what happens (events, an abort, a
    stream cut without a status)."""

    async def handle(self, requests, context):
        request = await requests.read()
        if request.max_new_tokens == 99:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "scripted refusal naming max_new_tokens")
        for index in range(request.max_new_tokens):
            yield verifier_pb2.GenerateEvent(token_ids=[index])
        if request.max_new_tokens == 7:
            raise ConnectionError  # (the stream ends without its status)


@pytest.fixture
async def service():
    folder = tempfile.mkdtemp(prefix="tandem-test-")
    server = LocalStreamServer(f"{folder}/s.sock", Scripted().handle, verifier_pb2.GenerateRequest,
                               limit=MAX_MESSAGE_BYTES)
    await server.start()
    yield server
    await server.close()
    shutil.rmtree(folder, ignore_errors=True)


def config(path: str, **overrides) -> FrontConfig:
    return FrontConfig(**{"address": "127.0.0.1:0", "service_name": SERVICE, "method": METHOD, "socket": path,
                          "message_limit": MAX_MESSAGE_BYTES, **overrides})


async def call(port: int, max_new_tokens: int) -> list[int]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        generate = channel.unary_stream(f"/{SERVICE}/{METHOD}", request_serializer=verifier_pb2.GenerateRequest.SerializeToString,
                                        response_deserializer=verifier_pb2.GenerateEvent.FromString)
        return [event.token_ids[0] async for event in generate(verifier_pb2.GenerateRequest(max_new_tokens=max_new_tokens))]


@pytest.fixture
async def started():
    """Start Fronts for a config (the port); every one stopped at the test's end."""
    running: list[Fronts] = []

    async def start(front_config: FrontConfig) -> int:
        running.append(Fronts(1, front_config))
        return await running[-1].start()

    yield start
    for fronts in running:
        await fronts.stop(0)


async def test_events_and_statuses_relayed(service, started):
    port = await started(config(service.path))
    assert await call(port, 5) == [0, 1, 2, 3, 4]
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call(port, 99)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert refused.value.details() == "scripted refusal naming max_new_tokens"
    with pytest.raises(grpc.aio.AioRpcError) as cut:
        await call(port, 7)
    assert cut.value.code() == grpc.StatusCode.UNAVAILABLE and "without a status" in cut.value.details()


async def test_no_service_behind_the_socket_is_unavailable(service, started):
    missing = service.path + ".missing"
    port = await started(config(missing))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call(port, 3)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and f"cannot connect to {missing}" in refused.value.details()


async def test_a_front_ends_with_its_control_pipe(service):
    fronts = Fronts(1, config(service.path))
    await fronts.start()
    (pid,) = fronts.pids
    process = fronts._processes[0]
    for watcher in fronts._watchers:  # (not started again: this is the service gone)
        watcher.cancel()
    process.stdin.close()
    assert await asyncio.wait_for(process.wait(), 10) == 0
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    await fronts.stop(0)


async def test_a_bad_address_is_a_front_error(service):
    fronts = Fronts(1, config(service.path, address="256.1.1.1:1"))
    with pytest.raises(FrontError, match="256.1.1.1"):
        await fronts.start()
    assert fronts.pids == []


def test_a_count_below_one_is_refused():
    with pytest.raises(ValueError, match="front processes"):
        Fronts(0, config("/tmp/x.sock"))

"""The verifier's port served by front processes (`--front-processes`, shared/front.py), driven
through what a user calls (AsyncVerifierClient, health checks, reflection) on a real port: the
same tokens, events and refusals as the verifier's own; health as the verifier says, through its
drain; the token checked; a client's deadline frees its session; a front that dies is replaced."""

from __future__ import annotations

import asyncio
import os
import signal
import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from shared.client import AsyncVerifierClient, GenerationConfig, VerifierError
from shared.security import channel_credentials, make_test_pki
from shared.service import StartupError
from verifier_service.server import VerifierServer
from verifier_service.settings import VerifierSettings

from .conftest import wait_idle

PROMPT = [5, 17, 3, 42, 8]
SERVICE = "tandem.v1.Verifier"


def target(servers) -> str:
    return f"127.0.0.1:{servers.verifier.port}"


async def health_status(address: str, service: str = SERVICE) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return reply.status


async def until_health(address: str, status: int, timeout_s: float = 10.0) -> None:
    """The front hears the verifier's health over its control pipe: a moment after the verifier."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while await health_status(address) != status:
        assert asyncio.get_running_loop().time() < deadline, f"health never became {status}"
        await asyncio.sleep(0.02)


async def test_same_generation_as_the_verifiers_own(servers, tiny_model, socket_path):
    await servers.start(tiny_model, local_socket=socket_path, front_processes=1)
    assert servers.verifier.fronts.pids and os.getpid() not in servers.verifier.fronts.pids
    configs = [GenerationConfig(max_new_tokens=24, temperature=0.0),
               GenerationConfig(max_new_tokens=24, temperature=0.9, top_p=0.9, seed=11)]
    async with AsyncVerifierClient(target(servers)) as fronted, \
            AsyncVerifierClient(target(servers), local_socket=socket_path) as local:
        for config in configs:
            through_front = await fronted.generate(PROMPT, config)
            direct = await local.generate(PROMPT, config)
            assert through_front.token_ids == direct.token_ids
            assert len(through_front.token_ids) == 24
            assert through_front.finish_reason == direct.finish_reason == "length"
            assert sum(r["num_rounds"] for r in through_front.rounds) == 24
        assert fronted.local_socket is None  # (a front names no socket: its callers stay on it)
    await wait_idle(servers.verifier)


async def test_refusals_pass_through_with_their_codes(servers, tiny_model):
    await servers.start(tiny_model, front_processes=1, max_new_tokens_limit=32)
    async with AsyncVerifierClient(target(servers)) as client:
        with pytest.raises(VerifierError) as refused:
            await client.generate(PROMPT, GenerationConfig(max_new_tokens=64))
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_new_tokens" in refused.value.message
    # bytes that are no GenerateRequest: refused by the verifier's parser, not the front's
    async with grpc.aio.insecure_channel(target(servers)) as channel:
        call = channel.unary_stream(f"/{SERVICE}/Generate")(b"\xff\xff\xff")
        with pytest.raises(grpc.aio.AioRpcError) as malformed:
            async for _ in call:
                pass
    assert malformed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed GenerateRequest" in malformed.value.details()


async def test_health_and_reflection_through_the_drain(servers, tiny_model):
    await servers.start(tiny_model, front_processes=1)
    address = target(servers)
    await until_health(address, health_pb2.HealthCheckResponse.SERVING)
    assert await health_status(address, "") == health_pb2.HealthCheckResponse.SERVING
    async with grpc.aio.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = [service.name async for reply in replies for service in reply.list_services_response.service]
    assert SERVICE in names
    # a request in flight while the verifier drains: it finishes; health turns NOT_SERVING and
    # new requests are refused UNAVAILABLE, through the front; then the front is gone
    verifier = servers.verifier
    pids = list(verifier.fronts.pids)
    async with AsyncVerifierClient(address) as client:
        running = asyncio.create_task(client.generate(PROMPT, GenerationConfig(max_new_tokens=120)))
        while not verifier.service.active:
            await asyncio.sleep(0.005)
        stopping = asyncio.create_task(verifier.stop(30.0))
        await until_health(address, health_pb2.HealthCheckResponse.NOT_SERVING)
        with pytest.raises(VerifierError) as refused:
            await client.generate(PROMPT, GenerationConfig(max_new_tokens=4))
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.value.message
        assert len((await running).token_ids) == 120
    await stopping
    servers.verifier = None
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


async def test_token_checked_at_the_front(servers, tiny_model):
    await servers.start(tiny_model, front_processes=1, auth_token="s3cret")
    config = GenerationConfig(max_new_tokens=4)
    for token in (None, "wrong"):
        async with AsyncVerifierClient(target(servers), token=token) as client:
            with pytest.raises(VerifierError) as refused:
                await client.generate(PROMPT, config)
        assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
    async with AsyncVerifierClient(target(servers), token="s3cret") as known:
        assert len((await known.generate(PROMPT, config)).token_ids) == 4


async def test_tls_at_the_front(servers, tiny_model, tmp_path):
    pki = make_test_pki(tmp_path)
    await servers.start(tiny_model, front_processes=1, tls_cert=str(pki["server_cert"]), tls_key=str(pki["server_key"]))
    address = f"localhost:{servers.verifier.port}"
    async with AsyncVerifierClient(address, credentials=channel_credentials(str(pki["ca"]))) as client:
        assert len((await client.generate(PROMPT, GenerationConfig(max_new_tokens=4))).token_ids) == 4
    async with AsyncVerifierClient(address, timeout=5) as plaintext:  # (to a TLS port)
        with pytest.raises(VerifierError) as refused:
            await plaintext.generate(PROMPT, GenerationConfig(max_new_tokens=4))
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE


async def test_deadline_frees_the_session(servers, tiny_model):
    await servers.start(tiny_model, front_processes=1)
    async with AsyncVerifierClient(target(servers), timeout=0.02) as hurried:
        with pytest.raises(VerifierError) as late:
            await hurried.generate(PROMPT, GenerationConfig(max_new_tokens=200))
    assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    await wait_idle(servers.verifier)
    async with AsyncVerifierClient(target(servers)) as client:
        assert len((await client.generate(PROMPT, GenerationConfig(max_new_tokens=3))).token_ids) == 3


async def test_a_front_that_dies_is_replaced_on_the_same_port(servers, tiny_model):
    await servers.start(tiny_model, front_processes=1)
    fronts = servers.verifier.fronts
    (first,) = fronts.pids
    os.kill(first, signal.SIGKILL)
    deadline = asyncio.get_running_loop().time() + 30
    while fronts.restarts == 0 or fronts.pids == [first] or not fronts.pids:
        assert asyncio.get_running_loop().time() < deadline, "the front was not started again"
        await asyncio.sleep(0.05)
    await until_health(target(servers), health_pb2.HealthCheckResponse.SERVING)
    async with AsyncVerifierClient(target(servers)) as client:
        assert len((await client.generate(PROMPT, GenerationConfig(max_new_tokens=5))).token_ids) == 5


async def test_two_fronts_share_the_port(servers, tiny_model):
    await servers.start(tiny_model, front_processes=2)
    assert len(set(servers.verifier.fronts.pids)) == 2
    async with AsyncVerifierClient(target(servers)) as client:
        replies = await asyncio.gather(*(client.generate(PROMPT, GenerationConfig(max_new_tokens=6)) for _ in range(4)))
    assert all(len(reply.token_ids) == 6 for reply in replies)


async def test_a_busy_port_fails_the_start(tiny_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = VerifierServer(VerifierSettings(port=taken.getsockname()[1], front_processes=1), model=tiny_model)
        with pytest.raises(StartupError, match="port"):
            await server.start()
    assert server.fronts.pids == []
    assert not os.path.exists(server.local.path)


def test_settings_refuse_a_negative_count():
    with pytest.raises(ValueError, match="front_processes"):
        VerifierSettings(front_processes=-1)

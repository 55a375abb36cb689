"""Generate on the verifier's local socket (`--local-socket`), driven through the client a user
calls (`AsyncVerifierClient(..., local_socket=...)`): the same tokens, events and status codes as
over gRPC; the token checked; a client's deadline or departure frees its session."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import grpc
import pytest

from shared.client import AsyncVerifierClient, GenerationConfig, VerifierError
from shared.local_stream import END, HEADER, MESSAGE, METADATA, STATUS, frame
from shared.service import StartupError
from verifier_service.server import VerifierServer
from verifier_service.settings import VerifierSettings

from .conftest import wait_idle

PROMPT = [5, 17, 3, 42, 8]


def target(servers) -> str:
    return f"127.0.0.1:{servers.verifier.port}"


async def test_same_generation_as_over_grpc(servers, tiny_model, socket_path):
    await servers.start(tiny_model, local_socket=socket_path)
    configs = [GenerationConfig(max_new_tokens=24, temperature=0.0),
               GenerationConfig(max_new_tokens=24, temperature=0.9, top_p=0.9, seed=11)]
    async with AsyncVerifierClient(target(servers), discover_local=False) as remote, \
            AsyncVerifierClient(target(servers), local_socket=socket_path) as local:
        for config in configs:
            over_grpc = await remote.generate(PROMPT, config)
            over_socket = await local.generate(PROMPT, config)
            assert over_socket.token_ids == over_grpc.token_ids
            assert len(over_socket.token_ids) == 24
            assert over_socket.finish_reason == over_grpc.finish_reason == "length"
            # (events merge plain rounds that were ready together: their count is timing's, the rounds' not)
            assert sum(r["num_rounds"] for r in over_socket.rounds) == sum(r["num_rounds"] for r in over_grpc.rounds) == 24
    await wait_idle(servers.verifier)


async def test_refusals_carry_grpc_codes_and_messages(servers, tiny_model, socket_path):
    await servers.start(tiny_model, local_socket=socket_path, max_new_tokens_limit=32)
    config = GenerationConfig(max_new_tokens=64)
    async with AsyncVerifierClient(target(servers), discover_local=False) as remote, \
            AsyncVerifierClient(target(servers), local_socket=socket_path) as local:
        errors = []
        for client in (remote, local):
            with pytest.raises(VerifierError) as refused:
                await client.generate(PROMPT, config)
            errors.append(refused.value)
    assert errors[1].code == errors[0].code == grpc.StatusCode.INVALID_ARGUMENT
    assert errors[1].message == errors[0].message
    assert "max_new_tokens" in errors[1].message


async def raw_stream(path: str, frames: list[bytes]) -> tuple[int, bytes]:
    """Send raw frames on a fresh connection; the first frame back (kind, payload)."""
    reader, writer = await asyncio.open_unix_connection(path)
    try:
        writer.write(b"".join(frames))
        await writer.drain()
        length, kind = HEADER.unpack(await reader.readexactly(HEADER.size))
        return kind, await reader.readexactly(length)
    finally:
        writer.close()


async def test_malformed_and_missing_requests_are_invalid_argument(servers, tiny_model, socket_path):
    await servers.start(tiny_model, local_socket=socket_path)
    kind, payload = await raw_stream(socket_path, [frame(METADATA, b"[]"), frame(MESSAGE, b"\xff\xff\xff"), frame(END, b"")])
    assert kind == STATUS and b"INVALID_ARGUMENT" in payload and b"malformed GenerateRequest" in payload
    kind, payload = await raw_stream(socket_path, [frame(METADATA, b"[]"), frame(END, b"")])
    assert kind == STATUS and b"INVALID_ARGUMENT" in payload and b"no GenerateRequest" in payload
    # the service is unharmed
    async with AsyncVerifierClient(target(servers), local_socket=socket_path) as local:
        assert len((await local.generate(PROMPT, GenerationConfig(max_new_tokens=4))).token_ids) == 4


async def test_token_checked_on_the_socket(servers, tiny_model, socket_path):
    await servers.start(tiny_model, local_socket=socket_path, auth_token="s3cret")
    config = GenerationConfig(max_new_tokens=4)
    async with AsyncVerifierClient(target(servers), local_socket=socket_path) as anonymous:
        with pytest.raises(VerifierError) as refused:
            await anonymous.generate(PROMPT, config)
    assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
    async with AsyncVerifierClient(target(servers), local_socket=socket_path, token="wrong") as wrong:
        with pytest.raises(VerifierError) as refused:
            await wrong.generate(PROMPT, config)
    assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
    async with AsyncVerifierClient(target(servers), local_socket=socket_path, token="s3cret") as known:
        assert len((await known.generate(PROMPT, config)).token_ids) == 4


async def test_deadline_and_departure_free_the_session(servers, tiny_model, socket_path):
    await servers.start(tiny_model, local_socket=socket_path)
    long = GenerationConfig(max_new_tokens=200)
    async with AsyncVerifierClient(target(servers), local_socket=socket_path, timeout=0.02) as hurried:
        with pytest.raises(VerifierError) as late:
            await hurried.generate(PROMPT, long)
    assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    await wait_idle(servers.verifier)
    async with AsyncVerifierClient(target(servers), local_socket=socket_path) as local:
        async with contextlib.aclosing(local.stream(PROMPT, long)) as events:
            async for event in events:
                if event.token_ids:
                    break  # the client leaves after its first tokens
        await wait_idle(servers.verifier)
        # the service goes on serving
        assert len((await local.generate(PROMPT, GenerationConfig(max_new_tokens=3))).token_ids) == 3


async def test_a_path_that_is_not_a_socket_fails_the_start(tiny_model, socket_path):
    Path(socket_path).write_text("not a socket")
    server = VerifierServer(VerifierSettings(port=0, local_socket=socket_path), model=tiny_model)
    with pytest.raises(StartupError, match="local_socket"):
        await server.start()


def test_settings_refuse_an_empty_path():
    with pytest.raises(ValueError, match="local_socket"):
        VerifierSettings(local_socket="")
    with pytest.raises(ValueError, match="local_socket"):
        AsyncVerifierClient("127.0.0.1:1", local_socket="")

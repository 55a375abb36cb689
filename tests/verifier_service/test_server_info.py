"""A verifier names its local socket to gRPC callers on its host (GetServerInfo, DESIGN §9), and
tandem's client streams Generate over it by default: the same tokens as over gRPC; no offer
under TLS, with --no-offer-local-socket, or to a target naming no single loopback address; a
socket gone falls back to gRPC and is asked for again."""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest

from shared.client import AsyncVerifierClient, GenerationConfig, VerifierError
from shared.protocol import verifier_pb2, verifier_pb2_grpc
from shared.security import channel_credentials, make_test_pki
from verifier_service.server import VerifierServer
from verifier_service.settings import VerifierSettings

from .conftest import wait_idle

PROMPT = [5, 17, 3, 42, 8]
GREEDY = GenerationConfig(max_new_tokens=12, temperature=0.0)
SAMPLED = GenerationConfig(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=5)


def target(servers) -> str:
    return f"127.0.0.1:{servers.verifier.port}"


async def test_a_client_on_this_host_streams_over_the_offered_socket(servers, tiny_model):
    stub = await servers.start(tiny_model)
    local = servers.verifier.local
    offered = (await stub.GetServerInfo(verifier_pb2.GetServerInfoRequest())).local_socket
    assert offered == local.path and os.path.exists(offered)
    assert oct(os.stat(os.path.dirname(offered)).st_mode & 0o777) == oct(0o700)  # (its directory owner-only)
    async with AsyncVerifierClient(target(servers), discover_local=False) as remote, \
            AsyncVerifierClient(target(servers)) as client:
        for config in (GREEDY, SAMPLED):
            served = local.served
            over_grpc = await remote.generate(PROMPT, config)
            assert local.served == served
            discovered = await client.generate(PROMPT, config)
            assert local.served == served + 1  # (this call, on the socket)
            assert client.local_socket == offered
            assert discovered.token_ids == over_grpc.token_ids and len(discovered.token_ids) == 12
    await wait_idle(servers.verifier)
    await servers.verifier.stop(0)
    assert not os.path.exists(os.path.dirname(offered))  # (the private directory removed at stop)
    servers.verifier = None


async def test_concurrent_first_calls_all_take_the_socket(servers, tiny_model):
    await servers.start(tiny_model)
    async with AsyncVerifierClient(target(servers)) as client:
        results = await asyncio.gather(*(client.generate(PROMPT, GREEDY) for _ in range(4)))
    assert servers.verifier.local.served == 4
    assert len({tuple(r.token_ids) for r in results}) == 1


async def test_no_offer_keeps_callers_on_grpc(servers, tiny_model):
    stub = await servers.start(tiny_model, offer_local_socket=False)
    assert servers.verifier.local is None  # (no socket at all)
    assert (await stub.GetServerInfo(verifier_pb2.GetServerInfoRequest())).local_socket == ""
    async with AsyncVerifierClient(target(servers)) as client:
        assert len((await client.generate(PROMPT, GREEDY)).token_ids) == 12
        assert client.local_socket is None


async def test_an_explicit_local_socket_is_the_one_offered(servers, tiny_model, socket_path):
    stub = await servers.start(tiny_model, local_socket=socket_path)
    assert (await stub.GetServerInfo(verifier_pb2.GetServerInfoRequest())).local_socket == socket_path
    async with AsyncVerifierClient(target(servers)) as client:
        await client.generate(PROMPT, GREEDY)
        assert client.local_socket == socket_path and servers.verifier.local.served == 1


async def test_a_target_naming_no_single_loopback_address_stays_on_grpc(servers, tiny_model):
    await servers.start(tiny_model)
    for address in (f"ipv4:127.0.0.1:{servers.verifier.port}", f"ipv4:127.0.0.1:{servers.verifier.port},127.0.0.2:1"):
        async with AsyncVerifierClient(address) as client:
            assert len((await client.generate(PROMPT, GREEDY)).token_ids) == 12
            assert client.local_socket is None
    assert servers.verifier.local.served == 0


async def test_a_socket_gone_falls_back_to_grpc_and_is_asked_for_again(servers, tiny_model):
    await servers.start(tiny_model)
    local = servers.verifier.local
    async with AsyncVerifierClient(target(servers), timeout=30) as client:
        first = await client.generate(PROMPT, GREEDY)
        assert local.served == 1
        await local.close()  # (as a verifier restarted elsewhere would leave a dead path behind)
        again = await client.generate(PROMPT, GREEDY)  # over gRPC, the path forgotten
        assert again.token_ids == first.token_ids and client.local_socket is None
        await local.start()
        await client.generate(PROMPT, GREEDY)  # asked again: the socket answers
        assert client.local_socket == local.path and local.served == 2


async def test_the_token_is_required_on_the_offered_socket_too(servers, tiny_model):
    await servers.start(tiny_model, auth_token="s3cret")
    async with AsyncVerifierClient(target(servers), token="s3cret") as known:
        assert len((await known.generate(PROMPT, GREEDY)).token_ids) == 12
        assert known.local_socket == servers.verifier.local.path
    async with AsyncVerifierClient(target(servers)) as anonymous:
        with pytest.raises(VerifierError) as refused:
            await anonymous.generate(PROMPT, GREEDY)
    assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED and anonymous.local_socket is not None


async def test_a_tls_verifier_offers_no_socket(servers, tiny_model, tmp_path):
    pki = make_test_pki(tmp_path)
    await servers.start(tiny_model, tls_cert=str(pki["server_cert"]), tls_key=str(pki["server_key"]))
    credentials = channel_credentials(str(pki["ca"]))
    async with grpc.aio.secure_channel(f"localhost:{servers.verifier.port}", credentials) as channel:
        info = await verifier_pb2_grpc.VerifierStub(channel).GetServerInfo(verifier_pb2.GetServerInfoRequest())
    assert info.local_socket == "" and servers.verifier.local is None  # (nobody would be told of one)
    async with AsyncVerifierClient(f"localhost:{servers.verifier.port}", credentials=credentials) as client:
        assert len((await client.generate(PROMPT, GREEDY)).token_ids) == 12
        assert client.local_socket is None


async def test_a_server_never_started_leaves_no_directory(tiny_model):
    server = VerifierServer(VerifierSettings(port=0), model=tiny_model)
    assert server.local is not None and not os.path.exists(os.path.dirname(server.local.path))

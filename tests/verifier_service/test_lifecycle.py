"""Health, reflection, cancellation, and the SIGTERM drain of a real verifier process."""

import asyncio
import os
import signal
import socket
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from shared.health import wait_serving
from shared.model import save_checkpoint
from shared.protocol import verifier_pb2_grpc

from .conftest import generate, request


async def test_health_is_serving_once_loaded_and_reflection_lists_services(servers, tiny_model):
    await servers.start(tiny_model)
    health = health_pb2_grpc.HealthStub(servers.channel)
    reply = await health.Check(health_pb2.HealthCheckRequest(service="tandem.v1.Verifier"))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(servers.channel)
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = [s.name async for r in responses for s in r.list_services_response.service]
    assert "tandem.v1.Verifier" in names and "grpc.health.v1.Health" in names


async def test_cancellation_frees_the_session(servers, tiny_model):
    stub = await servers.start(tiny_model, max_sessions=1)
    call = stub.Generate(request([1, 2, 3], 200))
    await call.read()
    assert servers.verifier.service.active == 1
    call.cancel()
    for _ in range(100):
        if servers.verifier.service.active == 0:
            break
        await asyncio.sleep(0.02)
    assert servers.verifier.service.active == 0
    tokens, _, _ = await generate(stub, request([1, 2, 3], 3))  # the slot is free again
    assert len(tokens) == 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def verifier_process(tmp_path, tiny_model):
    save_checkpoint(tiny_model, tmp_path / "tiny")
    port = free_port()
    env = dict(os.environ, TANDEM_VERIFIER_MODEL=str(tmp_path / "tiny"), TANDEM_VERIFIER_GRACE_S="20")
    process = subprocess.Popen([sys.executable, "-m", "verifier_service", "--port", str(port)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    yield process, port
    if process.poll() is None:
        process.kill()
    process.wait(10)


async def test_sigterm_drains_in_flight_requests(verifier_process):
    process, port = verifier_process
    await asyncio.to_thread(wait_serving, f"127.0.0.1:{port}", timeout=60, process=process)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        call = stub.Generate(request([1, 2, 3], 240))
        first = await call.read()
        assert 1 <= len(first.token_ids) < 240  # (rounds run ahead of the stream go out together)
        process.send_signal(signal.SIGTERM)
        health = health_pb2_grpc.HealthStub(channel)
        while (await health.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING:
            await asyncio.sleep(0.005)
        # Draining, the request still running: a new one is refused, retryably. (Once the
        # last request ended the port closes, and what a late caller sees is gRPC's to say.)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await generate(stub, request([1, 2, 3], 3))
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in error.value.details()
        tokens, final = list(first.token_ids), None
        while (event := await call.read()) != grpc.aio.EOF:
            tokens += list(event.token_ids)
            if event.HasField("final"):
                final = event.final
        assert final is not None and final.finish_reason == "length" and len(tokens) == 240
    assert process.wait(30) == 0


async def test_tandem_generate_against_a_verifier_process(verifier_process):
    import json

    process, port = verifier_process
    await asyncio.to_thread(wait_serving, f"127.0.0.1:{port}", timeout=60, process=process)
    command = [sys.executable, "-m", "shared.cli", "generate", "--verifier", f"127.0.0.1:{port}",
               "--prompt-ids", "1,2,3", "--max-new-tokens", "5", "--temperature", "0.7", "--seed", "9", "--json"]
    out = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert len(result["token_ids"]) == 5 and result["finish_reason"] == "length"
    assert result["stats"]["rounds"] == 5 and result["text"] is None
    bad = await asyncio.to_thread(subprocess.run, command[:-1] + ["--top-p", "1.5"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "top_p" in bad.stderr


async def test_a_drain_ends_long_requests_with_a_final_event(servers, tiny_model):
    """Stopping with requests still running: health NOT_SERVING while the port is open, new
    requests UNAVAILABLE, and a request still running near the grace limit ends with its
    final event (finish reason "shutdown") instead of being cut."""
    from .conftest import STALL, ScriptedDrafter

    # a drafter that never answers: every round waits out the 100 ms chain deadline
    stub = await servers.start(tiny_model, drafter=ScriptedDrafter(lambda state: STALL), drafter_deadline_ms=100.0)
    call = stub.Generate(request([1, 2, 3], 200, max_draft_tokens=3))
    first = await call.read()
    verifier, servers.verifier = servers.verifier, None  # stopped here, not by the fixture
    stopping = asyncio.create_task(verifier.stop(2.0))
    await asyncio.sleep(0.2)
    health = health_pb2_grpc.HealthStub(servers.channel)
    reply = await health.Check(health_pb2.HealthCheckRequest(service="tandem.v1.Verifier"))
    assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await generate(stub, request([1, 2, 3], 3))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    tokens, final = list(first.token_ids), None
    while (event := await call.read()) != grpc.aio.EOF:
        tokens += list(event.token_ids)
        if event.HasField("final"):
            final = event.final
    assert final is not None and final.finish_reason == "shutdown"
    assert 0 < len(tokens) < 200 and final.stats.completion_tokens == len(tokens)
    await stopping


async def test_a_cancelled_request_leaves_no_traceback(verifier_process):
    """A client cancelling mid-stream is routine: the process logs it and prints no traceback
    (an OpenTelemetry "Failed to detach context" traceback once appeared on every cancel)."""
    process, port = verifier_process
    await asyncio.to_thread(wait_serving, f"127.0.0.1:{port}", timeout=60, process=process)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        for _ in range(3):
            call = stub.Generate(request([1, 2, 3], 150))
            await call.read()
            call.cancel()
        tokens, _, _ = await generate(stub, request([1, 2, 3], 3))
        assert len(tokens) == 3
    process.send_signal(signal.SIGTERM)
    output = (await asyncio.to_thread(process.communicate, timeout=30))[0].decode()
    assert process.returncode == 0
    assert "Traceback" not in output and "Failed to detach" not in output, output[-3000:]
    assert "cancelled" in output  # the cancel is logged, as one line


class Context:
    """What Generate needs of a ServicerContext when nothing goes wrong."""

    async def abort(self, code, details):
        raise AssertionError(f"aborted: {code} {details}")


@pytest.mark.parametrize("closer", ["same task", "another task"])
async def test_closing_the_handler_at_a_yield_cleans_up_at_once(servers, tiny_model, caplog, closer):
    """gRPC closes the handler's generator when the client goes away while it waits to send,
    possibly from another task (another context): the request's session, admission slot and
    spans are released right there, and no span context is left entered across a yield
    (OpenTelemetry printed "Failed to detach context" tracebacks on such cancels)."""
    await servers.start(tiny_model)
    service = servers.verifier.service
    events = service.generate_raw(request([1, 2, 3], 50).SerializeToString(), Context())
    await events.__anext__()
    await events.__anext__()
    assert service.active == 1
    if closer == "same task":
        await events.aclose()
    else:
        await asyncio.create_task(events.aclose())
    assert service.active == 0
    assert "Failed to detach context" not in caplog.text

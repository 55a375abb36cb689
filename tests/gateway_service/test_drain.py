"""Stopping (issue 38): the gateway drains as the verifier does. On SIGTERM `/health` answers
503 on a port that stays open, new requests get 503, requests that finish within the grace
period finish, and those still running near its end are ended in OpenAI's shape (a stream:
an error event, then [DONE]; a whole reply: a 503); then the process exits 0, without a
traceback. A request the verifier itself ends while it drains (finish reason "shutdown")
reaches the client the same way."""

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway_service.server import Gateway, start_in_loop
from gateway_service.settings import GatewaySettings
from shared.model.registry import resolve_model
from shared.protocol import verifier_pb2, verifier_pb2_grpc

from .conftest import MODEL, PROMPT, EventStream, assert_openai_error, post

TICK_S = 0.02  # the fake verifier's time per token


class SteadyVerifier(verifier_pb2_grpc.VerifierServicer):
    """Streams "a" every TICK_S until max_new_tokens; counts the calls its clients cancelled."""

    def __init__(self) -> None:
        self.started = self.cancelled = 0

    async def Generate(self, request, context):
        self.started += 1
        try:
            for _ in range(request.max_new_tokens):
                await asyncio.sleep(TICK_S)
                yield verifier_pb2.GenerateEvent(token_ids=[7], text_delta="a")
            yield verifier_pb2.GenerateEvent(final=verifier_pb2.FinalEvent(
                finish_reason="length", stats=verifier_pb2.RequestStats(completion_tokens=request.max_new_tokens)))
        except (asyncio.CancelledError, GeneratorExit):  # (GeneratorExit: cancelled while at its yield)
            self.cancelled += 1
            raise


async def start_steady_verifier(servicer: SteadyVerifier | None = None) -> tuple[grpc.aio.Server, SteadyVerifier, int]:
    servicer = servicer or SteadyVerifier()
    server = grpc.aio.server()
    verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server)
    checks = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await checks.set("tandem.v1.Verifier", health_pb2.HealthCheckResponse.SERVING)
    return server, servicer, port


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def health_status(port: int) -> tuple[int | None, dict | None]:
    """(status, answer) of GET /health; (None, None) when the connection is refused."""
    def fetch():
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())
        except OSError:
            return None, None

    return await asyncio.to_thread(fetch)


async def test_sigterm_drains_open_requests_and_ends_them_in_openais_shape():
    verifier, servicer, vport = await start_steady_verifier()
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "gateway_service", "--port", str(port),
                                "--verifier", f"127.0.0.1:{vport}", "--grace-s", "4"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while (await health_status(port))[0] != 200:
            assert time.monotonic() < deadline and process.poll() is None, process.stdout.read()
            await asyncio.sleep(0.2)
        body = {"model": MODEL, "prompt": PROMPT}
        endless = await EventStream.open(port, {**body, "max_tokens": 100_000})
        short = await EventStream.open(port, {**body, "max_tokens": 40})  # done well within the grace
        assert endless.status == short.status == 200
        assert (await endless.next())["choices"][0]["text"] == "a"
        whole = asyncio.create_task(post(port, "/v1/completions", {**body, "max_tokens": 100_000}))
        while servicer.started < 3:  # the whole reply's request is under way too
            await asyncio.sleep(0.02)

        process.send_signal(signal.SIGTERM)
        status, answer = await health_status(port)
        for _ in range(50):  # the port stays open and says why
            if status == 503:
                break
            await asyncio.sleep(0.05)
            status, answer = await health_status(port)
        assert status == 503 and answer["error"]["code"] == "shutdown", answer
        refused, answer = await post(port, "/v1/completions", {**body, "max_tokens": 4})
        assert refused == 503 and answer["error"]["code"] == "shutdown"

        finished = await short.rest()
        assert finished[-2]["choices"][0]["finish_reason"] == "length" and finished[-1] == "[DONE]"
        ended = await endless.rest()  # near the end of the grace: an error event, then [DONE]
        assert assert_openai_error(ended[-2], None)["code"] == "shutdown"
        assert ended[-1] == "[DONE]" and all("choices" in event for event in ended[:-2])
        status, answer = await whole
        assert status == 503 and assert_openai_error(answer, None)["code"] == "shutdown"

        output = (await asyncio.to_thread(process.communicate, timeout=30))[0]
        assert process.returncode == 0, output
        assert "gateway stopped" in output and "Traceback" not in output and "CancelledError" not in output, output
        for _ in range(100):  # (the cancellations reach this process's server in their own time)
            if servicer.cancelled == 2:
                break
            await asyncio.sleep(0.05)
        assert servicer.cancelled == 2  # the gateway let go of the verifier's calls it ended
        endless.close()
        short.close()
    finally:
        process.kill()
        await verifier.stop(0)


class DrainingVerifier(SteadyVerifier):
    """Ends every request after a few tokens as a draining verifier does: finish reason "shutdown"."""

    async def Generate(self, request, context):
        for _ in range(3):
            yield verifier_pb2.GenerateEvent(token_ids=[7], text_delta="a")
        yield verifier_pb2.GenerateEvent(final=verifier_pb2.FinalEvent(
            finish_reason="shutdown", stats=verifier_pb2.RequestStats(completion_tokens=3)))


async def test_a_request_the_verifier_ends_as_it_drains_is_a_503_not_a_finish_reason():
    """The verifier's finish reason "shutdown" is no OpenAI value: the reply is a 503 (which
    OpenAI's clients retry), in a stream an error event and [DONE]."""
    verifier, _, vport = await start_steady_verifier(DrainingVerifier())
    gateway = Gateway(GatewaySettings(verifier=f"127.0.0.1:{vport}", port=0), model_dir=resolve_model(None))
    server, task, port = await start_in_loop(gateway)
    try:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 100}
        stream = await EventStream.open(port, body)
        events = await stream.rest()
        stream.close()
        assert stream.status == 200 and [e["choices"][0]["text"] for e in events[:3]] == ["a"] * 3
        assert assert_openai_error(events[3], None)["code"] == "shutdown" and events[4:] == ["[DONE]"]
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.APIStatusError) as error:
            await client.completions.create(**body)
        assert error.value.status_code == 503 and error.value.body["code"] == "shutdown"
    finally:
        server.should_exit = True
        await task
        await verifier.stop(0)

"""The OpenAI-compatible edge through the official `openai` package (issue 19): a real
verifier (embedded model and tokenizer) on a gRPC port and a real gateway on an HTTP port,
both in this process."""

import asyncio
import json
import shutil
import tempfile
import urllib.error
import urllib.request

import openai
import pytest

from gateway_service.chat import PLAIN_TEMPLATE, ChatTemplate
from gateway_service.settings import GatewaySettings
from shared import cli
from shared.client import AsyncVerifierClient, GenerationConfig

PROMPT = "def fibonacci(n):"


async def direct(address, prompt, **config):
    async with AsyncVerifierClient(address) as client:
        return await client.generate(prompt, GenerationConfig(**config))


async def test_completions_equal_the_verifier_and_tandem_generate(edge, embedded, capsys):
    client = await edge.start(embedded)
    model = (await client.models.list()).data[0].id
    assert model == "tandem-demo-moe"
    reply = await client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0.8, seed=5)
    expected = await direct(edge.address, PROMPT, max_new_tokens=12, temperature=0.8, seed=5)
    assert reply.choices[0].text == expected.text and reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 12 and reply.usage.prompt_tokens == expected.stats["prompt_tokens"]
    assert reply.usage.model_extra["rounds"] == expected.stats["rounds"]  # tandem's stats ride along
    argv = ["generate", "--verifier", edge.address, "--prompt", PROMPT, "--max-new-tokens", "12",
            "--temperature", "0.8", "--seed", "5", "--json"]
    assert await asyncio.to_thread(cli.main, argv) == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]  # (the in-process verifier logs to stdout too)
    assert json.loads(out)["text"] == reply.choices[0].text


@pytest.mark.parametrize("named", [False, True])
async def test_a_gateway_beside_its_verifier_streams_over_the_local_socket(edge, embedded, named):
    """named: the gateway's --verifier-socket; else the socket the verifier offers (no flags)."""
    folder = tempfile.mkdtemp(prefix="tandem-test-")  # (a Unix socket's path is at most 107 bytes)
    try:
        path = f"{folder}/v.sock"
        client = await (edge.start(embedded, verifier={"local_socket": path}, verifier_socket=path) if named
                        else edge.start(embedded))
        reply = await client.completions.create(model="tandem-demo-moe", prompt=PROMPT, max_tokens=12, temperature=0.8,
                                                seed=5)
        assert edge.verifier.local.served == 1  # the gateway's call came over the socket, not gRPC
        expected = await direct(edge.address, PROMPT, max_new_tokens=12, temperature=0.8, seed=5)
        assert reply.choices[0].text == expected.text
    finally:
        shutil.rmtree(folder, ignore_errors=True)


async def test_streamed_completions_and_chat_give_the_same_text(edge, embedded):
    client = await edge.start(embedded)
    options = dict(model="tandem-demo-moe", max_tokens=10, temperature=0.7, seed=3)
    whole = await client.completions.create(prompt=PROMPT, **options)
    chunks = [c async for c in await client.completions.create(prompt=PROMPT, stream=True,
                                                               stream_options={"include_usage": True}, **options)]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": PROMPT}]
    chat = await client.chat.completions.create(messages=messages, **options)
    rendered = ChatTemplate(PLAIN_TEMPLATE).render(messages)  # the embedded model has no template of its own
    assert rendered == f"system: You write Python.\nuser: {PROMPT}\nassistant:"
    expected = await direct(edge.address, rendered, max_new_tokens=10, temperature=0.7, seed=3)
    assert chat.choices[0].message.content == expected.text and chat.choices[0].message.role == "assistant"
    streamed = [c async for c in await client.chat.completions.create(messages=messages, stream=True, **options)]
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected.text


async def test_tandem_parameters_pass_as_extra_body(edge, embedded):
    client = await edge.start(embedded)
    extra = {"top_k": 5, "mode": "exact", "speculation": False, "max_draft_tokens": 2}
    reply = await client.completions.create(model="tandem-demo-moe", prompt=[1, 2, 3], max_tokens=4, seed=1,
                                            extra_body=extra)
    expected = await direct(edge.address, [1, 2, 3], max_new_tokens=4, temperature=1.0, seed=1, top_k=5,
                            speculation=False, max_draft_tokens=2)
    assert reply.choices[0].text == expected.text  # token-id prompts stream text too


@pytest.mark.parametrize("options, status, param", [
    ({"temperature": -1}, 400, "temperature"),
    ({"top_p": 1.5}, 400, "top_p"),
    ({"n": 2}, 400, "n"),
    ({"logprobs": 21}, 400, "logprobs"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"extra_body": {"gate": "pick"}}, 400, "gate"),
    ({"model": "gpt-4"}, 404, "model"),
])
async def test_bad_parameters_are_openai_errors_naming_the_field(edge, embedded, options, status, param):
    client = await edge.start(embedded)
    request = {"model": "tandem-demo-moe", "prompt": PROMPT, "max_tokens": 4, **options}
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as error:
            await client.completions.create(stream=stream, **request)
        assert error.value.status_code == status
        assert error.value.body["param"] == param, error.value.body


async def test_auth_capacity_and_health(edge, embedded):
    client = await edge.start(embedded, auth_token="s3cret", verifier={"max_sessions": 1, "max_queued": 0})
    anonymous = openai.AsyncOpenAI(base_url=f"{edge.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await anonymous.models.list()
    # Greedy, so it cannot draw the end-of-text token early (sampled, 1 seed in 30 stopped after 4
    # tokens and freed the session); long, so it is still decoding when the second request comes.
    first = await client.completions.create(model="tandem-demo-moe", prompt=PROMPT, max_tokens=1000,
                                            temperature=0, stream=True)
    await anext(aiter(first))  # holds the verifier's one session
    with pytest.raises(openai.RateLimitError):
        await client.completions.create(model="tandem-demo-moe", prompt=PROMPT, max_tokens=4)
    await first.close()
    assert (await get(f"{edge.base_url}/health"))[0] == 200  # no token needed
    await edge.verifier.stop(0)
    edge.verifier = None
    status, body = await get(f"{edge.base_url}/health")
    assert status == 503 and body["error"]["type"] == "server_error"
    with pytest.raises(openai.InternalServerError) as unavailable:  # no verifier to answer
        await client.completions.create(model="tandem-demo-moe", prompt=PROMPT, max_tokens=4)
    assert unavailable.value.status_code == 503


async def get(url: str) -> tuple[int, dict]:
    def fetch():
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    return await asyncio.to_thread(fetch)


def test_settings_are_validated():
    with pytest.raises(ValueError, match="timeout_s"):
        GatewaySettings(timeout_s=0)
    with pytest.raises(ValueError, match="verifier_tls_cert and verifier_tls_key"):
        GatewaySettings(verifier_tls_cert="c.pem")
    with pytest.raises(ValueError, match="verifier_socket"):
        GatewaySettings(verifier_socket="")
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="max_body_mb"):
            GatewaySettings(max_body_mb=bad)
    assert GatewaySettings(max_body_mb=0.5).max_body_bytes == 1 << 19


async def test_streamed_chunks_are_not_held_by_nagle():
    """Accepted connections get TCP_NODELAY (asyncio sets it only for sockets made with
    IPPROTO_TCP): without it, every request after a connection's first had its streamed
    chunks held back for the client's delayed ACKs and delivered at the end."""
    import socket

    from gateway_service.server import bind

    nodelay = asyncio.get_running_loop().create_future()

    def accepted(reader, writer):
        sock = writer.get_extra_info("socket")
        nodelay.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    listening = bind("127.0.0.1", 0)
    server = await asyncio.start_server(accepted, sock=listening)
    _, writer = await asyncio.open_connection(*listening.getsockname())
    assert await asyncio.wait_for(nodelay, 10) != 0
    writer.close()
    server.close()
    await server.wait_closed()


def test_sigterm_stops_the_gateway_process_with_status_0():
    import signal
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "gateway_service", "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:  # /v1/models answers without a verifier
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as reply:
                    assert json.loads(reply.read())["data"][0]["id"] == "tandem-demo-moe"
                    break
            except OSError:
                assert time.monotonic() < deadline and process.poll() is None, process.stdout.read()
                time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=30)[0]
    finally:
        process.kill()
    assert process.returncode == 0, output
    assert "gateway stopped" in output and "Traceback" not in output


async def test_metrics_count_requests_by_status_and_time_them(edge, embedded):
    client = await edge.start(embedded, auth_token="t")
    await client.completions.create(model="tandem-demo-moe", prompt=PROMPT, max_tokens=3)
    stream = await client.completions.create(model="tandem-demo-moe", prompt=PROMPT, max_tokens=3, stream=True)
    async for _ in stream:
        pass
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model="tandem-demo-moe", prompt=PROMPT, max_tokens=3, temperature=-1)
    url = f"{edge.base_url}/metrics"  # open, like /health
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read().decode())
    assert 'tandem_gateway_requests_total{endpoint="completions",status="200"} 2.0' in text
    assert 'tandem_gateway_requests_total{endpoint="completions",status="400"} 1.0' in text
    assert 'tandem_gateway_request_seconds_count{endpoint="completions"} 3.0' in text
    assert "tandem_gateway_active_requests 0.0" in text


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_gone_before_the_reply_cancels_the_verifier_call(edge, embedded, stream):
    """A completion whose client hangs up right after sending it, streamed or not: the
    verifier's call is cancelled (not left generating 2,000 tokens for nobody) and the
    gateway's request is settled. (Non-streamed requests used to run to their end.)"""
    await edge.start(embedded)
    gateway, verifier = edge.gateway.metrics.registry, edge.verifier.service.metrics.registry
    body = json.dumps({"model": "tandem-demo-moe", "prompt": PROMPT, "max_tokens": 2000, "stream": stream}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", edge.port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    writer.close()  # gone before reading a byte
    await writer.wait_closed()

    def settled():
        answered = sum(sample.value for metric in gateway.collect() for sample in metric.samples
                       if sample.name == "tandem_gateway_requests_total")
        return answered == 1 and gateway.get_sample_value("tandem_gateway_active_requests") == 0

    for _ in range(300):  # up to 15 s on a loaded machine; the generation alone would take far longer
        if settled() and edge.verifier.service.active == 0:
            break
        await asyncio.sleep(0.05)
    assert settled() and edge.verifier.service.active == 0
    # the call ended early: cancelled in the verifier, or before the verifier began it
    assert verifier.get_sample_value("tandem_verifier_requests_total", {"finish_reason": "length"}) is None


async def test_a_client_gone_while_sending_its_body_is_counted_not_failed(edge, embedded):
    await edge.start(embedded)
    reader, writer = await asyncio.open_connection("127.0.0.1", edge.port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"model\": ")  # and then nothing
    await writer.drain()
    writer.close()
    await writer.wait_closed()
    registry = edge.gateway.metrics.registry
    labels = {"endpoint": "completions", "status": "499"}
    for _ in range(200):
        if registry.get_sample_value("tandem_gateway_requests_total", labels) == 1:
            break
        await asyncio.sleep(0.05)
    assert registry.get_sample_value("tandem_gateway_requests_total", labels) == 1

"""What an adversarial client sends, and what OpenAI's clients expect back (issue 38): every
bad request is a 4xx in OpenAI's error shape naming the field the client sent, never a 500;
the body is bounded and parsed without stalling other requests."""

import asyncio
import threading

import openai
import pytest

from gateway_service import body as body_module

from .conftest import MODEL, PROMPT, assert_openai_error, post, raw_http

BASE = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
HUGE = int("1" + "0" * 400)  # a 400-digit number


@pytest.mark.parametrize("change, param", [
    ({"max_tokens": 2**31}, "max_tokens"),  # the int32 fields of the protocol
    ({"max_tokens": None, "max_completion_tokens": 2**31}, "max_completion_tokens"),
    ({"top_k": 2**31}, "top_k"),
    ({"max_support": 2**31}, "max_support"),
    ({"max_draft_tokens": 2**31}, "max_draft_tokens"),
    ({"prompt": [1, 4294967296]}, "prompt"),  # a token id past uint32
    ({"temperature": HUGE}, "temperature"),
    ({"seed": HUGE}, "seed"),
    ({"seed": -1}, "seed"),
    ({"top_p": "0.5"}, "top_p"),
    ({"stream": "yes"}, "stream"),
    ({"n": True}, "n"),
    ({"mode": 3}, "mode"),
])
async def test_out_of_range_values_are_400s_naming_the_field(edge, embedded, change, param):
    await edge.start(embedded)
    status, answer = await post(edge.port, "/v1/completions", {**BASE, **change})
    assert status == 400
    assert_openai_error(answer, param)


@pytest.mark.parametrize("raw, message", [
    (b'{"model": "tandem-demo-moe", "prompt": "a", "temperature": 1e400}', "temperature must be a finite number"),
    (b'{"model": "tandem-demo-moe", "prompt": "a", "temperature": NaN}', "not valid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "nests too deeply"),
    (b'{"model": "tandem-demo-moe", "prompt": "a", "stop": ' + b"[" * 900 + b"]" * 900 + b"}", "stop must be"),
    (b"\xff\xfe", "not valid JSON"),
    (b'"a string"', "must be a JSON object"),
])
async def test_malformed_bodies_are_400s(edge, embedded, raw, message):
    await edge.start(embedded)
    status, answer = await post(edge.port, "/v1/completions", raw)
    assert status == 400 and message in answer["error"]["message"], answer


async def test_errors_name_the_field_the_client_sent(edge, embedded):
    """The verifier says max_new_tokens; a client that sent max_tokens (or
    max_completion_tokens) reads its own name, in `param` and in the message."""
    client = await edge.start(embedded)
    with pytest.raises(openai.BadRequestError) as error:
        await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=100_000)
    assert error.value.body["param"] == "max_tokens" and "max_new_tokens" not in error.value.body["message"]
    assert error.value.body["message"].startswith("max_tokens must lie in [1, 4096]")
    with pytest.raises(openai.BadRequestError) as error:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                             max_completion_tokens=100_000)
    assert error.value.body["param"] == "max_completion_tokens"
    assert error.value.body["message"].startswith("max_completion_tokens must lie")


async def test_max_tokens_beyond_the_context_is_refused_not_cut(edge, embedded):
    """The embedded model's context holds 2,048 tokens: a prompt of 100 and max_tokens 2,000
    used to end quietly after 1,948 with finish_reason "length"; OpenAI and vLLM answer 400."""
    client = await edge.start(embedded)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as error:
            await client.completions.create(model=MODEL, prompt=[5] * 100, max_tokens=2000, stream=stream)
        assert error.value.body["param"] == "max_tokens"
        assert "the context holds 2048 tokens and the prompt has 100, so at most 1948" in error.value.body["message"]
    # not sent: the gateway's default (256 for chat) did not fit, and the message says so
    messages = [{"role": "user", "content": "x " * 1900}]  # 1,908 tokens rendered
    with pytest.raises(openai.BadRequestError) as error:
        await client.chat.completions.create(model=MODEL, messages=messages)
    assert error.value.body["param"] == "max_tokens" and "max_tokens was not sent" in error.value.body["message"]


@pytest.mark.parametrize("endpoint, change, param, status", [
    ("/v1/completions", {"temprature": 0}, "temprature", 400),  # unknown (here misspelt): refused, never ignored
    ("/v1/completions", {"messages": []}, "messages", 400),  # the other endpoint's field
    ("/v1/completions", {"echo": True}, "echo", 400),  # known, not served
    ("/v1/completions", {"top_logprobs": 2}, "top_logprobs", 400),  # the chat endpoint's
    ("/v1/completions", {"logprobs_mode": "processed"}, "logprobs_mode", 400),  # would do nothing
    ("/v1/completions", {"logprobs": 1, "logprobs_mode": "sorted"}, "logprobs_mode", 400),
    ("/v1/completions", {"user": "u-1", "metadata": {"a": "b"}, "logprobs": None}, None, 200),  # no effect on the output
])
async def test_every_field_is_served_neutral_or_refused(edge, embedded, endpoint, change, param, status):
    await edge.start(embedded)
    got, answer = await post(edge.port, endpoint, {**BASE, **change})
    assert got == status, answer
    if status != 200:
        assert_openai_error(answer, param)


@pytest.mark.parametrize("messages", [
    [{"role": "user"}],
    [{"role": "user", "content": None}],
    [{"role": "user", "content": "hi"}, {"role": "assistant"}],
    [{"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]}],
])
async def test_a_chat_message_without_content_is_refused(edge, embedded, messages):
    await edge.start(embedded)
    status, answer = await post(edge.port, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 4})
    assert status == 400
    assert_openai_error(answer, "messages")


async def test_unknown_paths_and_methods_answer_in_openais_shape(edge, embedded):
    await edge.start(embedded)
    head = b"GET /v1/engines HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    status, _, content = await raw_http(edge.port, head)
    assert status == 404 and b'"Invalid URL (GET /v1/engines)"' in content and b'"detail"' not in content
    head = b"DELETE /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    status, headers, content = await raw_http(edge.port, head)
    assert status == 405 and b'"error"' in content and headers["allow"] == "GET"


async def test_text_completion_chunks_carry_openais_fields_only(edge, embedded):
    client = await edge.start(embedded)
    chunks = [c async for c in await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, stream=True,
                                                               stream_options={"include_usage": True})]
    for chunk in chunks:
        assert chunk.object == "text_completion" and not chunk.model_extra, chunk  # no stray "chunk": true
    assert chunks[-1].usage.completion_tokens >= 1 and not chunks[-1].choices  # (the model may end before 6)


async def test_the_bearer_scheme_is_case_insensitive(edge, embedded):
    await edge.start(embedded, auth_token="s3cret")
    for header, status in (("bearer s3cret", 200), ("BEARER  s3cret", 200), ("Bearer s3cret", 200),
                           ("bearer wrong", 401), ("Basic s3cret", 401), ("s3cret", 401)):
        got, answer = await post(edge.port, "/v1/completions", BASE, {"Authorization": header})
        assert got == status, (header, answer)


async def test_a_body_past_the_limit_is_413_before_it_is_read(edge, embedded):
    await edge.start(embedded, max_body_mb=0.01)  # 10,485 bytes
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 300000000\r\n\r\n")  # declared, never sent
    status, _, content = await raw_http(edge.port, head)
    assert status == 413 and b'"request_too_large"' in content
    chunk = b"x" * 4096  # undeclared (chunked): refused once the limit is crossed
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    status, _, content = await raw_http(edge.port, head, (b"1000\r\n" + chunk + b"\r\n") * 3)
    assert status == 413 and b'"request_too_large"' in content
    status, answer = await post(edge.port, "/v1/completions", {**BASE, "user": "y" * 9000})  # under it: served
    assert status == 200, answer


async def test_a_large_body_is_parsed_without_stalling_other_requests(edge, embedded, monkeypatch):
    """While a large body's JSON is being decoded, /v1/models still answers. The decode is held
    until a thread's /v1/models request has its answer (or gave up after 5 s): decoded on the
    event loop, as it used to be, it would hold the loop, and /v1/models could answer only
    after the decode was released."""
    await edge.start(embedded)
    decoding, release, seen = threading.Event(), threading.Event(), {}
    decode = body_module.decode

    def held_decode(raw):
        decoding.set()
        release.wait(30)
        return decode(raw)

    def models_while_held() -> None:  # a thread: it runs whatever the event loop does
        import urllib.request

        try:
            assert decoding.wait(30)
            with urllib.request.urlopen(f"{edge.base_url}/v1/models", timeout=5) as reply:
                seen["answered while held"] = reply.status == 200 and not release.is_set()
        finally:
            release.set()

    monkeypatch.setattr(body_module, "decode", held_decode)
    watcher = threading.Thread(target=models_while_held)
    watcher.start()
    padding = "z" * (body_module.THREAD_DECODE_BYTES + 1)  # (in a field that changes nothing)
    status, answer = await post(edge.port, "/v1/completions", {**BASE, "user": padding})
    await asyncio.to_thread(watcher.join)
    assert seen == {"answered while held": True}
    assert status == 200, answer

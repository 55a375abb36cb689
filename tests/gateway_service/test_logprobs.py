"""logprobs through the gateway, in OpenAI's shapes (completions and chat, whole and streamed),
against the verifier's own numbers for the same request."""

import math

import openai
import pytest

from shared.client import AsyncVerifierClient, GenerationConfig

from .conftest import MODEL, PROMPT, assert_openai_error, post

CHAT = [{"role": "user", "content": "Write a loop."}]


async def direct(address, prompt, **config):
    async with AsyncVerifierClient(address) as client:
        return await client.generate(prompt, GenerationConfig(**config))


async def test_completion_logprobs_are_the_verifiers(edge, embedded):
    client = await edge.start(embedded)
    reply = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, seed=3, temperature=0.8,
                                            logprobs=3)
    expected = await direct(edge.address, PROMPT, max_new_tokens=12, temperature=0.8, seed=3, logprobs=3)
    tokenizer = embedded[2]
    got = reply.choices[0].logprobs
    assert len(got.tokens) == len(expected.token_ids) == 12
    assert got.token_logprobs == pytest.approx([x.logprob for x in expected.logprobs])
    assert "".join(got.tokens) == reply.choices[0].text == tokenizer.decode(expected.token_ids)  # (ASCII code)
    assert got.text_offset == [sum(len(t) for t in got.tokens[:i]) for i in range(12)]
    for token, top, x in zip(got.tokens, got.top_logprobs, expected.logprobs):
        # the three alternatives, and the chosen token (among them or not)
        assert {tokenizer.decode([t]): pytest.approx(lp) for t, lp in x.top} | {token: pytest.approx(x.logprob)} == top
        assert all(lp <= 0 for lp in top.values())


async def test_streamed_completion_logprobs_match_the_whole_reply(edge, embedded):
    client = await edge.start(embedded)
    request = dict(model=MODEL, prompt=PROMPT, max_tokens=16, seed=5, temperature=0.0, logprobs=2)
    whole = (await client.completions.create(**request)).choices[0].logprobs
    tokens, logprobs, offsets = [], [], []
    async for chunk in await client.completions.create(stream=True, **request):
        if chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens
            logprobs += chunk.choices[0].logprobs.token_logprobs
            offsets += chunk.choices[0].logprobs.text_offset
    assert (tokens, logprobs, offsets) == (whole.tokens, whole.token_logprobs, whole.text_offset)


async def test_chat_logprobs_carry_bytes_and_alternatives(edge, embedded):
    client = await edge.start(embedded)
    reply = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0.0,
                                                 logprobs=True, top_logprobs=4)
    content = reply.choices[0].logprobs.content
    assert "".join(x.token for x in content) == reply.choices[0].message.content
    for x in content:
        assert bytes(x.bytes).decode() == x.token
        assert len(x.top_logprobs) == 4 and x.top_logprobs[0].token == x.token  # greedy: the most likely
        assert x.logprob == x.top_logprobs[0].logprob
        assert [t.logprob for t in x.top_logprobs] == sorted((t.logprob for t in x.top_logprobs), reverse=True)
    streamed = []
    async for chunk in await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0.0,
                                                            logprobs=True, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [(x.token, x.logprob) for x in streamed] == [(x.token, x.logprob) for x in content]
    assert all(x.top_logprobs == [] for x in streamed)  # top_logprobs absent: none


async def test_processed_logprobs_on_request(edge, embedded):
    client = await edge.start(embedded)
    reply = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, seed=1, temperature=0.7,
                                            logprobs=5, extra_body={"top_k": 3, "logprobs_mode": "processed"})
    for top in reply.choices[0].logprobs.top_logprobs:
        assert len(top) <= 3  # top-k 3: nothing else has mass
        assert sum(math.exp(lp) for lp in top.values()) == pytest.approx(1.0, abs=1e-5)


async def test_no_logprobs_unless_asked(edge, embedded):
    await edge.start(embedded)
    status, answer = await post(edge.port, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 3})
    assert status == 200 and answer["choices"][0]["logprobs"] is None
    status, answer = await post(edge.port, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 3,
                                                                    "logprobs": False})
    assert status == 200 and answer["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("change, param", [
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({"logprobs": 3}, "logprobs"),  # chat's is a boolean
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
async def test_bad_chat_logprobs_are_refused(edge, embedded, change, param):
    await edge.start(embedded)
    status, answer = await post(edge.port, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, **change})
    assert status == 400
    assert_openai_error(answer, param)


async def test_logprobs_need_the_tokenizer(edge, embedded, tmp_path):
    path, model, tokenizer = embedded
    client = await edge.start((tmp_path, model, tokenizer))  # a model directory without tokenizer.json
    with pytest.raises(openai.BadRequestError) as error:
        await client.completions.create(model=tmp_path.name, prompt=[1, 2], max_tokens=2, logprobs=1)
    assert error.value.body["param"] == "logprobs" and "tokenizer" in error.value.body["message"]

"""Log-probabilities through the verifier's Generate: one per streamed token, under the target's
own rows (raw) or the law drawn from (processed), the same whether a token was drafted or not."""

import math

import grpc
import pytest
import torch

from kernels.sampling import SamplingParams, process_logits
from shared.protocol import verifier_pb2

from .conftest import ScriptedDrafter, chain, generate, request

PROMPT = [3, 14, 15, 92, 65]


def asking(req, num_top, mode=verifier_pb2.LOGPROB_MODE_RAW):
    req.logprobs.CopyFrom(verifier_pb2.LogprobParams(num_top=num_top, mode=mode))
    return req


async def events_of(stub, req):
    """(tokens, logprobs) of one Generate call, from its events."""
    tokens, logprobs = [], []
    async for event in stub.Generate(req):
        # one per token, in every event, where the request asks; else none
        assert len(event.logprobs) == (len(event.token_ids) if req.HasField("logprobs") else 0)
        tokens += list(event.token_ids)
        logprobs += list(event.logprobs)
    return tokens, logprobs


def reference_rows(model, prompt, tokens):
    """[len(tokens), vocab]: the target's logits at each generated token's position (one forward)."""
    logits, _ = model.score(torch.tensor(prompt + tokens))
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)].double()


async def test_raw_logprobs_are_the_target_rows(servers, tiny_model):
    stub = await servers.start(tiny_model)
    tokens, logprobs = await events_of(stub, asking(request(PROMPT, 12, temperature=0.9, seed=4), 3))
    assert len(tokens) == 12
    reference = torch.log_softmax(reference_rows(tiny_model, PROMPT, tokens), dim=-1)
    for j, (token, lp) in enumerate(zip(tokens, logprobs)):
        assert lp.logprob == pytest.approx(reference[j, token].item(), abs=1e-4)
        assert lp.rank == int((reference[j] > reference[j, token] + 1e-4).sum()) + 1
        assert len(lp.top_token_ids) == 3
        assert list(lp.top_logprobs) == pytest.approx(reference[j].topk(3).values.tolist(), abs=1e-4)
        assert list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True)


async def test_greedy_tokens_are_ranked_first(servers, tiny_model):
    stub = await servers.start(tiny_model)
    tokens, logprobs = await events_of(stub, asking(request(PROMPT, 8), 1))
    assert [lp.rank for lp in logprobs] == [1] * 8
    assert [lp.top_token_ids[0] for lp in logprobs] == tokens
    assert [lp.logprob for lp in logprobs] == [lp.top_logprobs[0] for lp in logprobs]


async def test_processed_logprobs_are_the_law_drawn_from(servers, tiny_model):
    stub = await servers.start(tiny_model)
    req = request(PROMPT, 10, temperature=0.7, seed=2, top_k=4)
    tokens, logprobs = await events_of(stub, asking(req, 5, verifier_pb2.LOGPROB_MODE_PROCESSED))
    params = SamplingParams(temperature=0.7, top_k=4)
    law = process_logits(reference_rows(tiny_model, PROMPT, tokens), params)
    for j, (token, lp) in enumerate(zip(tokens, logprobs)):
        row = law.row(j)
        assert lp.logprob == pytest.approx(math.log(row[token]), abs=1e-4)
        assert len(lp.top_token_ids) == 4  # top-k 4: the fifth alternative has no mass, left out
        assert sorted(lp.top_token_ids) == sorted(row)
        assert sum(math.exp(x) for x in lp.top_logprobs) == pytest.approx(1.0, abs=1e-5)


async def test_logprobs_are_the_same_for_drafted_tokens(servers, tiny_model):
    """Exact mode: a drafter proposing the greedy continuation gets drafts accepted; every token's
    numbers equal those of the same request decoded plainly."""
    def greedy_chain(state):
        tokens = list(state.tokens)
        for _ in range(3):
            logits, _ = tiny_model.score(torch.tensor(tokens))
            tokens.append(int(logits[-1].argmax()))
        return chain(state, tokens[len(state.tokens):])

    stub = await servers.start(tiny_model, drafter=ScriptedDrafter(greedy_chain))
    for temperature, mode in ((0.0, verifier_pb2.LOGPROB_MODE_RAW), (0.8, verifier_pb2.LOGPROB_MODE_PROCESSED)):
        req = asking(request(PROMPT, 16, temperature=temperature, seed=7, max_draft_tokens=3), 3, mode)
        tokens, logprobs = await events_of(stub, req)
        _, final, _ = await generate(stub, req)
        assert final.stats.accepted > 0
        req.speculation.disable = True
        plain_tokens, plain_logprobs = await events_of(stub, req)
        assert tokens == plain_tokens
        assert [(x.logprob, x.rank, list(x.top_token_ids), list(x.top_logprobs)) for x in logprobs] == \
            [(x.logprob, x.rank, list(x.top_token_ids), list(x.top_logprobs)) for x in plain_logprobs]


async def test_no_logprobs_unless_asked(servers, tiny_model):
    stub = await servers.start(tiny_model)
    async for event in stub.Generate(request(PROMPT, 4)):
        assert not event.logprobs


@pytest.mark.parametrize("params, field", [
    (verifier_pb2.LogprobParams(num_top=21), "logprobs.num_top"),
    (verifier_pb2.LogprobParams(num_top=-1), "logprobs.num_top"),
    (verifier_pb2.LogprobParams(mode=9), "logprobs.mode"),
])
async def test_bad_logprob_params_are_refused(servers, tiny_model, params, field):
    stub = await servers.start(tiny_model)
    req = request(PROMPT, 4)
    req.logprobs.CopyFrom(params)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await generate(stub, req)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in error.value.details()


async def test_logprobs_in_a_batch_are_those_of_the_request_alone(servers, tiny_model):
    """Three requests at once (one step's rows, plain and verify windows mixed): the one that
    asks gets its numbers as alone, the others none and their tokens unchanged."""
    import asyncio

    stub = await servers.start(tiny_model, max_batch_rows=16, batch_gather_ms=20.0)
    asked = asking(request(PROMPT, 10, temperature=0.7, seed=3), 2)
    others = [request(PROMPT[:3], 10, temperature=0.9, seed=5), request(PROMPT[1:], 10, seed=6)]
    alone = await events_of(stub, asked)
    alone_others = [await events_of(stub, r) for r in others]
    together = await asyncio.gather(events_of(stub, asked), *(events_of(stub, r) for r in others))
    key = lambda run: (run[0], [(x.logprob, x.rank, list(x.top_token_ids), list(x.top_logprobs)) for x in run[1]])  # noqa: E731
    assert key(together[0]) == key(alone) and len(alone[1]) == 10
    for run, solo in zip(together[1:], alone_others):
        assert run[0] == solo[0] and run[1] == [] == solo[1]

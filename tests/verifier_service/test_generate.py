"""Plain decoding through a real verifier on port 0 (no drafter)."""

import asyncio

import torch

from shared.model import load_model
from shared.model.registry import resolve_model
from shared.protocol import verifier_pb2
from shared.tokenizer import load_tokenizer
from verifier_service.request_rounds import RequestRounds

from .conftest import generate, request


async def test_greedy_matches_transformers_generate(servers, tmp_path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=8, num_experts_per_tok=2, max_position_embeddings=256, norm_topk_prob=True)
    hf = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "experts" in name or "mlp.gate" in name:
                param.mul_(10.0)
    hf.save_pretrained(tmp_path)
    prompt = [5, 17, 42, 8, 61]
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    stub = await servers.start(load_model(tmp_path))
    tokens, final, rounds = await generate(stub, request(prompt, 24))
    assert tokens == expected[0, len(prompt):].tolist()
    assert final.finish_reason == "length"
    assert final.stats.completion_tokens == 24 and final.stats.rounds == 24 == sum(max(r.num_rounds, 1) for r in rounds)
    assert final.stats.prompt_tokens == 5


async def test_plain_rounds_ready_together_go_out_as_one_event(servers, tiny_model, monkeypatch):
    # The engine loop runs granted plain rounds ahead of the request's coroutine (up to its lead
    # of 3); when the coroutine ends a plain round and the next ones' outcomes already wait, they
    # go out in the same event, RoundInfo.num_rounds counting them. A coroutine made slower than
    # the loop (30 ms a round here: a busy event loop) sends fewer events for the same tokens and
    # rounds; each round is still counted (stats) and traced.
    stub = await servers.start(tiny_model)
    req = request([3, 1, 4, 1, 5], 24)
    fast, fast_final, _ = await generate(stub, req)
    outcome = RequestRounds._outcome

    async def late_outcome(self, running, begun):
        result = await outcome(self, running, begun)
        await asyncio.sleep(0.03)
        return result

    monkeypatch.setattr(RequestRounds, "_outcome", late_outcome)
    events, final = [], None
    async for event in stub.Generate(req):
        if event.HasField("final"):
            final = event.final
        else:
            events.append(event)
    assert [t for e in events for t in e.token_ids] == fast
    assert final.stats.rounds == fast_final.stats.rounds == 24 == sum(max(e.round.num_rounds, 1) for e in events)
    assert all(len(e.token_ids) == max(e.round.num_rounds, 1) for e in events)  # (plain: a token a round)
    assert len(events) < 24 and max(e.round.num_rounds for e in events) >= 2
    ids = [e.round.round_id for e in events]
    assert ids[0] == 0 and all(b == a + max(e.round.num_rounds, 1) for a, b, e in zip(ids, ids[1:], events))
    assert all(not e.round.speculative and e.round.verify_ms > 0 for e in events)


async def test_same_seed_same_tokens_and_seeds_differ(servers, tiny_model):
    stub = await servers.start(tiny_model)
    runs = [await generate(stub, request([1, 2, 3], 16, temperature=1.0, seed=seed)) for seed in (7, 7, 8)]
    assert runs[0][0] == runs[1][0]
    assert runs[0][0] != runs[2][0]


async def test_text_prompt_streams_text_with_the_embedded_model(servers):
    path = resolve_model(None)
    tokenizer = load_tokenizer(path)
    stub = await servers.start(load_model(path), tokenizer=tokenizer)
    req = verifier_pb2.GenerateRequest(prompt_text="import os\n\n\ndef read_file(path):", max_new_tokens=20)
    text, tokens = "", []
    async for event in stub.Generate(req):
        text += event.text_delta
        tokens += list(event.token_ids)
    assert text == tokenizer.decode(tokens)
    assert text.startswith("\n    ")


async def test_an_id_prompt_streams_text_too_where_there_is_a_tokenizer(servers, tiny_model):
    """Text is streamed whenever the verifier has a tokenizer (`tandem generate --prompt-ids`
    printed raw ids before); text_delta is set on every token event there — and never where
    there is no tokenizer — so a client knows which it gets from the first event."""
    path = resolve_model(None)
    tokenizer = load_tokenizer(path)
    stub = await servers.start(load_model(path), tokenizer=tokenizer)
    req = verifier_pb2.GenerateRequest(prompt_ids=verifier_pb2.TokenIds(ids=tokenizer.encode("def main():").ids),
                                       max_new_tokens=12)
    events = [event async for event in stub.Generate(req) if event.token_ids]
    assert events and all(event.HasField("text_delta") for event in events)
    tokens = [t for event in events for t in event.token_ids]
    assert "".join(event.text_delta for event in events) == tokenizer.decode(tokens)
    await servers.stop()
    stub = await servers.start(tiny_model)
    events = [event async for event in stub.Generate(request([1, 2, 3], 4)) if event.token_ids]
    assert events and not any(event.HasField("text_delta") for event in events)


async def test_eos_stops_and_is_not_emitted(servers, tiny_model):
    stub = await servers.start(tiny_model)
    tokens, _, _ = await generate(stub, request([1, 2, 3], 12))
    eos = tokens[4]
    req = request([1, 2, 3], 12)
    req.stop.eos_token_ids.append(eos)
    stopped, final, rounds = await generate(stub, req)
    assert stopped == tokens[: tokens.index(eos)]
    assert final.finish_reason == "stop"
    # the round that committed the eos counts, and so does its token: plain rounds commit one each
    assert final.stats.rounds == len(stopped) + 1 and final.stats.mean_accepted_length == 1.0


async def test_quantize_fp8_loads_the_model_fp8_and_serves_its_tokens(servers):
    """--quantize fp8: the verifier loads the embedded model, makes it FP8, and serves what that
    model decodes (its reference forward, greedy) — a model with half its weight bytes or less."""
    from shared.model.loader import resident_bytes
    from shared.model.quantize import is_fp8

    stub = await servers.start(None, quantize="fp8")
    model = servers.verifier.service.model
    assert is_fp8(model) and resident_bytes(model) < 0.5 * resident_bytes(load_model(resolve_model(None), parts="trunk"))
    prompt = [0, 5, 17, 42, 7]
    tokens, final, _ = await generate(stub, request(prompt, 12))
    ids = torch.tensor(prompt)
    expected = []
    with torch.no_grad():
        for _ in range(12):
            logits, _ = model(ids, model.new_cache(64))
            expected.append(int(logits[-1].argmax()))
            ids = torch.cat([ids, torch.tensor(expected[-1:])])
    assert tokens == expected and final is not None

"""Concurrent requests through a real verifier with batched rounds (fused path, CPU torch ops):
a request's tokens do not depend on what else runs, KV slots and blocks all come back, and a
request refused for capacity leaves the others untouched."""

import asyncio
import threading

import grpc
import pytest

from shared.protocol import common_pb2

from .conftest import ScriptedDrafter, chain, generate, request


@pytest.fixture(autouse=True)
def torch_reference_ops(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # seconds per batched step otherwise


def propose(state):
    """Three drafts, a function of the committed tokens only (some accepted, some not)."""
    last = state.tokens[-1]
    return chain(state, [(last * 7 + j) % 97 for j in range(3)])


MIXED = [  # prompt, new tokens, temperature, seed, speculate
    ([5, 17, 42], 14, 0.0, 1, False),
    ([9, 9, 8, 7, 6, 5, 4, 3, 2, 1, 11], 10, 0.8, 2, True),
    ([33], 12, 1.0, 3, False),
    ([60, 61, 62, 63, 64], 14, 0.0, 4, True),
    ([2, 4, 8, 16, 32, 64, 31], 8, 0.7, 5, True),
    ([70, 3, 70, 3], 14, 1.2, 6, False),
    ([12, 24, 36, 48, 60, 72, 84, 96, 11, 22, 33, 44, 55], 11, 0.0, 7, True),
    ([1, 1, 2, 3, 5, 8], 13, 0.9, 8, False),
]


def mixed_request(prompt, new_tokens, temperature, seed, speculate):
    return request(prompt, new_tokens, temperature=temperature, seed=seed, max_draft_tokens=3, disable=not speculate,
                   top_k=40)


async def cancelled_midway(stub, after_events: int) -> int:
    call = stub.Generate(mixed_request([50, 51, 52, 53], 40, 0.8, 99, True))
    seen = 0
    async for _ in call:
        seen += 1
        if seen == after_events:
            call.cancel()
            break
    return seen


async def wait_until(predicate, timeout_s=5.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate() and loop.time() < deadline:
        await asyncio.sleep(0.02)
    return predicate()


async def test_concurrent_mixed_requests_match_each_run_alone(servers, tiny_model):
    stub = await servers.start(tiny_model, drafter=ScriptedDrafter(propose), fused="on", max_sessions=9,
                               batch_gather_ms=20.0)
    service = servers.verifier.service
    assert service.engine.path == "fused"
    alone = [(await generate(stub, mixed_request(*m)))[0] for m in MIXED]
    batches_before = service.metrics.registry.get_sample_value("tandem_verifier_batch_rounds_count")

    results = await asyncio.gather(*(generate(stub, mixed_request(*m)) for m in MIXED), cancelled_midway(stub, 3))
    together = [tokens for tokens, _, _ in results[:-1]]
    assert together == alone
    assert all(final.finish_reason == "length" for _, final, _ in results[:-1])
    assert results[-1] == 3
    # rounds really ran in batches of several sessions
    registry = service.metrics.registry
    batches = registry.get_sample_value("tandem_verifier_batch_rounds_count") - batches_before
    rounds = sum(final.stats.rounds for _, final, _ in results[:-1])
    assert batches < rounds
    # the cancelled request's slot comes back too, and it is counted as cancelled
    assert await wait_until(lambda: service.engine.free_slots == 9 and service.active == 0)
    assert service.engine.free_kv_blocks == service.engine.kv_plan.num_blocks and service.admission.blocks_held == 0
    assert registry.get_sample_value("tandem_verifier_requests_total", {"finish_reason": "cancelled"}) == 1


async def test_a_small_kv_pool_queues_requests_by_blocks_and_refuses_what_never_fits(servers, tiny_model):
    """A pool of 8 blocks of 8 positions holds two of these requests at a time (each holds 3-4
    blocks for its prompt, completion and one window) though 9 sessions are allowed: the rest
    wait for blocks and still get their tokens alone; a request larger than the whole pool is
    refused at once, naming the limit, and the blocks all come back."""
    stub = await servers.start(tiny_model, drafter=ScriptedDrafter(propose), fused="on", max_sessions=9,
                               kv_block_size=8, kv_cache_tokens=64, batch_gather_ms=5.0)
    service = servers.verifier.service
    assert service.engine.kv_plan.num_blocks == 8 and service.engine.free_kv_blocks == 8
    registry = service.metrics.registry
    assert registry.get_sample_value("tandem_verifier_kv_blocks") == 8
    alone = [(await generate(stub, mixed_request(*m)))[0] for m in MIXED]
    most_held = 0

    async def watch():
        nonlocal most_held
        while True:
            most_held = max(most_held, registry.get_sample_value("tandem_verifier_kv_blocks_held"))
            assert service.admission.blocks_held <= 8 and service.engine.free_kv_blocks >= 0
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    too_large = mixed_request([5, 6, 7], 70, 0.0, 1, False)  # 3 + 70 + 3 + 1 positions: 10 blocks
    results = await asyncio.gather(*(generate(stub, mixed_request(*m)) for m in MIXED), generate(stub, too_large),
                                   return_exceptions=True)
    watcher.cancel()
    assert [tokens for tokens, _, _ in results[:-1]] == alone
    refused = results[-1]
    assert isinstance(refused, grpc.aio.AioRpcError) and refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "10 KV blocks" in refused.details() and "kv_cache_tokens = 64" in refused.details()
    assert 6 <= most_held <= 8  # two at a time filled the pool; never more
    assert max(final.stats.queue_ms for _, final, _ in results[:-1]) > 0  # some waited for blocks
    assert await wait_until(lambda: service.engine.free_kv_blocks == 8 and service.admission.blocks_held == 0)
    assert registry.get_sample_value("tandem_verifier_kv_blocks_held") == 0


async def test_a_request_refused_for_capacity_leaves_the_others_untouched(servers, tiny_model):
    stub = await servers.start(tiny_model, drafter=ScriptedDrafter(propose), fused="on", max_sessions=2, max_queued=0)
    service = servers.verifier.service
    first, second = [(prompt, 40, *rest) for prompt, _, *rest in (MIXED[1], MIXED[3])]
    alone = [(await generate(stub, mixed_request(*m)))[0] for m in (first, second)]

    async def refused_while_full():
        assert await wait_until(lambda: service.active == 2)
        # the engine loop held (a job between steps) while the third arrives: neither of the two
        # can finish first, however fast their rounds
        held, release = threading.Event(), threading.Event()
        service.worker.submit(lambda: held.set() or release.wait(10))
        try:
            assert await asyncio.to_thread(held.wait, 10)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await generate(stub, mixed_request(*MIXED[0]))
        finally:
            release.set()
        return refused.value

    results = await asyncio.gather(generate(stub, mixed_request(*first)), generate(stub, mixed_request(*second)),
                                   refused_while_full())
    assert [results[0][0], results[1][0]] == alone
    error = results[2]
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_sessions" in error.details()
    assert await wait_until(lambda: service.engine.free_slots == 2)


async def test_probabilistic_requests_batch_like_alone(servers, tiny_model):
    """Probabilistic rounds with q rows, several at once, draw what each draws alone."""
    from .conftest import sampled_chain

    q = {3: 0.4, 9: 0.3, 27: 0.2, 81: 0.1}
    stub = await servers.start(tiny_model, drafter=ScriptedDrafter(lambda state: sampled_chain(state, q, 3)),
                               fused="on", max_sessions=4, batch_gather_ms=20.0, probabilistic_drafters="any")

    def probabilistic(seed):
        return request([7, 14, 21], 12, temperature=0.9, seed=seed, mode=common_pb2.MODE_PROBABILISTIC,
                       max_draft_tokens=3)

    alone = [(await generate(stub, probabilistic(seed)))[0] for seed in (1, 2, 3, 4)]
    together = await asyncio.gather(*(generate(stub, probabilistic(seed)) for seed in (1, 2, 3, 4)))
    assert [tokens for tokens, _, _ in together] == alone


async def test_a_long_prompt_prefills_in_chunks_between_other_sessions_rounds(servers, tiny_model):
    """Chunked prefill: each chunk is its own job on the model worker, so a session already
    decoding keeps getting rounds while a long prompt is prefilled (it is not stalled for the
    whole prompt), and the long request's tokens are what it produces alone."""
    stub = await servers.start(tiny_model, fused="on", max_sessions=2, prefill_chunk=4)
    service = servers.verifier.service
    prefiller, engine = service.prefiller, service.engine
    long_prompt = [(7 * i) % 97 for i in range(80)]  # 79 tokens to prefill: 20 chunks of <= 4
    alone = (await generate(stub, request(long_prompt, 6)))[0]

    jobs = []  # the worker's jobs in the order they ran
    run_prefill, run_rounds = prefiller.run_prefill, engine.run_rounds

    def logged_prefill(chunks):
        jobs.append(("prefill", tuple(session.spec.request_id for session, _ in chunks)))
        return run_prefill(chunks)

    def logged_run_rounds(rounds):
        jobs.append(("rounds", tuple(r.session.spec.request_id for r in rounds)))
        return run_rounds(rounds)

    prefiller.run_prefill, engine.run_rounds = logged_prefill, logged_run_rounds
    decoding = stub.Generate(request([5, 17, 42], 60))
    await anext(aiter(decoding))  # the short request decodes before the long one arrives
    long_tokens, final, _ = await generate(stub, request(long_prompt, 6))
    decoding.cancel()

    prefills = [i for i, (kind, _) in enumerate(jobs) if kind == "prefill" and i > 0]  # job 0: the short prompt
    assert len(prefills) == 20, jobs
    rounds_between = [job for job in jobs[prefills[0] : prefills[-1]] if job[0] == "rounds"]
    assert len(rounds_between) >= 5, [(k, i[0][:4]) for k, i in jobs]  # the decoding session ran on during the long prefill
    assert long_tokens == alone and final.finish_reason == "length"


async def test_prompts_arriving_together_prefill_in_shared_forwards(servers, tiny_model):
    """Batched prefill: requests that arrive together share prefill jobs under the token budget
    (oldest first, whole chunks, a long prompt chunked), and each request's tokens are what it
    produces alone."""
    stub = await servers.start(tiny_model, fused="on", max_sessions=4, prefill_chunk=16)
    prefiller = servers.verifier.service.prefiller
    prompts = [[(5 * i + k) % 97 for i in range(n)] for k, n in enumerate((10, 30, 7, 5))]
    alone = [(await generate(stub, request(prompt, 5)))[0] for prompt in prompts]

    jobs = []  # (request ids, tokens) of each prefill job
    run_prefill = prefiller.run_prefill

    def logged_prefill(chunks):
        jobs.append(([session.spec.request_id for session, _ in chunks], sum(count for _, count in chunks)))
        return run_prefill(chunks)

    # "Together" made exact: each request's handler is held at the batcher's door until all four
    # are there (on a loaded machine the first job could otherwise start before the others arrive).
    # The four then enter before the runner task first runs, so the batcher sees all four.
    prefill, arrived, all_in = prefiller.prefill, [], asyncio.Event()

    async def prefill_together(session):
        arrived.append(session)
        if len(arrived) == len(prompts):
            all_in.set()
        await all_in.wait()
        return await prefill(session)

    prefiller.run_prefill, prefiller.prefill = logged_prefill, prefill_together
    together = await asyncio.gather(*(generate(stub, request(prompt, 5)) for prompt in prompts))
    assert [tokens for tokens, _, _ in together] == alone
    assert sum(tokens for _, tokens in jobs) == sum(len(p) - 1 for p in prompts)
    assert all(tokens <= 16 for _, tokens in jobs), jobs
    assert max(len(ids) for ids, _ in jobs) >= 2, jobs  # prompts shared a forward
    # fewer jobs than the prompts' 5 chunks (9, 16 + 13, 6, 4 tokens) in any arrival order: the
    # 30-token prompt's two chunks run alone, and any two of the other three fit one job
    assert len(jobs) <= 4, jobs


async def test_a_request_cancelled_while_its_batch_runs_breaks_no_other(servers, tiny_model):
    """The batch holding a cancelled request's round is on the model worker when the request's
    handler ends: the batch must still find that session's KV slot, and the other request in
    it must finish as it does alone."""
    import threading

    stub = await servers.start(tiny_model, fused="on", max_sessions=2, batch_gather_ms=50.0)
    service = servers.verifier.service
    other = MIXED[0]
    alone = (await generate(stub, mixed_request(*other)))[0]
    entered, release = threading.Event(), threading.Event()
    run_rounds = service.engine.run_rounds

    def held(rounds):  # the first batch of two rounds waits on the worker until released
        if len(rounds) == 2 and not release.is_set():
            entered.set()
            release.wait(10)
        return run_rounds(rounds)

    service.engine.run_rounds = held
    victim = stub.Generate(mixed_request([50, 51, 52, 53], 40, 0.0, 99, False))
    others = asyncio.ensure_future(generate(stub, mixed_request(*other)))
    assert await wait_until(lambda: entered.is_set())
    victim.cancel()
    assert await wait_until(lambda: service.active == 1)  # the cancelled handler has ended
    release.set()
    tokens, final, _ = await others
    assert tokens == alone and final.finish_reason == "length"
    assert await wait_until(lambda: service.engine.free_slots == 2)

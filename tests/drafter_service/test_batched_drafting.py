"""Batched drafting (issue 11): the MTP work of concurrent streams on one drafter runs in
shared worker jobs and shared forwards, and every stream gets the chains it gets alone."""

import asyncio

import grpc
import pytest
import torch

from drafter_service.server import DrafterServer
from drafter_service.settings import DrafterSettings
from shared.protocol import common_pb2, drafter_pb2_grpc

PROMPTS = [[5, 17, 42, 8, 71, 3], [9, 1, 60, 33], [11, 12, 13, 14, 15, 16, 17, 18], [40, 41]]
ROUNDS = 4


@pytest.fixture(autouse=True)
def torch_reference_ops(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the fused ops' torch code: the interpreter is slow


def hidden_rows(model, n, seed):
    return torch.randn(n, model.config.hidden_size, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def stream(open_up, commit_up):
    """await stream(stub, model, index), its messages built by open_up and commit_up."""

    async def stream(stub, model, index):
        """Open on PROMPTS[index], then commit each chain's first draft (or 7) and one token more:
        every chain's (source, tokens)."""
        prompt = PROMPTS[index]
        call = stub.Draft()
        await call.write(open_up(model, prompt, session_id=f"s{index}",
                                 hidden=hidden_rows(model, len(prompt) - 1, index), max_draft_tokens=3))
        chains = [(await call.read()).chain]
        for round_id in range(ROUNDS):
            emitted = [chains[-1].token_ids[0] if chains[-1].token_ids else 7, (index * 13 + round_id) % 97]
            message = commit_up(model, round_id=round_id, emitted=emitted, num_verified=len(chains[-1].token_ids),
                                num_accepted=min(1, len(chains[-1].token_ids)))
            message.commit.hidden.CopyFrom(open_up(model, [0] * 3,
                                                   hidden=hidden_rows(model, 2, 100 * index + round_id)).open.hidden)
            await call.write(message)
            chains.append((await call.read()).chain)
        await call.done_writing()
        return [(chain.source, list(chain.token_ids), list(chain.confidences)) for chain in chains]

    return stream


async def test_concurrent_streams_batch_their_mtp_work_and_draft_what_they_draft_alone(tiny_mtp_model, stream):
    server = DrafterServer(DrafterSettings(port=0, planner="mtp", fused="on", draft_ahead=False), model=tiny_mtp_model)
    port = await server.start()
    await server.wait_loaded()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = drafter_pb2_grpc.DrafterStub(channel)
            alone = [await stream(stub, tiny_mtp_model, i) for i in range(len(PROMPTS))]
            metrics = server.service.metrics.registry
            jobs_alone = metrics.get_sample_value("tandem_drafter_mtp_batch_count")
            assert metrics.get_sample_value("tandem_drafter_mtp_batch_sum") == jobs_alone  # one session a job
            together = await asyncio.gather(*(stream(stub, tiny_mtp_model, i) for i in range(len(PROMPTS))))
        assert together == alone
        assert all(source == common_pb2.DRAFT_SOURCE_MTP for chains in alone for source, _, _ in chains)
        jobs = metrics.get_sample_value("tandem_drafter_mtp_batch_count") - jobs_alone
        items = metrics.get_sample_value("tandem_drafter_mtp_batch_sum") - jobs_alone
        assert items == len(PROMPTS) * (ROUNDS + 1) and jobs < items  # every chain a batcher item; jobs shared
        pool = server.service.drafter.mtp.runner.pool
        await asyncio.sleep(0.2)  # the streams' slots go back on the worker, after their last jobs
        assert pool.num_free == pool.num_slots and pool.num_free_blocks == pool.num_blocks
    finally:
        await server.stop(0)


async def test_a_reopened_or_broken_stream_gives_its_mtp_rows_back(tiny_mtp_model, open_up, commit_up):
    """The pool slot of a session replaced by a re-open on its stream, and of a stream that ends
    in an error, return to the pool."""
    server = DrafterServer(DrafterSettings(port=0, planner="mtp", fused="on", draft_ahead=False), model=tiny_mtp_model)
    port = await server.start()
    await server.wait_loaded()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = drafter_pb2_grpc.DrafterStub(channel).Draft()
            for prompt in ([1, 2, 3, 4], [5, 6, 7]):  # the second open replaces the first session
                await call.write(open_up(tiny_mtp_model, prompt))
                assert (await call.read()).HasField("chain")
            await call.write(commit_up(tiny_mtp_model, round_id=5))  # the wrong round: refused, the stream ends
            with pytest.raises(grpc.aio.AioRpcError):
                await call.read()
        pool = server.service.drafter.mtp.runner.pool
        for _ in range(50):
            if pool.num_free == pool.num_slots:
                break
            await asyncio.sleep(0.02)
        assert pool.num_free == pool.num_slots and pool.num_free_blocks == pool.num_blocks
    finally:
        await server.stop(0)

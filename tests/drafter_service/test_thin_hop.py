"""The thin hop (issue 13): a round drafted by suffix lookup never leaves the event loop; model
work (an open's catch-up, MTP drafts, deferred MTP rows) runs on the model worker."""

import pytest

from drafter_service.proposers.global_index import GlobalIndex
from drafter_service.proposers.suffix import SuffixIndex
from shared.protocol import common_pb2, drafter_pb2_grpc

REPEATING = [7, 8, 9, 10, 11] * 6  # a prompt whose suffix lookups find continuations


@pytest.fixture
def rounds(open_up, commit_up):
    """await rounds(channel, model, num_rounds), its messages built by open_up and commit_up."""

    async def rounds(channel, model, num_rounds):
        """Open on REPEATING, then commit each chain's first draft (or 7) for `num_rounds` rounds:
        (the chains, the tokens committed)."""
        call = drafter_pb2_grpc.DrafterStub(channel).Draft()
        await call.write(open_up(model, REPEATING, max_draft_tokens=4))
        chains, emitted = [(await call.read()).chain], []
        for round_id in range(num_rounds):
            emitted.append(chains[-1].token_ids[0] if chains[-1].token_ids else 7)
            await call.write(commit_up(model, round_id=round_id, emitted=emitted[-1:]))
            chains.append((await call.read()).chain)
        await call.done_writing()
        return chains, emitted

    return rounds


async def test_suffix_rounds_run_no_worker_job(tiny_mtp_model, worker_jobs, rounds, serve_drafter):
    async with serve_drafter(tiny_mtp_model, "suffix") as (_, channel):
        chains, _ = await rounds(channel, tiny_mtp_model, 6)
    assert sum(c.source == common_pb2.DRAFT_SOURCE_SUFFIX for c in chains) >= 5  # the rounds drafted
    # at load, the model thread's CPU threads and device (shared/threads.py); one job for the open (its MTP
    # catch-up, timed); after that only MTP batcher jobs, which with suffix chains only ever run
    # the deferred MTP rows of each commit after its chain went out — no job between a commit
    # and its chain
    assert worker_jobs[:3] == ["use_threads", "use_device", "open"] and set(worker_jobs[3:]) <= {"mtp_batch"}, worker_jobs


async def test_mtp_chains_draft_on_the_worker(tiny_mtp_model, worker_jobs, rounds, serve_drafter):
    async with serve_drafter(tiny_mtp_model, "mtp") as (_, channel):
        chains, _ = await rounds(channel, tiny_mtp_model, 4)
    assert all(c.source == common_pb2.DRAFT_SOURCE_MTP and c.costs.draft_ms > 0 for c in chains)
    assert worker_jobs.count("mtp_batch") == len(chains)  # the batcher's jobs (one stream: one chain each)


def test_the_global_index_counted_in_steps_equals_counted_at_once():
    output = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4] * 3
    at_once, in_steps = GlobalIndex(1 << 20), GlobalIndex(1 << 20)
    at_once.add(output)
    assert sum(1 for _ in in_steps.adding(output, 7)) == -(-len(output) // 7) - 1  # a pause between steps
    assert len(in_steps) == len(at_once)
    index = SuffixIndex()
    index.extend([0, 3, 1, 4, 1, 5])
    assert in_steps.lookup(index, 4) == at_once.lookup(index, 4) is not None

"""The verifier's engine loop runs torch ops on the threads shared/threads.py plans: beside a
drafter on this host every core while no request drafts, one left to the drafter while some
do; or what --cpu-threads says."""

import torch

from shared.threads import available_cores

from .conftest import ScriptedDrafter, chain, generate, request


def drafts_of(state):
    return chain(state, [5, 6])  # (whether they are accepted does not matter here)


async def test_a_verifier_beside_its_drafter_yields_it_a_core_while_requests_draft(servers, tiny_model):
    stub = await servers.start(tiny_model, drafter=ScriptedDrafter(drafts_of))
    loop = servers.verifier.service.worker
    cores = available_cores()
    assert await loop.run(torch.get_num_threads) == cores  # nobody drafts yet
    seen = []
    loop.on_drafting = lambda drafting, yield_core=loop.on_drafting: (seen.append(drafting), yield_core(drafting))
    _, final, rounds = await generate(stub, request([1, 2, 3], 6))
    assert final.stats.speculative_rounds > 0 and seen == [True]
    assert await loop.run(torch.get_num_threads) == max(cores - 1, 1)  # (no step since)
    _, final, _ = await generate(stub, request([1, 2, 3], 4, disable=True))  # a request without drafts
    assert final.stats.speculative_rounds == 0 and seen == [True, False]
    assert await loop.run(torch.get_num_threads) == cores


async def test_cpu_threads_says_how_many_whatever_drafts(servers, tiny_model):
    stub = await servers.start(tiny_model, drafter=ScriptedDrafter(drafts_of), cpu_threads=3)
    loop = servers.verifier.service.worker
    assert loop.on_drafting is None
    await generate(stub, request([1, 2, 3], 6))
    assert await loop.run(torch.get_num_threads) == 3

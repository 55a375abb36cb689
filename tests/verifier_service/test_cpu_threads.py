"""The verifier's engine loop runs on the threads shared/threads.py plans: beside a drafter on
this host its native steps take every core while no request drafts and leave one to the
drafter while some do, and torch's ops keep every core throughout (their bits may follow their
threads: a request's tokens may not depend on another's drafting); or what --cpu-threads says."""

import torch

from shared.threads import available_cores, step_threads

from .conftest import ScriptedDrafter, chain, generate, request


def drafts_of(state):
    return chain(state, [5, 6])  # (whether they are accepted does not matter here)


async def test_a_verifier_beside_its_drafter_yields_it_a_core_while_requests_draft(servers, tiny_model):
    stub = await servers.start(tiny_model, drafter=ScriptedDrafter(drafts_of))
    loop = servers.verifier.service.worker
    cores = available_cores()

    async def threads():  # (on the loop's thread: the step's, torch's)
        return await loop.run(lambda: (step_threads(), torch.get_num_threads()))

    assert await threads() in ((None, cores), (cores, cores))  # nobody drafts yet
    seen = []
    loop.on_drafting = lambda drafting, yield_core=loop.on_drafting: (seen.append(drafting), yield_core(drafting))
    _, final, rounds = await generate(stub, request([1, 2, 3], 6))
    assert final.stats.speculative_rounds > 0 and seen == [True]
    assert await threads() == (max(cores - 1, 1), cores)  # (no step since)
    _, final, _ = await generate(stub, request([1, 2, 3], 4, disable=True))  # a request without drafts
    assert final.stats.speculative_rounds == 0 and seen == [True, False]
    assert await threads() == (cores, cores)


async def test_cpu_threads_says_how_many_whatever_drafts(servers, tiny_model):
    stub = await servers.start(tiny_model, drafter=ScriptedDrafter(drafts_of), cpu_threads=3)
    loop = servers.verifier.service.worker
    assert loop.on_drafting is None
    await generate(stub, request([1, 2, 3], 6))
    assert await loop.run(torch.get_num_threads) == 3

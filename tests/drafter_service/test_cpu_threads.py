"""A drafter and a verifier on one host split its cores (shared/threads.py): on the CPU the
drafter's model thread takes one thread by default; the verifier's engine loop takes every core
until a request drafts (tests/verifier_service/test_cpu_threads.py)."""

import torch

from shared.threads import available_cores


async def test_a_pair_on_one_host_splits_its_cores(pair, demo_model):
    await pair.start(demo_model)
    assert await pair.drafter.service.worker.run(torch.get_num_threads) == 1
    assert await pair.verifier.service.worker.run(torch.get_num_threads) == available_cores()


async def test_cpu_threads_overrides_the_drafter_s_default(pair, demo_model):
    await pair.start(demo_model, drafter_settings={"cpu_threads": 2})
    assert await pair.drafter.service.worker.run(torch.get_num_threads) == 2

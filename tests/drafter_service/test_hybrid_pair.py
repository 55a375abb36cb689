"""The Qwen3-Next / Qwen3.5-MoE family through both services (issue 17): each loads its part
of a checkpoint with `mtp.*` tensors — the verifier the trunk, a lean drafter the MTP layer,
embeddings and lm_head — and MTP drafting is lossless: exact mode token-identical to plain."""

import pytest

from shared.protocol import common_pb2

from ..shared.model.next_checkpoints import with_mtp, write_checkpoint

PROMPT = [3, 14, 15, 92, 65, 35]


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5"])
def checkpoint(request, tmp_path_factory, next_pair):
    name = "hybrid" if request.param == "qwen3_next" else "qwen3.5"
    return write_checkpoint(tmp_path_factory.mktemp(request.param), with_mtp(next_pair(name)[1]), request.param)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
async def test_mtp_drafts_through_the_pair_are_lossless(pair, checkpoint, temperature, same_with_and_without):
    stub = await pair.start(None, model=str(checkpoint), drafter_settings={"planner": "mtp", "model": str(checkpoint)})
    drafter, verifier = pair.drafter.service, pair.verifier.service
    assert drafter.drafter.mtp is not None and len(drafter.model.layers) == 0  # lean: never the trunk
    assert verifier.model.mtp is None and len(verifier.model.layers) == 4
    drafter_bytes = drafter.metrics.registry.get_sample_value("tandem_drafter_model_bytes")
    verifier_bytes = verifier.metrics.registry.get_sample_value("tandem_verifier_model_bytes")
    assert 0 < drafter_bytes < verifier_bytes
    for seed in range(2):
        spec, plain, final, rounds = await same_with_and_without(stub, PROMPT, 16, temperature, seed)
        assert spec == plain and spec  # (eos, id 0, may end it early)
        assert final.stats.proposed > 0 and final.stats.drafter_faults == 0
        assert any(r.source == common_pb2.DRAFT_SOURCE_MTP for r in rounds)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
async def test_a_drafter_with_experts_in_host_memory_and_moce_stays_lossless(pair, checkpoint, temperature,
                                                                           same_with_and_without):
    """The lean drafter with 2 of its MTP layer's 8 experts on the device and MoCE on its draft
    rows (scale 3): drafts change, the output does not — exact mode token-identical to plain."""
    from shared.model.families.hybrid.loader import expert_modules

    stub = await pair.start(None, model=str(checkpoint), drafter_settings={
        "planner": "mtp", "model": str(checkpoint), "expert_slots": 2, "moce_scale": 3.0})
    drafter = pair.drafter.service
    assert drafter.drafter.mtp.runner.routing.moce and drafter.drafter.mtp.runner.routing.scale == 3.0
    stores = [experts.store for experts in expert_modules(drafter.model)]
    assert stores and all(store.num_slots == 2 and not store.all_resident for store in stores)
    spec, plain, final, rounds = await same_with_and_without(stub, PROMPT, 16, temperature, 0)
    assert spec == plain and spec
    assert final.stats.proposed > 0 and final.stats.drafter_faults == 0
    assert any(r.source == common_pb2.DRAFT_SOURCE_MTP for r in rounds)
    assert sum(store.counters.hits + store.counters.misses for store in stores) > 0


async def test_both_services_on_random_weights_from_a_config_alone(pair, tmp_path, same_with_and_without):
    """`--random-weights` on both services (benchmarks at real shapes without a checkpoint): the
    verifier builds its trunk and the drafter its lean part from config.json alone, and MTP
    drafts (noise here) still leave exact mode token-identical to plain decoding."""
    import json

    from ..shared.model.next_checkpoints import FUSED_CONFIG

    (tmp_path / "config.json").write_text(json.dumps(FUSED_CONFIG))
    stub = await pair.start(None, model=str(tmp_path), random_weights=True,
                            drafter_settings={"planner": "mtp", "model": str(tmp_path), "random_weights": True})
    drafter, verifier = pair.drafter.service, pair.verifier.service
    assert drafter.drafter.mtp is not None and len(drafter.model.layers) == 0
    assert verifier.model.mtp is None and len(verifier.model.layers) == FUSED_CONFIG["num_hidden_layers"]
    assert any(p.abs().sum() > 0 for p in drafter.model.mtp.parameters())  # weights made, not left empty
    spec, plain, final, rounds = await same_with_and_without(stub, PROMPT, 8, 0.0, 0)
    assert spec == plain and spec
    assert final.stats.proposed > 0 and any(r.source == common_pb2.DRAFT_SOURCE_MTP for r in rounds)

"""The hybrid family's lean drafter on the fused path (issue 34): its MTP layer through the same
kernels as the verifier's trunk; exact mode token-identical to plain decoding. On a CPU box the
kernels run in Triton's interpreter, which is not thread-safe: the verifier here runs its
reference path (its fused path: tests/verifier_service/test_hybrid_fused.py)."""

import pytest

from shared.model.mtp_runner import PooledMtpRunner
from shared.model.quantize import is_fp8
from shared.protocol import common_pb2

from ..shared.model.next_checkpoints import write_fused_checkpoint
from ..verifier_service.conftest import generate, request

PROMPT = [3, 14, 15, 92, 65, 35, 89]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_fused_checkpoint(tmp_path_factory.mktemp("hybrid-fused"))


@pytest.mark.parametrize("quantize", ["auto", "fp8"])
async def test_fused_mtp_drafts_through_the_pair_are_lossless(pair, checkpoint, quantize):
    """quantize fp8: both services make the checkpoint's weights FP8 on load (--quantize fp8),
    the drafter's MTP rows through the FP8 kernels; exact mode still emits plain decoding's tokens."""
    stub = await pair.start(None, model=str(checkpoint), drafter_deadline_ms=60000.0,  # (the interpreter is slow)
                            quantize=quantize,
                            drafter_settings={"planner": "mtp", "model": str(checkpoint), "fused": "on",
                                              "quantize": quantize})
    assert isinstance(pair.drafter.service.drafter.mtp.runner, PooledMtpRunner)
    assert is_fp8(pair.drafter.service.model) == (quantize == "fp8") == is_fp8(pair.verifier.service.model)
    req = request(PROMPT, 10, temperature=0.0, seed=0)
    spec, final, rounds = await generate(stub, req)
    req.speculation.disable = True
    plain, _, _ = await generate(stub, req)
    assert spec == plain and spec
    assert final.stats.proposed > 0 and final.stats.drafter_faults == 0
    assert any(r.source == common_pb2.DRAFT_SOURCE_MTP for r in rounds)

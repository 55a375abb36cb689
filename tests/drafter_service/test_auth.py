"""The drafter's Draft streams take a bearer token (issue 12, item 3): a verifier with the
token drafts; one without it (or with a wrong one) is refused and decodes plainly."""

import pytest

from ..verifier_service.conftest import generate, request

PROMPT = [5, 17, 42, 8, 71, 3, 9]


@pytest.mark.parametrize("link", ["grpc", "local"])
@pytest.mark.parametrize("sent", ["s3cret", None, "wrong"])
async def test_draft_streams_need_the_drafter_token(pair, tiny_mtp_model, sent, link):
    stub = await pair.start(tiny_mtp_model, drafter_settings={"auth_token": "s3cret", "planner": "mtp"}, drafter_token=sent,
                            max_draft_tokens=3, link=link)
    req = request(PROMPT, 12)
    tokens, final, rounds = await generate(stub, req)
    req.speculation.disable = True
    plain, _, _ = await generate(stub, req)
    assert tokens == plain
    drafted = sum(r.retained for r in rounds)
    assert pair.local_streams() == ((1 if sent == "s3cret" else 0) if link == "local" else None)
    if sent == "s3cret":
        assert drafted > 0 and final.stats.drafter_faults == 0
    else:
        assert drafted == 0 and final.stats.drafter_faults > 0  # refused: UNAUTHENTICATED streams
        # and no round waited out its deadline for a chain from a stream already refused
        faults = pair.verifier.service.metrics.registry.get_sample_value
        assert faults("tandem_verifier_drafter_faults_total", {"kind": "stream_lost"}) > 0
        assert faults("tandem_verifier_drafter_faults_total", {"kind": "deadline"}) in (None, 0)

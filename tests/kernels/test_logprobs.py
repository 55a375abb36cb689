"""kernels.logprobs against float64 definitions: the chosen token's log-probability, its rank
and the top alternatives, under the model's raw law and the processed one."""

import math

import pytest
import torch

from kernels.logprobs import MAX_TOP_LOGPROBS, processed_logprobs, raw_logprobs
from kernels.sampling import PAD_ID, SamplingParams, process_logits


@pytest.fixture
def logits():
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn((5, 97), generator=generator) * 3
    rows[2, 10] = rows[2, 11] = rows[2].max() + 1  # a tie at the top
    return rows


def test_raw_logprobs_match_the_float64_log_softmax(logits):
    chosen = torch.tensor([0, 5, 11, 96, 40])
    out = raw_logprobs(logits, chosen, 4)
    reference = torch.log_softmax(logits.double(), dim=-1)
    for i, token in enumerate(chosen.tolist()):
        assert out.logprobs[i].item() == pytest.approx(reference[i, token].item(), abs=1e-5)
        assert out.ranks[i].item() == int((reference[i] > reference[i, token] + 1e-9).sum()) + 1
        order = torch.argsort(reference[i], descending=True)[:4]
        assert sorted(out.top_ids[i].tolist()) == sorted(order.tolist())  # (ties: any order)
        assert out.top_logprobs[i].tolist() == pytest.approx(reference[i, order].tolist(), abs=1e-5)
        assert out.top_logprobs[i].tolist() == sorted(out.top_logprobs[i].tolist(), reverse=True)
    assert out.ranks[2].item() == 1  # tied for the top: nothing strictly more likely


def test_raw_logprobs_with_no_alternatives(logits):
    out = raw_logprobs(logits, logits.argmax(-1), 0)
    assert out.top_ids.shape == (5, 0) and out.ranks.tolist() == [1] * 5


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.05, max_support=8),
])
def test_processed_logprobs_are_the_law_drawn_from(logits, params):
    law = process_logits(logits, params)
    chosen = torch.tensor([law.token_ids[i, 0].item() for i in range(5)])
    chosen[1] = 96 if 96 not in law.row(1) else 95  # (a token outside the support, where possible)
    out = processed_logprobs(logits, chosen, 3, params)
    for i in range(5):
        row = law.row(i)
        p = row.get(int(chosen[i]), 0.0)
        assert out.logprobs[i].item() == (math.log(p) if p > 0 else -math.inf)
        assert out.ranks[i].item() == sum(q > p for q in row.values() if q > 0) + 1
        best = sorted(((q, t) for t, q in row.items() if q > 0), key=lambda x: -x[0])[:3]
        top = [(t, lp) for t, lp in zip(out.top_ids[i].tolist(), out.top_logprobs[i].tolist()) if t != PAD_ID]
        assert [lp for _, lp in top] == pytest.approx([math.log(q) for q, _ in best])
        assert all(math.log(row[t]) == pytest.approx(lp) for t, lp in top)
        # past the support: padding, never a token of no mass
        assert all(lp == -math.inf for t, lp in zip(out.top_ids[i].tolist(), out.top_logprobs[i].tolist()) if t == PAD_ID)


def test_processed_logprobs_of_greedy_rows_are_a_point_mass(logits):
    out = processed_logprobs(logits, logits.argmax(-1), 2, SamplingParams(temperature=0.0))
    assert out.logprobs.tolist() == [0.0] * 5 and out.ranks.tolist() == [1] * 5
    assert out.top_ids[:, 0].tolist() == logits.argmax(-1).tolist() and (out.top_ids[:, 1] == PAD_ID).all()


def test_bad_arguments_are_refused(logits):
    with pytest.raises(ValueError, match="num_top"):
        raw_logprobs(logits, logits.argmax(-1), MAX_TOP_LOGPROBS + 1)
    with pytest.raises(ValueError, match="token_ids"):
        raw_logprobs(logits, torch.tensor([1, 2]), 1)
    with pytest.raises(ValueError, match="logits"):
        raw_logprobs(logits[0], torch.tensor([1]), 1)

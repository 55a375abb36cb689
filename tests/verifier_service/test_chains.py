"""Retention of a validated chain (verifier_service.chains.retain) keeps what the definition keeps:
the policy applied to admission_confidences, whatever the chain's rows."""

import random

import pytest
import torch

from kernels.retention import RetentionPolicy
from kernels.sampling import SparseRows
from kernels.speculative import Gate, Mode, admission_confidences
from verifier_service.chains import ValidChain, retain

POLICIES = [RetentionPolicy(), RetentionPolicy(min_p=0.3), RetentionPolicy(schedule=(0.1, 0.5, 0.9), min_cum=0.2),
            RetentionPolicy(min_cum=0.05)]


def random_rows(rng: random.Random, tokens: list[int]) -> SparseRows:
    rows = []
    for token in tokens:
        others = rng.sample([t for t in range(20) if t != token], rng.randrange(0, 4))
        weights = [rng.random() + 0.01 for _ in range(len(others) + 1)]
        total = sum(weights)
        rows.append(dict(zip([token, *others], [w / total for w in weights])))
    return SparseRows.from_dicts(rows)


@pytest.mark.parametrize("point_masses", [True, False])
def test_retain_keeps_the_definitions_prefix(point_masses):
    """200 random chains per row kind, every mode, gate, policy and limit: the retained chain is
    the first min(policy.keep(admission_confidences), limit) drafts and their rows (point-mass
    chains take a path without torch: their confidences are 1)."""
    rng = random.Random(11)
    for _ in range(200):
        tokens = [rng.randrange(20) for _ in range(rng.randrange(1, 7))]
        q_rows = None if point_masses else random_rows(rng, tokens)
        chain = ValidChain("MTP" if q_rows is not None else "SUFFIX", tokens, q_rows, len(tokens) + 1)
        mode, gate = rng.choice(list(Mode)), rng.choice(list(Gate))
        policy, limit = rng.choice(POLICIES), rng.randrange(0, 8)
        expected = min(policy.keep(admission_confidences(torch.tensor(tokens), q_rows, mode=mode, gate=gate).tolist()),
                       limit)
        kept = retain(chain, mode=mode, gate=gate, policy=policy, limit=limit)
        if expected == 0:
            assert kept is None
            continue
        assert kept.token_ids == tokens[:expected] and kept.proposed == chain.proposed and kept.source == chain.source
        if q_rows is None:
            assert kept.q_rows is None
        else:
            assert torch.equal(kept.q_rows.token_ids, q_rows.token_ids[:expected])
            assert torch.equal(kept.q_rows.probs, q_rows.probs[:expected])

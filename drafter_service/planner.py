"""The planner: which source (MTP or suffix lookup) and how many drafts, per round.

It maximises expected committed tokens per unit cost (DESIGN §7): with per-step conditional
acceptance a_j of a source and match-length bucket, a chain of k drafts commits
R_k = 1 + Σ_{i<k} Π_{j≤i} a_j tokens and costs C_k = draft cost + verify cost(k + 1).

Estimates are learned server-wide (the live policy) and **snapshotted when a session
opens**: within a request the choice depends only on the committed context (which sources
are available, the suffix match length) and that fixed snapshot — never on the sampled MTP
token and never on timings observed during the same request (seed 002).
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field

# Suffix match lengths; matches of 1-2 tokens (the suffix proposer counts contexts from one
# token on) learn apart from longer ones, in the last bucket.
BUCKETS = ((3, 3), (4, 7), (8, 15), (16, 32), (1, 2))
SHORT_BUCKET = len(BUCKETS) - 1
PRIOR = {"MTP": (2.0, 2.0), "SUFFIX": (3.0, 1.0)}  # Beta(accepted, rejected) per step


def suffix_bucket(length: int) -> int:
    if length < BUCKETS[0][0]:
        return SHORT_BUCKET
    for index, (low, high) in enumerate(BUCKETS[:SHORT_BUCKET]):
        if low <= length <= high:
            return index
    return SHORT_BUCKET - 1


@dataclass
class Estimates:
    """Per (source, bucket, step) acceptance counts and per-window verify/draft costs (ms)."""

    accepted: dict[tuple[str, int, int], float] = field(default_factory=dict)
    tried: dict[tuple[str, int, int], float] = field(default_factory=dict)
    verify_ms: dict[int, float] = field(default_factory=dict)  # window rows -> EMA ms
    mtp_step_ms: float = 0.0  # EMA of one MTP draft step

    def acceptance(self, source: str, bucket: int, step: int) -> float:
        a, b = PRIOR[source]
        key = (source, bucket, step)
        return (self.accepted.get(key, 0.0) + a) / (self.tried.get(key, 0.0) + a + b)

    def verify_cost(self, rows: int) -> float:
        """Measured window cost, else a linear model anchored at the 1-row cost (0.2 per row)."""
        if rows in self.verify_ms:
            return self.verify_ms[rows]
        base = self.verify_ms.get(1) or min(self.verify_ms.values(), default=1.0)
        return base * (1.0 + 0.2 * (rows - 1))


@dataclass(frozen=True)
class Plan:
    source: str  # "MTP" | "SUFFIX" | "NONE"
    num_drafts: int
    bucket: int = 0
    expected_tokens: float = 1.0


class Planner:
    """The live policy: learns from every round's outcome; sessions take snapshots."""

    def __init__(self, ema: float = 0.1) -> None:
        self.live = Estimates()
        self.ema = ema
        self._lock = threading.Lock()

    def snapshot(self) -> Estimates:
        with self._lock:
            return copy.deepcopy(self.live)

    def learn(self, source: str, bucket: int, verified: int, accepted: int, verify_ms: float, rows: int) -> None:
        with self._lock:
            e = self.live
            for step in range(verified):
                key = (source, bucket, step)
                e.tried[key] = e.tried.get(key, 0.0) + 1
                if step < accepted:
                    e.accepted[key] = e.accepted.get(key, 0.0) + 1
                else:
                    break  # later steps were never judged
            if verify_ms > 0:
                old = e.verify_ms.get(rows)
                e.verify_ms[rows] = verify_ms if old is None else (1 - self.ema) * old + self.ema * verify_ms

    def learn_draft_cost(self, step_ms: float) -> None:
        with self._lock:
            e = self.live
            e.mtp_step_ms = step_ms if e.mtp_step_ms == 0 else (1 - self.ema) * e.mtp_step_ms + self.ema * step_ms


EXPLORE_EVERY = 8  # rounds: keep the estimates fresh even when drafting looks unprofitable


def choose(
    snapshot: Estimates,
    *,
    limit: int,
    mtp_available: bool,
    suffix_length: int | None,
    suffix_tokens: int,
    round_id: int = 1,
    policy: str = "adaptive",
) -> Plan:
    """The best (source, k) by expected tokens per cost, from committed-context facts only.

    policy "mtp" / "suffix" fixes the source at the full limit (benchmarks, ablations);
    "adaptive" also explores one MTP draft every EXPLORE_EVERY rounds (a function of the
    round number, never of a draw).
    """
    if policy == "mtp":
        return Plan("MTP", limit) if mtp_available and limit else Plan("NONE", 0)
    if policy == "suffix":
        k = min(limit, suffix_tokens)
        return Plan("SUFFIX", k, suffix_bucket(suffix_length)) if suffix_length is not None and k else Plan("NONE", 0)
    best = Plan("NONE", 0, expected_tokens=1.0)
    best_rate = 1.0 / snapshot.verify_cost(1)
    options = []
    if mtp_available:
        options.append(("MTP", 0, limit))
    if suffix_length is not None and suffix_tokens > 0:
        options.append(("SUFFIX", suffix_bucket(suffix_length), min(limit, suffix_tokens)))
    for source, bucket, most in options:
        expected, survive = 1.0, 1.0
        for k in range(1, most + 1):
            survive *= snapshot.acceptance(source, bucket, k - 1)
            expected += survive
            # Draft cost counts once verify costs are measured too (same unit: ms).
            draft_cost = snapshot.mtp_step_ms * k if source == "MTP" and snapshot.verify_ms else 0.0
            rate = expected / (draft_cost + snapshot.verify_cost(k + 1))
            if rate > best_rate:
                best, best_rate = Plan(source, k, bucket, expected), rate
    if best.source == "NONE" and mtp_available and limit and round_id % EXPLORE_EVERY == 0:
        return Plan("MTP", 1, 0, 1.0 + snapshot.acceptance("MTP", 0, 0))
    return best

"""The drafter is untrusted in probabilistic mode too (DESIGN §10, issue 12).

Speculative sampling is lossless only if each draft is a draw from the q row sent with it.
Two defences:

- The accept and residual draws are keyed by `accept_key(secret, seed)`: the request seed
  and a verifier-side secret the drafter never receives, so a drafter cannot predict them.
  (The pick and draft streams stay keyed by the seed alone: exact mode and coupled drafting
  are unchanged and reproducible anywhere.)
- An honesty audit: for an honest draft d ~ q, the randomised probability-integral transform
  F(d−) + v·q(d) (F the cdf of q over ascending token ids, v ~ U(0,1) from a verifier-keyed
  stream) is uniform on (0,1), independently step after step. The audit tests the PIT values
  a drafter has produced against the uniform law at n = 16, 32, ..., 2^20 observations with
  the Dvoretzky–Kiefer–Wolfowitz–Massart bound P(D_n > ε) ≤ 2·exp(−2nε²); then a new series
  starts. Series s (s = 1, 2, ...) tests each of its CHECKS_PER_SERIES checkpoints at
  FALSE_ALARM / (2^s · CHECKS_PER_SERIES), so an honest drafter is ever rejected with
  probability at most FALSE_ALARM over its whole life, and memory stays bounded. A rejected drafter is no longer used for probabilistic
  rounds (exact mode needs no trust: its output is the verifier's own draws).

Only top-gate chains are audited: under the pick gate the drafter's retention keeps a step
depending on its own draw, so kept drafts are not plain draws from q (that gate is
approximate by definition).

Only fresh draws are audited: an honest drafter's draw at a position comes from the draft
stream keyed by (seed, position), so a position drafted again (after a rejection, or by a
later request with the same seed; unset seeds are 0) repeats the same uniform and the same
v. Counting repeats would make the sample's values dependent and reject honest drafters.
`FreshPositions` remembers, per seed, which positions the audit has already seen.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections import OrderedDict

import torch

from kernels.rng import uniform
from kernels.sampling import PAD_ID, SparseRows

FALSE_ALARM = 1e-6  # probability that an honest drafter is ever rejected
FIRST_CHECK = 16
SERIES_LENGTH = 1 << 20  # observations per series (checkpoints 16, 32, ..., 2^20)
CHECKS_PER_SERIES = 17
AUDIT_TOKEN = 1  # counter word t of the audit's v draws on the accept stream (the accept draws use t = 0)


def accept_key(secret: bytes, seed: int) -> int:
    """The uint64 key of a request's accept and residual draws."""
    digest = hashlib.blake2b(seed.to_bytes(8, "little"), key=secret[:64], digest_size=8).digest()
    return int.from_bytes(digest, "little")


def pit_values(drafts: list[int], q_rows: SparseRows, key: int, base_position: int) -> list[float]:
    """F(d−) + v·q(d) for each draft under its own q row (v keyed by `key` and the position)."""
    positions = torch.arange(base_position, base_position + len(drafts), dtype=torch.int64)
    v = uniform(key, positions, "accept", token_ids=torch.full_like(positions, AUDIT_TOKEN)).tolist()
    values = []
    for j, draft in enumerate(drafts):
        ids = q_rows.token_ids[j].tolist()
        probs = q_rows.probs[j].tolist()
        below = sum(p for t, p in zip(ids, probs) if t != PAD_ID and t < draft)
        at = sum(p for t, p in zip(ids, probs) if t == draft)
        values.append(min(max(below + v[j] * at, 0.0), 1.0))
    return values


def ks_distance(values: list[float]) -> float:
    """Kolmogorov–Smirnov distance of the empirical law of `values` from U(0,1)."""
    ordered = sorted(values)
    n = len(ordered)
    return max(max((i + 1) / n - x, x - i / n) for i, x in enumerate(ordered))


class HonestyAudit:
    """PIT values of one drafter (shared by every request that uses it)."""

    def __init__(self, false_alarm: float = FALSE_ALARM) -> None:
        self.values: list[float] = []
        self.next_check = FIRST_CHECK
        self.threshold = false_alarm / 2 / CHECKS_PER_SERIES  # series 1's share, halved each series
        self.rejected: str | None = None  # why, once rejected
        self.fresh = FreshPositions()

    def observe_drafts(self, seed: int, key: int, base_position: int, drafts: list[int], q_rows: SparseRows) -> bool:
        """Audit a chain (drafts[j] at position base_position + j) by its fresh draws only;
        returns True when this call rejected the drafter."""
        fresh = self.fresh.claim(seed, base_position, base_position + len(drafts))
        if not fresh or self.rejected is not None:
            return False
        values = pit_values(drafts, q_rows, key, base_position)
        return self.observe([values[position - base_position] for position in fresh])

    def observe(self, values: list[float]) -> bool:
        """Add PIT values; returns True when this call rejected the drafter."""
        if self.rejected is not None:
            return False
        self.values.extend(values)
        while len(self.values) >= self.next_check:
            sample = self.values[: self.next_check]
            distance = ks_distance(sample)
            bound = 2.0 * math.exp(-2.0 * len(sample) * distance * distance)
            self.next_check *= 2
            if bound <= self.threshold:
                self.rejected = (f"its drafts are not draws from its q rows: KS distance {distance:.3f} over "
                                 f"{len(sample)} draws (P <= {bound:.1e} for an honest drafter)")
                self.values.clear()
                return True
            if self.next_check > SERIES_LENGTH:  # a new series, with half the false-alarm budget
                del self.values[:SERIES_LENGTH]
                self.next_check = FIRST_CHECK
                self.threshold /= 2
        return False


class FreshPositions:
    """The (seed, position) pairs already audited, as disjoint position ranges per seed.

    Bounded: the least recently used seeds are forgotten beyond `max_seeds` (a forgotten seed
    that comes back is audited again; with random seeds that never happens, and the default
    seed 0 is always recent)."""

    def __init__(self, max_seeds: int = 65536) -> None:
        if max_seeds < 1:
            raise ValueError(f"max_seeds must be >= 1, got {max_seeds}")
        self.max_seeds = max_seeds
        self._ranges: OrderedDict[int, list[tuple[int, int]]] = OrderedDict()  # sorted, disjoint, non-adjacent

    def claim(self, seed: int, start: int, stop: int) -> list[int]:
        """The positions in [start, stop) not seen before for `seed`, now marked as seen."""
        ranges = self._ranges.pop(seed, [])
        self._ranges[seed] = ranges
        if len(self._ranges) > self.max_seeds:
            self._ranges.popitem(last=False)
        if start >= stop:
            return []
        fresh, cursor = [], start
        first = bisect.bisect_right(ranges, (start, float("inf"))) - 1
        first = max(first, 0)
        last = first
        while last < len(ranges) and ranges[last][0] <= stop:
            lo, hi = ranges[last]
            if hi < start:
                first += 1
            else:
                fresh.extend(range(cursor, max(cursor, min(lo, stop))))
                cursor = max(cursor, hi)
            last += 1
        fresh.extend(range(cursor, stop))
        merged = ranges[first:last]
        lo = min([start] + [r[0] for r in merged])
        hi = max([stop] + [r[1] for r in merged])
        ranges[first:last] = [(lo, hi)]
        return fresh
